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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

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
                       "lab/catalog/hardware.yaml)")


# ------------------------------------------------------------------------------------------------ servelab
def read_servelab(folder: Path) -> Observations:
    """A ``servelab profile`` folder: ``meta.yaml`` plus ``<class>.csv`` files (``time_us``)."""
    meta_path = folder / "meta.yaml"
    meta = yaml.safe_load(meta_path.read_text()) or {}
    if meta.get("format") != "servelab-profile":
        raise ProfileError(f"{meta_path}: expected 'format: servelab-profile'")
    gpu = gpu_name(meta.get("gpu", ""), str(meta_path))
    obs = Observations()
    for cls in CLASSES:
        p = folder / f"{cls}.csv"
        if not p.is_file():
            continue
        df = pd.read_csv(p)
        need = set(COLUMNS[cls]) | {"time_us"}
        if not need <= set(df.columns):
            raise ProfileError(f"{p}: missing columns {sorted(need - set(df.columns))}; expected {COLUMNS[cls]} + time_us")
        df["time_s"] = df["time_us"].astype(float) * 1e-6
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
def read_aiconfigurator_file(p: Path) -> Observations:
    """One AIConfigurator parquet table (GEMM, attention, MLA module, MoE or custom all-reduce; latency in ms)."""
    obs = Observations()
    df = pd.read_parquet(p)
    if not df.empty and "device" in df.columns and "latency" in df.columns:
        gpu = gpu_name(df["device"].iloc[0], str(p))
        t = df["latency"].astype(float) * 1e-3
        base = pd.DataFrame({"gpu": gpu, "source": str(p), "time_s": t})
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
            d = df
            b = base.copy()
            b["model"] = d["model"].astype(str)
            b["dtype"] = d["gemm_type"].map(_DTYPES)
            b["kv_dtype"] = d["kv_cache_dtype"].map(_DTYPES)
            b["heads"] = d["num_heads"].astype(int)
            b["batch"] = d["batch_size"].astype(int)
            if p.name.startswith("mla_context"):
                b["q_len"] = d["isl"].astype(int)
                obs.add("mla_prefill", b)
            else:
                b["kv_len"] = d["step"].astype(int)
                obs.add("mla_decode", b)
        elif p.name == "moe_perf.parquet":
            d = df
            b = base.copy()
            b["dtype"] = d["moe_dtype"].map(_DTYPES)
            for src, dst in (("num_tokens", "tokens"), ("hidden_size", "hidden"), ("inter_size", "inter"),
                             ("topk", "topk"), ("num_experts", "experts"), ("moe_tp_size", "tp"), ("moe_ep_size", "ep")):
                b[dst] = d[src].astype(int)
            b["distribution"] = d["distribution"].astype(str)
            obs.add("moe", b[b["dtype"].notna()])
        elif p.name == "custom_allreduce_perf.parquet":
            d = df
            b = base.copy()
            b["gpus"] = d["num_gpus"].astype(int)
            b["bytes"] = d["message_size"].astype(float) * 2  # elements of bf16
            b["backend"] = d["backend"].map({"vllm_graph": "graph", "vllm_eager": "eager"}).fillna(d["backend"])
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
    col = f"time_stats.{op}.median"
    if col not in df.columns:
        raise ProfileError(f"column {col!r} missing")
    return df[col].astype(float) * 1e-3


def read_vidur_mlp(path: Path) -> Observations:
    """Vidur ``mlp.csv``: QKV, O, up (gate+up) and down GEMMs and the elementwise ops of one TP shard."""
    df = pd.read_csv(path)
    gpu = _vidur_gpu(path)
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


def read_vidur_attention(path: Path) -> Observations:
    """Vidur-schema ``attention.csv``: prefill rows (one chunk with its history) and decode rows."""
    df = pd.read_csv(path)
    gpu = _vidur_gpu(path) if any(p.lower().split("_")[0] in _VIDUR_GPU for p in path.parts) else _lss_gpu(path)
    tp = df["num_tensor_parallel_workers"].astype(int)
    heads = df["n_q_head"].astype(int) // tp
    kvh = np.maximum(1, df["n_kv_head"].astype(int) // tp)
    d = df["n_embd"].astype(int) // df["n_q_head"].astype(int)
    pre = df["is_prefill"].astype(bool)
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
    """Vidur ``all_reduce.csv`` / ``send_recv.csv`` (NCCL kernel time, ms; size in bytes); single-node rows only."""
    df = pd.read_csv(path)
    gpu = _vidur_gpu(path)
    if "pairwise" in str(path):
        # h100_pairwise_nvlink is a PCIe H100 system with NVLink bridges between pairs, not an SXM/DGX node
        obs = Observations()
        obs.notes.append(f"skipped {path}: pairwise-NVLink (PCIe) system, not the catalog's SXM GPU")
        return obs
    df = df[df["devices_per_node"] >= df["num_workers"]] if "send_recv" not in path.name else df
    obs = Observations()
    if "all_reduce" in path.name:
        obs.add("allreduce", pd.DataFrame({"gpu": gpu, "source": str(path), "gpus": df["num_workers"].astype(int),
                                           "bytes": df["size"].astype(float), "backend": "nccl",
                                           "time_s": _ms(df, "all_reduce")}))
    else:
        intra = df[df["devices_per_node"] > 1] if "devices_per_node" in df.columns else df
        obs.add("sendrecv", pd.DataFrame({"gpu": gpu, "source": str(path), "bytes": intra["size"].astype(float),
                                          "time_s": _ms(intra, "send_recv")}))
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
    the prefill attention of one sequence (``attn`` with ``kv_cache`` 0)."""
    model, tp = _lss_model(path)
    gpu = _lss_gpu(path)
    df = pd.read_csv(path)
    if not {"layer_name", "input", "latency(ns)"} <= set(df.columns):
        raise ProfileError(f"{path}: expected columns layer_name, input, latency(ns)")
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
    """LLMServingSim profiler bundle ``<model>/<variant>/tp<N>/`` (dense.csv, attention.csv, per_sequence.csv; µs)."""
    meta_path = folder.parent / "meta.yaml"
    meta = yaml.safe_load(meta_path.read_text()) if meta_path.is_file() else {}
    obs = Observations()
    try:
        model, tp = _lss_model(folder / "dense.csv")
    except ProfileError as e:
        obs.notes.append(f"skipped {folder}: {e}")
        return obs
    gpu = gpu_name(meta.get("gpu") or meta.get("hardware") or "", str(meta_path)) if meta else _lss_gpu(folder)
    dense = pd.read_csv(folder / "dense.csv")
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
        p = pd.read_csv(ps)
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
        a = pd.read_csv(at)
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
