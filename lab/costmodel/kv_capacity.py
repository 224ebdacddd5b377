"""KV-cache capacity the way vLLM derives it (vllm/v1/worker/gpu_worker.py ``determine_available_memory`` and
vllm/v1/core/kv_cache_utils.py; shared/specs/vllm-v1-scheduling.md §2):

    avail = memory_bytes · gpu_memory_utilization − weights − peak activation − non-torch/CUDA-graph memory
    num_gpu_blocks = floor(avail / bytes_per_block)

``bytes_per_block`` sums over the layers on one rank: 2·block_size·kv_heads_per_rank·head_dim·dtype_bytes for
GQA/MHA, block_size·(kv_lora_rank + rope_dim)·dtype_bytes for MLA; drafter layers (EAGLE/MTP) count as extra layers.

The peak activation is vLLM's profile run: one forward pass over ``max_num_batched_tokens`` tokens (largest live
set: the MLP's gate/up output, the activation output and two hidden-state buffers, in the activation dtype) and
the dummy sampler run over ``max_num_seqs`` float32 logits rows (logits plus one softmax copy); the larger of the
two counts.

A hybrid model (sliding window, chunked attention, Mamba / linear attention beside full attention) has its blocks
sized by vLLM's hybrid KV cache manager instead (lab/costmodel/hybrid_kv.py ``kv_layout``): ``num_gpu_blocks =
avail // page // group_size``, a block being one page of each of ``group_size`` layers, whatever group holds it. ``non_torch_bytes`` (CUDA graphs, cuBLAS/NCCL workspaces, allocator slack) is one constant fitted on
the only run that recorded its block count (LLMServingSim RTX 4090 Llama-3.1-8B, vLLM 0.19: 2588 blocks); see
docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

from lab.costmodel.hardware import Hardware
from lab.costmodel.model_arch import ModelArch

# Fitted: RTX 4090 run, 25,250,627,584 B x 0.9 - 16,059,990,016 B weights - 2588.5 x 2,097,152 B KV leaves
# 1,237.1 MB for activations + everything else; minus this module's activation estimate for that run (367.5 MB)
# leaves 869.6 MB, rounded to 870 MB.
DEFAULT_NON_TORCH_BYTES = 870_000_000


@dataclass(frozen=True)
class KVCapacity:
    """Result of the derivation (all bytes per GPU rank)."""

    num_gpu_blocks: int
    bytes_per_block: int
    requested_bytes: int
    weight_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    available_bytes: int
    layout: Any = None  # a hybrid model's KVLayout (lab/costmodel/hybrid_kv.py); None for full attention only

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.__dict__.items() if k != "layout"}
        if self.layout is not None:
            out["kv_cache_groups"] = self.layout.describe()
        return out


def bytes_per_block(model: ModelArch, block_size: int, kv_dtype: str = "bf16", tp: int = 1,
                    extra_layers: int = 0, pp: int = 1, extra_bytes_per_token: int = 0) -> int:
    """KV bytes of one block on one rank: per-token bytes of every layer of the largest pipeline stage, plus
    ``extra_layers`` more of the model's layers and ``extra_bytes_per_token`` (a speculative drafter's KV, which
    vLLM keeps in the same blocks: "drafter layers count as extra layers"), x block_size."""
    per_token = model.kv_bytes_per_token(kv_dtype, tp, pp)
    per_layer = model.kv_bytes_per_token_per_layer(kv_dtype, tp)
    return (per_token + extra_layers * per_layer + extra_bytes_per_token) * block_size


def activation_peak_bytes(model: ModelArch, max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1,
                          ep: int = 1, dp: int = 1) -> int:
    """Peak activation memory of vLLM's profile run (see module docstring), bytes. With EP the MoE block sees
    the tokens of all ``dp`` ranks and its experts are not TP-split."""
    h = model.hidden_size
    if model.is_moe and ep > 1:
        width = model.moe_intermediate_size * model.experts_per_token * dp // ep
    else:
        width = model.intermediate_size if not model.is_moe else model.moe_intermediate_size * model.experts_per_token
        width //= tp
    forward = max_num_batched_tokens * (2 * h + 3 * width) * 2
    sampler = max_num_seqs * (model.vocab_size // tp if tp > 1 else model.vocab_size) * 4 * 2
    return max(forward, sampler) + min(forward, sampler) // 2


def nccl_bytes(group: int) -> int:
    """Device memory NCCL takes for a communicator over ``group`` GPUs: 0 alone, 342 MiB for 2, 392 MiB for 4+
    (AIConfigurator systems/h100_sxm.yaml and h200_sxm.yaml ``misc.nccl_mem``, an empirical correction)."""
    if group <= 1:
        return 0
    return 358_612_992 if group == 2 else 411_041_792


def derive_num_gpu_blocks(model: ModelArch, hardware: Hardware, *, block_size: int = 16,
                          gpu_memory_utilization: float = 0.92, max_num_batched_tokens: int = 8192,
                          max_num_seqs: int = 256, tp: int = 1, kv_dtype: str = "bf16",
                          weight_dtype: str | None = None, non_torch_bytes: int = DEFAULT_NON_TORCH_BYTES,
                          extra_layers: int = 0, pp: int = 1, ep: int = 1, dp: int = 1,
                          drafter_kv_bytes_per_token: int = 0, drafter_weight_bytes: int = 0,
                          include_mtp: bool = False, layout: Any = None) -> KVCapacity:
    """Derive ``num_gpu_blocks`` for one rank of an instance split ``tp x pp`` (experts over ``ep`` GPUs shared
    by ``dp`` attention ranks): the most loaded GPU's weights (lab/costmodel/model_arch.py
    ``weight_bytes_per_rank``: FP8 linear layers, 16-bit embeddings, experts split over EP) and its stage's KV
    bytes per block; NCCL's memory is added to ``non_torch_bytes`` when the instance spans several GPUs. A
    speculative drafter adds its weights (``drafter_weight_bytes``; the model's own MTP modules with
    ``include_mtp``) and its KV per token (``drafter_kv_bytes_per_token``) to every block, so fewer blocks fit.
    With a hybrid ``layout`` (lab/costmodel/hybrid_kv.py ``KVLayout``; its block size and drafter layers already in
    it) a block costs ``layout.bytes_per_block`` and the count is vLLM's ``available // page // group_size``.

    Raises:
        ValueError: if the weights and activations leave no room for even two blocks (the model does not fit).
    """
    requested = int(hardware.memory_bytes * gpu_memory_utilization)
    weights = model.weight_bytes_per_rank(weight_dtype, tp, pp, ep, dp, include_mtp=include_mtp or extra_layers > 0)
    weights += drafter_weight_bytes
    act = activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, tp, ep, dp)
    non_torch_bytes = non_torch_bytes + nccl_bytes(max(tp * pp, ep))
    avail = requested - weights - act - non_torch_bytes
    if layout is not None and layout.is_hybrid:
        bpb = layout.bytes_per_block
        blocks = layout.num_blocks(avail) if avail > 0 else 0
    else:
        layout = None
        bpb = bytes_per_block(model, block_size, kv_dtype, tp, extra_layers, pp, drafter_kv_bytes_per_token)
        blocks = avail // bpb
    if blocks < 2:
        raise ValueError(
            f"{model.name} does not fit on {hardware.name} x tp{tp} pp{pp} ep{ep}: {requested / 1e9:.1f} GB requested "
            f"(gpu_memory_utilization {gpu_memory_utilization}) - {weights / 1e9:.1f} GB weights - "
            f"{act / 1e9:.2f} GB activations - {non_torch_bytes / 1e9:.2f} GB other leaves no room for the KV cache")
    return KVCapacity(int(blocks), bpb, requested, weights, act, non_torch_bytes, int(avail), layout)
