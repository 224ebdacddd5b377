"""Build a deployment from an experiment and run it: arrivals -> instance(s) -> per-request and per-step records."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Callable

import simpy

from lab.config import Experiment
from lab.costmodel.base import CostModel
from lab.costmodel.hardware import Hardware, load_hardware
from lab.costmodel.kv_capacity import KVCapacity, derive_num_gpu_blocks
from lab.costmodel.llmservingsim import LLMServingSimProfileCostModel
from lab.costmodel.model_arch import ModelArch, load_model
from lab.costmodel.roofline import Efficiency, RooflineCostModel
from lab.engine import Instance
from lab.kv_cache import KVCacheManager
from lab.request import Request, RequestStatus
from lab.sched_api import SchedulerConfig
from lab.workload import loaders, synthetic
from policies import make_router, make_scheduler


@dataclass
class Deployment:
    """Everything fixed before the run starts."""

    model: ModelArch
    hardware: Hardware
    scheduler_config: SchedulerConfig
    num_gpu_blocks: int
    kv_capacity: KVCapacity | None
    cost_model: CostModel


@dataclass
class SimResult:
    """What a run produced. ``requests`` keeps every request of the trace, in arrival order."""

    experiment: Experiment
    deployment: Deployment
    requests: list[Request]
    instances: list[Instance]
    itl_samples: array
    sim_end: float
    wall_time_s: float
    info: dict = field(default_factory=dict)


def build_requests(exp: Experiment) -> list[Request]:
    """Load or generate the experiment's workload, apply ``max_requests`` and ``time_scale``.

    Raises:
        lab.workload.loaders.WorkloadError: a bad trace file.
    """
    w = exp.workload
    if w.source == "synthetic":
        reqs = synthetic.generate(
            w.num_requests, w.rate,
            synthetic.LengthDist(**w.prompt_tokens.model_dump()),
            synthetic.LengthDist(**w.output_tokens.model_dump()),
            seed=exp.seed, cv=w.cv, num_priorities=w.num_priorities)
    else:
        path = exp.path(w.path, "workload.path")  # type: ignore[arg-type]
        if w.source == "azure":
            reqs = loaders.load_azure(path)
        elif w.source == "mooncake":
            reqs = loaders.load_mooncake(path, jitter_s=w.jitter_s, seed=exp.seed)
        elif w.source == "llmservingsim":
            reqs = loaders.load_llmservingsim(path)
        else:
            reqs = loaders.load_csv(path)
    if w.arrival_times is not None:
        reqs = loaders.override_arrivals(reqs, exp.path(w.arrival_times.path, "workload.arrival_times.path"),
                                         w.arrival_times.column)
    if w.max_requests is not None:
        reqs = reqs[: w.max_requests]
    if w.time_scale != 1.0:
        for r in reqs:
            r.arrival_time *= w.time_scale
    return reqs


def build_deployment(exp: Experiment) -> Deployment:
    """Resolve model, GPU, KV capacity, scheduler limits and cost model.

    Raises:
        ValueError: unknown model or GPU, a model that does not fit, or a bad profile folder.
    """
    m = exp.model
    model = load_model(m.name, exp.path(m.hf_config, "model.hf_config") if m.hf_config else None)
    hw = load_hardware(exp.hardware.gpu)
    tp = exp.hardware.tensor_parallel_size
    e = exp.engine
    kv_dtype = m.dtype if m.kv_cache_dtype == "auto" else m.kv_cache_dtype
    max_model_len = e.max_model_len or model.max_position_embeddings
    mbt = e.max_num_batched_tokens
    if not e.enable_chunked_prefill and mbt < max_model_len:
        mbt = max_model_len  # vLLM raises the budget to max_model_len when chunking is off
    capacity = None
    if e.num_gpu_blocks is not None:
        blocks = e.num_gpu_blocks
    else:
        capacity = derive_num_gpu_blocks(
            model, hw, block_size=e.block_size, gpu_memory_utilization=e.gpu_memory_utilization,
            max_num_batched_tokens=mbt, max_num_seqs=e.max_num_seqs, tp=tp, kv_dtype=kv_dtype,
            weight_dtype=m.dtype, pp=exp.hardware.pipeline_parallel_size, ep=exp.hardware.expert_parallel_size,
            dp=exp.hardware.data_parallel_size)
        blocks = capacity.num_gpu_blocks
    legacy = e.vllm_version == "legacy"
    sched = SchedulerConfig(
        max_num_batched_tokens=mbt, max_num_seqs=e.max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=e.enable_chunked_prefill, long_prefill_token_threshold=e.long_prefill_token_threshold,
        threshold_only_when_contended=not legacy, scheduler_reserve_full_isl=e.scheduler_reserve_full_isl,
        watermark=e.watermark, queue_policy=exp.policy.queue)
    cost = build_cost_model(exp, model, hw)
    return Deployment(model, hw, sched, blocks, capacity, cost)


def build_cost_model(exp: Experiment, model: ModelArch, hw: Hardware) -> CostModel:
    """The experiment's cost model."""
    c = exp.cost_model
    tp = exp.hardware.tensor_parallel_size
    link = (exp.hardware.link_gbps * 1e9) if exp.hardware.link_gbps else hw.link_bandwidth
    if c.kind == "llmservingsim_profile":
        return LLMServingSimProfileCostModel(exp.path(c.profile_dir, "cost_model.profile_dir"), model, tp=tp,  # type: ignore[arg-type]
                                             link_bandwidth=link, link_latency_s=exp.hardware.link_latency_us * 1e-6,
                                             use_skew=c.use_skew)
    if c.kind == "operator":
        from lab.costmodel.operator import build_operator_cost_model

        return build_operator_cost_model(exp, model, hw)
    over = {k: v for k, v in c.efficiency.model_dump().items() if v is not None}
    eff = Efficiency(**over)
    kv_dtype = exp.model.dtype if exp.model.kv_cache_dtype == "auto" else exp.model.kv_cache_dtype
    return RooflineCostModel(model, hw, tp=tp, weight_dtype=exp.model.dtype, kv_dtype=kv_dtype, efficiency=eff)


def simulate(exp: Experiment, requests: list[Request] | None = None,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Run the experiment and return every request and step.

    Args:
        exp: the validated experiment.
        requests: use these instead of building the workload (tests).
        progress: called as ``progress(done, total)`` when requests finish or are rejected.
    """
    t0 = time.perf_counter()
    dep = build_deployment(exp)
    reqs = requests if requests is not None else build_requests(exp)
    env = simpy.Environment()
    itl = array("d")
    total = len(reqs)
    done = [0]

    def on_done(_r: Request) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    e = exp.engine
    instances = []
    for i in range(exp.cluster.num_instances):
        kv = KVCacheManager(dep.num_gpu_blocks, e.block_size, dep.scheduler_config.max_model_len,
                            enable_prefix_caching=e.enable_prefix_caching,
                            prepend_unhashed=e.vllm_version != "legacy")
        scheduler = make_scheduler(exp.policy.scheduler, exp.base_dir)
        instances.append(Instance(env, i, dep.scheduler_config, scheduler, kv, dep.cost_model, itl, on_done,
                                  record_events=exp.simulation.record_events))
    router = make_router(exp.cluster.router)

    def arrivals():
        single = instances[0] if len(instances) == 1 else None
        for r in reqs:
            dt = r.arrival_time - env.now
            if dt > 0:
                yield env.timeout(dt)
            if single is not None:
                single.add_request(r)
            else:
                instances[router.route(r, instances, env.now)].add_request(r)

    env.process(arrivals())
    horizon = exp.simulation.horizon_s
    env.run(until=horizon) if horizon else env.run()
    for r in reqs:
        if r.status not in (RequestStatus.FINISHED, RequestStatus.REJECTED):
            r.reason = r.reason or ("still running at the horizon" if r.status == RequestStatus.RUNNING
                                    else "still waiting at the horizon")
    return SimResult(exp, dep, reqs, instances, itl, float(env.now), time.perf_counter() - t0)
