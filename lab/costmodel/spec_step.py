"""One speculative-decoding step from its mechanism: the target's verify forward, the rejection sampler, and the
proposer's k forwards, each launched by the host (vLLM V1's GPU model runner and its EAGLE/MTP proposer,
vllm/v1/worker/gpu_model_runner.py, vllm/v1/spec_decode/llm_base_proposer.py; shared/specs/vllm-v1-scheduling.md §3).

What a step of a model drafter (EAGLE, EAGLE-3, MTP, draft model) runs, in order on the GPU:

1. The target forward over the step's tokens: verify queries of 1 + k tokens in the decode kernel as the attention
   back-end runs them (lab/costmodel/attention.py), dense layers over every token (padded to the CUDA-graph size;
   with speculation vLLM rounds the capture sizes up to multiples of 1 + k, lab/experiment/speculative.py
   ``spec_capture_sizes``), the LM head over every scored position. EAGLE-3 also keeps three of the target's
   layers' hidden states (``aux_hidden_states``: three copies of T x h written and read back).
2. The rejection sampler (vllm/v1/sample/rejection_sampler.py): the target's probabilities at every draft position
   and the recovered-token sampling, about four passes over a vocabulary row of fp32 per draft, in
   :data:`REJECTION_KERNELS` kernels.
3. The proposer: one pass over every token the step scheduled (the draft prefill, writing the drafter's KV),
   then k - 1 passes of one token per request (CUDA graphs padded to the same capture sizes). EAGLE-3's first pass
   fuses the three hidden states (``combine_hidden_states``: fc 3h -> h over the step's tokens) and every pass
   reads 2h into its QKV projection and samples from its own LM head over ``draft_vocab_size``; EAGLE-1's passes
   concatenate embedding and hidden state (fc 2h -> h) and use the target's LM head; MTP's passes run the MTP
   module (DeepSeek-V3: one MoE layer with MLA, at the target's TP / EP, with its all-reduces and dispatch) with
   eh_proj (2h -> h) and the shared LM head.

The host launches each proposer pass: rebuilding the attention metadata, updating positions and slot mappings,
replaying the drafter's graph and sampling, :attr:`SpecDecodeCostModel.host_pass_s` per pass, plus
``host_step_s`` per step for the speculative metadata of the verify (``_calc_spec_decode_metadata``: index arrays
built on the CPU and copied) and the rejection sampler's launches. When they reach the GPU's critical path depends
on vLLM's drafting mode:

- **padded drafter batch** (vLLM's default since ``disable_padded_drafter_batch`` exists): the proposer reads the
  sampled tokens on the GPU (``prepare_next_token_ids_padded``), so the host launches its passes while the target
  still runs; pass j starts at max(end of pass j - 1, its launch). With async scheduling the proposer's host time
  joins the step's CPU work (:meth:`host_time`), which overlaps the step before it and shows when the CPU, not the
  GPU, sets the pace.
- **serial proposer** (``disable_padded_drafter_batch: true``, and vLLM before padded drafting, e.g. the V1
  runner of vLLM PR #16035): the proposer works on the sampled tokens on the host (``_bookkeeping_sync`` before
  ``propose_draft_token_ids``), so the host waits for the verify to end, then launches the passes one by one: each
  costs max(its GPU time, ``host_pass_s``). vLLM refuses async scheduling in this mode.

Fitted on what: ``host_pass_s`` and ``host_step_s`` on vLLM PR #16035's two EAGLE measurements (Llama-3-8B, batch
1, k = 2 and 4, in the serial mode of that V1 runner; docs/speculative.md "What was fitted"). Nothing else here is
fitted: every GPU time comes from the target's and drafter's cost models.
"""

from __future__ import annotations

from typing import Sequence

from lab.core.batch import BatchShape, padded_size
from lab.costmodel.base import CostModel, CostModelBase
from lab.costmodel.hardware import Hardware
from lab.costmodel.roofline import Efficiency

# Host seconds per proposer pass and per speculative step, fitted on vLLM PR #16035 (docs/speculative.md)
HOST_PASS_S = 0.867e-3
HOST_STEP_S = 0.691e-3
REJECTION_KERNELS = 4
REJECTION_PASSES = 4  # fp32 passes over a vocabulary row per draft position


class SpecDecodeCostModel(CostModelBase):
    """A speculative-decoding step (module docstring): target, rejection sampler, the proposer's passes with their
    host launches.

    Args:
        target: the target model's cost model (it prices verify queries itself).
        drafter: the drafter model's cost model (None for n-gram).
        method: ``eagle``, ``eagle3``, ``mtp``, ``draft_model`` or ``ngram``.
        num_speculative_tokens: k.
        hardware: the GPU.
        hidden_size: the target's hidden size h.
        vocab_size: the target's vocabulary (the rejection sampler's rows).
        weight_dtype: the drafter's extra projections' weight dtype.
        cudagraph_sizes: capture sizes (vLLM's, rounded to multiples of 1 + k); the drafter's passes pad to them.
        serial: the proposer waits for the verify on the host (``disable_padded_drafter_batch``).
        async_scheduling: the engine schedules the next step while this one runs (the proposer's host time is then
            CPU work overlapping the previous step, :meth:`host_time`; otherwise it is in the step).
        host_pass_s, host_step_s: the host's time per proposer pass and per speculative step.
        ngram_cpu_s_per_request: n-gram lookup CPU seconds per request per step (n-gram drafting only).
        projections_every_pass, projections_first_pass: the drafter's extra GEMMs (in, out features) on every pass
            and on the first pass only (EAGLE-3's fc 3h -> h over the target's hidden states).
    """

    def __init__(self, target: CostModel, drafter: CostModel | None, method: str, num_speculative_tokens: int,
                 hardware: Hardware, hidden_size: int, vocab_size: int, weight_dtype: str = "bf16",
                 cudagraph_sizes: tuple[int, ...] = (), serial: bool = False, async_scheduling: bool = True,
                 host_pass_s: float = HOST_PASS_S, host_step_s: float = HOST_STEP_S,
                 ngram_cpu_s_per_request: float = 0.0,
                 projections_every_pass: Sequence[tuple[int, int]] = (),
                 projections_first_pass: Sequence[tuple[int, int]] = ()) -> None:
        from lab.costmodel.model_arch import dtype_bytes

        self.target = target
        self.drafter = drafter
        self.method = method
        self.k = num_speculative_tokens
        self.hw = hardware
        self.h = hidden_size
        self.vocab = vocab_size
        self.wb = dtype_bytes(weight_dtype)
        self.peak = hardware.peak_flops(weight_dtype)
        self.eff = Efficiency()
        self.cudagraph_sizes = cudagraph_sizes
        self.serial = serial
        self.async_scheduling = async_scheduling and not serial
        self.host_pass_s = host_pass_s
        self.host_step_s = host_step_s
        self.ngram_cpu_s = ngram_cpu_s_per_request
        self.proj_all = tuple(projections_every_pass)
        self.proj_first = tuple(projections_first_pass)
        self._overhead = drafter.step_time(BatchShape()) if drafter is not None else 0.0
        self.name = f"{target.name} + {'n-gram' if drafter is None else method + ' proposer'}"

    # ---------------------------------------------------------------------------------------------- GPU parts
    def _gemms(self, tokens: int, projections) -> float:
        """Seconds of extra GEMMs over ``tokens`` rows (roofline, ``Efficiency`` defaults)."""
        e = self.eff
        t = 0.0
        for k, n in projections:
            flops = 2.0 * tokens * k * n
            byts = k * n * self.wb + tokens * (k + n) * 2
            t += max(flops / (self.peak * e.gemm_compute), byts / (self.hw.memory_bandwidth * e.gemm_memory))
        return t

    def _elementwise(self, byts: float, kernels: int = 1) -> float:
        e = self.eff
        return byts / (self.hw.memory_bandwidth * e.elementwise_memory) + kernels * e.kernel_launch_s if byts else 0.0

    def rejection_time(self, shape: BatchShape) -> float:
        """The rejection sampler's GPU seconds: :data:`REJECTION_PASSES` fp32 passes over a vocabulary row per
        draft position, in :data:`REJECTION_KERNELS` kernels (none without drafts)."""
        drafts = shape.num_logits - shape.num_seqs
        if drafts <= 0:
            return 0.0
        return self._elementwise(drafts * self.vocab * 4.0 * REJECTION_PASSES, REJECTION_KERNELS)

    def aux_time(self, shape: BatchShape) -> float:
        """EAGLE-3's auxiliary hidden states: three layers' T x h copies written and read back (bf16)."""
        if self.method != "eagle3":
            return 0.0
        return self._elementwise(3 * shape.dense_tokens * self.h * 2.0 * 2, 3)

    def pass_times(self, shape: BatchShape) -> list[float]:
        """GPU seconds of each proposer pass: the draft prefill over the step's tokens, then k - 1 one-token passes
        (none for n-gram or an empty step)."""
        if self.drafter is None or shape.num_tokens == 0:
            return []
        d = self.drafter
        first = d.step_time(shape) - self._overhead + self._gemms(shape.dense_tokens, self.proj_all + self.proj_first)
        out = [first]
        if self.k > 1:
            one = self._one_token_pass(shape)
            t = d.step_time(one) - self._overhead + self._gemms(one.dense_tokens, self.proj_all)
            out += [t] * (self.k - 1)
        return out

    def _one_token_pass(self, shape: BatchShape) -> BatchShape:
        """One token per request against what the step left in its KV, padded to the capture sizes; in a lock-step
        group each rank's count is its verify tokens over 1 + k (its requests)."""
        ctx = [c + 1 for c in shape.decode_context]
        ctx += [c + q for q, c in zip(shape.verify_new, shape.verify_context)]
        ctx += [c + q for q, c in zip(shape.prefill_new, shape.prefill_context)]
        one = BatchShape.decode_only(ctx, sum(ctx), max(ctx), min(ctx))
        one.padded_tokens = padded_size(self.cudagraph_sizes, len(ctx))
        if shape.group_tokens:
            q = 1 + self.k
            group = tuple(max(1, -(-g // q)) for g in shape.group_tokens)
            if self.cudagraph_sizes:
                top = max(group)
                group = (padded_size(self.cudagraph_sizes, top) or top,) * len(group)
            one.group_tokens = group
        return one

    # ---------------------------------------------------------------------------------------------- the step
    def proposer_time(self, shape: BatchShape, verify_end: float) -> float:
        """When the proposer's last pass ends (seconds from the step's GPU start), given when the verify ended: pass
        j starts at max(end of pass j - 1, its launch by the host); the host launches pass j at
        ``host_step_s`` + j·``host_pass_s`` after the verify ended (serial) or j·``host_pass_s`` after the step
        started (padded: the host runs ahead of the GPU)."""
        passes = self.pass_times(shape)
        end = verify_end
        h = self.host_pass_s
        start_host = verify_end + self.host_step_s if self.serial else 0.0
        for j, g in enumerate(passes, 1):
            launch = start_host + j * h
            end = (end if end >= launch else launch) + g
        return end

    def step_time(self, shape: BatchShape) -> float:
        if shape.num_tokens == 0:
            return self.target.step_time(shape)
        if self.drafter is None:
            return self.target.step_time(shape) + self.ngram_cpu_s * shape.num_seqs
        verify = self.target.step_time(shape) + self.aux_time(shape) + self.rejection_time(shape)
        if not self.async_scheduling and not self.serial:
            verify += self.host_step_s  # sync scheduling: the speculative metadata is built before the launch
        return self.proposer_time(shape, verify)

    def drafter_time(self, shape: BatchShape) -> float:
        """Seconds the speculation adds to the target's step (rejection sampler, proposer, their host time)."""
        return self.step_time(shape) - self.target.step_time(shape)

    def host_time(self, shape: BatchShape) -> float:
        """CPU seconds the proposer adds to the step's CPU work under async scheduling (the engine overlaps them
        with the step in flight, lab/engine/instance.py); 0 when they are in the step itself."""
        if not self.async_scheduling or self.drafter is None or shape.num_tokens == 0:
            return 0.0
        return self.host_step_s + self.k * self.host_pass_s

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """The target's components plus ``rejection_sampler``, ``eagle3_aux`` and ``drafter`` (the proposer's
        passes with the host launches that delay them); sums to :meth:`step_time`."""
        out = dict(self.target.breakdown(shape))
        rej = self.rejection_time(shape) if self.drafter is not None else 0.0
        aux = self.aux_time(shape) if self.drafter is not None else 0.0
        out["rejection_sampler"] = rej
        if aux:
            out["eagle3_aux"] = aux
        out["drafter"] = self.step_time(shape) - self.target.step_time(shape) - rej - aux
        return out

    def stage_times(self, shape: BatchShape, stage_layers: Sequence[int]) -> list[float]:
        """The target's stage times with the rejection sampler and proposer on the last stage (vLLM runs the
        drafter on the last PP rank)."""
        times = list(self.target.stage_times(shape, stage_layers))
        times[-1] += self.drafter_time(shape)
        return times


def spec_capture_sizes(sizes: tuple[int, ...], num_speculative_tokens: int, max_num_seqs: int,
                       max_num_batched_tokens: int, user_sizes: bool = False) -> tuple[int, ...]:
    """vLLM's CUDA-graph capture sizes with speculation: the largest is min(max_num_seqs · (1 + k) · 2, 512,
    max_num_batched_tokens) (vllm/config/vllm.py ``_set_cudagraph_sizes``: ``decode_query_len = 1 + k``), and every
    size is rounded up to a multiple of 1 + k, those above the largest dropped, [1 + k] if none is left
    (vllm/config/compilation.py ``adjust_cudagraph_sizes_for_spec_decode``: a uniform verify batch has 1 + k tokens
    a request). A verify batch of B requests therefore replays the graph of the next multiple of 1 + k at or above
    B·(1 + k); a batch above the largest runs without a full graph (unpadded). ``user_sizes``: the list came from
    ``engine.cudagraph_capture_sizes`` (only the rounding applies)."""
    q = 1 + num_speculative_tokens
    if not sizes:
        return ()
    top = min(max_num_batched_tokens, max(sizes)) if user_sizes else min(max_num_seqs * q * 2, 512,
                                                                       max_num_batched_tokens)
    base = sizes if user_sizes else tuple([1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16)))
    rounded = sorted({-(-s // q) * q for s in base if s <= top} | set())
    out = tuple(s for s in rounded if s <= top)
    if not out and q <= top:
        out = (q,)
    return out
