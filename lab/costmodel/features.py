"""FLOPs, bytes and fit features of the measured operator classes, computed from observation columns (see
lab/costmodel/profiles.py).

The same definitions serve the curve fit (lab/costmodel/fit.py), the roofline sanity check on profile tables
(lab/costmodel/families.py ``drop_impossible``) and, at run time, the operator cost model
(lab/costmodel/operator.py), so a fitted curve applies to a shape exactly as it was fitted. The formulas
themselves are in lab/costmodel/ops.py.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lab.costmodel import ops
from lab.costmodel.hardware import Hardware, load_hardware
from lab.costmodel.model_arch import dtype_bytes, load_model

# (compute features, memory features) each efficiency curve of a class is a function of (lab/costmodel/fit.py)
FEATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gemm": (("m", "n", "k", "align", "mtile", "ntile", "wave"), ("bytes", "n", "k", "m", "align")),
    "attn_prefill": (("q_len", "span", "units", "head_dim"), ("bytes",)),
    "attn_decode": (("units", "head_dim", "batch"), ("kv_len", "kv_units", "bytes", "batch")),
    "mla_prefill": (("q_len", "batch", "heads"), ("bytes",)),
    "mla_decode": (("batch", "heads"), ("kv_len", "bytes")),
    "moe": (("rows_per_expert", "rows", "inter", "hidden", "topk"), ("bytes", "experts_local", "tokens", "rows_per_expert")),
    "allreduce": ((), ("bytes",)),
    "sendrecv": ((), ("bytes",)),
    "elementwise": ((), ("bytes",)),
}
COMM = ("allreduce", "sendrecv")

# Output tile edge of the Hopper-class GEMM kernels (CUTLASS / cuBLAS 128 x 128 tiles, one tile per SM at a time).
GEMM_TILE = 128


def gemm_features(m, n, k, byts, num_sms):
    """Fit features of a GEMM (m tokens x k inputs -> n outputs); scalars or numpy arrays alike.

    ``align`` (2 when m is a multiple of 16, else 1) separates the kernels picked for aligned m; ``mtile`` and
    ``ntile`` are the used fraction of the last 128-wide output tile along m and n; ``wave`` is the used fraction
    of the last wave of tiles over ``num_sms`` SMs (wave quantization: 133 tiles on 132 SMs take two waves).
    Together they give the saw-tooth that FP8 GEMMs show right after a tile or wave boundary.
    """
    mt = -(-m // GEMM_TILE)
    nt = -(-n // GEMM_TILE)
    tiles = mt * nt
    return {"m": m, "n": n, "k": k, "align": 1.0 + (m % 16 == 0), "mtile": m / (mt * GEMM_TILE),
            "ntile": n / (nt * GEMM_TILE), "wave": tiles / (-(-tiles // num_sms) * num_sms), "bytes": byts}


def _num_sms(df: pd.DataFrame | dict) -> np.ndarray:
    """SMs of each observation's GPU (its ``gpu`` column, looked up in the hardware catalog)."""
    gpus = np.asarray(df["gpu"])
    out = np.empty(len(gpus))
    for g in set(gpus.tolist()):
        out[gpus == g] = load_hardware(g).num_sms
    return out


def _kv_bytes(kv_dtype) -> np.ndarray | float:
    if isinstance(kv_dtype, str):
        return float(dtype_bytes(kv_dtype))
    return np.array([dtype_bytes(str(x)) for x in kv_dtype], dtype=float)


def _w_bytes(dtype) -> np.ndarray | float:
    if isinstance(dtype, str):
        return float(dtype_bytes("fp8" if dtype.startswith("fp8") else dtype))
    return np.array([dtype_bytes("fp8" if str(x).startswith("fp8") else str(x)) for x in dtype], dtype=float)


def mla_module_work(model_name, heads, batch, q_len=None, kv_len=None, w_bytes=1.0, kv_bytes=2.0):
    """FLOPs and bytes of one MLA attention module (vLLM DeepseekV2MLAAttention: fused q_a/kv_a projection, q_b,
    kv_b, latent attention, o_proj) for a uniform batch; prefill when ``q_len`` is given (no history, kv_b expands
    the chunk), decode (absorbed) when ``kv_len`` is. Works on scalars or numpy arrays."""
    m = model_name if hasattr(model_name, "kv_lora_rank") else load_model(model_name)
    h, rq, r, rope = m.hidden_size, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    nope, dv = m.qk_nope_head_dim, m.v_head_dim
    qk = nope + rope
    tokens = batch * (q_len if q_len is not None else 1)
    w_a = h * (rq + r + rope)
    w_qb = rq * heads * qk
    w_kvb = r * heads * (nope + dv)
    w_o = heads * dv * h
    weights = (w_a + w_qb + w_kvb + w_o) * w_bytes
    proj_flops = 2.0 * tokens * (w_a + w_qb + w_o)
    kv_tok = (r + rope) * kv_bytes
    if q_len is not None:
        pairs = batch * ops.prefill_pairs(q_len, 0)
        flops = proj_flops + 2.0 * tokens * w_kvb + 2.0 * heads * (qk + dv) * pairs
        byts = weights + tokens * (h + rq + r + rope + heads * (qk + 2 * nope + 2 * dv) + h) * 2 + tokens * kv_tok
    else:
        attended = batch * (kv_len + 1)
        flops = proj_flops + 2.0 * tokens * w_kvb + (2.0 * heads * (r + rope) + 2.0 * heads * r) * attended
        byts = weights + attended * kv_tok + tokens * (h + rq + heads * (qk + 2 * r + dv) + h) * 2 + tokens * kv_tok
    return flops, byts


def work(cls: str, df: pd.DataFrame | dict) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """FLOPs, bytes and the fit features of observations (columns as in lab/costmodel/profiles.py).

    The same definitions are used at run time by the operator cost model, so a fitted curve applies to a shape
    exactly as it was fitted.
    """
    g = (lambda c: df[c].to_numpy()) if isinstance(df, pd.DataFrame) else (lambda c: np.asarray(df[c]))
    if cls == "gemm":
        m, n, k = (g(c).astype(float) for c in "mnk")
        wb = _w_bytes(list(g("dtype")))
        F, B = ops.gemm(m, n, k, wb, wb)
        return F, B, gemm_features(m, n, k, B, _num_sms(df))
    if cls == "attn_prefill":
        b, q, c, H, Hk, d = (g(x).astype(float) for x in ("batch", "q_len", "ctx_len", "heads", "kv_heads", "head_dim"))
        kvt = 2 * Hk * d * _kv_bytes(list(g("kv_dtype")))
        F, B = ops.attention_prefill(q, c, H, Hk, d, d, kvt)
        return F * b, B * b, {"q_len": q, "span": q + c, "units": b * H, "head_dim": d, "bytes": B * b}
    if cls == "attn_decode":
        b, L, H, Hk, d = (g(x).astype(float) for x in ("batch", "kv_len", "heads", "kv_heads", "head_dim"))
        kvt = 2 * Hk * d * _kv_bytes(list(g("kv_dtype")))
        F, B = ops.attention_decode(b, b * L, H, d, d, kvt)
        return F, B, {"units": b * H, "head_dim": d, "kv_len": L + 1, "kv_units": b * Hk, "bytes": B, "batch": b}
    if cls in ("mla_prefill", "mla_decode"):
        models = list(g("model"))
        H, b = g("heads").astype(float), g("batch").astype(float)
        wb, kvb = _w_bytes(list(g("dtype"))), _kv_bytes(list(g("kv_dtype")))
        F = np.zeros(len(H))
        B = np.zeros(len(H))
        for name in set(models):
            sel = np.array([x == name for x in models])
            if cls == "mla_prefill":
                f, by = mla_module_work(name, H[sel], b[sel], q_len=g("q_len").astype(float)[sel],
                                        w_bytes=np.broadcast_to(wb, H.shape)[sel], kv_bytes=np.broadcast_to(kvb, H.shape)[sel])
            else:
                f, by = mla_module_work(name, H[sel], b[sel], kv_len=g("kv_len").astype(float)[sel],
                                        w_bytes=np.broadcast_to(wb, H.shape)[sel], kv_bytes=np.broadcast_to(kvb, H.shape)[sel])
            F[sel], B[sel] = f, by
        feats = {"batch": b, "heads": H, "bytes": B}
        if cls == "mla_prefill":
            feats["q_len"] = g("q_len").astype(float)
        else:
            feats["kv_len"] = g("kv_len").astype(float) + 1
        return F, B, feats
    if cls == "moe":
        T, h, i, k, E, tp, ep = (g(x).astype(float) for x in ("tokens", "hidden", "inter", "topk", "experts", "tp", "ep"))
        wb = _w_bytes(list(g("dtype")))
        F, B = ops.moe_experts(T, h, i / tp, k, E, ep, wb, wb)
        rows = T * k / ep
        return F, B, {"rows_per_expert": np.maximum(rows / (E / ep), 1e-3), "rows": np.maximum(rows, 1e-3),
                      "inter": i / tp, "hidden": h, "topk": k, "tokens": T, "bytes": B, "experts_local": E / ep}
    if cls == "allreduce":
        n = g("gpus").astype(float)
        B = 2.0 * (n - 1) / n * g("bytes").astype(float)
        return np.zeros(len(n)), B, {"bytes": g("bytes").astype(float)}
    if cls in ("sendrecv", "elementwise"):
        B = g("bytes").astype(float)
        return np.zeros(len(B)), B, {"bytes": B}
    raise ValueError(f"unknown operator class {cls!r}")


def variant_of(cls: str, df: pd.DataFrame) -> pd.Series:
    """The variant key a curve is fitted per (dtype, KV dtype, or collective backend and size)."""
    if cls in ("gemm", "moe"):
        return df["dtype"].astype(str)
    if cls in ("attn_prefill", "attn_decode"):
        return df["kv_dtype"].astype(str)
    if cls in ("mla_prefill", "mla_decode"):
        return df["dtype"].astype(str) + "/" + df["kv_dtype"].astype(str)
    if cls == "allreduce":
        return df["backend"].astype(str) + "/" + df["gpus"].astype(int).astype(str)
    if cls == "elementwise":
        return df["op"].map(elementwise_kind)
    return pd.Series("all", index=df.index)


_KINDS = {"norm": ("layernorm", "norm"), "rope": ("rope", "rotary"), "act": ("act",), "add": ("add",),
          "embedding": ("emb",), "sampler": ("sampler",)}


def elementwise_kind(op: str) -> str:
    """Group an elementwise op name from any profile format into norm, rope, act, add, embedding or other."""
    o = str(op).lower()
    for kind, keys in _KINDS.items():
        if any(k in o for k in keys):
            return kind
    return "other"


def peaks(cls: str, variant: str, hw: Hardware) -> tuple[float, float]:
    """(peak FLOP/s, bandwidth B/s) the curve's efficiencies are relative to."""
    if cls in COMM:
        return 1.0, hw.link_bandwidth
    dtype = variant.split("/")[0]
    if cls.startswith("attn") or cls == "elementwise":
        dtype = "bf16"
    return hw.peak_flops(dtype), hw.memory_bandwidth
