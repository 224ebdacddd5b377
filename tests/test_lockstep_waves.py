"""DP prefill waves: in a lock-step group (lab/cluster/lockstep.py) a prefill on one rank stretches the step every
other rank decodes in, so their inter-token gap becomes the prefill's step time. vLLM runs the DP ranks of an MoE
model in lock-step (vllm/v1/engine/core.py ``DPEngineCoreProc``: an idle rank runs ``execute_dummy_batch``; the
ranks' forward passes meet in the MoE collectives), so the group steps at its slowest rank's pace; a dense model's DP
ranks run as independent engines (``data_parallel_lock_step: false`` here). The effect is built in: no plug-in."""

import pytest
import simpy

from lab.cluster.lockstep import LockStepGroup
from lab.core.batch import BatchShape
from lab.core.kv_cache import KVCacheManager
from lab.core.samples import WeightedSamples
from lab.core.sched_api import SchedulerConfig
from lab.costmodel.base import CostModelBase
from lab.engine.instance import EngineOptions, Instance
from lab.experiment.config import parse_experiment
from lab.experiment.simulation import simulate
from policies.vllm_v1 import VLLMV1Scheduler
from tests.conftest import req

BASE_S, PER_TOKEN_S = 0.001, 1e-5  # a step: 1 ms plus 10 µs per token
LONG = 2000  # the prefill that makes the wave: one 2,000-token step of 21 ms


class TokenCost(CostModelBase):
    """A step lasts ``BASE_S + PER_TOKEN_S`` x its tokens (a dummy batch: one token)."""

    name = "per-token"

    def step_time(self, shape: BatchShape) -> float:
        return BASE_S + PER_TOKEN_S * shape.num_tokens


def _gaps(lock_step: bool) -> tuple[list[float], list[float]]:
    """Rank 1 decodes a 40-token reply from t = 0; at t = 10 ms rank 0 gets a 2,000-token prompt. Returns each
    rank's inter-token gaps (seconds, as recorded; ITL samples of rank 0 then rank 1)."""
    env = simpy.Environment()
    samples = [WeightedSamples(), WeightedSamples()]
    ranks = []
    for i in range(2):
        config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=4096)
        options = EngineOptions(async_scheduling=False, cpu_base_s=0.0, fast_forward=False)
        ranks.append(Instance(env, i, config, VLLMV1Scheduler(), KVCacheManager(512, 16, 4096), TokenCost(),
                              samples[i], options=options, start=not lock_step))
    if lock_step:
        LockStepGroup(env, ranks)
    ranks[1].add_request(req(0, 8, 40))

    def late_prompt():
        yield env.timeout(0.010)
        ranks[0].add_request(req(1, LONG, 4, t=0.010))

    env.process(late_prompt())
    env.run()
    return [s.expand().tolist() for s in samples]


def test_a_prefill_on_one_rank_stalls_the_other_ranks_decode_in_lock_step():
    _, decode_gaps = _gaps(lock_step=True)
    prefill_step = BASE_S + PER_TOKEN_S * LONG  # 21 ms: rank 0's prefill step, the group's step time
    # rank 1's decode, one token a step (1.01 ms), waits for the group's prefill step once: one 21 ms gap
    assert max(decode_gaps) == pytest.approx(prefill_step)
    assert sorted(decode_gaps)[-2] == pytest.approx(BASE_S + PER_TOKEN_S)
    # after the wave rank 0 decodes too: the group's decode steps carry one token on each rank
    assert decode_gaps.count(pytest.approx(BASE_S + PER_TOKEN_S)) == len(decode_gaps) - 1


def test_independent_ranks_decode_through_the_other_ranks_prefill():
    _, decode_gaps = _gaps(lock_step=False)
    assert max(decode_gaps) == pytest.approx(BASE_S + PER_TOKEN_S)


def _moe_dp2(lock_step: bool) -> dict:
    """Qwen3-30B-A3B, DP2 + EP2 on H100 (operator model, roofline terms): two ranks, one decoding 60 tokens, a
    6,000-token prompt arriving at the other rank while it does (the round-robin router alternates the ranks)."""
    return {"name": "waves", "seed": 0, "model": {"name": "Qwen3-30B-A3B"},
            "hardware": {"gpu": "H100-SXM5-80GB", "data_parallel_size": 2, "expert_parallel_size": 2,
                         "data_parallel_lock_step": lock_step},
            "cluster": {"num_instances": 2, "router": "round_robin"},
            "engine": {"max_num_batched_tokens": 8192, "max_model_len": 8192, "async_scheduling": False},
            "cost_model": {"kind": "operator"}, "frontend": {"request_s": 0, "per_prompt_token_s": 0,
                                                            "per_output_token_s": 0},
            "simulation": {"record_events": False}}


@pytest.mark.parametrize("lock_step", [True, False])
def test_the_wave_from_an_experiment_file(lock_step, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0.0,64,60\n0.05,6000,2\n")
    data = _moe_dp2(lock_step)
    data["workload"] = {"source": "csv", "path": str(trace)}
    res = simulate(parse_experiment(data))
    decoding, prefilling = sorted(res.requests, key=lambda r: r.index)
    assert decoding.instance_id != prefilling.instance_id
    longest_gap = float(res.itl_samples.expand().max())
    alone = _alone_tpot(tmp_path)
    if lock_step:
        # one of the decode's gaps is the other rank's 6,000-token prefill step (about 0.1 s, ten decode steps)
        assert len(res.groups) == 1
        assert longest_gap > 5 * alone
    else:
        assert not res.groups
        assert longest_gap < 1.5 * alone


def _alone_tpot(tmp_path) -> float:
    trace = tmp_path / "alone.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0.0,64,60\n")
    data = _moe_dp2(False)
    data["workload"] = {"source": "csv", "path": str(trace)}
    r, = simulate(parse_experiment(data)).requests
    return (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)
