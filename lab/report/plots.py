"""Matplotlib for report figures, loaded on first use (it costs ~0.3 s to import, and runs without plots never
need it) with the non-interactive Agg backend, so reports render headless."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` with the Agg backend selected."""
    import matplotlib  # noqa: PLC0415 - heavy, needed only when a report draws figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt
