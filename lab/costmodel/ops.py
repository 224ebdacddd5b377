"""Operators of one decoder step and their FLOP and byte counts, on one GPU of an instance.

Every function returns ``(flops, bytes)`` for one invocation (one layer), counted the way a roofline needs them:
FLOPs are multiply-adds x 2; bytes are what the kernel must move between HBM and the SMs at least once (weights,
activations in and out, KV cache read and written). Activations are bf16 (2 B) unless a function says otherwise.

Formulas (sources: the Megatron-LM / vLLM layer definitions, the FlashAttention-2 paper for attention FLOPs,
DeepSeek-V2 §2.1 and FlashMLA for MLA, NCCL's ring algorithm for collectives):

* GEMM ``m x k`` by ``k x n``: ``2mkn`` FLOPs; bytes ``n·k·w + m·k·a + m·n·2`` (weights in the weight dtype ``w``;
  W8A8 FP8 GEMMs read fp8 activations, ``a = 1``; output bf16).
* Attention, per query token and attended context token: ``2·H·(d_qk + d_v)`` FLOPs (QKᵀ and PV); a prefill chunk
  of ``q`` new tokens after ``c`` cached ones attends ``q·c + q(q+1)/2`` pairs (causal); a decode with ``c`` cached
  tokens attends ``c + 1``. Bytes: Q in and O out (bf16), the KV of every attended token read once per sequence,
  the new tokens' KV written.
* MLA decode (absorbed, FlashMLA): queries live in the latent space, one shared KV "head" of ``r + d_rope``
  elements; per pair ``2·H·(r + d_rope) + 2·H·r`` FLOPs; per cached token ``(r + d_rope)·kv_bytes`` read once per
  sequence. The absorption BMMs (W_UK: d_nope -> r, W_UV: r -> d_v per head) are counted as GEMMs.
* MLA prefill (not absorbed, as vLLM runs it): the latent KV of the whole context is expanded by kv_b
  (``r x H·(d_nope + d_v)``) and attention runs with ``d_qk = d_nope + d_rope``, ``d_v``.
* MoE (fused grouped GEMM): ``R = tokens·top_k / ep`` token-expert rows on this GPU; ``6·R·h·i`` FLOPs
  (gate+up and down); weights of the experts touched, ``min(E_l, R)`` of the ``E_l`` local ones under balanced
  routing (as AIConfigurator's "balanced" MoE tables measure it; skew is a separate load-imbalance factor).
* Elementwise (RMSNorm with residual, rotary, SiLU-and-mul, embedding gather): bytes only.
* Ring all-reduce of ``B`` bytes over ``n`` GPUs: each GPU sends and receives ``2(n−1)/n·B``; all-to-all dispatch
  of a token to ``g`` remote GPUs moves ``g·h·a`` bytes.
"""

from __future__ import annotations

import numpy as np

ACT_BYTES = 2  # bf16 activations


def gemm(m: float, n: int, k: int, w_bytes: float = 2, a_bytes: float = 2) -> tuple[float, float]:
    """GEMM (m x k) @ (k x n): (FLOPs, bytes). ``w_bytes``/``a_bytes``: weight and input-activation bytes."""
    return 2.0 * m * n * k, n * k * w_bytes + m * k * a_bytes + m * n * ACT_BYTES


def prefill_pairs(q: int, c: int) -> float:
    """Query/key pairs a causal prefill chunk of ``q`` new tokens after ``c`` cached tokens attends."""
    return q * c + q * (q + 1) / 2.0


def attention_prefill(q: int, c: int, heads: int, kv_heads: int, d_qk: int, d_v: int,
                      kv_token_bytes: float) -> tuple[float, float]:
    """One prefill chunk, one layer: (FLOPs, bytes).

    Args:
        q, c: new and already-cached tokens of the chunk.
        heads, kv_heads: query and KV heads on this GPU.
        d_qk, d_v: head dims of QK and V.
        kv_token_bytes: KV-cache bytes of one token in this layer on this GPU.
    """
    flops = 2.0 * heads * (d_qk + d_v) * prefill_pairs(q, c)
    byts = q * heads * (d_qk + d_v) * ACT_BYTES + (c + q) * kv_token_bytes + q * kv_token_bytes
    return flops, byts


def attention_decode(num: int, ctx_sum: int, heads: int, d_qk: int, d_v: int,
                     kv_token_bytes: float) -> tuple[float, float]:
    """``num`` decodes whose cached lengths sum to ``ctx_sum``, one layer: (FLOPs, bytes).

    Each decode attends its cached tokens plus itself; Q in and O out in bf16; its new KV written.
    """
    attended = ctx_sum + num
    flops = 2.0 * heads * (d_qk + d_v) * attended
    byts = attended * kv_token_bytes + num * heads * (d_qk + d_v) * ACT_BYTES + num * kv_token_bytes
    return flops, byts


def mla_decode(num: int, ctx_sum: int, heads: int, kv_lora_rank: int, rope_dim: int,
               kv_token_bytes: float) -> tuple[float, float]:
    """Absorbed MLA decode attention (FlashMLA), one layer: (FLOPs, bytes); BMMs excluded."""
    attended = ctx_sum + num
    flops = (2.0 * heads * (kv_lora_rank + rope_dim) + 2.0 * heads * kv_lora_rank) * attended
    byts = attended * kv_token_bytes + num * heads * (2 * kv_lora_rank + rope_dim) * ACT_BYTES + num * kv_token_bytes
    return flops, byts


def moe_experts(tokens: float, hidden: int, inter: int, top_k: int, num_experts: int, ep: int = 1,
                w_bytes: float = 2, a_bytes: float = 2) -> tuple[float, float]:
    """Fused MoE grouped GEMMs (gate+up, activation, down) on one GPU: (FLOPs, bytes).

    Args:
        tokens: tokens entering the MoE block of the EP group (all DP ranks' tokens with EP).
        hidden, inter: h and the per-GPU expert width (i / moe_tp).
        top_k, num_experts: routing.
        ep: experts are split over ``ep`` GPUs; this GPU owns ``num_experts / ep`` and gets ``1/ep`` of the rows.
    """
    rows = tokens * top_k / ep
    local = num_experts / ep
    touched = np.minimum(local, rows) if isinstance(rows, np.ndarray) else min(local, rows)
    flops = 6.0 * rows * hidden * inter
    byts = touched * 3 * hidden * inter * w_bytes + rows * (hidden * a_bytes + 3 * inter * ACT_BYTES + hidden * ACT_BYTES)
    return flops, byts


def allreduce_bytes(byts: float, n: int) -> float:
    """Bytes each GPU sends (and receives) in a ring all-reduce of ``byts`` over ``n`` GPUs."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * byts


def expected_remote_ranks(top_k: int, ep: int) -> float:
    """Expected distinct GPUs other than its own that a token's ``top_k`` experts live on (uniform routing)."""
    if ep <= 1:
        return 0.0
    distinct = ep * (1.0 - (1.0 - 1.0 / ep) ** top_k)
    return distinct * (ep - 1) / ep
