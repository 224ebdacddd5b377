"""Speculative decoding for an experiment: the default acceptance figures and their sources, the drafter, the cost
model wrapper, and each instance's :class:`lab.core.speculation.Speculator`.

Default conditional acceptance rates (draft i accepted with p_i given drafts 1..i-1 were; positions past the list
repeat its last value). Each comes from a published measurement; none is fitted to a run this project validates:

- EAGLE-3 on Llama-3.1-8B-Instruct: vLLM's acceptance-length regression test
  (tests/v1/spec_decode/test_acceptance_length.py, RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3, MT-Bench,
  k = 3, temperature 0) records per-position rates 0.7296, 0.5208, 0.3545 of all drafts; conditionally
  0.730, 0.714, 0.681.
- EAGLE-3 on Qwen3-8B: the same test, 0.6541, 0.3993, 0.2020; conditionally 0.654, 0.610, 0.506. Other targets
  with EAGLE-3 use the Llama-3.1-8B figures.
- EAGLE (EAGLE-1) on Llama-3-8B-Instruct: vLLM PR #16035 measured mean acceptance length 1.89 at k = 2 on
  MT-Bench; 1 + a + a^2 = 1.89 gives an i.i.d. a = 0.60.
- DeepSeek-V3 MTP: the DeepSeek-V3 technical report (arXiv:2412.19437, §5.4.3) gives 85-90 % acceptance of the
  second-token prediction: p_1 = 0.875. For k > 1 vLLM reuses the one MTP module; the report gives no figure, so
  later positions fall off by the ratio measured for DeepSeek-V4's MTP in vLLM PR #41044 (k = 2: 0.7694 then
  0.3807 of all drafts, conditional ratio 0.495 / 0.769 = 0.643): p_2 = 0.563, p_3 = 0.362.
- draft model and n-gram: no published figure fits a generic pair or prompt set; the defaults (i.i.d. 0.6; n-gram
  hit probability 0.5 and acceptance 0.5 given a hit) are placeholders to be replaced by the user's measured rates.
"""

from __future__ import annotations

import numpy as np

from lab.core.request import Request
from lab.core.speculation import Speculator
from lab.costmodel.base import CostModel
from lab.costmodel.hardware import Hardware
from lab.costmodel.model_arch import ModelArch, load_model, resolve_kv_dtype
from lab.costmodel.spec_step import SpecDecodeCostModel, spec_capture_sizes  # noqa: F401 (used by simulation)
from lab.costmodel.speculative import Drafter, make_drafter
from lab.experiment.schema import Experiment

_EAGLE3_LLAMA = (0.7296, 0.5208 / 0.7296, 0.3545 / 0.5208)
_EAGLE3_QWEN3 = (0.6541, 0.3993 / 0.6541, 0.2020 / 0.3993)
_MTP_FALLOFF = (0.3807 / 0.7694) / 0.7694
_MTP_DEEPSEEK = (0.875, 0.875 * _MTP_FALLOFF, 0.875 * _MTP_FALLOFF ** 2)

DEFAULT_NGRAM_HIT_PROBABILITY = 0.5


def default_rates(method: str, model_name: str) -> tuple[tuple[float, ...], str]:
    """(conditional acceptance rates, source) used when ``speculative.acceptance.kind`` is ``default``."""
    if method == "eagle3":
        if model_name.startswith("Qwen3"):
            return _EAGLE3_QWEN3, "vLLM tests/v1/spec_decode/test_acceptance_length.py (Qwen3-8B EAGLE-3, MT-Bench)"
        return _EAGLE3_LLAMA, "vLLM tests/v1/spec_decode/test_acceptance_length.py (Llama-3.1-8B EAGLE-3, MT-Bench)"
    if method == "eagle":
        return (0.60,), "vLLM PR #16035 (Llama-3-8B EAGLE, MT-Bench, acceptance length 1.89 at k=2)"
    if method == "mtp":
        return _MTP_DEEPSEEK, ("DeepSeek-V3 report §5.4.3 (85-90 % second-token acceptance); later positions: "
                               "falloff of DeepSeek-V4 MTP in vLLM PR #41044")
    if method == "ngram":
        return (0.5,), "placeholder (no published figure fits every prompt set): set speculative.acceptance"
    return (0.6,), "placeholder (no published figure fits every draft/target pair): set speculative.acceptance"


def acceptance_rates(exp: Experiment, model: ModelArch) -> tuple[tuple[float, ...], str]:
    """The experiment's conditional acceptance vector and where it comes from."""
    spec = exp.speculative
    assert spec is not None
    a = spec.acceptance
    if a.kind == "per_position":
        return tuple(a.rates or ()), "speculative.acceptance.rates"
    if a.kind == "iid":
        return (float(a.rate),), "speculative.acceptance.rate"  # type: ignore[arg-type]
    rates, source = default_rates(spec.method, model.name)
    return rates, source


def make_speculator(exp: Experiment, model: ModelArch) -> Speculator | None:
    """The drafter's random part for one instance (None without speculative decoding)."""
    spec = exp.speculative
    if spec is None:
        return None
    rates, _ = acceptance_rates(exp, model)
    hit = 1.0
    if spec.method == "ngram":
        hit = spec.ngram_hit_probability if spec.ngram_hit_probability is not None else DEFAULT_NGRAM_HIT_PROBABILITY
    return Speculator(spec.num_speculative_tokens, rates, exp.seed, hit)


def assign_request_rates(exp: Experiment, requests: list[Request]) -> None:
    """Under ``acceptance.kind: per_request``, give every request without a rate from its trace one drawn from
    ``acceptance.distribution`` (seeded by the experiment's seed, in trace order)."""
    spec = exp.speculative
    if spec is None or spec.acceptance.kind != "per_request":
        return
    d = spec.acceptance.distribution
    rng = np.random.default_rng([exp.seed, 0x5EC])
    n = len(requests)
    if d.kind == "beta":
        alpha = d.mean * d.concentration
        draws = rng.beta(alpha, d.concentration - alpha, n)
    elif d.kind == "uniform":
        draws = rng.uniform(d.low, d.high, n)
    else:
        draws = np.full(n, d.value)
    for r, a in zip(requests, draws.tolist()):
        if r.acceptance_rate is None:
            r.acceptance_rate = a


def make_experiment_drafter(exp: Experiment, model: ModelArch) -> Drafter:
    """The experiment's drafter on one GPU (lab/costmodel/speculative.py ``make_drafter``).

    Raises:
        ValueError: MTP for a model without MTP layers; an unknown draft model; a draft TP size vLLM refuses.
    """
    spec = exp.speculative
    assert spec is not None
    draft = None
    if spec.method == "draft_model":
        path = exp.path(spec.hf_config, "speculative.hf_config") if spec.hf_config else None
        draft = load_model(spec.model, path)
        check_draft_tp(spec.draft_tensor_parallel_size, exp.hardware.tensor_parallel_size, draft)
    kv_dtype = resolve_kv_dtype(exp.model.dtype, exp.model.kv_cache_dtype)
    return make_drafter(spec.method, model, kv_dtype, exp.model.dtype, exp.hardware.tensor_parallel_size, draft,
                        spec.draft_vocab_size, spec.draft_tensor_parallel_size)


def check_draft_tp(draft_tp: int | None, target_tp: int, draft: ModelArch) -> None:
    """vLLM's rules for ``draft_tensor_parallel_size``: 1 or the target's TP (vllm/config/speculative.py
    ``_verify_and_get_draft_tp``), and, like any TP size, a divisor of the draft model's attention heads (and of
    its KV heads, or a multiple of them).

    Raises:
        ValueError: naming ``speculative.draft_tensor_parallel_size`` and the rule.
    """
    if draft_tp is None:
        return
    field = f"speculative.draft_tensor_parallel_size ({draft_tp})"
    if draft_tp not in (1, target_tp):
        raise ValueError(f"{field}: vLLM accepts only 1 or the target's tensor_parallel_size ({target_tp})")
    kv = draft.num_kv_heads
    if draft.num_heads % draft_tp or (kv % draft_tp if kv >= draft_tp else draft_tp % kv):
        raise ValueError(f"{field} must divide the draft model {draft.name}'s {draft.num_heads} attention heads "
                         f"and {kv} KV heads (or be a multiple of the KV heads), as vLLM requires")


def speculative_cost_model(exp: Experiment, target: CostModel, drafter: Drafter, hw: Hardware,
                           build, cudagraph_sizes: tuple[int, ...], model: ModelArch,
                           async_scheduling: bool) -> SpecDecodeCostModel:
    """The speculative step's cost (lab/costmodel/spec_step.py): ``target``, the rejection sampler and the
    proposer's passes with their host launches; ``build(arch, tp)`` makes a cost model of the experiment's kind for
    a drafter architecture on ``tp`` GPUs (no pipeline split: vLLM runs the drafter on the last PP rank). EAGLE and
    MTP drafters run at the target's tensor-parallel size (and, MoE, its expert parallelism), as vLLM runs them;
    a draft model at ``draft_tensor_parallel_size``."""
    spec = exp.speculative
    assert spec is not None
    drafter_cost = None
    if drafter.arch is not None:
        tp = spec.draft_tensor_parallel_size or exp.hardware.tensor_parallel_size
        drafter_cost = build(drafter.arch, tp if spec.method == "draft_model" else exp.hardware.tensor_parallel_size)
    every, first = drafter.projections, ()
    if spec.method == "eagle3":  # combine_hidden_states (fc 3h -> h) runs once, on the target's hidden states
        first = tuple(p for p in drafter.projections if p[0] == 3 * model.hidden_size)
        every = tuple(p for p in drafter.projections if p[0] != 3 * model.hidden_size)
    return SpecDecodeCostModel(target, drafter_cost, spec.method, spec.num_speculative_tokens, hw,
                               model.hidden_size, model.vocab_size, exp.model.dtype, cudagraph_sizes,
                               serial=spec.disable_padded_drafter_batch, async_scheduling=async_scheduling,
                               ngram_cpu_s_per_request=spec.ngram_cpu_us_per_request * 1e-6,
                               projections_every_pass=every, projections_first_pass=first)


def num_lookahead_tokens(exp: Experiment) -> int:
    """vLLM's ``num_lookahead_tokens``: k for EAGLE, EAGLE-3, MTP and draft models, 0 for n-gram (§3)."""
    spec = exp.speculative
    if spec is None or spec.method == "ngram":
        return 0
    return spec.num_speculative_tokens


def drops_last_hit_block(exp: Experiment) -> bool:
    """EAGLE, EAGLE-3 and MTP drop one more block from a prefix hit (vLLM ``use_eagle_block_drop``): their
    drafter needs the hidden state of the block's tokens, which the cache does not keep."""
    spec = exp.speculative
    return spec is not None and spec.method in ("eagle", "eagle3", "mtp")
