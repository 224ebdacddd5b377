"""Step time from LLMServingSim-format layer profiles (``dense.csv``, ``attention.csv``, ``per_sequence.csv``,
optional ``moe.csv`` and ``skew_fit.csv``), combined the way LLMServingSim combines them
(shared/data/validation/llmservingsim/PROVENANCE.md §3; casys-kaist/LLMServingSim serving/core/trace_generator.py).

One iteration = ``embedding(T)`` + L x [``layernorm(T)`` x 2 + the other per-layer dense layers at T +
``attention(pc, kp, nd, kvd)`` + two TP all-reduces] + ``final_layernorm(T)`` + ``lm_head(S)`` + ``sampler(S)``,
where T = tokens in the step, S = sequences, pc / kp = Σ new / already-computed tokens of prefill chunks, nd = number
of decodes and kvd = their mean KV length. Profiles are one decoder layer measured in eager mode, in microseconds;
TP > 1 profiles hold per-rank shapes without communication, so the all-reduce of T x hidden bf16 activations is
added from the communication model (lab/costmodel/comm.py: the algorithm vLLM picks for that size on the link).
Lookups are linear in every axis (clamped below the grid, extrapolated above it); the 4-D attention table is read
bilinearly over (kp, kvd) inside each bracketing (pc, nd) slice and blended linearly over nd and pc; a missing slice
falls back to the nearest one on the nd axis. With ``skew_fit.csv`` present, decode attention is corrected for
unequal KV lengths: t = t(kvd_mean) + α·(t(kvd_max) − t(kvd_mean)), α looked up by bucket.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path

import pandas as pd

from lab.core.batch import BatchShape
from lab.costmodel import comm
from lab.costmodel.base import CostModelBase
from lab.costmodel.model_arch import ModelArch
from lab.costmodel.profiles import ProfileError, read_checked_csv, read_yaml_mapping, reject_duplicates

_US = 1e-6


def _bracket(xs: list[float], x: float) -> tuple[int, int, float]:
    """(lo, hi, t) for linear interpolation on sorted ``xs``: clamped below, extrapolated above."""
    n = len(xs)
    if n == 1 or x <= xs[0]:
        return 0, 0, 0.0
    i = bisect.bisect_right(xs, x)
    if i >= n:
        lo, hi = n - 2, n - 1
    else:
        lo, hi = i - 1, i
    x0, x1 = xs[lo], xs[hi]
    if x1 == x0:
        return lo, lo, 0.0
    return lo, hi, (x - x0) / (x1 - x0)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    lo, hi, t = _bracket(xs, x)
    return ys[lo] + t * (ys[hi] - ys[lo])


_ATTN_KEYS = ["prefill_chunk", "kv_prefill", "n_decode", "kv_decode"]


def _read_table(path: Path, spec: dict[str, str], keys: list[str]) -> pd.DataFrame:
    """A profile table with every ``spec`` value checked (profiles.py kinds: times finite and > 0, token and
    sequence counts integers) and one row per ``keys`` point: the lookups sort each axis and interpolate, so two
    times for one point would be ambiguous.

    Raises:
        ProfileError: one line naming the file, the row (file line), the column and what was expected.
    """
    df = read_checked_csv(path, spec)
    reject_duplicates(path, df, keys)
    return df


class _AttentionTable:
    """The 4-D attention grid: slices keyed by (prefill_chunk, n_decode), each a (kv_prefill x kv_decode) grid."""

    def __init__(self, path: Path) -> None:
        df = _read_table(path, {**dict.fromkeys(_ATTN_KEYS, "int0"), "time_us": "pos"}, _ATTN_KEYS)
        self.slices: dict[tuple[int, int], tuple[list[int], list[tuple[list[int], list[float]]]]] = {}
        for (pc, nd), g in df.groupby(["prefill_chunk", "n_decode"]):
            rows = []
            kps = sorted(g["kv_prefill"].unique())
            for kp in kps:
                r = g[g["kv_prefill"] == kp].sort_values("kv_decode")
                rows.append((r["kv_decode"].tolist(), r["time_us"].astype(float).tolist()))
            self.slices[(int(pc), int(nd))] = ([int(k) for k in kps], rows)
        self.pcs = sorted({k[0] for k in self.slices})
        self.nds_by_pc = {pc: sorted(nd for (p, nd) in self.slices if p == pc) for pc in self.pcs}

    def _slice(self, pc: int, nd: int, kp: float, kvd: float) -> float:
        kps, rows = self.slices[(pc, nd)]
        lo, hi, t = _bracket(kps, kp)
        xs, ys = rows[lo]
        v_lo = _interp(xs, ys, kvd)
        if lo == hi:
            return v_lo
        xs, ys = rows[hi]
        return v_lo + t * (_interp(xs, ys, kvd) - v_lo)

    def _at_pc(self, pc: int, nd: float, kp: float, kvd: float) -> float:
        nds = self.nds_by_pc[pc]
        lo, hi, t = _bracket(nds, nd)
        v_lo = self._slice(pc, nds[lo], kp, kvd)
        if lo == hi:
            return v_lo
        return v_lo + t * (self._slice(pc, nds[hi], kp, kvd) - v_lo)

    def lookup_us(self, pc: float, kp: float, nd: float, kvd: float) -> float:
        lo, hi, t = _bracket(self.pcs, pc)
        v_lo = self._at_pc(self.pcs[lo], nd, kp, kvd)
        if lo == hi:
            return v_lo
        return v_lo + t * (self._at_pc(self.pcs[hi], nd, kp, kvd) - v_lo)


# Default bucket edges of the skew correction (right-inclusive), used when meta.yaml gives none.
_DEFAULT_SKEW_AXES = {
    "n_bins": [0, 2, 4, 8, 16, 32, 64, 128, 10**6],
    "n_labels": ["n<=2", "n<=4", "n<=8", "n<=16", "n<=32", "n<=64", "n<=128", "n>128"],
    "kv_big_bins": [0, 1024, 4096, 16384, 10**9],
    "kv_big_labels": ["kvB<=1k", "kvB<=4k", "kvB<=16k", "kvB>16k"],
    "skew_rate_bins": [-0.01, 0.05, 0.15, 0.40, 0.70, 1.01],
    "skew_rate_labels": ["sr<=5%", "sr<=15%", "sr<=40%", "sr<=70%", "sr>70%"],
    "kp_bins": [-1, 0, 2048, 10**9],
    "kp_labels": ["kp=0", "kp<=2k", "kp>2k"],
}


_SKEW_LABELS = ["n_label", "skew_rate_label", "kv_big_label", "kp_label"]


def _finite(v: object, where: str) -> float:
    """``v`` as a float, or :class:`ProfileError` at ``where`` when it is not a finite number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProfileError(f"{where}: expected a finite number, got {v!r}")
    return float(v)


def _section(path: Path, parent: dict, key: object, where: str) -> dict:
    """``parent[key]`` as a mapping ({} when absent or null), or :class:`ProfileError` naming ``where.key``."""
    value = parent.get(key) or {}
    if not isinstance(value, dict):
        raise ProfileError(f"{path}: {where}.{key}: expected a mapping, got {type(value).__name__}")
    return value


def _meta_section(meta_path: Path, key: str) -> dict:
    """The ``key`` mapping of a profile's ``meta.yaml`` ({} when the file or the key is absent)."""
    if not meta_path.is_file():
        return {}
    value = read_yaml_mapping(meta_path).get(key) or {}
    if not isinstance(value, dict):
        raise ProfileError(f"{meta_path}: {key}: expected a mapping, got {type(value).__name__}")
    return value


def _skew_axes(meta_path: Path, fit: dict) -> dict:
    """Bucket edges and labels of the skew correction: the defaults, overridden by ``skew_fit.bucket_axes``. Each
    ``*_bins`` must be strictly increasing finite numbers (buckets are found by scanning upwards) and each
    ``*_labels`` one label per bucket."""
    axes = dict(_DEFAULT_SKEW_AXES)
    axes.update({k: v for k, v in _section(meta_path, fit, "bucket_axes", "skew_fit").items() if k in axes})
    for axis in ("n", "skew_rate", "kv_big", "kp"):
        where = f"{meta_path}: skew_fit.bucket_axes.{axis}"
        bins, labels = axes[f"{axis}_bins"], axes[f"{axis}_labels"]
        if not isinstance(bins, list) or len(bins) < 2:
            raise ProfileError(f"{where}_bins: expected a list of at least 2 bucket edges, got {bins!r}")
        edges = [_finite(b, f"{where}_bins[{i}]") for i, b in enumerate(bins)]
        for i in range(1, len(edges)):
            if edges[i] <= edges[i - 1]:
                raise ProfileError(f"{where}_bins[{i}]: expected edges in increasing order, got {bins[i]!r} after "
                                   f"{bins[i - 1]!r}")
        if not isinstance(labels, list) or len(labels) != len(bins) - 1:
            raise ProfileError(f"{where}_labels: expected {len(bins) - 1} labels (one per bucket of {axis}_bins), "
                               f"got {labels!r}")
    return axes


def _label(bins: list[float], labels: list[str], v: float) -> str:
    for i, lab in enumerate(labels):
        if v <= bins[i + 1]:
            return lab
    return labels[-1]


class LLMServingSimProfileCostModel(CostModelBase):
    """Cost model over one LLMServingSim profile folder (e.g. ``.../RTX4090/meta-llama/Llama-3.1-8B/bf16/tp1``).

    Args:
        profile_dir: folder with ``dense.csv``, ``attention.csv`` and ``per_sequence.csv`` (times in µs).
        model: architecture (number of layers, hidden size for the all-reduce size).
        tp: tensor-parallel size the profiles were taken at.
        link: the TP group's link (lab/costmodel/comm.py; the experiment picks it from the catalog with
            ``comm.group_link``); default: PCIe 5 without P2P, only used when ``tp > 1``.
        use_skew: apply ``skew_fit.csv`` when present.

    Raises:
        FileNotFoundError: a required CSV is missing (the message names it).
        ProfileError: a bad table or ``../meta.yaml``: an empty or header-only file, a missing column, a missing,
            non-numeric, non-finite or non-positive time, a non-integer count, or a point measured twice (one
            line naming the file, the row and the column).
    """

    name = "llmservingsim_profile"

    def __init__(self, profile_dir: str | Path, model: ModelArch, tp: int = 1,
                 link: comm.LinkSpec | None = None, use_skew: bool = True) -> None:
        d = Path(profile_dir)
        for f in ("dense.csv", "attention.csv", "per_sequence.csv"):
            if not (d / f).is_file():
                raise FileNotFoundError(f"cost_model.profile_dir: {d / f} does not exist (an LLMServingSim profile "
                                        "folder holds dense.csv, attention.csv and per_sequence.csv)")
        self.model = model
        self.tp = tp
        self.link = link or comm.LINKS["pcie5_no_p2p"]
        self.dense = self._read_1d(d / "dense.csv", "layer", "tokens")
        self.per_seq = self._read_1d(d / "per_sequence.csv", "layer", "sequences")
        self.attn = _AttentionTable(d / "attention.csv")
        for name in ("lm_head", "sampler"):
            if name not in self.per_seq:
                raise ProfileError(f"{d / 'per_sequence.csv'}: no rows for layer {name!r}; expected lm_head and "
                                   "sampler rows")
        self.layer_names = [n for n in self.dense if n not in ("embedding", "final_layernorm")]
        self.moe = None
        if model.is_moe and (d / "moe.csv").is_file():
            self.moe = _read_table(d / "moe.csv", {"tokens": "int1", "activated_experts": "pos", "time_us": "pos"},
                                   ["tokens", "activated_experts"])
            self.layer_names = [n for n in self.layer_names if n not in ("gate_up_proj", "act_fn", "down_proj")]
        self.skew: dict[str, float] = {}
        self.skew_default = 0.0
        self.skew_axes = _DEFAULT_SKEW_AXES
        if use_skew and (d / "skew_fit.csv").is_file():
            self._load_skew(d)
        self._dense_cache: dict[int, tuple[float, float, float]] = {}

    def _load_skew(self, d: Path) -> None:
        """Read the per-bucket α table, its bucket edges and the pooled default from ``../meta.yaml``."""
        meta_path = d.parent / "meta.yaml"
        fit = _meta_section(meta_path, "skew_fit")
        if not fit.get("enabled", True):
            return
        self.skew_axes = _skew_axes(meta_path, fit)
        per_tp = _section(meta_path, fit, "per_tp", "skew_fit")
        key = self.tp if self.tp in per_tp else str(self.tp)
        entry = _section(meta_path, per_tp, key, "skew_fit.per_tp")
        where = f"{meta_path}: skew_fit.per_tp.{key}.alpha_default"
        self.skew_default = _finite(entry.get("alpha_default", 0.0), where)
        spec = {"pc": "int0", **dict.fromkeys(_SKEW_LABELS, "text"), "alpha": "num"}
        for r in _read_table(d / "skew_fit.csv", spec, ["pc", *_SKEW_LABELS]).itertuples():
            self.skew[f"{int(r.pc)}|{r.n_label}|{r.skew_rate_label}|{r.kv_big_label}|{r.kp_label}"] = float(r.alpha)

    @staticmethod
    def _read_1d(path: Path, key: str, x: str) -> dict[str, tuple[list[float], list[float]]]:
        """``{name: (sorted x values, times in µs)}`` of a (name, count, time) table, every value checked."""
        df = _read_table(path, {key: "text", x: "int1", "time_us": "pos"}, [key, x])
        out = {}
        for name, g in df.groupby(key):
            g = g.sort_values(x)
            out[str(name)] = (g[x].astype(float).tolist(), g["time_us"].astype(float).tolist())
        return out

    def _dense_us(self, T: int) -> tuple[float, float, float]:
        """(per-layer dense µs, embedding + final norm µs, MoE µs per layer) at T tokens; cached by T."""
        hit = self._dense_cache.get(T)
        if hit is not None:
            return hit
        per_layer = 0.0
        for n in self.layer_names:
            xs, ys = self.dense[n]
            v = _interp(xs, ys, T)
            per_layer += 2 * v if n == "layernorm" else v
        edge = 0.0
        for n in ("embedding", "final_layernorm"):
            if n in self.dense:
                xs, ys = self.dense[n]
                edge += _interp(xs, ys, T)
        moe = self._moe_us(T) if self.moe is not None else 0.0
        out = (per_layer, edge, moe)
        self._dense_cache[T] = out
        return out

    def _moe_us(self, T: int) -> float:
        m = self.model
        k, E = m.experts_per_token, m.num_experts
        active = E * (1.0 - (1.0 - k / E) ** T)
        df = self.moe
        toks = sorted(df["tokens"].unique())
        lo, hi, t = _bracket(toks, T)

        def at(tok: int) -> float:
            g = df[df["tokens"] == tok].sort_values("activated_experts")
            return _interp(g["activated_experts"].astype(float).tolist(), g["time_us"].astype(float).tolist(), active)

        v = at(toks[lo])
        return v if lo == hi else v + t * (at(toks[hi]) - v)

    def _attention_us(self, shape: BatchShape) -> float:
        # verify queries (1 + k tokens) count as decodes of context c + q - 1: the profiled decode attention reads
        # each request's KV once; the extra queries' compute is not in the tables (memory-bound decode)
        vn = shape.verify_new
        pc = shape.num_tokens - shape.num_decodes - sum(vn)
        kp = sum(shape.prefill_context)
        nd = shape.num_decodes + len(vn)
        kv_sum = shape.decode_sum + sum(c + q - 1 for q, c in zip(vn, shape.verify_context)) if vn else shape.decode_sum
        kvd = kv_sum // nd if nd else 0
        t = self.attn.lookup_us(pc, kp, nd, kvd)
        if self.skew and nd > 1:
            kmax, kmin = shape.decode_max, shape.decode_min
            if kmax != kvd:
                sr = (kvd - kmin) / (kmax - kmin) if kmax > kmin else 0.5
                a = self.skew_axes
                key = (f"{int(pc)}|{_label(a['n_bins'], a['n_labels'], nd)}"
                       f"|{_label(a['skew_rate_bins'], a['skew_rate_labels'], min(1.0, max(0.0, sr)))}"
                       f"|{_label(a['kv_big_bins'], a['kv_big_labels'], kmax)}"
                       f"|{_label(a['kp_bins'], a['kp_labels'], kp)}")
                alpha = self.skew.get(key, self.skew_default)
                if alpha:
                    t_max = self.attn.lookup_us(pc, kp, nd, kmax)
                    if t_max > t:
                        t += alpha * (t_max - t)
        return t

    def _allreduce_s(self, T: int) -> float:
        if self.tp == 1:
            return 0.0
        return comm.allreduce(self.link, self.tp, T * self.model.hidden_size * 2)

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """Step time split into dense layers, attention, MoE, communication and head (seconds)."""
        T, S = shape.num_tokens, shape.num_logits
        if T == 0:
            return {}
        L = self.model.num_layers
        per_layer, edge, moe = self._dense_us(shape.dense_tokens)
        lm, smp = self.per_seq["lm_head"], self.per_seq["sampler"]
        head = _interp(*lm, S) + _interp(*smp, S)
        return {
            "dense": (per_layer * L + edge) * _US,
            "attention": self._attention_us(shape) * L * _US,
            "moe": moe * L * _US,
            "communication": 2 * L * self._allreduce_s(shape.dense_tokens),
            "head": head * _US,
        }

    def step_time(self, shape: BatchShape) -> float:
        T, S = shape.num_tokens, shape.num_logits
        if T == 0:
            return 0.0
        L = self.model.num_layers
        Td = shape.dense_tokens
        per_layer, edge, moe = self._dense_us(Td)
        lm, smp = self.per_seq["lm_head"], self.per_seq["sampler"]
        us = (per_layer + moe + self._attention_us(shape)) * L + edge + _interp(*lm, S) + _interp(*smp, S)
        return us * _US + 2 * L * self._allreduce_s(Td)
