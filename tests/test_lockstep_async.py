"""Lock-stepped DP ranks under async scheduling (lab/cluster/lockstep.py): vLLM's DP engine cores run
step_with_batch_queue, so each rank's CPU work overlaps the group's step in flight instead of adding to it."""

import pytest
import simpy

from lab.cluster.lockstep import LockStepGroup
from lab.core.kv_cache import KVCacheManager
from lab.core.samples import WeightedSamples
from lab.core.sched_api import SchedulerConfig
from lab.engine.instance import EngineOptions, Instance
from policies.vllm_v1 import VLLMV1Scheduler
from tests.conftest import ConstantCost, req

GPU_S, CPU_S, OUT = 0.010, 0.005, 20


def _finish_times(async_scheduling: bool) -> list[float]:
    env = simpy.Environment()
    ranks = []
    for i in range(2):
        config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024)
        options = EngineOptions(async_scheduling=async_scheduling, cpu_base_s=CPU_S, fast_forward=False)
        ranks.append(Instance(env, i, config, VLLMV1Scheduler(), KVCacheManager(64, 16, 1024), ConstantCost(GPU_S),
                              WeightedSamples(), options=options, start=False))
    group = LockStepGroup(env, ranks)
    reqs = [req(0, 8, OUT), req(1, 8, OUT)]
    ranks[0].add_request(reqs[0])
    ranks[1].add_request(reqs[1])
    env.run()
    assert group.depth == (2 if async_scheduling else 1)
    return [r.finish_time for r in reqs]


def test_sync_lock_step_adds_every_steps_cpu_time():
    # one prefill step then OUT - 1 decodes, each GPU + CPU
    assert _finish_times(False) == pytest.approx([OUT * (GPU_S + CPU_S)] * 2)


def test_async_lock_step_hides_cpu_time_shorter_than_the_step_in_flight():
    # the first step waits for its CPU work, every later one overlaps the step before: OUT steps of GPU time,
    # plus the first CPU time
    assert _finish_times(True) == pytest.approx([CPU_S + OUT * GPU_S] * 2)


def test_async_pipeline_lock_step_waits_for_a_gated_decode_instead_of_stalling():
    # composition draws (make composition): under async PP a decode is eligible again only pp scheduler steps after
    # it sampled; with one request and nothing in flight the group must advance the ranks' step counters (vLLM calls
    # schedule() again at once) rather than report a stalled scheduler
    from lab.experiment.config import parse_experiment
    from lab.experiment.simulation import simulate

    exp = parse_experiment({
        "name": "pp-lockstep", "seed": 1,
        "workload": {"source": "synthetic", "num_requests": 3, "rate": 100.0,
                     "prompt_tokens": {"kind": "constant", "value": 117},
                     "output_tokens": {"kind": "constant", "value": 13}},
        "model": {"name": "Qwen3-30B-A3B"},
        "engine": {"max_model_len": 2048, "async_scheduling": True},
        "hardware": {"pipeline_parallel_size": 3, "data_parallel_size": 2, "expert_parallel_size": 2},
        "cluster": {"num_instances": 2}, "cost_model": {"kind": "operator"}})
    res = simulate(exp)
    assert [r.num_output_tokens for r in res.requests] == [13, 13, 13]
