"""Profile families and the roofline sanity check on measured tables.

A *family* is the tool a profile table comes from (servelab's own profiler, AIConfigurator, Vidur,
LLMServingSim). Families are never mixed within one lookup or curve: different kernels and timing methods disagree
by more than the fit error, so the highest-priority family that covers a key wins (``FAMILY_PRIORITY``).
:func:`drop_impossible` removes whole source tables that run faster than the GPU's roofline allows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lab.costmodel.features import peaks, variant_of, work
from lab.costmodel.hardware import load_hardware
from lab.costmodel.profiles import Observations

FAMILY_PRIORITY = ("servelab", "aiconfigurator", "vidur", "llmservingsim")


def family_of(source: str) -> str:
    """The profile family a source path belongs to (servelab, aiconfigurator, vidur, llmservingsim)."""
    s = source.lower()
    for fam in ("aiconfigurator", "vidur", "llmservingsim"):
        if fam in s:
            return fam
    if s.endswith(".parquet"):
        return "aiconfigurator"
    if "mlp.csv" in s or "all_reduce.csv" in s or "send_recv.csv" in s:
        return "vidur"
    if "layers.csv" in s or "dense.csv" in s:
        return "llmservingsim"
    return "servelab"


def roofline_ratio(cls: str, df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(measured / roofline time, roofline time) per observation, against the catalog peaks of its GPU."""
    F, B, _ = work(cls, df)
    var = variant_of(cls, df).to_numpy()
    gpus = df["gpu"].to_numpy()
    tmin = np.zeros(len(df))
    for g in np.unique(gpus):
        hw = load_hardware(g)
        for v in np.unique(var):
            sel = (gpus == g) & (var == v)
            if sel.any():
                P, W = peaks(cls, v, hw)
                tmin[sel] = np.maximum(F[sel] / P, B[sel] / W)
    return df["time_s"].to_numpy(float) / np.maximum(tmin, 1e-30), tmin


def drop_impossible(obs: Observations, min_time_s: float = 20e-6, slack: float = 0.9, max_bad: float = 0.05) -> Observations:
    """Drop whole source tables that contradict the roofline, and say so in ``obs.notes``.

    Among a table's rows whose roofline time exceeds ``min_time_s`` (too big for caches or launch effects to
    matter), if more than ``max_bad`` run faster than ``slack`` x the roofline (above the GPU's peak FLOP/s or
    bandwidth), the table cannot be measuring what its columns say. Elementwise tables are exempt: small
    activations legitimately stay in L2 and beat the HBM roofline.
    """
    out = Observations(notes=list(obs.notes))
    for cls, df in obs.tables.items():
        if cls == "elementwise":
            out.tables[cls] = df
            continue
        r, tmin = roofline_ratio(cls, df)
        files = df["source"].str.replace(r":.*$", "", regex=True)
        keep = np.ones(len(df), dtype=bool)
        for f in files.unique():
            sel = (files == f).to_numpy()
            big = sel & (tmin > min_time_s)
            if big.sum() == 0:
                continue
            bad = float(np.mean(r[big] < slack))
            if bad > max_bad:
                keep &= ~sel
                out.notes.append(f"dropped {f} ({cls}): {bad:.0%} of its {int(big.sum())} large rows run faster "
                                 f"than the roofline (fastest at {float(r[big].min()):.2f}x), so it cannot be "
                                 "measuring the shapes its columns give")
        if keep.any():
            out.tables[cls] = df[keep].reset_index(drop=True)
    return out
