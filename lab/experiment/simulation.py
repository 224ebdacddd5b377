"""Build a deployment from an experiment and run it: arrivals -> instance(s) -> per-request and per-step records."""

from __future__ import annotations

import gc
import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

import simpy

from lab.cluster.cluster import Cluster, HandOff, Pool
from lab.cluster.frontend import FRONTEND_DEFAULTS, FrontEnd, FrontEndCost, shift_to_engine
from lab.cluster.transfer import TransferCost
from lab.cluster.lockstep import LockStepGroup
from lab.experiment.config import Experiment, pool_experiments, scheduler_name
from lab.experiment.support import check_composition
from lab.costmodel.base import CostModel
from lab.costmodel.hardware import Hardware, load_hardware
from lab.costmodel.hybrid_kv import VERSION_RULES, KVLayout, kv_layout, mamba_prefix_caching
from lab.costmodel.kv_capacity import KVCapacity, bytes_per_block, derive_num_gpu_blocks
from lab.costmodel import comm
from lab.costmodel.model_arch import ModelArch, load_model, resolve_kv_dtype
from lab.costmodel.parallel import Parallelism
from lab.costmodel.roofline import Efficiency, RooflineCostModel
from lab.costmodel.speculative import Drafter
from lab.costmodel.batch_expansion import BatchExpansionCostModel
from lab.experiment import speculative as spec_setup
from lab.core.step_log import ROW_BUDGET, SpillFolder, StepLog, rows_per_log
from lab.engine.jump import KnownArrivals
from lab.engine.instance import EngineOptions, Instance
from lab.core.kv_cache import KVCacheManager
from lab.core.kv_groups import HybridKV
from lab.core.kv_offload import KVOffloader, cpu_tier_blocks
from lab.core.samples import WeightedSamples
from lab.core.request import Request, RequestStatus
from lab.core.sched_api import EngineStall, SchedulerConfig
from lab.workload import loaders, synthetic
from lab.workload.closed_loop import ClosedLoopClients, warmup_copies, SessionClients
from policies import make_router, make_scheduler


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


@dataclass
class Deployment:
    """Everything fixed before the run starts."""

    model: ModelArch
    hardware: Hardware
    scheduler_config: SchedulerConfig
    num_gpu_blocks: int
    kv_capacity: KVCapacity | None
    cost_model: CostModel
    engine_options: EngineOptions
    prepend_unhashed: bool = True
    derived_kv_capacity: KVCapacity | None = None
    drafter: Drafter | None = None
    # a hybrid model's KV cache configuration (lab/costmodel/hybrid_kv.py); None for full attention only
    kv_layout: KVLayout | None = None
    block_size: int = 16  # tokens per block the KV manager uses (a Mamba hybrid's raised attention block size)
    enable_prefix_caching: bool = True  # in force (vLLM turns it off for Mamba hybrids before 0.33 by default)


@dataclass
class SimResult:
    """What a run produced. ``requests`` keeps every request of the trace, in arrival order."""

    experiment: Experiment
    deployment: Deployment
    requests: list[Request]
    instances: list[Instance]
    itl_samples: WeightedSamples
    sim_end: float
    wall_time_s: float
    info: dict = field(default_factory=dict)
    pools: list = field(default_factory=list)  # (pool name, Deployment), configuration order
    groups: list = field(default_factory=list)  # lock-step groups of DP ranks
    cluster: Cluster | None = None
    spill_folder: SpillFolder | None = None  # the step logs' spill folder (simulation.step_log: spill) until cleanup()

    def cleanup(self) -> None:
        """Remove the step log's spill folder, once the outputs are written (the step log cannot be read after).
        ``with simulate(exp) as result:`` calls it at the end of the block. Raises nothing."""
        for inst in self.instances:
            inst.steps.close()
        if self.spill_folder is not None:
            self.spill_folder.remove()

    def __enter__(self) -> "SimResult":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


class _RouterView:
    """What a router gets for each instance: reading any attribute first brings an instance that is inside a
    fast-forward jump up to date, so routers see exactly the state of step-by-step simulation, and routers that
    read nothing (round robin) do not cut jumps short."""

    __slots__ = ("_inst",)

    def __init__(self, inst: Instance) -> None:
        self._inst = inst

    def __getattr__(self, name: str):
        inst = self._inst
        inst.jump.materialize()
        return getattr(inst, name)


def build_requests(exp: Experiment) -> list[Request]:
    """Load or generate the experiment's workload, apply ``max_requests`` and ``time_scale``.

    Raises:
        lab.workload.loaders.WorkloadError: a bad trace file.
    """
    with _collecting_rarely():
        return _build_requests(exp)


def _build_requests(exp: Experiment) -> list[Request]:
    w = exp.workload
    if w.source == "sessions":
        sessions, _ = build_sessions(exp)
        return [r for convo in sessions for r in convo]
    if w.source == "synthetic":
        burst = w.rate == math.inf  # vllm bench serve --request-rate inf: every request sent at once
        reqs = synthetic.generate(
            w.num_requests, 1.0 if burst else w.rate,
            synthetic.LengthDist(**w.prompt_tokens.model_dump()),
            synthetic.LengthDist(**w.output_tokens.model_dump()),
            seed=exp.seed, cv=w.cv, num_priorities=w.num_priorities)
        if burst or (w.concurrency is not None and "rate" not in w.model_fields_set):
            for r in reqs:  # all ready at once (closed loop without a rate: the clients pace the sends)
                r.arrival_time = 0.0
    else:
        path = exp.path(w.path, "workload.path")  # type: ignore[arg-type]
        if w.source == "azure":
            reqs = loaders.load_azure(path)
        elif w.source == "mooncake":
            reqs = loaders.load_mooncake(path, jitter_s=w.jitter_s, seed=exp.seed)
        elif w.source == "llmservingsim":
            reqs = loaders.load_llmservingsim(path)
        elif w.source == "vllm_bench":
            reqs = loaders.load_vllm_bench(path, seed=exp.seed)
        else:
            reqs = loaders.load_csv(path)
        if not reqs:
            raise loaders.WorkloadError(f"{path}: no requests in the trace")
    if w.arrival_times is not None:
        reqs = loaders.override_arrivals(reqs, exp.path(w.arrival_times.path, "workload.arrival_times.path"),
                                         w.arrival_times.column)
    if w.source != "synthetic" or w.arrival_times is not None:
        loaders.check_requests(exp.path(w.path, "workload.path") if w.arrival_times is None else
                               exp.path(w.arrival_times.path, "workload.arrival_times.path"), reqs)
    if w.max_requests is not None:
        reqs = reqs[: w.max_requests]
    if w.time_scale != 1.0:
        for r in reqs:
            r.arrival_time *= w.time_scale
    return reqs


def build_sessions(exp: Experiment) -> tuple[list[list[Request]], list[float]]:
    """The multi-turn conversations of ``source: sessions`` (lab/workload/synthetic.py ``generate_sessions``):
    ``num_requests`` sessions starting at ``rate`` sessions/s."""
    w = exp.workload
    dist = lambda spec: synthetic.LengthDist(**spec.model_dump())  # noqa: E731
    return synthetic.generate_sessions(w.num_requests, w.rate, dist(w.turns), dist(w.prompt_tokens),
                                       dist(w.turn_tokens), dist(w.output_tokens), seed=exp.seed, cv=w.cv)


def _group_sessions(reqs: list[Request]) -> tuple[list[list[Request]], list[float]]:
    """Requests grouped by ``session_id`` (trace order within a session), and each session's first arrival."""
    groups: dict[str, list[Request]] = {}
    for r in reqs:
        groups.setdefault(r.session_id or f"#{r.index}", []).append(r)
    sessions = list(groups.values())
    return sessions, [convo[0].arrival_time for convo in sessions]


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


def build_deployment(exp: Experiment, kv_connector: bool = False) -> Deployment:
    """Resolve model, GPU, KV capacity, scheduler limits and cost model. ``kv_connector``: the instances move KV to
    or from other instances (a pool of a prefill/decode disaggregated deployment), which before vLLM 0.33 turns a
    hybrid model's hybrid KV cache manager off.

    Raises:
        ValueError: unknown model or GPU, a model that does not fit, or a bad profile folder.
    """
    m = exp.model
    model = load_model(m.name, exp.path(m.hf_config, "model.hf_config") if m.hf_config else None)
    hw = load_hardware(exp.hardware.gpu)
    if exp.hardware.pipeline_parallel_size > model.num_layers:
        raise ValueError(f"hardware.pipeline_parallel_size: {exp.hardware.pipeline_parallel_size} pipeline stages "
                         f"exceed the model's {model.num_layers} layers ({model.name})")
    tp = exp.hardware.tensor_parallel_size
    check_model_limits(exp, model)
    e = exp.engine
    ver = VERSION_DEFAULTS[e.vllm_version]

    def pick(field: str):
        v = getattr(e, field)
        return ver[field] if v is None else v

    kv_dtype = resolve_kv_dtype(m.dtype, m.kv_cache_dtype)
    spec = exp.speculative
    drafter = spec_setup.make_experiment_drafter(exp, model) if spec is not None else None
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
    layout, prefix_caching = hybrid_kv_layout(exp, model, kv_dtype, max_model_len,
                                              kv_connector or exp.deployment.mode == "disaggregated")
    block_size = layout.block_size if layout is not None else e.block_size
    try:
        derived = derive_num_gpu_blocks(
            model, hw, block_size=e.block_size, gpu_memory_utilization=pick("gpu_memory_utilization"),
            max_num_batched_tokens=mbt, max_num_seqs=max_num_seqs, tp=tp, kv_dtype=kv_dtype,
            weight_dtype=m.dtype, pp=exp.hardware.pipeline_parallel_size, ep=exp.hardware.expert_parallel_size,
            dp=exp.hardware.data_parallel_size,
            drafter_kv_bytes_per_token=drafter.kv_bytes_per_token if drafter else 0,
            drafter_weight_bytes=drafter.weight_bytes if drafter else 0,
            include_mtp=drafter is not None and drafter.method == "mtp", layout=layout)
    except ValueError:
        if e.num_gpu_blocks is None:
            raise
        derived = None
    if e.num_gpu_blocks is not None:
        blocks, capacity = e.num_gpu_blocks, None
    else:
        blocks, capacity = derived.num_gpu_blocks, derived  # type: ignore[union-attr]
    sglang = scheduler_name(exp) == "sglang"
    if sglang and e.max_num_seqs is None:  # SGLang's --max-running-requests default, from its KV pool
        from policies.sglang import sglang_max_running_requests  # noqa: PLC0415
        max_num_seqs = sglang_max_running_requests((blocks - 1) * block_size, max_model_len)
    threshold = e.long_prefill_token_threshold
    if e.max_num_partial_prefills > 1 and not threshold:  # vLLM V0: 4 % of max_model_len (vllm/config.py)
        threshold = int(max_model_len * 0.04)
    slots = draft_slots_per_request(exp)
    slot_budget = pick("draft_slot_budget")
    if slots and slot_budget == "reserved" and mbt - slots * max_num_seqs <= 0:
        raise ValueError(f"engine.max_num_batched_tokens ({mbt}) leaves no budget after the draft model's slot for "
                         f"each of max_num_seqs ({max_num_seqs}) requests (draft_slot_budget reserved; vLLM "
                         "VllmConfig._set_max_num_scheduled_tokens refuses it)")
    sched = SchedulerConfig(
        max_num_batched_tokens=mbt, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold,
        threshold_only_when_contended=ver["threshold_only_when_contended"],
        scheduler_reserve_full_isl=pick("scheduler_reserve_full_isl"),
        watermark=e.watermark, queue_policy=exp.policy.queue,
        preemption_mode=exp.policy.preemption.mode, preemption_victim=exp.policy.preemption.victim,
        preemption_requeue=exp.policy.preemption.requeue,
        num_lookahead_tokens=spec_setup.num_lookahead_tokens(exp),
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        pad_new_one_token_requests=spec is not None and e.vllm_version == "0.33",
        skip_blocked_waiting=e.skip_blocked_waiting, priority_preemption=pick("priority_preemption"),
        draft_slots_per_request=slots, draft_slot_budget=slot_budget,
        max_num_partial_prefills=e.max_num_partial_prefills, max_long_partial_prefills=e.max_long_partial_prefills)
    cost = build_cost_model(exp, model, hw)
    if drafter is not None and e.vllm_version == "0.6":  # V0 scores drafts by batch expansion
        cost = BatchExpansionCostModel(cost)
    sizes: tuple[int, ...] = ()
    if e.cudagraph:
        sizes = tuple(sorted(e.cudagraph_capture_sizes)) if e.cudagraph_capture_sizes else default_capture_sizes(max_num_seqs)
    # SGLang's overlap scheduler is on by default whatever the vLLM era (--disable-overlap-schedule turns it off)
    async_ = _async_scheduling(exp, True if sglang and e.async_scheduling is None else pick("async_scheduling"))
    if drafter is not None:
        if spec.method != "ngram" and sizes:  # vLLM rounds the capture sizes to multiples of 1 + k
            sizes = spec_setup.spec_capture_sizes(sizes, spec.num_speculative_tokens, max_num_seqs, mbt,
                                                  user_sizes=bool(e.cudagraph_capture_sizes))
        cost = spec_setup.speculative_cost_model(exp, cost, drafter, hw,
                                                 lambda arch, tp: build_cost_model(exp, arch, hw, tp, drafter=True),
                                                 sizes, model, async_)
    c = e.cpu_overhead
    h = exp.hardware
    stages = tuple(Parallelism(pp=h.pipeline_parallel_size).stage_layers(model.num_layers)) \
        if h.pipeline_parallel_size > 1 else ()
    options = EngineOptions(async_scheduling=async_, cpu_base_s=c.base_s,
                            cpu_per_seq_s=c.per_seq_s, cpu_per_token_s=c.per_token_s,
                            cpu_per_new_request_s=c.per_new_request_s, cudagraph_sizes=sizes,
                            stage_layers=stages)
    return Deployment(model, hw, sched, blocks, capacity, cost, options, ver["prepend_unhashed"], derived, drafter,
                      layout, block_size, prefix_caching)


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


def _async_scheduling(exp: Experiment, default: bool) -> bool:
    """Async scheduling, unless n-gram drafting or the serial proposer rules it out (vLLM turns it off for spec
    methods its async path does not support, n-gram among them, and with ``disable_padded_drafter_batch``:
    vllm/config/vllm.py; shared/specs/vllm-v1-scheduling.md §6; asking for both is refused by
    lab/experiment/support.py). Lock-stepped DP ranks schedule asynchronously too: each rank's engine core runs
    ``step_with_batch_queue`` in vLLM's DP loop (vllm/v1/engine/core.py ``DPEngineCoreProc.run_busy_loop``), and
    with async scheduling vLLM syncs the ranks' token counts over the CPU (``disable_nccl_for_dp_synchronization``;
    lab/cluster/lockstep.py)."""
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


def check_model_limits(exp: Experiment, model: ModelArch) -> None:
    """Refuse what vLLM or the model would refuse: a TP size that does not divide the attention heads (or the KV
    heads, which are split or else replicated: TP must then be a multiple of them), a ``max_model_len`` beyond the
    model's positions, and weights that exceed the GPUs' memory even when ``num_gpu_blocks`` is given.

    Raises:
        ValueError: naming the field and the model.
    """
    tp = exp.hardware.tensor_parallel_size
    if model.num_heads % tp:
        raise ValueError(f"hardware.tensor_parallel_size ({tp}) must divide {model.name}'s {model.num_heads} "
                         "attention heads (vLLM requires it)")
    kv = model.num_kv_heads
    if not model.is_mla and (kv % tp if kv >= tp else tp % kv):
        raise ValueError(f"hardware.tensor_parallel_size ({tp}) and {model.name}'s {kv} KV heads: TP must divide "
                         "them, or be a multiple of them (KV heads replicated), as vLLM requires")
    mml = exp.engine.max_model_len
    if mml is not None and mml > model.max_position_embeddings:
        raise ValueError(f"engine.max_model_len ({mml}) exceeds {model.name}'s max_position_embeddings "
                         f"({model.max_position_embeddings}); vLLM refuses it")
    hw = load_hardware(exp.hardware.gpu)
    h = exp.hardware
    weights = model.weight_bytes_per_rank(exp.model.dtype, tp, h.pipeline_parallel_size, h.expert_parallel_size,
                                          h.data_parallel_size)
    if weights > hw.memory_bytes:
        raise ValueError(f"{model.name} does not fit: {weights / 1e9:.1f} GB of weights per GPU on {hw.name} "
                         f"({hw.memory_bytes / 1e9:.1f} GB); raise hardware.tensor_parallel_size or "
                         "pipeline_parallel_size")


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


def build_cost_model(exp: Experiment, model: ModelArch, hw: Hardware, tp: int | None = None,
                     drafter: bool = False) -> CostModel:
    """The experiment's cost model for ``model`` on ``tp`` GPUs (default: the experiment's TP). With ``drafter``
    it prices a speculative drafter: no pipeline split, and a draft model of another architecture than the
    profiled one falls back to the roofline under ``llmservingsim_profile``."""
    c = exp.cost_model
    tp = tp or exp.hardware.tensor_parallel_size
    h = exp.hardware
    if model.is_hybrid and c.kind != "roofline":
        raise ValueError(f"cost_model.kind {c.kind}: {model.name} is a hybrid model, whose sliding-window, chunked, "
                         "linear-attention and Mamba layers are priced by the roofline only "
                         "(lab/costmodel/hybrid_cost.py); use cost_model.kind roofline")
    for name in ("attention_backend", "moe_backend"):
        if getattr(exp.engine, name) is not None and c.kind != "operator":
            raise ValueError(f"engine.{name}: kernel back-ends are priced by cost_model.kind operator only "
                             f"(this experiment uses {c.kind})")
    # the profiled cost models are imported only by the runs that use them (their tables need pandas: start-up)
    if c.kind == "operator":
        from lab.costmodel.operator import build_operator_cost_model  # noqa: PLC0415

        if drafter:
            ep = h.expert_parallel_size if model.is_moe else 1
            dp = h.data_parallel_size if model.is_moe else 1
            return build_operator_cost_model(exp, model, hw, Parallelism(tp, 1, ep, dp))
        return build_operator_cost_model(exp, model, hw)
    profiled = not drafter or exp.speculative is None or exp.speculative.method != "draft_model"
    if c.kind == "llmservingsim_profile" and profiled:
        from lab.costmodel.llmservingsim import LLMServingSimProfileCostModel  # noqa: PLC0415

        return LLMServingSimProfileCostModel(exp.path(c.profile_dir, "cost_model.profile_dir"), model, tp=tp,  # type: ignore[arg-type]
                                             link=comm_link(exp, hw, tp), use_skew=c.use_skew)
    over = {k: v for k, v in c.efficiency.model_dump().items() if v is not None}
    eff = Efficiency(**over)
    kv_dtype = resolve_kv_dtype(exp.model.dtype, exp.model.kv_cache_dtype)
    if model.is_hybrid:
        from lab.costmodel.hybrid_cost import HybridRooflineCostModel  # noqa: PLC0415

        return HybridRooflineCostModel(model, hw, tp=tp, weight_dtype=exp.model.dtype, kv_dtype=kv_dtype,
                                       efficiency=eff, link=comm_link(exp, hw, tp))
    return RooflineCostModel(model, hw, tp=tp, weight_dtype=exp.model.dtype, kv_dtype=kv_dtype, efficiency=eff,
                             link=comm_link(exp, hw, tp))


def simulate(exp: Experiment, requests: list[Request] | None = None,
             progress: Callable[[int, int], None] | None = None, record_breakdown: bool = False) -> SimResult:
    """Run the experiment and return every request and step.

    Fast-forward jumps (lab/engine/jump/) are sized by each instance's ``arrival_hint``. It is the exact
    time of the instance's next arrival for an open-loop workload with one entry instance, or behind a router that
    declares ``routes_by_arrival_order`` (round robin) when the front end delays no request: the stream is then
    routed before the run (:func:`route_open_loop`), for the instances of entry pools without a hand-off. Otherwise
    (closed-loop clients and sessions, routers that read load, pools with a hand-off or fed by one) it is an
    estimate. Results do not depend on it.

    Args:
        exp: the validated experiment.
        requests: use these instead of building the workload (tests).
        progress: called as ``progress(done, total)`` when requests finish or are rejected.
        record_breakdown: keep each step's cost breakdown (``servelab validate``).

    Raises:
        ConfigError: features that do not compose (lab/experiment/support.py), before anything is built.
        ValueError: a model that does not fit, a bad profile folder, an unknown catalog name.
        lab.core.sched_api.SchedulerContractError: a scheduler broke the contract during the run.
        lab.core.sched_api.EngineStall: the run ran out of events with requests neither finished nor rejected.
    """
    t0 = time.perf_counter()
    check_composition(exp, own_requests=requests is not None)
    pd = exp.deployment.mode == "disaggregated"
    pools = [(cfg, sub, _build_pool_deployment(cfg, i, sub, pd)) for i, (cfg, sub) in enumerate(pool_experiments(exp))]
    reqs = requests if requests is not None else build_requests(exp)
    horizon = exp.simulation.horizon_s
    if horizon is not None and reqs and horizon < min(r.arrival_time for r in reqs):
        raise ValueError(f"simulation.horizon_s ({horizon}) is before the first arrival "
                         f"({min(r.arrival_time for r in reqs):.6g} s): nothing would run")
    spec_setup.assign_request_rates(exp, reqs)
    env = simpy.Environment()
    itl = WeightedSamples()
    total = len(reqs)
    done = [0]

    clients: list[ClosedLoopClients] = []

    def on_done(r: Request) -> None:
        done[0] += 1
        if clients:
            clients[0].completed(r)
        if progress is not None:
            progress(done[0], total)

    big = len(reqs) > 200_000
    sim = exp.simulation
    summary_steps = exp.output.step_log == "summary"
    run = _RunSettings(
        record_events=sim.record_events if sim.record_events is not None else not big,
        spill_folder=SpillFolder() if sim.step_log != "memory" and not summary_steps else None,
        record_breakdown=record_breakdown, horizon=sim.horizon_s, summary_steps=summary_steps,
        rows_per_log=rows_per_log(sum(sub.cluster.num_instances for _, sub, _ in pools)))
    # the spill folder goes with SimResult.cleanup(), when the run fails, else at the latest when the process exits
    spill = weakref.finalize(env, run.spill_folder.remove) if run.spill_folder is not None else None
    instances: list[Instance] = []
    built: list[Pool] = []
    groups: list[LockStepGroup] = []
    for cfg, sub, dep in pools:
        name = cfg.name if cfg is not None else ""
        members = _build_instances(env, sub, dep, run, itl, on_done, len(instances), name)
        if lock_step(sub):
            dp = sub.hardware.data_parallel_size
            groups += [LockStepGroup(env, members[i:i + dp]) for i in range(0, len(members), dp)]
        instances += members
        router = make_router(sub.cluster.router, sub.base_dir, sub.cluster.router_options, sub.seed)
        rule = cfg.hand_off if cfg is not None else None
        hand_off = None
        if rule is not None:
            transfer, bandwidth = _kv_transfer(exp, sub, dep, pools, rule.to)
            hand_off = HandOff(rule.to, rule.after_output_tokens, rule.delay_s, transfer, bandwidth)
        built.append(Pool(name, members, router, hand_off))
        if hand_off is not None:
            for inst in members:  # a hand-off enters another pool at its own instant: a jump ends right after it
                inst.jump.ends_at_hand_offs()
    cluster = Cluster(env, built, _RouterView)
    for inst in instances:
        inst.jump.expects_arrivals(inst.jump.expected_next_arrival)

    # one pool of one instance: arrivals go straight to it (no router, no hand-off)
    arrive = instances[0].add_request if len(built) == 1 and len(instances) == 1 else cluster.arrive
    frontend = frontend_cost(exp)
    concurrency = closed_loop_concurrency(exp)
    w = exp.workload
    open_loop = w.source != "sessions" and concurrency is None
    if not frontend.is_zero and not open_loop:  # the API server: requests reach the engines after it
        arrive = FrontEnd(env, frontend, arrive).submit

    if w.source == "sessions":
        sessions, starts = _group_sessions(reqs)
        clients.append(SessionClients(env, sessions, starts, arrive, w.think_time_s))
    elif concurrency is not None:
        if w.num_warmup and reqs:  # extra copies of the first request, as vllm bench serve --num-warmups sends
            reqs = warmup_copies(reqs[0], w.num_warmup, len(reqs)) + reqs
        clients.append(ClosedLoopClients(env, reqs, concurrency, arrive, w.think_time_s, w.num_warmup, itl.clear))
    if clients:
        for inst in instances:
            inst.jump.ends_at_completions()
            if len(instances) > 1:
                # a completion on one instance sends a request to another at that instant: hypothesis found a jump
                # on the receiving side that is not exact (swap + async), so these runs go step by step
                inst.jump.disable()
        env.process(clients[0].run())
    else:
        # an open-loop stream passes the front end before the run: the engines see it at its queue entries
        stream = shift_to_engine(list(reqs), frontend) if not frontend.is_zero else reqs
        routed = route_open_loop(cluster, stream, FrontEndCost())
        env.process(_open_loop_arrivals(env, stream, arrive, routed, cluster, True))
    try:
        _run_env(env, run.horizon)
    except BaseException:
        if spill is not None:
            spill()
        raise
    if clients and isinstance(clients[0], SessionClients):
        clients[0].mark_unsent()
    _mark_unfinished(reqs, run.horizon, float(env.now))
    return SimResult(exp, pools[0][2], reqs, instances, itl, float(env.now), time.perf_counter() - t0,
                     pools=[(cfg.name if cfg is not None else "", dep) for cfg, _, dep in pools], groups=groups,
                     cluster=cluster, spill_folder=run.spill_folder)


def route_open_loop(cluster: Cluster, reqs: list[Request], frontend: FrontEndCost) -> list[int] | None:
    """Route an open-loop arrival stream before the run where that gives the same choices as routing at each
    arrival (lab/cluster/cluster.py ``Cluster.route_ahead``): one entry instance, or an entry router that declares
    ``routes_by_arrival_order`` (round robin) — the latter only when the front end delays no request
    (``frontend.request_s`` and ``per_prompt_token_s`` zero), since per-request delays may reorder the stream.

    Returns:
        per request (list order), the index in ``cluster.entry_instances`` of its instance, or None (the requests
        are routed at their arrivals).

    Raises:
        lab.cluster.cluster.RouterError: the router returned no valid index, or read instance state.
    """
    delays = frontend.request_s or frontend.per_prompt_token_s
    if delays and len(cluster.entry_instances) > 1:
        return None
    return cluster.route_ahead(reqs)


def next_arrival_times(reqs: list[Request], routed: list[int], num_instances: int) -> tuple[list[float], list[float]]:
    """Exact next-arrival times per instance of a routed stream.

    Args:
        reqs: the requests in arrival order; ``arrival_time`` in seconds.
        routed: per request, its instance index (0 .. num_instances - 1).
        num_instances: the number of instances routed to.

    Returns:
        (first, following): per instance, the arrival time of its first request (inf if none); per request, the
        arrival time of the next request routed to the same instance (inf if none). Seconds.
    """
    inf = float("inf")
    first = [inf] * num_instances
    following = [inf] * len(reqs)
    for j in range(len(reqs) - 1, -1, -1):
        k = routed[j]
        following[j] = first[k]
        first[k] = reqs[j].arrival_time
    return first, following


def _open_loop_arrivals(env: simpy.Environment, reqs: list[Request], arrive: Callable[[Request], None],
                        routed: list[int] | None, cluster: Cluster, direct: bool = False):
    """The open-loop arrival process (a generator of SimPy events for ``env.process``): each request is handed to
    ``arrive`` at its ``arrival_time``, in list order.

    With ``routed`` (:func:`route_open_loop`) the ``arrival_hint`` of every entry instance of a pool without a
    hand-off becomes, now, the exact time of its own next arrival, so its fast-forward jumps end where that request
    arrives and arrivals routed elsewhere never cut them; the other hints stay the instances' estimates
    (``JumpContext.expected_next_arrival``). Either way results are the same: the hint only sizes jumps. (A pool
    with a hand-off keeps the estimate: a request that leaves in the middle of a jump is handed on when the jump
    is applied, so longer jumps there would change when it arrives in the next pool.)

    With ``direct`` (no front end between the stream and the engines, so each request reaches its instance at
    exactly its ``arrival_time``) those instances also get the requests they will receive
    (``Instance.jump.known_arrivals``): a jump may then plan their admissions (lab/engine/jump/)."""
    if routed is None:
        return _deliver_at_arrival_times(env, reqs, arrive, None, None, None)
    entry = cluster.entry_instances
    nxt, following = next_arrival_times(reqs, routed, len(entry))
    per_instance: list[list[Request]] = [[] for _ in entry]
    if direct:
        for r, k in zip(reqs, routed):
            per_instance[k].append(r)
    for k, inst in enumerate(entry):
        if cluster.pools[inst.pool].hand_off is None:
            inst.jump.expects_arrivals(lambda k=k: nxt[k], KnownArrivals(per_instance[k]) if direct else None)
    return _deliver_at_arrival_times(env, reqs, arrive, routed, nxt, following)


def _deliver_at_arrival_times(env: simpy.Environment, reqs: list[Request], arrive: Callable[[Request], None],
                              routed: list[int] | None, nxt: list[float] | None, following: list[float] | None):
    """Hand each request to ``arrive`` at its ``arrival_time``; with ``routed``, first move its instance's next
    arrival time (``nxt``) on to the one after it (``following``). Yields SimPy events."""
    for j, r in enumerate(reqs):
        dt = r.arrival_time - env.now
        if dt > 0:
            yield env.timeout(dt)
        if routed is not None:
            nxt[routed[j]] = following[j]  # type: ignore[index]
        arrive(r)


def _kv_transfer(exp: Experiment, sub: Experiment, dep: Deployment, pools: list, target: str):
    """(TransferCost, ingress bandwidth in B/s of each target instance) of a disaggregated deployment's hand-off,
    or (None, 0) for a plain hand-off between pools.

    Bytes per token are the whole model's KV in P's layout (lab/costmodel/model_arch.py ``kv_bytes_per_token`` at
    TP 1), plus the drafter's layers when ``transfer_drafter_kv`` and the drafter shares the target's blocks
    (EAGLE, EAGLE-3, MTP). The link: the per-GPU bandwidth of ``transfer.link`` times min(P's TP, D's TP)."""
    if exp.deployment.mode != "disaggregated":
        return None, 0.0
    t = exp.deployment.transfer
    kv_dtype = resolve_kv_dtype(sub.model.dtype, sub.model.kv_cache_dtype)
    model = dep.model
    per_token = model.kv_bytes_per_token(kv_dtype, 1)
    drafter = 0
    spec = exp.speculative
    if spec is not None and t.transfer_drafter_kv and spec.method in ("eagle", "eagle3", "mtp"):
        layers = model.num_mtp_layers if spec.method == "mtp" else 1
        drafter = layers * model.kv_bytes_per_token_per_layer(kv_dtype, 1)
    d_sub, d_dep = next((s_, d_) for c, s_, d_ in pools if c is not None and c.name == target)
    hw = dep.hardware
    per_gpu = t.bandwidth_gbps * 1e9 if t.bandwidth_gbps else {
        "nvlink": hw.link_bandwidth, "pcie": hw.pcie_bandwidth, "rdma": RDMA_NIC_BYTES_PER_S}[t.link]
    links = min(sub.hardware.tensor_parallel_size, d_sub.hardware.tensor_parallel_size)
    bytes_for = None
    if dep.kv_layout is not None and dep.kv_layout.is_hybrid:  # the hybrid manager sends each group's own blocks
        groups = HybridKV(dep.kv_layout.runtime_spec(dep.scheduler_config.max_num_batched_tokens))
        layer_bytes = model.kv_bytes_per_token_per_layer(kv_dtype, 1)
        state = max(model.state_bytes_per_layer(k, 1, sub.model.dtype) for k in ("linear_attention", "mamba")
                    if model.count_layers(k)) if model.count_layers("linear_attention", "mamba") else 0
        bytes_for = lambda n: groups.bytes_to_send(n, layer_bytes, state)  # noqa: E731
    cost = TransferCost(per_token + drafter, drafter, dep.block_size, t.handshake_ms * 1e-3,
                        t.per_block_us * 1e-6, t.latency_us * 1e-6, t.kv_lease_s, bytes_for, t.first_token)
    return cost, per_gpu * links


# One 400 Gb/s RDMA NIC per GPU (ConnectX-7, as in DGX H100/H200 nodes): 50 GB/s per direction.
RDMA_NIC_BYTES_PER_S = 50e9


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


def _build_pool_deployment(cfg, index: int, exp: Experiment, kv_connector: bool = False) -> Deployment:
    """build_deployment for one pool; an error names the pool."""
    try:
        return build_deployment(exp, kv_connector)
    except ValueError as e:
        if cfg is None:
            raise
        raise ValueError(f"pools[{index}] {cfg.name}: {e}") from None


@dataclass(frozen=True)
class _RunSettings:
    record_events: bool
    spill_folder: SpillFolder | None
    record_breakdown: bool
    horizon: float | None
    summary_steps: bool = False  # output.step_log: summary (no per-step rows, only totals)
    rows_per_log: int = ROW_BUDGET  # rows a spilling log holds (step_log.rows_per_log of the run's instance count)


def _build_instances(env: simpy.Environment, exp: Experiment, dep: Deployment, run: _RunSettings,
                     itl: WeightedSamples, on_done: Callable[[Request], None], first_id: int,
                     pool: str) -> list[Instance]:
    """The instances of one pool, numbered from ``first_id``."""
    e = exp.engine
    options = dep.engine_options
    if run.record_breakdown or not exp.simulation.fast_forward:
        options = replace(options, record_breakdown=run.record_breakdown, fast_forward=exp.simulation.fast_forward)
    own_loop = not lock_step(exp)
    out = []
    hybrid = dep.kv_layout is not None and dep.kv_layout.is_hybrid
    for i in range(first_id, first_id + exp.cluster.num_instances):
        kv = KVCacheManager(dep.num_gpu_blocks, dep.block_size, dep.scheduler_config.max_model_len,
                            enable_prefix_caching=dep.enable_prefix_caching,
                            prepend_unhashed=dep.prepend_unhashed,
                            drop_last_hit_block=spec_setup.drops_last_hit_block(exp),
                            hybrid=HybridKV(dep.kv_layout.runtime_spec(dep.scheduler_config.max_num_batched_tokens),
                                            spec_setup.drops_last_hit_block(exp)) if hybrid else None)
        scheduler = make_scheduler(scheduler_name(exp), exp.base_dir, exp.policy.options, exp.seed)
        inst = Instance(env, i, dep.scheduler_config, scheduler, kv, dep.cost_model, itl, on_done,
                        record_events=run.record_events, options=options, pool=pool, start=own_loop,
                        acceptance=spec_setup.make_speculator(exp, dep.model))
        if exp.policy.preemption.mode == "swap":  # KV bytes cross the host link both ways
            kv_dtype = resolve_kv_dtype(exp.model.dtype, exp.model.kv_cache_dtype)
            inst.configure_swap(dep.model.kv_bytes_per_token(kv_dtype, exp.hardware.tensor_parallel_size),
                                dep.hardware.pcie_bandwidth, exp.policy.preemption.swap_space_gb * 2**30)
        if e.kv_offloading_size:  # a CPU tier of the KV cache (vLLM --kv-offloading-size)
            inst.configure_kv_offload(make_kv_offloader(exp, dep))
        if run.summary_steps:
            inst.steps = StepLog(i, dep.num_gpu_blocks - 1, num_slots=inst.steps.num_slots, summary=True)
        elif run.spill_folder is not None:  # each holds at most run.rows_per_log rows; older ones go to its file
            inst.steps = StepLog(i, dep.num_gpu_blocks - 1, None, run.rows_per_log, num_slots=inst.steps.num_slots,
                                 spill_folder=run.spill_folder)
        inst.jump.stops_at(run.horizon if run.horizon else float("inf"))
        if hybrid:  # the fast-forward plans full-attention block needs only: hybrids go step by step
            inst.jump.disable()
        out.append(inst)
    return out


def make_kv_offloader(exp: Experiment, dep: Deployment) -> KVOffloader:
    """The CPU tier of one instance for ``engine.kv_offloading_size`` GiB (lab/core/kv_offload.py): capacity from
    the GPU cache's bytes per block on one rank (lab/costmodel/kv_capacity.py ``bytes_per_block``, drafter layers
    included) times the TP x PP ranks, the catalog's host link (``pcie_gbps``, ``pcie_latency_us``) per GPU. What
    the tier composes with (swap preemption, disaggregation, schedulers) is decided by lab/experiment/support.py.

    Raises:
        ValueError: naming ``engine.kv_offloading_size``, a size smaller than one block.
    """
    e = exp.engine
    field = f"engine.kv_offloading_size ({e.kv_offloading_size} GiB)"
    h = exp.hardware
    world = h.tensor_parallel_size * h.pipeline_parallel_size
    cap = dep.derived_kv_capacity or dep.kv_capacity
    if cap is not None:
        bpb = cap.bytes_per_block
    else:
        kv_dtype = resolve_kv_dtype(exp.model.dtype, exp.model.kv_cache_dtype)
        drafter = dep.drafter.kv_bytes_per_token if dep.drafter is not None else 0
        bpb = bytes_per_block(dep.model, e.block_size, kv_dtype, h.tensor_parallel_size,
                              pp=h.pipeline_parallel_size, extra_bytes_per_token=drafter)
    blocks = cpu_tier_blocks(e.kv_offloading_size, bpb, world)
    if blocks < 1:
        raise ValueError(f"{field}: holds no KV block ({bpb * world:,} bytes per block over {world} GPU(s))")
    return KVOffloader(blocks, e.block_size, bpb, world, dep.hardware.pcie_bandwidth, dep.hardware.pcie_latency_s,
                       max_concurrent_loads=dep.scheduler_config.max_num_seqs,
                       dedupe_loads=e.prefix_caching())


def _run_env(env: simpy.Environment, horizon: float | None) -> None:
    # The run allocates many small objects and holds a large, stable set (requests, KV blocks): move what exists
    # now out of the cyclic collector's way and collect rarely, or collection time grows with the run (100,000
    # requests on 16 instances: 2 collections instead of 13 with a threshold of 50,000, ~10 % faster in paired runs,
    # the same peak memory). A run's own objects form cycles (its SimPy processes): a process that runs many should
    # collect between runs, as sweeps do (lab/report/sweep.py _collect_cycles).
    gc.freeze()
    try:
        with _collecting_rarely():
            env.run(until=horizon) if horizon else env.run()
    finally:
        gc.unfreeze()


# Young objects allocated (net) between cyclic collections during a run (Python's default is 700).
_GC_THRESHOLD = 1_000_000


@contextmanager
def _collecting_rarely():
    """Run the block with the cyclic collector run every ``_GC_THRESHOLD`` net new objects (and its older
    generations every 100 of those), then restore the thresholds. Building requests allocates millions of objects
    that all live on: at Python's default every collection re-traverses the ones built so far (1,000,000 synthetic
    requests: 6.0 s to build, 1.7 s so). On exit every object still young (the block's survivors among them) goes
    to the oldest generation unscanned (``gc.freeze`` then ``gc.unfreeze``, which also releases any earlier freeze):
    restoring the default thresholds would otherwise make the next allocation scan all of them at once as young
    objects (Azure conversation trace, 19,366 requests: 60 ms at the end of the
    run, a gen-0 collection), though they are the run's long-lived state. A cycle among them is freed by the next
    full collection (sweeps make one after each run: lab/report/sweep.py)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(_GC_THRESHOLD, 100, 100)
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def _mark_unfinished(reqs: list[Request], horizon: float | None, end: float) -> None:
    """Give every request that neither finished nor was rejected its reason: it runs, waits or arrives after the
    horizon.

    Raises:
        EngineStall: the run ran out of events (no horizon, or before it, at ``end`` seconds) with such requests
            left: they would wait for ever, which is an engine or policy defect, not a result.
    """
    stuck = [r for r in reqs if r.status not in (RequestStatus.FINISHED, RequestStatus.REJECTED) and not r.reason]
    if stuck and (horizon is None or end < horizon):
        where = "; ".join(f"request {r.request_id} {r.status.name.lower()} on instance {r.instance_id}"
                          for r in stuck[:3])
        raise EngineStall(f"the run ran out of events at t = {end:.6f} s with {len(stuck)} request(s) neither "
                          f"finished nor rejected ({where}{'; ...' if len(stuck) > 3 else ''}): a mechanism waits "
                          "for an event that never comes")
    for r in stuck:
        if r.status == RequestStatus.RUNNING:
            r.reason = "still running at the horizon"
        elif horizon and r.arrival_time >= horizon:
            r.reason = "arrives after the horizon"
        else:
            r.reason = "still waiting at the horizon"
