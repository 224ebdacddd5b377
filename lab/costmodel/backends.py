"""Kernel back-ends: which attention and MoE kernels a step runs, as vLLM names and chooses them.

vLLM picks one attention back-end per model (``--attention-backend``, before 0.11 the ``VLLM_ATTENTION_BACKEND``
environment variable) and one fused-MoE back-end (``--moe-backend``, vLLM's ``KernelConfig.moe_backend``; before it
the ``VLLM_USE_DEEP_GEMM`` / ``VLLM_USE_FLASHINFER_MOE_*`` switches). The names here are vLLM's. This module holds
what each back-end is (the attention kind it serves, the GPUs it runs on), the default vLLM picks for a GPU, model
and version, and the one-line check of a user's choice. How each back-end is priced is in
lab/costmodel/attention.py (one strategy class per attention kind and back-end) and lab/costmodel/moe_backends.py.

Defaults (vllm/platforms/cuda.py ``_get_backend_priorities``, the first back-end of the list that supports the
model; vllm/envs.py for the MoE switches):

- standard attention (GQA/MHA/MQA): ``FLASHINFER`` on compute capability 10.x (B200), ``FLASH_ATTN`` elsewhere
  (A100, H100/H200/H800, RTX 4090, RTX PRO 6000), ``TRITON_ATTN`` on ROCm (MI300X, vLLM's ROCm default without
  AITER);
- MLA: 0.19 and 0.33 list ``FLASH_ATTN_MLA, FLASHMLA, FLASHINFER_MLA, TRITON_MLA`` below 10.x and
  ``FLASHINFER_MLA, CUTLASS_MLA, FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA`` on 10.x; the 0.11-era dict of priorities
  ranks ``CUTLASS_MLA`` first on 10.x and ``FLASHMLA`` first below it (``FLASH_ATTN_MLA`` came later), so 0.11
  picks ``FLASHMLA`` on Hopper. ``TRITON_MLA`` elsewhere (Ampere, Ada, ROCm), and before 0.11 (the V0 engine had
  neither FlashMLA nor FlashAttention's MLA kernels, both of 2025);
- fused MoE: ``deep_gemm`` for block-scaled fp8 weights (DeepSeek-V3's checkpoint) on compute capability 9.x and
  10.x in 0.19 and 0.33 (``VLLM_USE_DEEP_GEMM`` and ``VLLM_MOE_USE_DEEP_GEMM`` default to 1 in their envs.py; the
  0.10-era envs.py defaults ``VLLM_USE_DEEP_GEMM`` to 0, so 0.11 runs ``triton``); ``triton`` (vLLM's fused_moe
  Triton kernel) for every other weight format and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.costmodel.hardware import Hardware, fit_proxy

# Compute capability of the catalog GPUs (NVIDIA's CUDA GPU list); None = not a CUDA GPU (ROCm).
_CAPABILITY = {
    "A100-80GB-SXM4": (8, 0), "RTX4090": (8, 9), "H100-SXM5-80GB": (9, 0), "H200-SXM-141GB": (9, 0),
    "H800-SXM5-80GB": (9, 0), "B200-HGX": (10, 0), "RTXPRO6000": (12, 0), "MI300X": None,
}


def compute_capability(hw: Hardware) -> tuple[int, int] | None:
    """The GPU's CUDA compute capability (major, minor); a user GPU takes its ``fit_proxy``'s, else Hopper's
    (9, 0) (the checks then accept what a Hopper accepts); None for ROCm GPUs."""
    if hw.name in _CAPABILITY:
        return _CAPABILITY[hw.name]
    proxy = fit_proxy(hw.name)
    if proxy is not None and proxy.name in _CAPABILITY:
        return _CAPABILITY[proxy.name]
    return (9, 0)


@dataclass(frozen=True)
class AttentionBackend:
    """One of vLLM's attention back-ends.

    Attributes:
        name: vLLM's name (``AttentionBackendEnum``).
        mla: serves MLA models (True) or standard attention (False).
        capabilities: compute-capability majors it runs on (vLLM's ``supports_compute_capability``); () = any
            CUDA GPU.
        rocm: runs on ROCm GPUs.
        tile_rows: query rows (query tokens x query heads of one KV head, packed) one thread block of its decode /
            verify kernel takes: a verify query of q tokens over g heads per KV head runs ceil(q·g / tile_rows)
            blocks per KV head where a decode runs ceil(g / tile_rows) (lab/costmodel/attention.py).
        source: where the facts come from.
    """

    name: str
    mla: bool
    capabilities: tuple[int, ...] = ()
    rocm: bool = False
    tile_rows: int = 64
    source: str = ""


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (
    AttentionBackend("FLASH_ATTN", False, (8, 9, 10, 12), False, 64,
                     "vllm/v1/attention/backends/flash_attn.py (FlashAttention 2/3 varlen; GQA heads packed per KV "
                     "head, pack_gqa, 64-row query tiles in the decode path)"),
    AttentionBackend("FLASHINFER", False, (8, 9, 10, 12), False, 16,
                     "vllm/v1/attention/backends/flashinfer.py (decode wrapper for one query token; queries of "
                     "several tokens, verify included, go to its prefill kernel, 16-row query tiles at small q)"),
    AttentionBackend("TRITON_ATTN", False, (), True, 16,
                     "vllm/v1/attention/backends/triton_attn.py (unified attention kernel, BLOCK_M = 16 query rows)"),
    AttentionBackend("FLASH_ATTN_MLA", True, (9,), False, 64,
                     "vllm/v1/attention/backends/mla/flashattn_mla.py (FlashAttention-3 MLA decode, Hopper only)"),
    AttentionBackend("FLASHMLA", True, (9, 10), False, 64,
                     "vllm/v1/attention/backends/mla/flashmla.py; FlashMLA README / deep-dive: 64-row tiles of "
                     "h_q x s_q, compute-bound from h_q·s_q >= 128"),
    AttentionBackend("TRITON_MLA", True, (), True, 16,
                     "vllm/v1/attention/backends/mla/triton_mla.py (decode kernel adapted from SGLang's "
                     "triton decode_attention)"),
    AttentionBackend("CUTLASS_MLA", True, (10,), False, 128,
                     "vllm/v1/attention/backends/mla/cutlass_mla.py (SM100 only, 128-row tiles)"),
    AttentionBackend("FLASHINFER_MLA", True, (10,), False, 64,
                     "vllm/v1/attention/backends/mla/flashinfer_mla.py (TRT-LLM-gen MLA kernels, SM100 only)"),
)}

MOE_BACKENDS = ("triton", "deep_gemm", "cutlass", "flashinfer_cutlass", "flashinfer_trtllm")

# MoE back-end -> (compute-capability majors it runs on, weight formats it takes; () = any)
_MOE_SUPPORT: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "triton": ((), ()),
    "deep_gemm": ((9, 10), ("fp8_block",)),
    "cutlass": ((9, 10), ("fp8", "fp8_block")),
    "flashinfer_cutlass": ((9, 10), ("bf16", "fp8", "fp8_block")),
    "flashinfer_trtllm": ((10,), ("fp8_block", "bf16")),
}


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def default_attention_backend(is_mla: bool, hw: Hardware, vllm_version: str = "0.33") -> str:
    """The attention back-end vLLM picks for a model kind on a GPU in a version (module docstring). Before 0.11
    (the V0 engine of 0.6) vLLM had neither FlashMLA nor FlashAttention's MLA kernels (both 2025): ``TRITON_MLA``."""
    cc = compute_capability(hw)
    if cc is None:
        return "TRITON_MLA" if is_mla else "TRITON_ATTN"
    major = cc[0]
    v = _version(vllm_version)
    if not is_mla:
        return "FLASHINFER" if major == 10 else "FLASH_ATTN"
    if v < (0, 11):
        return "TRITON_MLA"
    if major == 10:
        return "CUTLASS_MLA" if v < (0, 19) else "FLASHINFER_MLA"
    if major == 9:
        return "FLASHMLA" if v < (0, 19) else "FLASH_ATTN_MLA"
    return "TRITON_MLA"


def default_moe_backend(weight_variant: str, hw: Hardware, vllm_version: str = "0.33") -> str:
    """The fused-MoE back-end vLLM picks for a weight format ("bf16", "fp8" per-tensor W8A8, "fp8_block"
    block-scaled) on a GPU in a version (module docstring)."""
    cc = compute_capability(hw)
    if weight_variant == "fp8_block" and cc is not None and cc[0] in (9, 10) and _version(vllm_version) >= (0, 19):
        return "deep_gemm"
    return "triton"


def check_attention_backend(name: str, is_mla: bool, hw: Hardware, model_name: str) -> None:
    """vLLM's refusals for an attention back-end, one line each.

    Raises:
        ValueError: an unknown name, a back-end of the other attention kind, or one the GPU cannot run.
    """
    b = ATTENTION_BACKENDS.get(name)
    if b is None:
        raise ValueError(f"engine.attention_backend {name!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if b.mla != is_mla:
        kind = "an MLA" if b.mla else "a standard-attention"
        model_kind = "uses MLA" if is_mla else "does not use MLA"
        raise ValueError(f"engine.attention_backend {name}: {kind} back-end, but {model_name} {model_kind} (vLLM "
                         f"refuses it)")
    cc = compute_capability(hw)
    if cc is None:
        if not b.rocm:
            raise ValueError(f"engine.attention_backend {name}: not available on {hw.name} (ROCm); use "
                             f"{'TRITON_MLA' if is_mla else 'TRITON_ATTN'}")
        return
    if b.capabilities and cc[0] not in b.capabilities:
        raise ValueError(f"engine.attention_backend {name}: needs compute capability "
                         f"{' or '.join(f'{c}.x' for c in b.capabilities)}; {hw.name} is {cc[0]}.{cc[1]} (vLLM "
                         "refuses it)")


def check_moe_backend(name: str, weight_variant: str, hw: Hardware) -> None:
    """vLLM's refusals for a fused-MoE back-end, one line each.

    Raises:
        ValueError: an unknown name, a weight format the kernel does not take, or a GPU it does not run on.
    """
    if name not in _MOE_SUPPORT:
        raise ValueError(f"engine.moe_backend {name!r}: expected one of {', '.join(MOE_BACKENDS)}")
    caps, formats = _MOE_SUPPORT[name]
    if formats and weight_variant not in formats:
        what = {"bf16": "bf16 weights", "fp8": "per-tensor fp8 weights", "fp8_block": "block-scaled fp8 weights"}
        raise ValueError(f"engine.moe_backend {name}: takes {', '.join(what[f] for f in formats)}; this model runs "
                         f"{what.get(weight_variant, weight_variant)}")
    cc = compute_capability(hw)
    if caps and (cc is None or cc[0] not in caps):
        where = "ROCm" if cc is None else f"{cc[0]}.{cc[1]}"
        raise ValueError(f"engine.moe_backend {name}: needs compute capability "
                         f"{' or '.join(f'{c}.x' for c in caps)}; {hw.name} is {where}")
