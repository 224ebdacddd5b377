"""The step time of speculative decoding: the target's forward pass (verify queries included) plus the drafter's.

Following vLLM's EAGLE/MTP proposer (vllm/v1/spec_decode/llm_base_proposer.py; shared/specs/vllm-v1-scheduling.md
§3), a step with a model drafter runs, after the target:

1. one drafter pass over every token the step scheduled (the "draft prefill": it also runs over prefill chunks and
   writes the drafter's KV, and runs even when no request samples drafts);
2. k - 1 autoregressive passes of one token per request in the batch.

The drafter is a model of its own (lab/costmodel/model_arch.py ``ModelArch``) priced by the same kind of cost model
as the target, so its GEMMs, attention, MoE and collectives come from the same tables and curves:

- EAGLE: one decoder layer of the target's width plus ``fc`` (2h -> h, embedding and hidden state fused); the
  target's LM head.
- EAGLE-3: one decoder layer whose QKV projection reads 2h (embedding and fused hidden state), ``fc`` (3h -> h:
  three target layers' hidden states), its own LM head over ``draft_vocab_size`` (32,000 for the published Llama
  heads).
- MTP (DeepSeek ``num_nextn_predict_layers``): the model's MTP module, one decoder layer of the MoE kind plus
  ``eh_proj`` (2h -> h), reused for every draft when k exceeds the modules; the shared LM head.
- draft model: its own forward passes (all its layers, its own KV).

Each pass is priced as the drafter model's step time without its fixed per-step overhead (the engine step's
overhead is the target's, counted once), plus the projections above on a GEMM roofline. n-gram drafting costs CPU
time only: ``ngram_cpu_s_per_request`` per request per step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from lab.core.batch import BatchShape, padded_size
from lab.costmodel.base import CostModel, CostModelBase
from lab.costmodel.hardware import Hardware
from lab.costmodel.model_arch import ModelArch
from lab.costmodel.roofline import Efficiency

DRAFTER_METHODS = ("ngram", "eagle", "eagle3", "mtp", "draft_model")


@dataclass(frozen=True)
class Drafter:
    """What a speculative method adds to the target, per GPU of the instance.

    Attributes:
        method: one of :data:`DRAFTER_METHODS`.
        arch: the drafter as a model (None for n-gram).
        projections: (in features, out features) of the drafter's extra GEMMs per pass (fc, eh_proj, EAGLE-3's
            wider QKV input).
        kv_bytes_per_token: KV bytes per token the drafter adds on one GPU (its layers share the target's blocks).
        weight_bytes: drafter weights on one GPU not already counted with the target (bytes).
    """

    method: str
    arch: ModelArch | None
    projections: tuple[tuple[int, int], ...] = ()
    kv_bytes_per_token: int = 0
    weight_bytes: int = 0


def _one_dense_layer(target: ModelArch, name: str, vocab: int) -> ModelArch:
    return replace(target, name=name, num_layers=1, num_experts=0, experts_per_token=0, moe_intermediate_size=0,
                   num_shared_experts=0, first_k_dense_layers=0, num_mtp_layers=0, vocab_size=vocab,
                   intermediate_size=target.intermediate_size or target.moe_intermediate_size,
                   layer_types=(), moe_weight_dtype="")  # a drafter layer is full attention


def make_drafter(method: str, target: ModelArch, kv_dtype: str, weight_dtype: str, tp: int,
                 draft_model: ModelArch | None = None, draft_vocab_size: int = 32000,
                 draft_tp: int | None = None) -> Drafter:
    """The drafter of ``method`` for ``target`` on one GPU of a ``tp``-way instance.

    Raises:
        ValueError: an unknown method, MTP for a model without MTP layers, or draft_model without a model.
    """
    from lab.costmodel.model_arch import dtype_bytes

    wb = dtype_bytes(weight_dtype)
    h = target.hidden_size
    if method == "ngram":
        return Drafter(method, None)
    if method in ("eagle", "eagle3"):
        vocab = target.vocab_size if method == "eagle" else draft_vocab_size
        arch = _one_dense_layer(target, f"{target.name} {method.upper()} head", vocab)
        qkv_out = (target.num_heads + 2 * target.num_kv_heads) * target.head_dim
        proj = ((2 * h, h),) if method == "eagle" else ((3 * h, h), (h, qkv_out))
        layer = arch.attention_params_per_layer() + arch.dense_mlp_params()
        own_head = 0 if method == "eagle" else draft_vocab_size * h
        weights = (layer // tp + sum(i * o for i, o in proj) + own_head // tp) * wb
        kv = target.kv_bytes_per_token_per_layer(kv_dtype, tp)
        return Drafter(method, arch, proj, kv, weights)
    if method == "mtp":
        if not target.num_mtp_layers:
            raise ValueError(f"speculative.method mtp: {target.name} has no MTP layers (num_nextn_predict_layers "
                             "is 0); use eagle, eagle3, draft_model or ngram")
        arch = replace(target, name=f"{target.name} MTP", num_layers=target.num_mtp_layers, first_k_dense_layers=0,
                       num_mtp_layers=0, layer_types=())
        kv = target.num_mtp_layers * target.kv_bytes_per_token_per_layer(kv_dtype, tp)
        return Drafter(method, arch, ((2 * h, h),) * target.num_mtp_layers, kv, 0)  # weights: include_mtp
    if method == "draft_model":
        if draft_model is None:
            raise ValueError("speculative.method draft_model needs speculative.model (a catalog name or hf_config)")
        dtp = draft_tp or tp
        kv = draft_model.kv_bytes_per_token(kv_dtype, dtp)
        weights = draft_model.weight_bytes_per_rank(weight_dtype, dtp)
        return Drafter(method, draft_model, (), kv, weights)
    raise ValueError(f"unknown speculative method {method!r}; expected one of {', '.join(DRAFTER_METHODS)}")


class SpeculativeCostModel(CostModelBase):
    """A target cost model with the drafter's passes added to every step.

    Args:
        target: the target model's cost model (it prices verify queries itself, lab/core/batch.py).
        drafter: the drafter model's cost model (None for n-gram).
        num_speculative_tokens: k.
        projections: the drafter's extra GEMMs (in, out features), priced on a GEMM roofline per pass.
        hardware: the GPU (for the roofline of the projections).
        weight_dtype: the drafter's weight dtype.
        cudagraph_sizes: CUDA-graph capture sizes; the k - 1 one-token passes replay graphs padded to them.
        ngram_cpu_s_per_request: n-gram lookup CPU seconds per request per step.
    """

    def __init__(self, target: CostModel, drafter: CostModel | None, num_speculative_tokens: int,
                 projections: Sequence[tuple[int, int]], hardware: Hardware, weight_dtype: str = "bf16",
                 cudagraph_sizes: tuple[int, ...] = (), ngram_cpu_s_per_request: float = 0.0) -> None:
        from lab.costmodel.model_arch import dtype_bytes

        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.projections = tuple(projections)
        self.hw = hardware
        self.wb = dtype_bytes(weight_dtype)
        self.peak = hardware.peak_flops(weight_dtype)
        self.eff = Efficiency()
        self.cudagraph_sizes = cudagraph_sizes
        self.ngram_cpu_s = ngram_cpu_s_per_request
        self._overhead = drafter.step_time(BatchShape()) if drafter is not None else 0.0
        self.name = f"{target.name} + {'n-gram' if drafter is None else 'drafter'}"

    def _projections(self, tokens: int) -> float:
        """Seconds of the drafter's extra GEMMs over ``tokens`` rows (roofline, ``Efficiency`` defaults)."""
        e = self.eff
        t = 0.0
        for k, n in self.projections:
            flops = 2.0 * tokens * k * n
            byts = k * n * self.wb + tokens * (k + n) * 2
            t += max(flops / (self.peak * e.gemm_compute), byts / (self.hw.memory_bandwidth * e.gemm_memory))
        return t

    def _pass(self, shape: BatchShape) -> float:
        return self.drafter.step_time(shape) - self._overhead + self._projections(shape.dense_tokens)  # type: ignore[union-attr]

    def drafter_time(self, shape: BatchShape) -> float:
        """Seconds the drafter adds to a step of this shape (see the module docstring)."""
        if shape.num_tokens == 0:
            return 0.0
        if self.drafter is None:
            return self.ngram_cpu_s * shape.num_seqs
        t = self._pass(shape)
        if self.k > 1:
            t += (self.k - 1) * self._pass(self._one_token_pass(shape))
        return t

    def _one_token_pass(self, shape: BatchShape) -> BatchShape:
        """One token per request against what the step left in its KV."""
        ctx = [c + 1 for c in shape.decode_context]
        ctx += [c + q for q, c in zip(shape.verify_new, shape.verify_context)]
        ctx += [c + q for q, c in zip(shape.prefill_new, shape.prefill_context)]
        one = BatchShape.decode_only(ctx, sum(ctx), max(ctx), min(ctx))
        one.padded_tokens = padded_size(self.cudagraph_sizes, len(ctx))
        return one

    def step_time(self, shape: BatchShape) -> float:
        return self.target.step_time(shape) + self.drafter_time(shape)

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """The target's components plus ``drafter``."""
        out = dict(self.target.breakdown(shape))
        out["drafter"] = self.drafter_time(shape)
        return out

    def stage_times(self, shape: BatchShape, stage_layers: Sequence[int]) -> list[float]:
        """The target's stage times with the drafter on the last stage (vLLM runs it on the last PP rank)."""
        times = list(self.target.stage_times(shape, stage_layers))
        times[-1] += self.drafter_time(shape)
        return times
