"""Build what a run is made of from a validated experiment and its resolved settings (lab/experiment/resolve.py):
the :class:`Deployment` (model, GPU, KV capacity, scheduler configuration, cost model, engine options), the cost
model, each pool's instances (KV cache manager, scheduler, swap space, CPU KV tier, step log) and the KV transfer
of a prefill/decode hand-off. lab/experiment/simulation.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import simpy

from lab.cluster.transfer import TransferCost
from lab.core.kv_cache import KVCacheManager
from lab.core.kv_groups import HybridKV
from lab.core.kv_offload import KVOffloader, cpu_tier_blocks
from lab.core.request import Request
from lab.core.samples import WeightedSamples
from lab.core.sched_api import SchedulerConfig
from lab.core.step_log import ROW_BUDGET, SpillFolder, StepLog
from lab.costmodel.base import CostModel
from lab.costmodel.batch_expansion import BatchExpansionCostModel
from lab.costmodel.hardware import Hardware, load_hardware
from lab.costmodel.hybrid_kv import KVLayout
from lab.costmodel.kv_capacity import KVCapacity, bytes_per_block, derive_num_gpu_blocks
from lab.costmodel.model_arch import ModelArch, load_model, resolve_kv_dtype
from lab.costmodel.parallel import Parallelism
from lab.costmodel.roofline import Efficiency, RooflineCostModel
from lab.costmodel.speculative import Drafter
from lab.engine.instance import EngineOptions, Instance
from lab.experiment import speculative as spec_setup
from lab.experiment.resolve import (VERSION_DEFAULTS, BatchLimits, async_scheduling, batch_limits, capture_sizes,
                                    comm_link, engine_setting, hybrid_kv_layout, lock_step, max_running_requests,
                                    scheduler_config)
from lab.experiment.schema import Experiment, scheduler_name
from policies import make_scheduler


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
    check_model_limits(exp, model)
    e = exp.engine
    kv_dtype = resolve_kv_dtype(m.dtype, m.kv_cache_dtype)
    drafter = spec_setup.make_experiment_drafter(exp, model) if exp.speculative is not None else None
    limits = batch_limits(exp, model, hw)
    layout, prefix_caching = hybrid_kv_layout(exp, model, kv_dtype, limits.max_model_len,
                                              kv_connector or exp.deployment.mode == "disaggregated")
    block_size = layout.block_size if layout is not None else e.block_size
    derived = _derived_kv_capacity(exp, model, hw, limits, kv_dtype, drafter, layout)
    if e.num_gpu_blocks is not None:
        blocks, capacity = e.num_gpu_blocks, None
    else:
        blocks, capacity = derived.num_gpu_blocks, derived  # type: ignore[union-attr]
    max_num_seqs = max_running_requests(exp, limits, blocks, block_size)
    sched = scheduler_config(exp, limits, max_num_seqs)
    sizes = capture_sizes(e, max_num_seqs)
    async_ = async_scheduling(exp)
    cost, sizes = _step_cost_model(exp, model, hw, drafter, sizes, max_num_seqs, limits.max_num_batched_tokens,
                                   async_)
    c = e.cpu_overhead
    h = exp.hardware
    stages = tuple(Parallelism(pp=h.pipeline_parallel_size).stage_layers(model.num_layers)) \
        if h.pipeline_parallel_size > 1 else ()
    options = EngineOptions(async_scheduling=async_, cpu_base_s=c.base_s,
                            cpu_per_seq_s=c.per_seq_s, cpu_per_token_s=c.per_token_s,
                            cpu_per_new_request_s=c.per_new_request_s, cudagraph_sizes=sizes,
                            stage_layers=stages)
    return Deployment(model, hw, sched, blocks, capacity, cost, options,
                      VERSION_DEFAULTS[e.vllm_version]["prepend_unhashed"], derived, drafter, layout, block_size,
                      prefix_caching)


def _derived_kv_capacity(exp: Experiment, model: ModelArch, hw: Hardware, limits: BatchLimits, kv_dtype: str,
                         drafter: Drafter | None, layout: KVLayout | None) -> KVCapacity | None:
    """The KV capacity vLLM would derive from memory (lab/costmodel/kv_capacity.py), or None when it cannot be
    derived and ``engine.num_gpu_blocks`` is given.

    Raises:
        ValueError: the model does not fit and ``engine.num_gpu_blocks`` is unset.
    """
    e, h, m = exp.engine, exp.hardware, exp.model
    try:
        return derive_num_gpu_blocks(
            model, hw, block_size=e.block_size, gpu_memory_utilization=engine_setting(e, "gpu_memory_utilization"),
            max_num_batched_tokens=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
            tp=h.tensor_parallel_size, kv_dtype=kv_dtype, weight_dtype=m.dtype, pp=h.pipeline_parallel_size,
            ep=h.expert_parallel_size, dp=h.data_parallel_size,
            drafter_kv_bytes_per_token=drafter.kv_bytes_per_token if drafter else 0,
            drafter_weight_bytes=drafter.weight_bytes if drafter else 0,
            include_mtp=drafter is not None and drafter.method == "mtp", layout=layout)
    except ValueError:
        if e.num_gpu_blocks is None:
            raise
        return None


def _step_cost_model(exp: Experiment, model: ModelArch, hw: Hardware, drafter: Drafter | None,
                     sizes: tuple[int, ...], max_num_seqs: int, max_num_batched_tokens: int,
                     async_: bool) -> tuple[CostModel, tuple[int, ...]]:
    """(the cost of one engine step, the capture sizes in force). With a drafter: V0 (0.6) scores drafts by batch
    expansion; a model drafter rounds the capture sizes to multiples of 1 + k, as vLLM does; the drafter's own
    passes join the step (lab/experiment/speculative.py)."""
    cost = build_cost_model(exp, model, hw)
    if drafter is None:
        return cost, sizes
    spec = exp.speculative
    assert spec is not None
    if exp.engine.vllm_version == "0.6":  # V0 scores drafts by batch expansion
        cost = BatchExpansionCostModel(cost)
    if spec.method != "ngram" and sizes:  # vLLM rounds the capture sizes to multiples of 1 + k
        sizes = spec_setup.spec_capture_sizes(sizes, spec.num_speculative_tokens, max_num_seqs,
                                              max_num_batched_tokens,
                                              user_sizes=bool(exp.engine.cudagraph_capture_sizes))
    cost = spec_setup.speculative_cost_model(exp, cost, drafter, hw,
                                             lambda arch, tp: build_cost_model(exp, arch, hw, tp, drafter=True),
                                             sizes, model, async_)
    return cost, sizes


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


def kv_transfer(exp: Experiment, sub: Experiment, dep: Deployment, pools: list, target: str):
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


def build_pool_deployment(cfg, index: int, exp: Experiment, kv_connector: bool = False) -> Deployment:
    """build_deployment for one pool; an error names the pool."""
    try:
        return build_deployment(exp, kv_connector)
    except ValueError as e:
        if cfg is None:
            raise
        raise ValueError(f"pools[{index}] {cfg.name}: {e}") from None


@dataclass(frozen=True)
class RunSettings:
    """How a run records: lifecycle events, the step log (kept in memory, spilled, or totals only), each step's cost
    breakdown, and where it stops."""

    record_events: bool
    spill_folder: SpillFolder | None
    record_breakdown: bool
    horizon: float | None
    summary_steps: bool = False  # output.step_log: summary (no per-step rows, only totals)
    rows_per_log: int = ROW_BUDGET  # rows a spilling log holds (step_log.rows_per_log of the run's instance count)


def build_instances(env: simpy.Environment, exp: Experiment, dep: Deployment, run: RunSettings,
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
