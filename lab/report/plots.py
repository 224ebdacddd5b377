"""Matplotlib for report figures, loaded on first use (it costs ~0.3 s to import, and runs without plots never
need it) with the non-interactive Agg backend, so reports render headless; and the conventions every report figure
shares: one distinct colour per series, a legend that names every series, and the SLO bounds drawn on the latency
CDFs they apply to."""

from __future__ import annotations

from types import ModuleType
from typing import Any

# tab10 (matplotlib's qualitative palette): ten colours no two of which are shades of one hue, unlike tab20's
# light/dark pairs. After ten series the colours repeat with the next line style.
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf")
LINE_STYLES = ("-", "--", ":", "-.")

# The SLO field (slo.<field>, seconds) drawn on each latency CDF; ITL gaps are held to the TPOT bound, as vLLM's
# goodput holds a request's mean gap.
SLO_FIELDS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "tpot_s", "e2el": "e2el_s"}
SLO_COLOR = "black"


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` with the Agg backend selected."""
    import matplotlib  # noqa: PLC0415 - heavy, needed only when a report draws figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def series_style(k: int) -> dict[str, str]:
    """``plot`` keywords of the ``k``-th series (0-based) of a figure: tab10 colour ``k % 10``, a new line style
    every ten series (solid, dashed, dotted, dash-dot)."""
    return {"color": TAB10[k % 10], "ls": LINE_STYLES[(k // 10) % len(LINE_STYLES)]}


def slo_bound(slo: Any, metric: str) -> float | None:
    """The SLO bound (seconds) that applies to ``metric`` (``ttft``, ``tpot``, ``itl``, ``e2el``; any case), or None.

    Args:
        slo: the experiment's ``slo`` section, or its dict (summary.json ``slo``), or None.
    """
    field = SLO_FIELDS.get(metric.lower())
    if slo is None or field is None:
        return None
    v = slo.get(field) if isinstance(slo, dict) else getattr(slo, field, None)
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def draw_slo(ax, slo: Any, metric: str, scale: float = 1000.0) -> float | None:
    """Draw the SLO bound of ``metric`` as a vertical dashed line on a CDF panel whose x axis is in seconds x
    ``scale`` (default ms), labelled for the legend (``TTFT SLO 500 ms``; the ITL panel says ``TPOT SLO``).

    Returns:
        The bound in seconds, or None when the experiment sets none for this metric (nothing is drawn).
    """
    bound = slo_bound(slo, metric)
    if bound is None:
        return None
    name = SLO_FIELDS[metric.lower()].removesuffix("_s").upper()
    unit = "ms" if scale == 1000.0 else ("s" if scale == 1.0 else "")
    ax.axvline(bound * scale, color=SLO_COLOR, ls="--", lw=1.0, alpha=0.8,
               label=f"{name} SLO {bound * scale:g} {unit}".rstrip())
    return bound


def shared_legend(fig, axes, fontsize: float = 8, max_rows: int = 24) -> None:
    """One legend for the whole figure, right of the panels, naming every series once (the union over ``axes``, in
    order of first appearance; SLO lines included). Save the figure with ``bbox_inches="tight"`` so it is kept."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label and not label.startswith("_"):
                handles.setdefault(label, h)
    if handles:
        ncol = max(1, -(-len(handles) // max_rows))
        fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize=fontsize, ncol=ncol, frameon=False)
