"""Measured operator timings ("profiles") in every format servelab reads, converted to one set of observation
tables: the project's own profile format.

Formats read (detected per folder, recursively):

* **servelab** (written by ``servelab profile``): a folder with ``meta.yaml`` (``format: servelab-profile``,
  ``gpu``) and one CSV per operator class below, times in ``time_us``.
* **AIConfigurator** perf_db (ai-dynamo/aiconfigurator ``systems/data/<gpu>/<op>/vllm/<version>/*.parquet``,
  latency in ms): GEMM, context and generation attention, MLA modules, MoE, custom all-reduce.
* **Vidur** (microsoft/vidur ``data/profiling``): ``mlp.csv`` (per-layer non-attention ops of one TP shard, ms),
  ``attention.csv`` (Vidur schema, ms), ``all_reduce.csv`` / ``send_recv.csv`` (ms, size in bytes).
* **LLMServingSim**: v1 ``layers.csv`` (per-layer latency in ns, the model and TP from the folder path
  ``<org>/<model>/tp<N>``), and the profiler bundle ``dense.csv`` / ``attention.csv`` / ``per_sequence.csv`` (µs,
  the model from ``../meta.yaml``).

Observation classes and columns (all shapes are per GPU; ``time_s`` in seconds; ``gpu`` is the catalog name):

| class | columns |
|---|---|
| ``gemm`` | dtype (bf16, fp8, fp8_block), m, n, k |
| ``attn_prefill`` | kv_dtype, batch, q_len (new tokens per sequence), ctx_len (cached tokens before them), heads, kv_heads, head_dim |
| ``attn_decode`` | kv_dtype, batch, kv_len (cached tokens per sequence), heads, kv_heads, head_dim |
| ``mla_prefill`` / ``mla_decode`` | model, dtype (GEMMs), kv_dtype, heads, batch, q_len / kv_len — a whole MLA attention module (projections, latent attention, o_proj) |
| ``moe`` | dtype, tokens, hidden, inter, topk, experts, tp, ep, distribution — fused routed experts (no router, no shared expert) |
| ``allreduce`` | gpus, bytes, backend |
| ``sendrecv`` | bytes |
| ``elementwise`` | op, bytes |

Every table also has ``gpu`` and ``source`` (the file it came from, for provenance).

Every reader checks the columns it uses and their values and raises :class:`ProfileError`, a one-line message
naming the file, the row and the column and saying what was expected: an empty, header-only, non-UTF-8 or
malformed file, a missing column, and a missing (NaN), non-numeric, non-integer or out-of-range value (times must be
finite and > 0, sizes integers >= 1, cached lengths integers >= 0). A CSV row is its line number (the header is
row 1); a parquet row counts from 1 (the first data row).
"""

from __future__ import annotations

import re
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
import yaml

from lab.costmodel.hardware import load_hardware
from lab.costmodel.model_arch import ModelArch, load_model

CLASSES = ("gemm", "attn_prefill", "attn_decode", "mla_prefill", "mla_decode", "moe", "allreduce", "sendrecv",
           "elementwise")

COLUMNS: dict[str, list[str]] = {
    "gemm": ["dtype", "m", "n", "k"],
    "attn_prefill": ["kv_dtype", "batch", "q_len", "ctx_len", "heads", "kv_heads", "head_dim"],
    "attn_decode": ["kv_dtype", "batch", "kv_len", "heads", "kv_heads", "head_dim"],
    "mla_prefill": ["model", "dtype", "kv_dtype", "heads", "batch", "q_len"],
    "mla_decode": ["model", "dtype", "kv_dtype", "heads", "batch", "kv_len"],
    "moe": ["dtype", "tokens", "hidden", "inter", "topk", "experts", "tp", "ep", "distribution"],
    "allreduce": ["gpus", "bytes", "backend"],
    "sendrecv": ["bytes"],
    "elementwise": ["op", "bytes"],
}

_DTYPES = {"bfloat16": "bf16", "float16": "bf16", "fp16": "bf16", "bf16": "bf16", "fp8": "fp8",
           "fp8_block": "fp8_block", "fp8_e4m3": "fp8", "auto": "bf16"}


class ProfileError(ValueError):
    """A profile folder or file that cannot be read; the message names the file and what was expected."""


# ------------------------------------------------------------------------------------------------ checked reading
# Column kinds: what a value must be. Numbers are finite; "flag" is True/False.
_NEED = {"int0": "an integer >= 0", "int1": "an integer >= 1", "pos": "a number > 0", "num": "a finite number",
         "text": "a non-empty string", "flag": "True or False"}
_FLAGS = {True: True, False: False, "True": True, "False": False, "true": True, "false": False, "TRUE": True,
          "FALSE": False}


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _valid(s: pd.Series, kind: str) -> tuple[pd.Series, np.ndarray]:
    """(converted values, mask of valid ones) of a column of kind ``kind`` (see ``_NEED``)."""
    if kind == "text":
        return s, (s.notna() & (s.astype(str).str.strip() != "")).to_numpy()
    if kind == "flag":
        v = s.map(lambda x: _FLAGS.get(x) if isinstance(x, (bool, np.bool_, str)) else None)
        return v, v.notna().to_numpy()
    a = (np.full(len(s), np.nan) if pd.api.types.is_bool_dtype(s)
         else pd.to_numeric(s, errors="coerce").to_numpy(dtype=float))
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(a)
        if kind != "num":
            ok &= (a > 0) if kind in ("pos", "int1") else (a >= 0)
        if kind not in ("pos", "num"):
            ok &= a == np.floor(a)
    return pd.Series(a, index=s.index), ok


def _checked(where: Path, df: pd.DataFrame, spec: dict[str, str], first_row: int = 2) -> pd.DataFrame:
    """``df`` with the columns of ``spec`` (name -> kind) checked and converted; row ``i`` of the file is
    ``df.index[i] + first_row``.

    Raises:
        ProfileError: a missing column, or the first bad value, naming the file, the row and the column.
    """
    missing = [c for c in spec if c not in df.columns]
    if missing:
        raise ProfileError(f"{where}: missing column(s) {missing}; found {list(df.columns)}")
    out = df.copy()
    for col, kind in spec.items():
        values, ok = _valid(df[col], kind)
        bad = np.flatnonzero(~ok)
        if len(bad):
            i = int(bad[0])
            v = df[col].iloc[i]
            raise ProfileError(f"{where}: row {df.index[i] + first_row}: {col} must be {_NEED[kind]}, got "
                               f"{v.item() if hasattr(v, 'item') else v!r}")
        out[col] = values.astype(bool) if kind == "flag" else values
    return out


def blank_rows(df: pd.DataFrame) -> np.ndarray:
    """Rows whose every cell is empty (blank lines, read with ``keep_default_na=False`` so that a cell written
    ``nan`` stays a value to reject, not a blank)."""
    blank = np.ones(len(df), dtype=bool)
    for c in df.columns:
        s = df[c]
        if not (pd.api.types.is_object_dtype(s) or pd.api.types.is_string_dtype(s)):
            return np.zeros(len(df), dtype=bool)
        blank &= (s.astype(str).str.strip() == "").to_numpy()
    return blank


def _read_csv(path: Path, spec: dict[str, str]) -> pd.DataFrame:
    """A measured CSV table with at least one data row, its ``spec`` columns checked (see :func:`_checked`).
    Blank lines are skipped but counted, so rows keep their line numbers.

    Raises:
        ProfileError: an empty, header-only, non-UTF-8 or malformed file, a missing column or a bad value.
    """
    try:
        with warnings.catch_warnings():  # a first data row with an extra field: a warning, made an error
            warnings.simplefilter("error", pd.errors.ParserWarning)
            df = pd.read_csv(path, skip_blank_lines=False, keep_default_na=False, index_col=False, encoding="utf-8")
    except pd.errors.EmptyDataError:
        raise ProfileError(f"{path}: the file is empty; expected a header row and one row per measurement") from None
    except pd.errors.ParserError as e:
        raise ProfileError(f"{path}: not a well-formed CSV ({_one_line(e)})") from None
    except pd.errors.ParserWarning:
        raise ProfileError(f"{path}: not a well-formed CSV (line 2 has more fields than the header)") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x}); expected a UTF-8 CSV") from None
    except (OSError, EOFError, zlib.error) as e:
        raise ProfileError(f"{path}: cannot read the file ({_one_line(e) or type(e).__name__})") from None
    df = df[~blank_rows(df)]
    if df.empty:
        raise ProfileError(f"{path}: no measurements (only a header row); expected one row per measurement")
    return _checked(path, df, spec)


def read_checked_csv(path: Path, spec: dict[str, str]) -> pd.DataFrame:
    """A measured CSV table whose ``spec`` columns (name -> kind: ``int0``, ``int1``, ``pos``, ``num``, ``text``,
    ``flag``) are checked and converted; the index is the file line number minus 2 (the header is line 1).

    Raises:
        ProfileError: an empty, header-only, non-UTF-8 or malformed file, a missing column or a bad value, naming
        the file, the row and the column.
    """
    return _read_csv(path, spec)


def reject_duplicates(path: Path, df: pd.DataFrame, keys: list[str]) -> None:
    """Raise :class:`ProfileError` at the first row of ``df`` (read by :func:`read_checked_csv`) that repeats the
    ``keys`` of an earlier row: a lookup table holds one measurement per point."""
    dup = df.duplicated(keys, keep="first").to_numpy()
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        row = df.iloc[i]
        same = (df[keys] == row[keys]).all(axis=1).to_numpy()
        first = int(np.flatnonzero(same)[0])
        point = ", ".join(f"{k}={_plain(row[k])}" for k in keys)
        raise ProfileError(f"{path}: row {df.index[i] + 2}: {point} repeats row {df.index[first] + 2}; expected "
                           f"one row per ({', '.join(keys)})")


def _plain(v: object) -> object:
    """A cell for a message: integral floats without their ``.0``."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def read_yaml_mapping(path: Path) -> dict:
    """A YAML mapping (an empty file is ``{}``).

    Raises:
        ProfileError: not UTF-8, not valid YAML, or not a mapping (one line naming the file).
    """
    return _read_yaml(path)


def _read_parquet(path: Path) -> pd.DataFrame:
    """A parquet table with at least one row.

    Raises:
        ProfileError: an unreadable (corrupt, truncated, not parquet) or empty table.
    """
    try:
        df = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError types for corrupt files
        raise ProfileError(f"{path}: not a readable parquet file ({_one_line(e) or type(e).__name__})") from None
    if df.empty:
        raise ProfileError(f"{path}: no measurements (the table has no rows)")
    return df.reset_index(drop=True)


def _read_yaml(path: Path) -> dict:
    """A YAML mapping (an empty file is ``{}``).

    Raises:
        ProfileError: not UTF-8, not valid YAML, or not a mapping.
    """
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        raise ProfileError(f"{path}: {line}not valid YAML ({_one_line(getattr(e, 'problem', None) or e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a YAML mapping (key: value lines), got {type(data).__name__}")
    return data


@dataclass
class Observations:
    """Measured operator times by class (see the module docstring for the columns)."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, cls: str, df: pd.DataFrame) -> None:
        if df is None or df.empty:
            return
        missing = set(COLUMNS[cls]) | {"gpu", "source", "time_s"}
        missing -= set(df.columns)
        if missing:
            raise ProfileError(f"{cls} observations lack columns {sorted(missing)}")
        df = df[["gpu", "source", *COLUMNS[cls], "time_s"]]
        df = df[np.isfinite(df["time_s"].astype(float)) & (df["time_s"].astype(float) > 0)]
        self.tables[cls] = pd.concat([self.tables[cls], df], ignore_index=True) if cls in self.tables else df.reset_index(drop=True)

    def extend(self, other: "Observations") -> None:
        for cls, df in other.tables.items():
            self.add(cls, df)
        self.notes += other.notes

    def get(self, cls: str, gpu: str | None = None) -> pd.DataFrame:
        df = self.tables.get(cls)
        if df is None:
            return pd.DataFrame(columns=["gpu", "source", *COLUMNS[cls], "time_s"])
        return df if gpu is None else df[df["gpu"] == gpu]

    def gpus(self) -> list[str]:
        return sorted({g for df in self.tables.values() for g in df["gpu"].unique()})

    def only(self, gpu: str | None = None, source_contains: str | None = None) -> "Observations":
        out = Observations()
        for cls, df in self.tables.items():
            if gpu is not None:
                df = df[df["gpu"] == gpu]
            if source_contains is not None:
                df = df[df["source"].str.contains(source_contains, regex=False)]
            if not df.empty:
                out.tables[cls] = df.reset_index(drop=True)
        return out

    def summary(self) -> pd.DataFrame:
        rows = [(cls, g, len(d)) for cls, df in self.tables.items() for g, d in df.groupby("gpu")]
        return pd.DataFrame(rows, columns=["class", "gpu", "rows"])


def gpu_name(name: str, where: str) -> str:
    """Catalog name of a GPU named by a device string, a folder name or an alias."""
    cleaned = str(name).strip()
    candidates = [cleaned, cleaned.lower(), cleaned.upper(), cleaned.replace("_sxm", ""), cleaned.split("_")[0]]
    for c in candidates:
        try:
            return load_hardware(c).name
        except ValueError:
            continue
    raise ProfileError(f"{where}: GPU {name!r} is not in the hardware catalog (add it or an alias to "
                       "lab/catalog/hardware.yaml, or to the experiment's hardware.gpu_catalog)")


# ------------------------------------------------------------------------------------------------ servelab
# Kinds of the servelab columns that are not integer sizes >= 1 (see ``_NEED``).
_SERVELAB_KIND = {"dtype": "text", "kv_dtype": "text", "model": "text", "distribution": "text", "backend": "text",
                  "op": "text", "ctx_len": "int0", "kv_len": "int0", "bytes": "pos"}


def read_servelab(folder: Path) -> Observations:
    """A ``servelab profile`` folder: ``meta.yaml`` plus ``<class>.csv`` files (``time_us``).

    Raises:
        ProfileError: a bad meta.yaml (format, gpu) or a bad class table (see the module docstring).
    """
    meta_path = folder / "meta.yaml"
    meta = _read_yaml(meta_path)
    if meta.get("format") != "servelab-profile":
        raise ProfileError(f"{meta_path}: expected 'format: servelab-profile'")
    if not meta.get("gpu"):
        raise ProfileError(f"{meta_path}: missing key 'gpu' (the GPU the profile was measured on)")
    gpu = gpu_name(meta["gpu"], str(meta_path))
    obs = Observations()
    for cls in CLASSES:
        p = folder / f"{cls}.csv"
        if not p.is_file():
            continue
        df = _read_csv(p, {**{c: _SERVELAB_KIND.get(c, "int1") for c in COLUMNS[cls]}, "time_us": "pos"})
        df["time_s"] = df["time_us"] * 1e-6
        df["gpu"] = gpu
        df["source"] = str(p)
        obs.add(cls, df)
    return obs


def write_servelab(obs: Observations, folder: Path, meta: dict) -> list[Path]:
    """Write observations in the servelab profile format (one CSV per class, ``time_us``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.yaml").write_text(yaml.safe_dump({"format": "servelab-profile", "version": 1, **meta},
                                                      sort_keys=False))
    written = [folder / "meta.yaml"]
    for cls, df in obs.tables.items():
        out = df[COLUMNS[cls]].copy()
        out["time_us"] = (df["time_s"].astype(float) * 1e6).round(4)
        p = folder / f"{cls}.csv"
        out.to_csv(p, index=False)
        written.append(p)
    return written


# ------------------------------------------------------------------------------------------------ AIConfigurator
_AIC_ATTN = {"kv_cache_dtype": "text", "batch_size": "int1", "num_heads": "int1", "num_key_value_heads": "int1",
             "head_dim": "int1"}
_AIC_MLA = {"model": "text", "gemm_type": "text", "kv_cache_dtype": "text", "num_heads": "int1", "batch_size": "int1"}
# The columns each AIConfigurator table must have, and their kinds (see ``_NEED``), besides device and latency.
_AIC_SPEC = {
    "gemm_perf.parquet": {"gemm_dtype": "text", "m": "int1", "n": "int1", "k": "int1"},
    "context_attention_perf.parquet": {**_AIC_ATTN, "isl": "int1"},
    "generation_attention_perf.parquet": {**_AIC_ATTN, "step": "int0"},
    "mla_context_module_perf.parquet": {**_AIC_MLA, "isl": "int1"},
    "mla_generation_module_perf.parquet": {**_AIC_MLA, "step": "int0"},
    "moe_perf.parquet": {"moe_dtype": "text", "num_tokens": "int1", "hidden_size": "int1", "inter_size": "int1",
                         "topk": "int1", "num_experts": "int1", "moe_tp_size": "int1", "moe_ep_size": "int1",
                         "distribution": "text"},
    "custom_allreduce_perf.parquet": {"num_gpus": "int1", "message_size": "pos", "backend": "text"},
}


def _aic_table(p: Path) -> pd.DataFrame:
    """One AIConfigurator table with its columns checked (optional ``step`` / ``window_size`` too, when present).

    Raises:
        ProfileError: unreadable or empty table, a missing column or a bad value (row counted from 1).
    """
    df = _read_parquet(p)
    spec = {"device": "text", "latency": "pos", **_AIC_SPEC[p.name]}
    spec.update({c: "int0" for c in ("step", "window_size") if c in df.columns and c not in spec})
    return _checked(p, df, spec, first_row=1)


def read_aiconfigurator_file(p: Path) -> Observations:
    """One AIConfigurator parquet table (GEMM, attention, MLA module, MoE or custom all-reduce; latency in ms);
    other ``*_perf.parquet`` names are not read.

    Raises:
        ProfileError: see :func:`_aic_table`, or a device not in the hardware catalog.
    """
    obs = Observations()
    if p.name not in _AIC_SPEC:
        return obs
    df = _aic_table(p)
    gpu = gpu_name(df["device"].iloc[0], str(p))
    base = pd.DataFrame({"gpu": gpu, "source": str(p), "time_s": df["latency"] * 1e-3})
    op = str(df["op_name"].iloc[0]) if "op_name" in df.columns else ""
    if p.name == "gemm_perf.parquet":
        base["dtype"] = df["gemm_dtype"].map(_DTYPES)
        for c in "mnk":
            base[c] = df[c].astype(int)
        obs.add("gemm", base[base["dtype"].notna()])
    elif p.name in ("context_attention_perf.parquet", "generation_attention_perf.parquet"):
        keep = (df["window_size"] == 0) if "window_size" in df.columns else slice(None)
        d = df[keep]
        b = base[keep].copy()
        b["kv_dtype"] = d["kv_cache_dtype"].map(_DTYPES)
        b["batch"] = d["batch_size"].astype(int)
        b["heads"] = d["num_heads"].astype(int)
        b["kv_heads"] = d["num_key_value_heads"].astype(int)
        b["head_dim"] = d["head_dim"].astype(int)
        if op == "context_attention" or p.name.startswith("context"):
            b["q_len"] = d["isl"].astype(int)
            b["ctx_len"] = d["step"].astype(int) if "step" in d.columns else 0
            obs.add("attn_prefill", b)
        else:
            # generation: `step` tokens already cached, one new token each
            b["kv_len"] = d["step"].astype(int)
            obs.add("attn_decode", b)
    elif p.name in ("mla_context_module_perf.parquet", "mla_generation_module_perf.parquet"):
        b = base.copy()
        b["model"] = df["model"].astype(str)
        b["dtype"] = df["gemm_type"].map(_DTYPES)
        b["kv_dtype"] = df["kv_cache_dtype"].map(_DTYPES)
        b["heads"] = df["num_heads"].astype(int)
        b["batch"] = df["batch_size"].astype(int)
        if p.name.startswith("mla_context"):
            b["q_len"] = df["isl"].astype(int)
            obs.add("mla_prefill", b)
        else:
            b["kv_len"] = df["step"].astype(int)
            obs.add("mla_decode", b)
    elif p.name == "moe_perf.parquet":
        b = base.copy()
        b["dtype"] = df["moe_dtype"].map(_DTYPES)
        for src, dst in (("num_tokens", "tokens"), ("hidden_size", "hidden"), ("inter_size", "inter"),
                         ("topk", "topk"), ("num_experts", "experts"), ("moe_tp_size", "tp"), ("moe_ep_size", "ep")):
            b[dst] = df[src].astype(int)
        b["distribution"] = df["distribution"].astype(str)
        obs.add("moe", b[b["dtype"].notna()])
    else:  # custom_allreduce_perf.parquet
        b = base.copy()
        b["gpus"] = df["num_gpus"].astype(int)
        b["bytes"] = df["message_size"].astype(float) * 2  # elements of bf16
        b["backend"] = df["backend"].map({"vllm_graph": "graph", "vllm_eager": "eager"}).fillna(df["backend"])
        obs.add("allreduce", b)
    return obs


# ------------------------------------------------------------------------------------------------ Vidur
_VIDUR_GPU = {"h100": "H100-SXM5-80GB", "a100": "A100-80GB-SXM4"}


def _vidur_gpu(path: Path) -> str:
    for part in reversed(path.parts):
        key = part.lower().split("_")[0]
        if key in _VIDUR_GPU:
            return _VIDUR_GPU[key]
    raise ProfileError(f"{path}: cannot tell the GPU from the path (expected a folder named h100/a100/h100_dgx/...)")


def _ms(df: pd.DataFrame, op: str) -> pd.Series:
    """Vidur's median time of ``op`` in seconds (the column is checked by the reader; an empty selection may lack
    it)."""
    col = f"time_stats.{op}.median"
    return df[col].astype(float) * 1e-3 if col in df.columns else pd.Series(dtype=float, index=df.index)


def _vidur_times(path: Path, df: pd.DataFrame, ops: Iterable[str]) -> pd.DataFrame:
    """``df`` with each op's ``time_stats.<op>.median`` checked: present, a number > 0 (ms).

    Raises:
        ProfileError: a missing column or the first bad time, naming the file, the row and the column.
    """
    return _checked(path, df, {f"time_stats.{op}.median": "pos" for op in ops}) if len(df) else df


_VIDUR_MLP = {"n_embd": "int1", "n_head": "int1", "n_kv_head": "int1", "num_tensor_parallel_workers": "int1",
              "n_expanded_embd": "int1", "use_gated_mlp": "flag", "num_tokens": "int1"}
_VIDUR_MLP_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "input_layernorm",
                  "post_attention_layernorm", "attn_rope", "mlp_act", "add", "emb")


def read_vidur_mlp(path: Path) -> Observations:
    """Vidur ``mlp.csv``: QKV, O, up (gate+up) and down GEMMs and the elementwise ops of one TP shard.

    Raises:
        ProfileError: a bad file, column or value (see the module docstring), or no GPU in the path.
    """
    gpu = _vidur_gpu(path)
    df = _vidur_times(path, _read_csv(path, _VIDUR_MLP), _VIDUR_MLP_OPS)
    h = df["n_embd"].astype(int)
    H = df["n_head"].astype(int)
    Hkv = df["n_kv_head"].astype(int)
    tp = df["num_tensor_parallel_workers"].astype(int)
    d = h // H
    inter = df["n_expanded_embd"].astype(int)
    gated = df["use_gated_mlp"].astype(bool)
    T = df["num_tokens"].astype(int)
    heads = H // tp
    kvh = np.maximum(1, Hkv // tp)
    i_r = inter // tp
    obs = Observations()
    gem = []
    for op, n, k in (("attn_pre_proj", (heads + 2 * kvh) * d, h), ("attn_post_proj", h, heads * d),
                     ("mlp_up_proj", np.where(gated, 2 * i_r, i_r), h), ("mlp_down_proj", h, i_r)):
        gem.append(pd.DataFrame({"gpu": gpu, "source": f"{path}:{op}", "dtype": "bf16", "m": T, "n": n, "k": k,
                                 "time_s": _ms(df, op)}))
    obs.add("gemm", pd.concat(gem, ignore_index=True))
    el = []
    for op, byts in (("input_layernorm", 4 * T * h), ("post_attention_layernorm", 4 * T * h),
                     ("attn_rope", 2 * 2 * T * (heads + kvh) * d), ("mlp_act", 2 * T * (2 * i_r + i_r)),
                     ("add", 2 * 3 * T * h), ("emb", 2 * 2 * T * h)):
        el.append(pd.DataFrame({"gpu": gpu, "source": f"{path}:{op}", "op": op, "bytes": byts.astype(float),
                                "time_s": _ms(df, op)}))
    obs.add("elementwise", pd.concat(el, ignore_index=True))
    return obs


_VIDUR_ATTN = {"n_embd": "int1", "n_q_head": "int1", "n_kv_head": "int1", "num_tensor_parallel_workers": "int1",
               "batch_size": "int1", "prefill_chunk_size": "int0", "kv_cache_size": "int0", "is_prefill": "flag"}


def read_vidur_attention(path: Path) -> Observations:
    """Vidur-schema ``attention.csv``: prefill rows (one chunk with its history) and decode rows.

    Raises:
        ProfileError: a bad file, column or value (the prefill time on prefill rows, the decode time on decode
        rows), or no GPU in the path.
    """
    gpu = _vidur_gpu(path) if any(p.lower().split("_")[0] in _VIDUR_GPU for p in path.parts) else _lss_gpu(path)
    df = _read_csv(path, _VIDUR_ATTN)
    pre = df["is_prefill"]
    _vidur_times(path, df[pre], ["attn_prefill"])
    _vidur_times(path, df[~pre], ["attn_decode"])
    tp = df["num_tensor_parallel_workers"].astype(int)
    heads = df["n_q_head"].astype(int) // tp
    kvh = np.maximum(1, df["n_kv_head"].astype(int) // tp)
    d = df["n_embd"].astype(int) // df["n_q_head"].astype(int)
    obs = Observations()
    p = df[pre]
    obs.add("attn_prefill", pd.DataFrame({
        "gpu": gpu, "source": str(path), "kv_dtype": "bf16", "batch": p["batch_size"].astype(int),
        "q_len": p["prefill_chunk_size"].astype(int), "ctx_len": p["kv_cache_size"].astype(int),
        "heads": heads[pre], "kv_heads": kvh[pre], "head_dim": d[pre], "time_s": _ms(p, "attn_prefill")}))
    q = df[~pre]
    obs.add("attn_decode", pd.DataFrame({
        "gpu": gpu, "source": str(path), "kv_dtype": "bf16", "batch": q["batch_size"].astype(int),
        "kv_len": q["kv_cache_size"].astype(int), "heads": heads[~pre], "kv_heads": kvh[~pre], "head_dim": d[~pre],
        "time_s": _ms(q, "attn_decode")}))
    return obs


def read_vidur_collective(path: Path) -> Observations:
    """Vidur ``all_reduce.csv`` / ``send_recv.csv`` (NCCL kernel time, ms; size in bytes); single-node rows only
    (their times are checked; multi-node rows are not read).

    Raises:
        ProfileError: a bad file, column or value (see the module docstring), or no GPU in the path.
    """
    gpu = _vidur_gpu(path)
    obs = Observations()
    if "pairwise" in str(path):
        # h100_pairwise_nvlink is a PCIe H100 system with NVLink bridges between pairs, not an SXM/DGX node
        obs.notes.append(f"skipped {path}: pairwise-NVLink (PCIe) system, not the catalog's SXM GPU")
        return obs
    if "all_reduce" in path.name:
        df = _read_csv(path, {"num_workers": "int1", "devices_per_node": "int1", "size": "pos"})
        df = _vidur_times(path, df[df["devices_per_node"] >= df["num_workers"]], ["all_reduce"])
        obs.add("allreduce", pd.DataFrame({"gpu": gpu, "source": str(path), "gpus": df["num_workers"].astype(int),
                                           "bytes": df["size"].astype(float), "backend": "nccl",
                                           "time_s": _ms(df, "all_reduce")}))
    else:
        df = _read_csv(path, {"size": "pos"})
        if "devices_per_node" in df.columns:
            df = _checked(path, df, {"devices_per_node": "int1"})
            df = df[df["devices_per_node"] > 1]
        df = _vidur_times(path, df, ["send_recv"])
        obs.add("sendrecv", pd.DataFrame({"gpu": gpu, "source": str(path), "bytes": df["size"].astype(float),
                                          "time_s": _ms(df, "send_recv")}))
    return obs


# ------------------------------------------------------------------------------------------------ LLMServingSim
def _lss_gpu(path: Path) -> str:
    for part in reversed(path.parts):
        try:
            return load_hardware(part).name
        except ValueError:
            continue
    raise ProfileError(f"{path}: cannot tell the GPU from the path")


def _lss_model(path: Path) -> tuple[ModelArch, int]:
    """Model and TP of an LLMServingSim profile from its folder path ``.../<org>/<model>[/<variant>]/tp<N>``."""
    tp_dir = path.parent
    m = re.fullmatch(r"tp(\d+)", tp_dir.name)
    if not m:
        raise ProfileError(f"{path}: expected the file inside a tp<N> folder")
    tp = int(m.group(1))
    parts = tp_dir.parent.parts
    for i in range(len(parts) - 1, 0, -1):
        for cand in (f"{parts[i - 1]}/{parts[i]}", parts[i]):
            try:
                return load_model(cand), tp
            except ValueError:
                continue
    raise ProfileError(f"{path}: the model in its path is not in the model catalog")


def read_llmservingsim_layers(path: Path) -> Observations:
    """LLMServingSim v1 ``layers.csv`` (ns per layer vs tokens): q/k/v/o, gate/up/down GEMMs, elementwise ops and
    the prefill attention of one sequence (``attn`` with ``kv_cache`` 0).

    Raises:
        ProfileError: a bad file, column or value (see the module docstring), or no model/TP/GPU in the path.
    """
    model, tp = _lss_model(path)
    gpu = _lss_gpu(path)
    df = _read_csv(path, {"layer_name": "text", "input": "int1", "latency(ns)": "pos"})
    if "kv_cache" in df.columns:
        df = _checked(path, df, {"kv_cache": "int0"})
    h = model.hidden_size
    heads = max(1, model.num_heads // tp)
    kvh = max(1, model.num_kv_heads // tp)
    d = model.head_dim
    i_r = model.intermediate_size // tp
    shapes = {"q_proj": (heads * d, h), "k_proj": (kvh * d, h), "v_proj": (kvh * d, h), "o_proj": (h, heads * d),
              "gate_proj": (i_r, h), "up_proj": (i_r, h), "down_proj": (h, i_r)}
    T = df["input"].astype(int)
    t = df["latency(ns)"].astype(float) * 1e-9
    obs = Observations()
    g = df["layer_name"].isin(list(shapes))
    nk = df.loc[g, "layer_name"].map(shapes)
    obs.add("gemm", pd.DataFrame({"gpu": gpu, "source": str(path) + ":" + df.loc[g, "layer_name"], "dtype": "bf16",
                                  "m": T[g], "n": [a for a, _ in nk], "k": [b for _, b in nk], "time_s": t[g]}))
    eb = {"input_layernorm": 4 * h, "post_layernorm": 4 * h, "final_layernorm": 4 * h, "embedding": 4 * h,
          "rope": 4 * (heads + kvh) * d, "act_fn": 6 * i_r}
    e = df["layer_name"].isin(list(eb))
    obs.add("elementwise", pd.DataFrame({"gpu": gpu, "source": str(path) + ":" + df.loc[e, "layer_name"],
                                         "op": df.loc[e, "layer_name"],
                                         "bytes": T[e] * df.loc[e, "layer_name"].map(eb), "time_s": t[e]}))
    a = (df["layer_name"] == "attn") & (df.get("kv_cache", 0) == 0)
    obs.add("attn_prefill", pd.DataFrame({"gpu": gpu, "source": str(path) + ":attn", "kv_dtype": "bf16", "batch": 1,
                                          "q_len": T[a], "ctx_len": 0, "heads": heads, "kv_heads": kvh,
                                          "head_dim": d, "time_s": t[a]}))
    return obs


def read_llmservingsim_bundle(folder: Path) -> Observations:
    """LLMServingSim profiler bundle ``<model>/<variant>/tp<N>/`` (dense.csv, attention.csv, per_sequence.csv; µs).

    Raises:
        ProfileError: a bad ``../meta.yaml`` or table (see the module docstring); a model not in the catalog is
        skipped with a note instead.
    """
    meta_path = folder.parent / "meta.yaml"
    meta = _read_yaml(meta_path) if meta_path.is_file() else {}
    obs = Observations()
    try:
        model, tp = _lss_model(folder / "dense.csv")
    except ProfileError as e:
        obs.notes.append(f"skipped {folder}: {e}")
        return obs
    gpu = gpu_name(meta.get("gpu") or meta.get("hardware") or "", str(meta_path)) if meta else _lss_gpu(folder)
    dense = _read_csv(folder / "dense.csv", {"layer": "text", "tokens": "int1", "time_us": "pos"})
    h = model.hidden_size
    heads = max(1, model.num_heads // tp)
    kvh = max(1, model.num_kv_heads // tp)
    d = model.head_dim
    i_r = (model.intermediate_size if not model.is_moe else model.moe_intermediate_size) // tp
    shapes = {"qkv_proj": ((heads + 2 * kvh) * d, h), "o_proj": (h, heads * d)}
    if not model.is_moe:
        shapes.update({"gate_up_proj": (2 * i_r, h), "down_proj": (h, i_r)})
    T = dense["tokens"].astype(int)
    t = dense["time_us"].astype(float) * 1e-6
    g = dense["layer"].isin(list(shapes))
    nk = dense.loc[g, "layer"].map(shapes)
    obs.add("gemm", pd.DataFrame({"gpu": gpu, "source": str(folder / "dense.csv") + ":" + dense.loc[g, "layer"],
                                  "dtype": "bf16", "m": T[g], "n": [a for a, _ in nk], "k": [b for _, b in nk],
                                  "time_s": t[g]}))
    eb = {"layernorm": 4 * h, "final_layernorm": 4 * h, "embedding": 4 * h, "rotary_emb": 4 * (heads + kvh) * d,
          "qk_norm": 4 * (heads + kvh) * d}
    if not model.is_moe:
        eb["act_fn"] = 6 * i_r
    e = dense["layer"].isin(list(eb))
    obs.add("elementwise", pd.DataFrame({"gpu": gpu, "source": str(folder / "dense.csv") + ":" + dense.loc[e, "layer"],
                                         "op": dense.loc[e, "layer"], "bytes": T[e] * dense.loc[e, "layer"].map(eb),
                                         "time_s": t[e]}))
    ps = folder / "per_sequence.csv"
    if ps.is_file():
        p = _read_csv(ps, {"layer": "text", "sequences": "int1", "time_us": "pos"})
        lm = p[p["layer"] == "lm_head"]
        obs.add("gemm", pd.DataFrame({"gpu": gpu, "source": f"{ps}:lm_head", "dtype": "bf16",
                                      "m": lm["sequences"].astype(int), "n": model.vocab_size // tp, "k": h,
                                      "time_s": lm["time_us"].astype(float) * 1e-6}))
        sm = p[p["layer"] == "sampler"]
        obs.add("elementwise", pd.DataFrame({"gpu": gpu, "source": f"{ps}:sampler", "op": "sampler",
                                             "bytes": sm["sequences"].astype(float) * model.vocab_size * 4 * 3,
                                             "time_s": sm["time_us"].astype(float) * 1e-6}))
    at = folder / "attention.csv"
    if at.is_file():
        a = _read_csv(at, {"prefill_chunk": "int0", "kv_prefill": "int0", "n_decode": "int0", "kv_decode": "int0",
                           "time_us": "pos"})
        pre = a[(a["n_decode"] == 0) & (a["prefill_chunk"] > 0)]
        obs.add("attn_prefill", pd.DataFrame({"gpu": gpu, "source": str(at), "kv_dtype": "bf16", "batch": 1,
                                              "q_len": pre["prefill_chunk"].astype(int),
                                              "ctx_len": pre["kv_prefill"].astype(int), "heads": heads,
                                              "kv_heads": kvh, "head_dim": d,
                                              "time_s": pre["time_us"].astype(float) * 1e-6}))
        dec = a[(a["prefill_chunk"] == 0) & (a["n_decode"] > 0)]
        obs.add("attn_decode", pd.DataFrame({"gpu": gpu, "source": str(at), "kv_dtype": "bf16",
                                             "batch": dec["n_decode"].astype(int), "kv_len": dec["kv_decode"].astype(int),
                                             "heads": heads, "kv_heads": kvh, "head_dim": d,
                                             "time_s": dec["time_us"].astype(float) * 1e-6}))
    return obs


# ------------------------------------------------------------------------------------------------ discovery
def read_profiles(paths: list[str | Path]) -> Observations:
    """Read every profile found under ``paths`` (folders searched recursively, or single files).

    Raises:
        ProfileError: a path that does not exist, or one under which no known profile format was found.
    """
    obs = Observations()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ProfileError(f"profile path {path} does not exist")
        found = _read_any(path, obs)
        if not found:
            raise ProfileError(f"{path}: no profile found (expected a servelab profile folder with meta.yaml, an "
                               "AIConfigurator perf_db folder of parquet files, Vidur mlp.csv/attention.csv/"
                               "all_reduce.csv/send_recv.csv, or LLMServingSim layers.csv / dense.csv bundles)")
    return obs


def _read_any(path: Path, obs: Observations) -> int:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    found = 0
    aic_roots: set[Path] = set()
    for f in files:
        name = f.name
        if name == "meta.yaml" and "servelab-profile" in f.read_text(errors="ignore")[:200]:
            obs.extend(read_servelab(f.parent))
            found += 1
        elif name.endswith("_perf.parquet"):
            aic_roots.add(f)
        elif name == "mlp.csv":
            obs.extend(read_vidur_mlp(f))
            found += 1
        elif name == "attention.csv" and not (f.parent / "dense.csv").is_file():
            obs.extend(read_vidur_attention(f))
            found += 1
        elif name in ("all_reduce.csv", "send_recv.csv"):
            obs.extend(read_vidur_collective(f))
            found += 1
        elif name == "layers.csv":
            obs.extend(read_llmservingsim_layers(f))
            found += 1
        elif name == "dense.csv":
            obs.extend(read_llmservingsim_bundle(f.parent))
            found += 1
    for f in sorted(aic_roots):
        obs.extend(read_aiconfigurator_file(f))
        found += 1
    return found
