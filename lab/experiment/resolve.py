"""What an experiment leaves unset, as vLLM (or SGLang) would set it: each vLLM era's defaults, the GPU's batch
limits, CUDA-graph capture sizes, async scheduling, the hybrid KV layout, DP lock-step, the API server's times and
the closed-loop concurrency. Pure functions of the validated experiment (and the model and GPU it names); every
default names its source. lab/experiment/build.py turns the results into a deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.cluster.frontend import FRONTEND_DEFAULTS, FrontEndCost
from lab.core.sched_api import SchedulerConfig
from lab.costmodel import comm
from lab.costmodel.hardware import Hardware
from lab.costmodel.hybrid_kv import VERSION_RULES, KVLayout, kv_layout, mamba_prefix_caching
from lab.costmodel.model_arch import ModelArch
from lab.experiment import speculative as spec_setup
from lab.experiment.schema import Experiment, scheduler_name
from lab.experiment.sections import EngineConfig
from lab.workload import loaders
from policies import make_scheduler


# Behaviour that changed between vLLM releases (shared/specs/vllm-v1-scheduling.md marks the legacy forms).
# priority_preemption: V0's _schedule_priority_preemption (vLLM PR #5958, 0.6.2); V1 never preempts for a waiting
# request (issue #40004, open). draft_slot_budget: a draft model's slot per request charged per scheduled request
# since vLLM PR #51725 (Aug 2026), max_num_seqs x slots reserved before (VllmConfig._set_max_num_scheduled_tokens).
# "0.6" is the V0 engine (policies/vllm_v0.py): no async scheduling, no full-sequence gate, prefix caching and (up to
# a 32K max_model_len) chunked prefill off (EngineConfig.prefix_caching / chunked_prefill), V0's batch defaults.
VERSION_DEFAULTS = {
    "0.33": {"gpu_memory_utilization": 0.92, "async_scheduling": True, "scheduler_reserve_full_isl": True,
             "threshold_only_when_contended": True, "prepend_unhashed": True, "priority_preemption": "none",
             "draft_slot_budget": "per_request"},
    "0.19": {"gpu_memory_utilization": 0.9, "async_scheduling": True, "scheduler_reserve_full_isl": True,
             "threshold_only_when_contended": False, "prepend_unhashed": False, "priority_preemption": "none",
             "draft_slot_budget": "reserved"},
    "0.11": {"gpu_memory_utilization": 0.9, "async_scheduling": False, "scheduler_reserve_full_isl": False,
             "threshold_only_when_contended": False, "prepend_unhashed": False, "priority_preemption": "none",
             "draft_slot_budget": "reserved"},
    "0.6": {"gpu_memory_utilization": 0.9, "async_scheduling": False, "scheduler_reserve_full_isl": False,
            "threshold_only_when_contended": False, "prepend_unhashed": False, "priority_preemption": "v0",
            "draft_slot_budget": "reserved"},
}


def draft_slots_per_request(exp: Experiment) -> int:
    """vLLM's ``SpeculativeConfig.max_num_new_slots_for_drafting`` for the methods servelab models: 1 for a draft
    model (its first pass takes one more position per request: the draft tokens are not sliced), 0 for EAGLE,
    EAGLE-3, MTP and n-gram (the parallel drafters that take k - 1 more are not modelled)."""
    spec = exp.speculative
    return 1 if spec is not None and spec.method == "draft_model" else 0


def v0_batch_defaults(max_model_len: int, chunked: bool) -> tuple[int, int]:
    """vLLM V0's (0.6) default (max_num_batched_tokens, max_num_seqs): 512 with chunked prefill, else
    max(max_model_len, 2048); 256 sequences (vllm/config.py ``SchedulerConfig``, 0.6.x)."""
    return (512 if chunked else max(max_model_len, 2048)), 256


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default CUDA-graph capture sizes: 1, 2, 4, then every 8 up to 256, then every 16, up to
    min(2 · max_num_seqs, 512) (vllm/config/compilation.py; the RTX 4090 run's resolved config lists exactly
    these for max_num_seqs 256)."""
    top = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    return tuple(x for x in sizes if x <= top)


def engine_setting(engine: EngineConfig, field: str):
    """An ``engine`` field as in force: its value, else the default of its ``vllm_version``
    (:data:`VERSION_DEFAULTS`; ``field`` must be one of its keys)."""
    value = getattr(engine, field)
    return VERSION_DEFAULTS[engine.vllm_version][field] if value is None else value


def batch_defaults(hw: Hardware) -> tuple[int, int]:
    """vLLM's default (max_num_batched_tokens, max_num_seqs) for its OpenAI API server on a GPU: 16384 / 1024 with
    at least 160 GiB of memory, 8192 / 1024 with at least 70 GiB except the A100, else 2048 / 256
    (vllm/engine/arg_utils.py ``get_batch_defaults``; shared/specs/vllm-v1-scheduling.md §6)."""
    gib = hw.memory_bytes / 2**30
    if gib >= 160:
        return 16384, 1024
    if gib >= 70 and not hw.name.startswith("A100"):
        return 8192, 1024
    return 2048, 256


@dataclass(frozen=True)
class BatchLimits:
    """The scheduler's limits in force: tokens (``max_model_len``, ``max_num_batched_tokens``), sequences
    (``max_num_seqs``) and whether prompts are chunked."""

    max_model_len: int
    enable_chunked_prefill: bool
    max_num_batched_tokens: int
    max_num_seqs: int


def batch_limits(exp: Experiment, model: ModelArch, hw: Hardware) -> BatchLimits:
    """``max_model_len`` (default: the model's positions), chunked prefill, ``max_num_batched_tokens`` and
    ``max_num_seqs`` (default: vLLM's for the GPU, or V0's) as vLLM resolves them; with chunking off the token
    budget rises to ``max_model_len``, as vLLM raises it.

    Raises:
        ValueError: naming the engine field, a budget vLLM refuses (below ``max_num_seqs``, or below
            ``max_model_len`` with chunked prefill off).
    """
    e = exp.engine
    max_model_len = e.max_model_len or model.max_position_embeddings
    chunked = e.chunked_prefill(max_model_len)
    default_mbt, default_seqs = (v0_batch_defaults(max_model_len, chunked) if e.vllm_version == "0.6"
                                 else batch_defaults(hw))
    mbt = e.max_num_batched_tokens or default_mbt
    max_num_seqs = e.max_num_seqs or default_seqs
    if mbt < max_num_seqs and budgeted_by_max_num_batched_tokens(exp):
        default = "" if e.max_num_seqs else f" (vLLM's default for {hw.name}; set engine.max_num_seqs)"
        raise ValueError(f"engine.max_num_batched_tokens ({mbt}) must be >= engine.max_num_seqs ({max_num_seqs}"
                         f"{default}), as vLLM requires (every running request must be able to take one token per "
                         "step)")
    if not chunked and e.max_num_batched_tokens is not None and mbt < max_model_len:
        raise ValueError(f"engine.max_num_batched_tokens ({mbt}) is below max_model_len ({max_model_len}) with "
                         "enable_chunked_prefill false: vLLM refuses it (no prompt longer than the budget could run)")
    if not chunked and mbt < max_model_len:
        mbt = max_model_len  # vLLM raises the budget to max_model_len when chunking is off
    return BatchLimits(max_model_len, chunked, mbt, max_num_seqs)


def max_running_requests(exp: Experiment, limits: BatchLimits, num_gpu_blocks: int, block_size: int) -> int:
    """``max_num_seqs`` in force once the KV cache is sized: under ``policy.scheduler: sglang`` an unset
    ``engine.max_num_seqs`` takes SGLang's ``--max-running-requests`` default from its KV pool
    (policies/sglang.py), else ``limits.max_num_seqs``."""
    if scheduler_name(exp) == "sglang" and exp.engine.max_num_seqs is None:
        from policies.sglang import sglang_max_running_requests  # noqa: PLC0415

        return sglang_max_running_requests((num_gpu_blocks - 1) * block_size, limits.max_model_len)
    return limits.max_num_seqs


def scheduler_config(exp: Experiment, limits: BatchLimits, max_num_seqs: int) -> SchedulerConfig:
    """The scheduler's configuration (lab/core/sched_api.py): the limits, the era's rules, preemption and
    speculative settings. V0's partial prefills take a ``long_prefill_token_threshold`` of 4 % of
    ``max_model_len`` when unset (vllm/config.py).

    Raises:
        ValueError: a draft model's reserved slots leave no token budget (vLLM
            ``VllmConfig._set_max_num_scheduled_tokens`` refuses it).
    """
    e = exp.engine
    spec = exp.speculative
    mbt, max_model_len = limits.max_num_batched_tokens, limits.max_model_len
    threshold = e.long_prefill_token_threshold
    if e.max_num_partial_prefills > 1 and not threshold:  # vLLM V0: 4 % of max_model_len (vllm/config.py)
        threshold = int(max_model_len * 0.04)
    slots = draft_slots_per_request(exp)
    slot_budget = engine_setting(e, "draft_slot_budget")
    if slots and slot_budget == "reserved" and mbt - slots * max_num_seqs <= 0:
        raise ValueError(f"engine.max_num_batched_tokens ({mbt}) leaves no budget after the draft model's slot for "
                         f"each of max_num_seqs ({max_num_seqs}) requests (draft_slot_budget reserved; vLLM "
                         "VllmConfig._set_max_num_scheduled_tokens refuses it)")
    return SchedulerConfig(
        max_num_batched_tokens=mbt, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=limits.enable_chunked_prefill, long_prefill_token_threshold=threshold,
        threshold_only_when_contended=VERSION_DEFAULTS[e.vllm_version]["threshold_only_when_contended"],
        scheduler_reserve_full_isl=engine_setting(e, "scheduler_reserve_full_isl"),
        watermark=e.watermark, queue_policy=exp.policy.queue,
        preemption_mode=exp.policy.preemption.mode, preemption_victim=exp.policy.preemption.victim,
        preemption_requeue=exp.policy.preemption.requeue,
        num_lookahead_tokens=spec_setup.num_lookahead_tokens(exp),
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        pad_new_one_token_requests=spec is not None and e.vllm_version == "0.33",
        skip_blocked_waiting=e.skip_blocked_waiting, priority_preemption=engine_setting(e, "priority_preemption"),
        draft_slots_per_request=slots, draft_slot_budget=slot_budget,
        max_num_partial_prefills=e.max_num_partial_prefills, max_long_partial_prefills=e.max_long_partial_prefills)


def capture_sizes(engine: EngineConfig, max_num_seqs: int) -> tuple[int, ...]:
    """The CUDA-graph capture sizes in force (ascending): ``cudagraph_capture_sizes``, else vLLM's defaults for
    ``max_num_seqs``; none with ``cudagraph`` off (eager mode)."""
    if not engine.cudagraph:
        return ()
    if engine.cudagraph_capture_sizes:
        return tuple(sorted(engine.cudagraph_capture_sizes))
    return default_capture_sizes(max_num_seqs)


def hybrid_kv_layout(exp: Experiment, model: ModelArch, kv_dtype: str, max_model_len: int,
                     kv_connector: bool = False) -> tuple[KVLayout | None, bool]:
    """The KV cache layout vLLM builds for a hybrid model (lab/costmodel/hybrid_kv.py ``kv_layout``) and whether
    prefix caching is in force; (None, ``engine.enable_prefix_caching``) for a full-attention model.

    The hybrid manager is off when ``engine.disable_hybrid_kv_cache_manager`` asks, and under prefill/decode
    disaggregation before vLLM 0.33 (a KV connector turned it off: vllm/config/vllm.py; 0.33 keeps it for
    connectors that support it, NIXL's among them). A Mamba hybrid caches prefixes only where that version does
    (``mamba_prefix_caching``); a drafter's full-attention layers (EAGLE, EAGLE-3: one; MTP: its modules) join
    the full-attention layers, and each speculative token adds a state block per Mamba group.

    Raises:
        ValueError: the model cannot be configured so (a Mamba hybrid without the hybrid manager, no full-attention
            layer).
    """
    e = exp.engine
    if not model.is_hybrid:
        return None, e.prefix_caching()
    ver = e.vllm_version
    connector_off = kv_connector and not VERSION_RULES[ver]["hma_with_connector"]
    manager = not e.disable_hybrid_kv_cache_manager and not connector_off
    has_state = model.count_layers("linear_attention", "mamba") > 0
    caching = (mamba_prefix_caching(ver, e.prefix_caching(), e.enable_prefix_caching is not None)
               if has_state else e.prefix_caching())
    spec = exp.speculative
    extra = 0
    if spec is not None and spec.method in ("eagle", "eagle3"):
        extra = 1
    elif spec is not None and spec.method == "mtp":
        extra = model.num_mtp_layers
    layout = kv_layout(model, kv_dtype=kv_dtype, tp=exp.hardware.tensor_parallel_size, block_size=e.block_size,
                       max_model_len=max_model_len, version=ver, prefix_caching=caching, hybrid_manager=manager,
                       extra_full_layers=extra, num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                       model_dtype=exp.model.dtype)
    return layout, caching


def async_scheduling(exp: Experiment) -> bool:
    """Async scheduling in force: ``engine.async_scheduling``, else the era's default (SGLang's overlap scheduler is
    on by default whatever the era: --disable-overlap-schedule turns it off), unless n-gram drafting or the serial
    proposer rules it out (vLLM turns it off for spec methods its async path does not support, n-gram among them,
    and with ``disable_padded_drafter_batch``:
    vllm/config/vllm.py; shared/specs/vllm-v1-scheduling.md §6; asking for both is refused by
    lab/experiment/support.py). Lock-stepped DP ranks schedule asynchronously too: each rank's engine core runs
    ``step_with_batch_queue`` in vLLM's DP loop (vllm/v1/engine/core.py ``DPEngineCoreProc.run_busy_loop``), and
    with async scheduling vLLM syncs the ranks' token counts over the CPU (``disable_nccl_for_dp_synchronization``;
    lab/cluster/lockstep.py)."""
    e = exp.engine
    sglang_default = scheduler_name(exp) == "sglang" and e.async_scheduling is None
    default = True if sglang_default else engine_setting(e, "async_scheduling")
    spec = exp.speculative
    ngram = spec is not None and spec.method == "ngram"
    serial = spec is not None and spec.disable_padded_drafter_batch
    return default and not ngram and not serial


def budgeted_by_max_num_batched_tokens(exp: Experiment) -> bool:
    """Whether the experiment's scheduler caps its steps at ``max_num_batched_tokens`` (vLLM-style policies; SGLang,
    Orca and static batching budget differently, so vLLM's rules on that budget do not apply to them)."""
    probe = SchedulerConfig(max_num_batched_tokens=1)
    return make_scheduler(scheduler_name(exp), exp.base_dir, exp.policy.options, exp.seed).max_step_tokens(probe) \
        is not None


def lock_step(exp: Experiment) -> bool:
    """Whether the experiment's DP ranks step together: ``hardware.data_parallel_lock_step``, by default on when
    attention DP is combined with expert parallelism (vLLM's DP + EP; lab/cluster/lockstep.py)."""
    h = exp.hardware
    if h.data_parallel_size == 1:
        return False
    if h.data_parallel_lock_step is not None:
        return h.data_parallel_lock_step
    return h.expert_parallel_size > 1


def comm_link(exp: Experiment, hw: Hardware, gpus: int):
    """The link a collective over ``gpus`` GPUs of the experiment runs on (lab/costmodel/comm.py ``link_for``), with
    ``hardware.link_gbps`` / an explicitly set ``hardware.link_latency_us`` as overrides."""
    h = exp.hardware
    latency = h.link_latency_us if "link_latency_us" in h.model_fields_set else None
    return comm.link_for(hw.name, gpus, h.link_gbps, latency)


def frontend_cost(exp: Experiment) -> FrontEndCost:
    """The experiment's API-server times (``frontend``; lab/cluster/frontend.py): each field set, else vLLM's for
    ``engine.vllm_version`` (``FRONTEND_DEFAULTS``, public measurements). A disaggregated deployment's router adds
    its way in to P (``deployment.transfer`` ``entry_s``: the dispatch, and the P-D bootstrap of a parallel
    router) to the time in."""
    d = FRONTEND_DEFAULTS.get(exp.engine.vllm_version) or FRONTEND_DEFAULTS["0.11"]  # (V0: the oldest measured era)
    f = exp.frontend.model_copy(update={k: d[k] for k in d if getattr(exp.frontend, k) is None})
    entry = exp.deployment.transfer.entry_s() if exp.deployment.mode == "disaggregated" else 0.0
    return FrontEndCost(f.request_s + entry, f.per_prompt_token_s, f.per_output_token_s)


def closed_loop_concurrency(exp: Experiment) -> int | None:
    """The closed-loop concurrency: ``workload.concurrency``, else the ``max_concurrency`` a vllm_bench result was
    run with, else None (open loop: requests arrive at their trace times)."""
    w = exp.workload
    if w.concurrency is not None:
        return w.concurrency
    if w.source == "vllm_bench" and w.path:
        return loaders.vllm_bench_max_concurrency(exp.path(w.path, "workload.path"))
    return None
