"""A run's PNG figures: latency CDFs, and throughput, queues and KV usage over time."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lab.experiment.simulation import SimResult
from lab.report.plots import draw_slo, pyplot, series_style

if TYPE_CHECKING:
    import pandas as pd


def plot_all(req: pd.DataFrame, series: pd.DataFrame | None, result: SimResult, out_dir: Path) -> list[tuple[str, str]]:
    """Latency CDFs, throughput and queue length over time, KV usage over time; returns (title, file) pairs."""
    plt = pyplot()

    figs = []
    fin = req[req["status"] == "finished"]
    itl = result.itl_samples.arrays()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, vals) in zip(axes, (("TTFT", (fin["ttft"], None)), ("TPOT", (fin["tpot"], None)), ("ITL", itl),
                                       ("E2EL", (fin["e2el"], None)))):
        x, y = cdf_points(*vals)
        if len(x):
            ax.plot(x * 1000, y, label="simulated", **series_style(0))
        if draw_slo(ax, result.experiment.slo, name) is not None:  # the SLO bound as a vertical line
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{name} of finished requests" if name != "ITL" else "ITL (every token gap)", fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_cdf.png", dpi=110)
    plt.close(fig)
    figs.append(("Latency CDFs", "latency_cdf.png"))

    if series is not None and len(series):
        span = series.index.max() - series.index.min() + 1
        step = max(1, int(span // 4000))  # at most ~4000 points per line
        ser = series.groupby(series.index // step * step).mean() if step > 1 else series
        fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
        axes[0].plot(ser.index, ser["output_tokens"], label="output tokens/s")
        axes[0].plot(ser.index, ser["prefill_tokens"], label="prefill tokens/s", alpha=0.7)
        axes[0].set_ylabel("tokens/s")
        axes[0].set_title("Throughput, queue and KV usage over time (all instances)", fontsize=10)
        axes[0].legend()
        axes[1].plot(ser.index, ser["num_running"], label="running", lw=0.8)
        axes[1].plot(ser.index, ser["num_waiting"], label="waiting", lw=0.8)
        axes[1].set_ylabel("requests (all instances)")
        axes[1].legend()
        axes[2].plot(ser.index, ser["kv_usage"] * 100, lw=0.8)
        axes[2].set_ylabel("KV usage (%, mean of instances)")
        axes[2].set_xlabel("time (s)")
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "timeseries.png", dpi=110)
        plt.close(fig)
        figs.append(("Throughput, queues and KV usage over time", "timeseries.png"))
    return figs


def cdf_points(values, weights=None, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """Points of the empirical CDF of ``values`` (finite ones; each counted ``weights[i]`` times, default once) for
    a plot: (sorted values, cumulative fraction), at most ``max_points`` + 1 of them, taken at evenly spaced
    fractions (a line of 2,000 points draws the same curve as one per sample, at a fraction of the time)."""
    v = np.asarray(values, dtype=float)
    w = np.ones(len(v)) if weights is None else np.asarray(weights, dtype=float)
    keep = np.isfinite(v) & (w > 0)
    v, w = v[keep], w[keep]
    if not len(v):
        return v, v
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(w[order])
    cum /= cum[-1]
    if len(v) > max_points:
        idx = np.unique(np.searchsorted(cum, np.linspace(0.0, 1.0, max_points + 1)[1:], side="left"))
        v, cum = v[np.minimum(idx, len(v) - 1)], cum[np.minimum(idx, len(v) - 1)]
    return v, cum
