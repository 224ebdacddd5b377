"""Measured operator tables, interpolated in the dimensions they were measured in.

Inside a table's grid, times are interpolated linearly in log(time) over log(size) along each measured axis
(exact for power laws, which GEMM, attention and collective times follow piecewise). Below the smallest measured
size the smallest time is used (small kernels are latency-bound); above the largest, the last measured point is
extended linearly in size (past the largest measured size the hardware is saturated; for causal attention over the
sequence length, with the measured log-log slope up to 2). A shape whose fixed
dimensions (a GEMM's n and k, an attention's heads and head dim, an MoE's configuration) are not in a table is not
covered: the operator cost model then falls back to a fitted curve or the roofline.

Lookups (built per GPU by :class:`TableSet`; when several profile families cover the same key the
highest-priority one wins, see lab/costmodel/families.py ``FAMILY_PRIORITY``):

* GEMM: time over ``m`` for each measured ``(dtype, n, k)``; an ``(n, k)`` between measured ones is interpolated
  bilinearly in (log n, log k) from the four surrounding measured pairs when the table is a full grid (AIConfigurator);
  families are tried in priority order, so an AIConfigurator interpolation wins over an exact Vidur shape.
* Prefill attention: for each ``(kv_dtype, heads, kv_heads, head_dim)``, a (batch x q_len) grid of uniform batches
  without history (AIConfigurator) and/or a (ctx_len x q_len) grid of single chunks with history (Vidur,
  LLMServingSim).
* Decode attention: (batch x kv_len) grid per head configuration.
* MLA modules: (batch x q_len) and (batch x kv_len) grids per (model, heads per GPU, GEMM dtype, KV dtype).
* MoE: time over tokens per (dtype, hidden, inter, topk, experts, tp, ep), balanced routing.
* All-reduce: time over bytes per (backend, GPUs); send/recv: time over bytes.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path

import numpy as np
import pandas as pd

from lab.costmodel.families import FAMILY_PRIORITY, drop_impossible, family_of
from lab.costmodel.model_arch import ModelArch, load_model
from lab.costmodel.profiles import Observations, read_profiles


class Curve1D:
    """Log-log interpolation of measured ``(x, time)`` points (duplicates reduced to their median)."""

    __slots__ = ("lx", "ly", "x0", "y0", "slope")

    def __init__(self, xs, ys, max_slope: float = 1.0) -> None:
        s = pd.Series(np.asarray(ys, float)).groupby(np.asarray(xs, float)).median().sort_index()
        s = s[(s.index > 0) & (s.to_numpy() > 0)]
        if len(s) == 0:
            raise ValueError("no positive points")
        self.lx = [math.log(x) for x in s.index]
        self.ly = [math.log(y) for y in s.to_numpy()]
        self.x0 = float(s.index[0])
        self.y0 = float(s.iloc[0])
        n = len(self.lx)
        if n >= 3:
            sl = (self.ly[-1] - self.ly[-3]) / (self.lx[-1] - self.lx[-3])
        elif n == 2:
            sl = (self.ly[-1] - self.ly[-2]) / (self.lx[-1] - self.lx[-2])
        else:
            sl = 1.0
        # beyond the largest measured size the operator is saturated: time grows linearly with size (up to
        # ``max_slope``: 2 for causal attention over the sequence length)
        self.slope = min(max_slope, max(1.0, sl))

    @property
    def xmax(self) -> float:
        return math.exp(self.lx[-1])

    def __call__(self, x: float) -> float:
        if x <= self.x0:
            return self.y0
        lx = math.log(x)
        xs = self.lx
        if lx >= xs[-1]:
            return math.exp(self.ly[-1] + self.slope * (lx - xs[-1]))
        i = bisect.bisect_right(xs, lx)
        t = (lx - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(self.ly[i - 1] + t * (self.ly[i] - self.ly[i - 1]))


class Grid2D:
    """Rows keyed by ``a`` (e.g. batch), each a :class:`Curve1D` over ``b`` (e.g. sequence length); log-linear
    between rows, slope-extended above the largest ``a``, clamped below the smallest."""

    __slots__ = ("la", "rows", "a0")

    def __init__(self, a, b, t, max_slope_b: float = 1.0) -> None:
        df = pd.DataFrame({"a": np.asarray(a, float), "b": np.asarray(b, float), "t": np.asarray(t, float)})
        df = df[(df["a"] > 0) & (df["b"] > 0) & (df["t"] > 0)]
        rows = []
        for av, g in df.groupby("a"):
            rows.append((float(av), Curve1D(g["b"], g["t"], max_slope_b)))
        if not rows:
            raise ValueError("empty grid")
        rows.sort(key=lambda r: r[0])
        self.la = [math.log(r[0]) for r in rows]
        self.rows = [r[1] for r in rows]
        self.a0 = rows[0][0]

    def __call__(self, a: float, b: float) -> float:
        la = math.log(max(a, self.a0))
        ks = self.la
        if len(ks) == 1 or la <= ks[0]:
            return self.rows[0](b)
        if la >= ks[-1]:
            y1 = math.log(self.rows[-1](b))
            y0 = math.log(self.rows[-2](b))
            sl = min(1.0, max(1.0, (y1 - y0) / (ks[-1] - ks[-2])))
            return math.exp(y1 + sl * (la - ks[-1]))
        i = bisect.bisect_right(ks, la)
        t = (la - ks[i - 1]) / (ks[i] - ks[i - 1])
        y0 = math.log(self.rows[i - 1](b))
        y1 = math.log(self.rows[i](b))
        return math.exp(y0 + t * (y1 - y0))


class AlignedCurve:
    """GEMM time over m when the table measured both m and m+1 (AIConfigurator's grid): kernels pad m to a
    multiple of their tile, so time jumps right after a multiple of 16; aligned (m % 16 == 0) and unaligned m
    are interpolated on separate curves."""

    __slots__ = ("aligned", "other", "x0", "xmax")

    def __init__(self, aligned: Curve1D, other: Curve1D) -> None:
        self.aligned, self.other = aligned, other
        self.x0 = min(aligned.x0, other.x0)
        self.xmax = max(aligned.xmax, other.xmax)

    def __call__(self, m: float) -> float:
        return self.aligned(m) if m % 16 == 0 else self.other(m)


def _m_curve(g: pd.DataFrame):
    al = g[g["m"] % 16 == 0]
    un = g[g["m"] % 16 != 0]
    if al["m"].nunique() >= 3 and un["m"].nunique() >= 3:
        return AlignedCurve(Curve1D(al["m"], al["time_s"]), Curve1D(un["m"], un["time_s"]))
    return Curve1D(g["m"], g["time_s"])


class GemmTable:
    """Measured GEMM times of one dtype: a curve over m per measured (n, k)."""

    def __init__(self, df: pd.DataFrame) -> None:
        self.curves: dict[tuple[int, int], Curve1D] = {}
        self.sources: dict[tuple[int, int], str] = {}
        for (n, k), g in df.groupby(["n", "k"]):
            self.curves[(int(n), int(k))] = _m_curve(g)
            self.sources[(int(n), int(k))] = str(g["source"].iloc[0]).split(":")[0]
        self.ns = sorted({n for n, _ in self.curves})
        self.ks = sorted({k for _, k in self.curves})

    def lookup(self, n: int, k: int):
        """A callable m -> seconds for (n, k), and the source file; (None, None) when not covered."""
        c = self.curves.get((n, k))
        if c is not None:
            return c, self.sources[(n, k)]
        if not (self.ns[0] <= n <= self.ns[-1] and self.ks[0] <= k <= self.ks[-1]):
            return None, None
        n0 = self.ns[max(0, bisect.bisect_right(self.ns, n) - 1)]
        n1 = self.ns[min(len(self.ns) - 1, bisect.bisect_left(self.ns, n))]
        k0 = self.ks[max(0, bisect.bisect_right(self.ks, k) - 1)]
        k1 = self.ks[min(len(self.ks) - 1, bisect.bisect_left(self.ks, k))]
        corners = [(n0, k0), (n0, k1), (n1, k0), (n1, k1)]
        if any(c not in self.curves for c in corners):
            return None, None
        tn = 0.0 if n1 == n0 else (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
        tk = 0.0 if k1 == k0 else (math.log(k) - math.log(k0)) / (math.log(k1) - math.log(k0))
        c00, c01, c10, c11 = (self.curves[c] for c in corners)

        def f(m: float) -> float:
            a = (1 - tk) * math.log(c00(m)) + tk * math.log(c01(m))
            b = (1 - tk) * math.log(c10(m)) + tk * math.log(c11(m))
            return math.exp((1 - tn) * a + tn * b)

        return f, self.sources[(n0, k0)] + f" (interpolated between n {n0}-{n1}, k {k0}-{k1})"


def _best_family(df: pd.DataFrame) -> pd.DataFrame:
    """Keep the rows of the highest-priority profile family present."""
    if df.empty:
        return df
    fam = df["source"].map(family_of)
    for f in FAMILY_PRIORITY:
        if (fam == f).any():
            return df[fam == f]
    return df


class TableSet:
    """Every measured lookup for one GPU (see the module docstring).

    Args:
        obs: observations (lab/costmodel/profiles.py), any GPUs; only ``gpu``'s rows are used.
        gpu: catalog name.
    """

    def __init__(self, obs: Observations, gpu: str) -> None:
        self.gpu = gpu
        self.obs = obs.only(gpu=gpu)
        self._gemm: dict[str, list[GemmTable]] = {}
        g = self.obs.get("gemm")
        fam = g["source"].map(family_of) if len(g) else pd.Series(dtype=str)
        for dt, d in g.groupby("dtype"):
            f = fam[d.index]
            self._gemm[str(dt)] = [GemmTable(d[f == name]) for name in FAMILY_PRIORITY if (f == name).any()]

    # ---- GEMM
    def gemm(self, dtype: str, n: int, k: int):
        """(callable m -> s, source) or (None, None)."""
        order = [dtype] + (["fp8_block", "fp8"] if dtype.startswith("fp8") else [])
        for dt in dict.fromkeys(order):
            for t in self._gemm.get(dt, []):  # highest-priority family first, exact or interpolated
                f, src = t.lookup(n, k)
                if f is not None:
                    return f, f"{src} [{dt}]"
        return None, None

    # ---- attention
    def attn_prefill(self, kv_dtype: str, heads: int, kv_heads: int, head_dim: int):
        """(uniform grid (batch, q_len) or None, history grid (ctx_len, q_len) or None, curve over q_len of
        single chunks without history or None, source)."""
        d = self.obs.get("attn_prefill")
        d = d[(d["kv_dtype"] == kv_dtype) & (d["heads"] == heads) & (d["kv_heads"] == kv_heads) & (d["head_dim"] == head_dim)]
        d = _best_family(d)
        if d.empty:
            return None, None, None, None
        uni = d[d["ctx_len"] == 0]
        uniform = (Grid2D(uni["batch"], uni["q_len"], uni["time_s"], 2.0)
                   if len(uni) >= 4 and uni["batch"].nunique() > 1 else None)
        hist = d[(d["batch"] == 1)]
        history = hist0 = None
        if hist["ctx_len"].nunique() > 1:
            h = hist[hist["ctx_len"] > 0]
            history = Grid2D(h["ctx_len"], h["q_len"], h["time_s"], 2.0)
            uni1 = hist[hist["ctx_len"] == 0]
            hist0 = Curve1D(uni1["q_len"], uni1["time_s"], 2.0) if len(uni1) else None
        if uniform is None and history is None:
            return None, None, None, None
        return uniform, history, hist0, str(d["source"].iloc[0]).split(":")[0]

    def attn_decode(self, kv_dtype: str, heads: int, kv_heads: int, head_dim: int):
        """(grid (batch, kv_len), source) or (None, None)."""
        d = self.obs.get("attn_decode")
        d = d[(d["kv_dtype"] == kv_dtype) & (d["heads"] == heads) & (d["kv_heads"] == kv_heads) & (d["head_dim"] == head_dim)]
        d = _best_family(d)
        if len(d) < 4:
            return None, None
        return Grid2D(d["batch"], d["kv_len"] + 1, d["time_s"]), str(d["source"].iloc[0]).split(":")[0]

    def mla(self, phase: str, model: ModelArch, dtype: str, kv_dtype: str, heads: int):
        """(grid (batch, q_len | kv_len+1), source) for an MLA module of a model with the same MLA dimensions
        (hidden, q/kv LoRA ranks, head dims) as ``model``, or (None, None)."""
        cls = "mla_prefill" if phase == "prefill" else "mla_decode"
        d = self.obs.get(cls)
        dims = lambda a: (a.hidden_size, a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim,  # noqa: E731
                          a.v_head_dim)
        names = []
        for name in d["model"].unique():
            try:
                if dims(load_model(str(name))) == dims(model):
                    names.append(name)
            except ValueError:
                continue
        d = d[d["model"].isin(names) & (d["dtype"] == dtype) & (d["kv_dtype"] == kv_dtype) & (d["heads"] == heads)]
        d = _best_family(d)
        if len(d) < 4:
            return None, None
        x = d["q_len"] if phase == "prefill" else d["kv_len"] + 1
        return Grid2D(d["batch"], x, d["time_s"], 2.0 if phase == "prefill" else 1.0), str(d["source"].iloc[0]).split(":")[0]

    # ---- MoE and collectives
    def moe(self, dtype: str, hidden: int, inter: int, topk: int, experts: int, tp: int, ep: int):
        """(callable tokens -> s, source) for the fused routed experts, or (None, None)."""
        d = self.obs.get("moe")
        d = d[(d["dtype"] == dtype) & (d["hidden"] == hidden) & (d["inter"] == inter) & (d["topk"] == topk)
              & (d["experts"] == experts) & (d["tp"] == tp) & (d["ep"] == ep) & (d["distribution"] == "balanced")]
        d = _best_family(d)
        if len(d) < 2:
            return None, None
        return Curve1D(d["tokens"], d["time_s"]), str(d["source"].iloc[0]).split(":")[0]

    def allreduce(self, gpus: int):
        """(callable bytes -> s, source) preferring CUDA-graph custom all-reduce, then NCCL, then eager."""
        d = self.obs.get("allreduce")
        d = d[d["gpus"] == gpus]
        for backend in ("graph", "nccl", "eager"):
            x = _best_family(d[d["backend"] == backend])
            if len(x) >= 2:
                return Curve1D(x["bytes"], x["time_s"]), f"{str(x['source'].iloc[0]).split(':')[0]} [{backend}]"
        return None, None

    def sendrecv(self):
        """(callable bytes -> s, source) for a pipeline-stage send/recv, or (None, None)."""
        d = _best_family(self.obs.get("sendrecv"))
        if len(d) < 2:
            return None, None
        return Curve1D(d["bytes"], d["time_s"]), str(d["source"].iloc[0]).split(":")[0]


def interpolation_holdout(cls: str, df: pd.DataFrame, test: np.ndarray) -> tuple[float, int] | None:
    """MAPE (%) of interpolating the held-out rows of one table from the others, and how many held-out rows lay
    inside the training grid (rows outside it are extrapolation and not counted); None for classes the cost model
    does not interpolate (elementwise) or when no held-out row lies inside the grid."""
    train, held = df[~test], df[test]
    pred, obs_t = [], []
    if cls == "gemm":
        tables = {dt: GemmTable(g) for dt, g in train.groupby("dtype")}
        for r in held.itertuples():
            t = tables.get(r.dtype)
            if t is None:
                continue
            f, _ = t.lookup(int(r.n), int(r.k))
            c = t.curves.get((int(r.n), int(r.k)))
            if f is None or (c is not None and not (c.x0 <= r.m <= c.xmax)):
                continue
            pred.append(f(r.m))
            obs_t.append(r.time_s)
    elif cls in ("attn_prefill", "attn_decode", "mla_prefill", "mla_decode"):
        keys = {"attn_prefill": ["kv_dtype", "heads", "kv_heads", "head_dim", "ctx_len"],
                "attn_decode": ["kv_dtype", "heads", "kv_heads", "head_dim"],
                "mla_prefill": ["model", "dtype", "kv_dtype", "heads"],
                "mla_decode": ["model", "dtype", "kv_dtype", "heads"]}[cls]
        ax = {"attn_prefill": ("batch", "q_len"), "attn_decode": ("batch", "kv_len"), "mla_prefill": ("batch", "q_len"),
              "mla_decode": ("batch", "kv_len")}[cls]
        grids = {}
        for k, g in train.groupby(keys):
            if g[ax[0]].nunique() >= 1 and len(g) >= 2:
                grids[k if isinstance(k, tuple) else (k,)] = (Grid2D(g[ax[0]], g[ax[1]] + 1, g["time_s"]),
                                                             g[ax[0]].min(), g[ax[0]].max(), g)
        for r in held.itertuples():
            k = tuple(getattr(r, c) for c in keys)
            if k not in grids:
                continue
            grid, amin, amax, g = grids[k]
            a, b = getattr(r, ax[0]), getattr(r, ax[1])
            same = g[g[ax[0]] == a]
            if not (amin <= a <= amax) or same.empty or not (same[ax[1]].min() <= b <= same[ax[1]].max()):
                continue
            pred.append(grid(a, b + 1))
            obs_t.append(r.time_s)
    elif cls in ("moe", "allreduce", "sendrecv"):
        keys, x = {"moe": (["dtype", "hidden", "inter", "topk", "experts", "tp", "ep"], "tokens"),
                   "allreduce": (["backend", "gpus"], "bytes"), "sendrecv": ([], "bytes")}[cls]
        curves = {}
        groups = train.groupby(keys) if keys else [((), train)]
        for k, g in groups:
            if len(g) >= 2:
                curves[k if isinstance(k, tuple) else (k,)] = Curve1D(g[x], g["time_s"])
        for r in held.itertuples():
            k = tuple(getattr(r, c) for c in keys)
            c = curves.get(k)
            v = getattr(r, x)
            if c is None or not (c.x0 <= v <= c.xmax):
                continue
            pred.append(c(v))
            obs_t.append(r.time_s)
    else:
        return None
    if not pred:
        return None
    p, o = np.asarray(pred), np.asarray(obs_t)
    return float(np.mean(np.abs(p / o - 1)) * 100), len(p)


def load_tables(paths: list[str | Path]) -> Observations:
    """Read profile folders for the cost model, dropping tables that contradict the roofline
    (lab/costmodel/families.py ``drop_impossible``).

    Raises:
        lab.costmodel.profiles.ProfileError: a missing path, a folder without a known profile, or a bad table: one
        line naming the file, the row and the column (see lab/costmodel/profiles.py).
    """
    return drop_impossible(read_profiles(paths))
