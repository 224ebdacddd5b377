"""Efficiency curves over the roofline, fitted per GPU, operator class and dtype from measured profiles.

Model (one curve = one GPU x class x variant):

    t = t0 + (t_c^p + t_m^p)^(1/p)
    t_c = F / (P · σ(a_c + Σ_i f_i(log2 x_i)))        x_i: the class's compute features (e.g. GEMM m, n, k)
    t_m = B / (W · σ(a_m + Σ_j g_j(log2 y_j)))        y_j: its memory features (e.g. bytes moved)

``F``/``B`` are the operator's FLOPs and bytes and ``x``/``y`` its features (lab/costmodel/features.py), ``P`` the GPU's dense peak for the dtype and
``W`` its HBM bandwidth (link bandwidth for collectives), σ the logistic function (so each efficiency stays in
(0, 1)), ``f_i``/``g_j`` piecewise-linear functions of log2 of the feature with knots every 2 octaves (clamped
outside the fitted range), ``p`` a smooth-max exponent and ``t0`` a fixed latency. It is the roofline with
"achievable fraction of peak" made a smooth function of the shape, which is how kernel efficiency behaves (small
tiles, few waves, short rows waste the machine). Parameters are fitted by robust non-linear least squares on log
time (scipy.optimize.least_squares, soft-L1 loss) with a small penalty on second differences of the knot values.

Held-out accuracy is measured by :func:`holdout`: a deterministic 80/20 split of the measured grid, fitted on the
80 %, MAPE on the 20 %.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from lab.costmodel.families import FAMILY_PRIORITY, family_of
from lab.costmodel.features import FEATURES, peaks, variant_of, work
from lab.costmodel.hardware import Hardware, load_hardware
from lab.costmodel.profiles import COLUMNS, Observations
from lab.costmodel.tables import interpolation_holdout

# The tile features are fitted only from a grid with at least this many distinct (n, k) weight shapes: with fewer,
# n and the tile counts are confounded and the curve extrapolates badly to a model's other shapes (LLMServingSim's
# H100 table, 9 shapes, put a Llama-3.1-8B decode step 19 % above the two richer sources with them).
MIN_GEMM_SHAPES_FOR_TILE_FEATURES = 16
TILE_FEATURES = ("mtile", "ntile", "wave")


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@dataclass
class Curve:
    """One fitted efficiency curve (see the module docstring). Evaluated with :meth:`time` (scalars, fast)."""

    cls: str
    variant: str
    peak_flops: float
    bandwidth: float
    t0: float
    p: float
    a_c: float
    a_m: float
    mem_cap: float = 1.0  # largest memory efficiency (elementwise: 4, L2-resident activations beat HBM)
    knots: dict[str, list[float]] = field(default_factory=dict)   # feature -> knot positions (log2)
    values: dict[str, list[float]] = field(default_factory=dict)  # feature -> values at the knots
    n_obs: int = 0
    source: str = ""
    # attention classes fitted on shapes of one head configuration: (query heads, KV heads, head dim) per GPU. The
    # fit cannot learn how its terms depend on heads then; lab/costmodel/attention.py scales from it (empty: varied)
    heads: tuple[int, ...] = ()

    def _pl(self, feat: str, x: float) -> float:
        ks = self.knots[feat]
        vs = self.values[feat]
        lx = math.log2(x) if x > 0 else ks[0]
        if lx <= ks[0]:
            return vs[0]
        if lx >= ks[-1]:
            return vs[-1]
        i = bisect.bisect_right(ks, lx)
        t = (lx - ks[i - 1]) / (ks[i] - ks[i - 1])
        return vs[i - 1] + t * (vs[i] - vs[i - 1])

    def efficiencies(self, feats: dict[str, float]) -> tuple[float, float]:
        """(compute efficiency, memory efficiency) at a shape's features."""
        cf, mf = FEATURES[self.cls]
        zc = self.a_c + sum(self._pl(f, feats[f]) for f in cf)
        zm = self.a_m + sum(self._pl(f, feats[f]) for f in mf)
        return 1.0 / (1.0 + math.exp(-zc)), self.mem_cap / (1.0 + math.exp(-zm))

    def time(self, flops: float, byts: float, feats: dict[str, float]) -> float:
        """Predicted seconds for an operator with these FLOPs, bytes and features."""
        ec, em = self.efficiencies(feats)
        tc = flops / (self.peak_flops * ec) if flops > 0 else 0.0
        tm = byts / (self.bandwidth * em)
        p = self.p
        m = max(tc, tm)
        if m <= 0:
            return self.t0
        return self.t0 + m * ((tc / m) ** p + (tm / m) ** p) ** (1.0 / p)

    def predict(self, F: np.ndarray, B: np.ndarray, feats: dict[str, np.ndarray]) -> np.ndarray:
        """Vectorised :meth:`time`."""
        cf, mf = FEATURES[self.cls]

        def pl(f):
            return np.interp(np.log2(np.maximum(feats[f], 1e-12)), self.knots[f], self.values[f])

        ec = _sigmoid(self.a_c + sum((pl(f) for f in cf), np.zeros(len(B))))
        em = self.mem_cap * _sigmoid(self.a_m + sum((pl(f) for f in mf), np.zeros(len(B))))
        tc = np.where(F > 0, F / (self.peak_flops * ec), 0.0)
        tm = B / (self.bandwidth * em)
        mx = np.maximum(np.maximum(tc, tm), 1e-30)
        return self.t0 + mx * ((tc / mx) ** self.p + (tm / mx) ** self.p) ** (1.0 / self.p)

    def to_dict(self) -> dict:
        r = lambda x: float(f"{x:.6g}")  # noqa: E731
        return {"cls": self.cls, "variant": self.variant, "peak_flops": r(self.peak_flops),
                "bandwidth": r(self.bandwidth), "t0": r(self.t0), "p": r(self.p), "a_c": r(self.a_c),
                "a_m": r(self.a_m), "mem_cap": self.mem_cap, "knots": {k: [r(x) for x in v] for k, v in self.knots.items()},
                "values": {k: [r(x) for x in v] for k, v in self.values.items()}, "n_obs": self.n_obs,
                **({"heads": list(self.heads)} if self.heads else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "Curve":
        return cls(d["cls"], d["variant"], d["peak_flops"], d["bandwidth"], d["t0"], d["p"], d["a_c"], d["a_m"],
                   d.get("mem_cap", 1.0), {k: list(v) for k, v in d["knots"].items()},
                   {k: list(v) for k, v in d["values"].items()}, d.get("n_obs", 0),
                   heads=tuple(int(x) for x in d.get("heads", ())))


def _knots(x: np.ndarray) -> list[float]:
    lx = np.log2(np.maximum(x, 1e-12))
    lo, hi = math.floor(lx.min()), math.ceil(lx.max())
    if hi - lo < 2:
        return [float(lo), float(lo + 2)]
    return [float(v) for v in np.arange(lo, hi + 1e-9, 2.0)] + ([float(hi)] if (hi - lo) % 2 else [])


def fit_curve(cls: str, variant: str, df: pd.DataFrame, hw: Hardware, smooth: float = 0.05,
              max_rows: int = 4000) -> Curve:
    """Fit one curve to observations of one GPU, class and variant.

    Raises:
        ValueError: fewer than 8 observations.
    """
    if len(df) < 8:
        raise ValueError(f"{hw.name} {cls} {variant}: {len(df)} observations, need at least 8 to fit")
    if len(df) > max_rows:  # deterministic subsample keeps the fit fast; every shape class stays represented
        df = df.sample(n=max_rows, random_state=0)
    F, B, feats = work(cls, df)
    t = df["time_s"].to_numpy(float)
    P, W = peaks(cls, variant, hw)
    cf, mf = FEATURES[cls]
    # a feature that does not vary carries no information: drop its knots (kept as a constant 0)
    knots = {f: (_knots(feats[f]) if np.ptp(np.log2(np.maximum(feats[f], 1e-12))) > 0.5 else [0.0, 1.0])
             for f in (*cf, *mf)}
    if cls == "gemm" and df.groupby(["n", "k"]).ngroups < MIN_GEMM_SHAPES_FOR_TILE_FEATURES:
        for f in TILE_FEATURES:
            knots[f] = [0.0, 1.0]
    active = [f for f in (*cf, *mf) if knots[f] != [0.0, 1.0]]
    sizes = [len(knots[f]) for f in active]
    compute = F.sum() > 0 and bool(cf)
    cap = 4.0 if cls == "elementwise" else 1.0

    def unpack(x):
        t0 = math.exp(x[0])
        p = 1.0 + math.exp(x[1])
        a_c, a_m = x[2], x[3]
        vals, off = {}, 4
        for f, s in zip(active, sizes):
            vals[f] = x[off:off + s]
            off += s
        return t0, p, a_c, a_m, vals

    lt = np.log(t)
    logx = {f: np.log2(np.maximum(feats[f], 1e-12)) for f in active}

    def predict(x):
        t0, p, a_c, a_m, vals = unpack(x)
        zc = a_c + sum((np.interp(logx[f], knots[f], vals[f]) for f in cf if f in vals), np.zeros(len(t)))
        zm = a_m + sum((np.interp(logx[f], knots[f], vals[f]) for f in mf if f in vals), np.zeros(len(t)))
        tc = np.where(F > 0, F / (P * _sigmoid(zc)), 0.0) if compute else np.zeros(len(t))
        tm = B / (W * cap * _sigmoid(zm))
        mx = np.maximum(np.maximum(tc, tm), 1e-30)
        return t0 + mx * ((tc / mx) ** p + (tm / mx) ** p) ** (1.0 / p)

    def resid(x):
        r = np.log(predict(x)) - lt
        pen = []
        for f in active:
            v = unpack(x)[4][f]
            if len(v) >= 3:
                pen.append(smooth * np.diff(v, 2))
        return np.concatenate([r, *pen]) if pen else r

    x0 = np.concatenate([[math.log(max(float(np.min(t)) * 0.5, 1e-7)), math.log(3.0), 1.0, 1.5],
                         *[np.zeros(s) for s in sizes]])
    lo = np.concatenate([[math.log(1e-8), -3.0, -8.0, -8.0], np.full(sum(sizes), -8.0)])
    hi = np.concatenate([[math.log(1e-2), 4.0, 8.0, 8.0], np.full(sum(sizes), 8.0)])
    from scipy.optimize import least_squares  # noqa: PLC0415 - 0.25 s to import; only fitting needs it
    sol = least_squares(resid, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, max_nfev=100)
    t0, p, a_c, a_m, vals = unpack(sol.x)
    values = {f: [float(v) for v in vals[f]] if f in vals else [0.0, 0.0] for f in (*cf, *mf)}
    heads: tuple[int, ...] = ()
    if cls in ("attn_prefill", "attn_decode") and {"heads", "kv_heads", "head_dim"} <= set(df.columns):
        configs = df[["heads", "kv_heads", "head_dim"]].drop_duplicates()
        if len(configs) == 1:
            heads = tuple(int(x) for x in configs.iloc[0])
    return Curve(cls, variant, P, W, t0, p, float(a_c), float(a_m), cap, knots, values, len(df), heads=heads)


def split_mask(df: pd.DataFrame, cls: str, frac: float = 0.2, seed: int = 0) -> np.ndarray:
    """Deterministic held-out mask: ``frac`` of the distinct measured shapes (all repeats of a shape go together)."""
    keys = df[COLUMNS[cls]].astype(str).agg("|".join, axis=1)
    uniq = pd.Index(keys.unique())
    rng = np.random.default_rng(seed)
    test_keys = set(uniq[rng.random(len(uniq)) < frac])
    return keys.isin(test_keys).to_numpy()


def mape(pred: np.ndarray, obs: np.ndarray) -> float:
    """Mean absolute percentage error, %."""
    return float(np.mean(np.abs(pred / obs - 1.0)) * 100.0)


# ------------------------------------------------------------------------------------------------ calibration
def _groups(obs: Observations, cls: str):
    """(gpu, variant, family, frame) groups of one class, MoE restricted to balanced routing."""
    df = obs.get(cls)
    if df.empty:
        return
    if cls == "moe":
        df = df[df["distribution"] == "balanced"]
    fam = df["source"].map(family_of)
    var = variant_of(cls, df)
    for (gpu, v, f), d in df.groupby([df["gpu"], var, fam]):
        yield gpu, v, f, d.reset_index(drop=True)


# Seconds one curve fit took, by operator class and profile family: the mean over the 87 fits of `servelab costcheck
# all` on the 2-core reference machine (2026-12-04, shared with other jobs, load average 1.1 to 2.4). The same fit
# took from 0.3 s to 8 s there, so these are rough; the progress displays' ETAs (lab/cli/progress.py) use them as
# relative weights, scaled by the speed measured as the fits go. The rows do not predict it (fit_curve fits at most
# 4,000 of them): the class's features and the table's grid do.
FIT_SECONDS: dict[tuple[str, str], float] = {
    ("allreduce", "aiconfigurator"): 0.07, ("allreduce", "vidur"): 0.09, ("sendrecv", "vidur"): 0.1,
    ("attn_decode", "aiconfigurator"): 19.2, ("attn_decode", "vidur"): 1.9,
    ("attn_prefill", "aiconfigurator"): 1.7, ("attn_prefill", "llmservingsim"): 0.8, ("attn_prefill", "vidur"): 0.6,
    ("elementwise", "llmservingsim"): 0.23, ("elementwise", "vidur"): 0.2,
    ("gemm", "aiconfigurator"): 13.3, ("gemm", "llmservingsim"): 2.8, ("gemm", "vidur"): 2.0,
    ("mla_decode", "aiconfigurator"): 6.8, ("mla_prefill", "aiconfigurator"): 1.9, ("moe", "aiconfigurator"): 12.3,
}


def fit_weight(cls: str, family: str, rows: int) -> float:
    """The expected seconds of one curve fit (:data:`FIT_SECONDS`; for a class and family it lacks, the mean of
    the class's families, else 2 s per 4,000 rows fitted): the weight of a fit in the progress displays."""
    if (cls, family) in FIT_SECONDS:
        return FIT_SECONDS[(cls, family)]
    same = [v for (c, _), v in FIT_SECONDS.items() if c == cls]
    return sum(same) / len(same) if same else 2.0 * min(rows, 4000) / 4000


def fit_plan(obs: Observations, min_rows: int = 16) -> list[tuple[str, str, str, str, pd.DataFrame]]:
    """The curves :func:`calibrate` fits, in its order: ``(gpu, class, variant, family, rows)``, one per GPU, class
    and variant, from the highest-priority profile family with at least ``min_rows`` observations of it."""
    best: dict[tuple[str, str, str], tuple[int, str, pd.DataFrame]] = {}
    for cls in FEATURES:
        for gpu, v, f, d in _groups(obs, cls):
            if len(d) < min_rows:
                continue
            rank = FAMILY_PRIORITY.index(f)
            key = (gpu, cls, v)
            if key not in best or rank < best[key][0]:
                best[key] = (rank, f, d)
    return [(gpu, cls, v, f, d) for (gpu, cls, v), (_, f, d) in sorted(best.items())]


def calibrate(obs: Observations, min_rows: int = 16, log=None, progress=None) -> "CurveSet":
    """Fit one curve per GPU, class and variant from the highest-priority profile family that has at least
    ``min_rows`` observations of it (servelab > aiconfigurator > vidur > llmservingsim: families are not mixed,
    because different kernels and timing methods disagree by more than the fit error; :func:`fit_plan`).

    ``progress`` (lab/cli/progress.py ``ItemProgress``, its items already counted by the caller from
    :func:`fit_plan`): each fit is an item of weight :func:`fit_weight`, its line the one ``log`` gets otherwise."""
    curves = CurveSet()
    for gpu, cls, v, f, d in fit_plan(obs, min_rows):
        if progress is not None:
            progress.start(f"fit {gpu} {cls} {v} from {f} ({len(d)} rows)", fit_weight(cls, f, len(d)))
        t0 = time.perf_counter()
        c = fit_curve(cls, v, d, load_hardware(gpu))
        c.source = f"{f}: " + ", ".join(sorted({s.split(':')[0] for s in d['source']}))
        curves.add(gpu, c)
        msg = f"fitted {gpu} {cls} {v} from {f} ({len(d)} rows"
        if progress is not None:
            progress.done(msg + ")")  # (the display adds the time)
        elif log:
            log(f"{msg}, {time.perf_counter() - t0:.1f} s)")
    return curves


def holdout_plan(obs: Observations, frac: float = 0.2,
                 min_rows: int = 30) -> list[tuple[str, str, str, str, pd.DataFrame, np.ndarray]]:
    """The tables :func:`holdout` scores, in its order: ``(gpu, class, variant, family, rows, test mask)``."""
    out = []
    for cls in FEATURES:
        for gpu, v, f, d in _groups(obs, cls):
            if len(d) < min_rows:
                continue
            test = split_mask(d, cls, frac)
            if test.sum() == 0 or (~test).sum() < 8:
                continue
            out.append((gpu, cls, v, f, d, test))
    return out


def holdout(obs: Observations, frac: float = 0.2, min_rows: int = 30, log=None, progress=None) -> pd.DataFrame:
    """Held-out accuracy of every (GPU, class, variant, family) table: fit on a deterministic 80 % of its distinct
    shapes, report MAPE (%) of the fitted curve on the other 20 % and, for the tables the cost model interpolates
    (lab/costmodel/tables.py), of that interpolation from the 80 % as well (:func:`holdout_plan`).

    ``progress``: each table is an item of weight :func:`fit_weight` (as :func:`calibrate`)."""
    rows = []
    for gpu, cls, v, f, d, test in holdout_plan(obs, frac, min_rows):
        if progress is not None:
            progress.start(f"held-out {gpu} {cls} {v} [{f}] ({len(d)} rows)",
                           fit_weight(cls, f, int((~test).sum())))
        c = fit_curve(cls, v, d[~test].reset_index(drop=True), load_hardware(gpu))
        F, B, feats = work(cls, d[test])
        obs_t = d.loc[test, "time_s"].to_numpy(float)
        fit_err = mape(c.predict(F, B, feats), obs_t)
        interp = interpolation_holdout(cls, d, test)
        rows.append({"gpu": gpu, "op_class": cls, "variant": v, "family": f, "rows": len(d),
                     "test_rows": int(test.sum()), "fit_mape_pct": round(fit_err, 1),
                     "table_mape_pct": None if interp is None else round(interp[0], 1),
                     "table_test_rows": None if interp is None else interp[1]})
        msg = f"{gpu} {cls} {v} [{f}] fit {fit_err:.1f} %" + ("" if interp is None else f", table {interp[0]:.1f} %")
        if progress is not None:
            progress.done(msg)
        elif log:
            log(msg)
    return pd.DataFrame(rows)


class CurveSet:
    """Fitted curves by GPU, class and variant, with a note; read and written as JSON (see
    lab/data/costmodel_coefficients.json)."""

    def __init__(self, note: dict | None = None) -> None:
        self.curves: dict[tuple[str, str, str], Curve] = {}
        self.note = note or {}

    def add(self, gpu: str, curve: Curve) -> None:
        self.curves[(gpu, curve.cls, curve.variant)] = curve

    def get(self, gpu: str, cls: str, variant: str) -> Curve | None:
        return self.curves.get((gpu, cls, variant))

    def to_json(self) -> dict:
        out: dict = {"note": self.note, "curves": {}}
        for (gpu, cls, v), c in sorted(self.curves.items()):
            d = c.to_dict()
            d["source"] = c.source
            out["curves"].setdefault(gpu, {}).setdefault(cls, {})[v] = d
        return out

    @classmethod
    def from_json(cls, data: dict, where: str = "<coefficients>") -> "CurveSet":
        if not isinstance(data, dict) or "curves" not in data:
            raise ValueError(f"{where}: not a servelab coefficients file (expected keys 'note' and 'curves')")
        cs = cls(data.get("note") or {})
        for gpu, classes in data["curves"].items():
            for c_name, variants in classes.items():
                for v, d in variants.items():
                    try:
                        c = Curve.from_dict(d)
                    except KeyError as e:
                        raise ValueError(f"{where}: curve {gpu}/{c_name}/{v} lacks field {e}") from None
                    want = set(FEATURES.get(c_name, ((), ()))[0]) | set(FEATURES.get(c_name, ((), ()))[1])
                    if c_name not in FEATURES or set(c.knots) != want:
                        raise ValueError(f"{where}: curve {gpu}/{c_name}/{v} has features {sorted(c.knots)}, this "
                                         f"servelab expects {sorted(want)}: the file was written by another version; "
                                         "rerun `servelab calibrate` (docs/costmodel.md gives the command)")
                    c.source = d.get("source", "")
                    cs.add(gpu, c)
        return cs
