"""Lock-stepped DP ranks with expert parallelism: every rank's EP collectives priced from the group's per-rank
token counts (lab/cluster/lockstep.py, lab/costmodel/operator.py), the idle rank's dummy batch, the group's step
time, and the ``hardware.all2all_backend`` field."""

import pytest
import simpy

from lab.cluster.lockstep import LockStepGroup, dummy_batch, tokens_across_dp
from lab.core.batch import BatchShape
from lab.core.kv_cache import KVCacheManager
from lab.core.samples import WeightedSamples
from lab.core.sched_api import SchedulerConfig
from lab.costmodel import comm
from lab.costmodel.hardware import load_hardware
from lab.costmodel.model_arch import load_model
from lab.costmodel.operator import OperatorCostModel, build_operator_cost_model
from lab.costmodel.parallel import Parallelism
from lab.engine.instance import EngineOptions, Instance
from lab.experiment.config import ConfigError, parse_experiment
from policies.vllm_v1 import VLLMV1Scheduler
from tests.conftest import req

MOE = load_model("Qwen3-30B-A3B")   # 48 MoE layers, hidden 2048, top-8 of 128 experts
H100 = load_hardware("H100-SXM5-80GB")


def _model(backend: str, dp: int = 2) -> OperatorCostModel:
    return OperatorCostModel(MOE, H100, Parallelism(1, 1, dp, dp), all2all_backend=backend)


def _shape(tokens: int, group: tuple[int, ...]) -> BatchShape:
    shape = BatchShape.from_requests([tokens], [0])
    shape.group_tokens = group
    return shape


def test_tokens_across_dp_pad_with_cuda_graphs_and_not_in_eager_mode():
    # CUDA graphs: every rank runs the group's largest count padded to its graph size (vLLM get_dp_padding);
    # above the largest graph, the largest count itself
    assert tokens_across_dp((3, 0, 9), (1, 2, 4, 8, 16)) == (16, 16, 16)
    assert tokens_across_dp((300, 0), (1, 2, 4, 8, 16)) == (300, 300)
    # eager: no DP padding; an idle rank's dummy batch is one token
    assert tokens_across_dp((300, 0, 7), ()) == (300, 1, 7)


@pytest.mark.parametrize("backend", comm.EP_BACKENDS)
def test_every_rank_prices_the_ep_collectives_from_the_group_counts(backend):
    m = _model(backend)
    group = (300, 20)  # eager: uneven counts
    busy, light = _shape(300, group), _shape(20, group)
    a2a = comm.ep_dispatch_combine(m.ep_link, group, MOE.hidden_size, MOE.experts_per_token, 2.0, backend)
    # the collective is the group's: both ranks wait for the same dispatch/combine, 48 MoE layers of it
    assert m.breakdown(busy)["ep_alltoall"] == pytest.approx(48 * a2a)
    assert m.breakdown(light)["ep_alltoall"] == pytest.approx(48 * a2a)
    # without the group (independent ranks) a rank assumes every rank carries its own count
    alone = comm.ep_dispatch_combine(m.ep_link, (20, 20), MOE.hidden_size, MOE.experts_per_token, 2.0, backend)
    assert m.breakdown(BatchShape.from_requests([20], [0]))["ep_alltoall"] == pytest.approx(48 * alone)
    assert alone < a2a


def test_the_routed_experts_see_the_sum_of_the_group():
    m = _model("allgather_reducescatter")
    # 300 + 20 tokens enter the EP group's MoE block: the same expert work as two ranks of 160 each
    uneven = m.breakdown(_shape(20, (300, 20)))["moe_experts"]
    even = m.breakdown(BatchShape.from_requests([160], [0]))["moe_experts"]
    assert uneven == pytest.approx(even)
    assert m.breakdown(BatchShape.from_requests([20], [0]))["moe_experts"] < uneven


def test_a_group_count_per_rank_is_required():
    with pytest.raises(ValueError, match="group_tokens holds 3 ranks' counts; this cost model's DP group has 2"):
        _model("naive").step_time(_shape(20, (300, 20, 5)))


def test_the_dummy_batch_runs_one_token_and_its_full_share_of_the_collectives():
    m = _model("deepep_low_latency")
    group = (300, 1)
    dummy = m.breakdown(dummy_batch(1, group))
    busy = m.breakdown(_shape(300, group))
    # the idle rank joins every dispatch/combine (two low-latency rounds here) and computes its experts' share of
    # the other rank's tokens; its own layers run one token
    assert dummy["ep_alltoall"] == pytest.approx(busy["ep_alltoall"]) and dummy["ep_alltoall"] > 0
    assert dummy["moe_experts"] == pytest.approx(busy["moe_experts"])
    one = m.breakdown(BatchShape.from_requests([1], [0]))
    assert dummy["qkv_proj"] == pytest.approx(one["qkv_proj"]) and one["qkv_proj"] < busy["qkv_proj"]
    assert m.step_time(dummy_batch(1, group)) == pytest.approx(sum(dummy.values()))
    # with CUDA graphs the dummy batch is padded to the group's graph size like every other rank
    assert dummy_batch(16, (16, 16)).dense_tokens == 16 and dummy_batch(1, (1, 1)).padded_tokens == 0


def _ranks(env, cost, sizes=()):
    out = []
    for i in range(2):
        config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096)
        out.append(Instance(env, i, config, VLLMV1Scheduler(), KVCacheManager(256, 16, 4096), cost,
                            WeightedSamples(), options=EngineOptions(fast_forward=False, cudagraph_sizes=sizes),
                            start=False))
    return out


@pytest.mark.parametrize("sizes", [(), (1, 2, 4, 8, 16, 32)])
def test_the_group_step_lasts_as_long_as_its_slowest_rank(sizes):
    env = simpy.Environment()
    cost = _model("deepep_high_throughput")
    r0, r1 = _ranks(env, cost, sizes)
    group = LockStepGroup(env, [r0, r1])
    r0.add_request(req(0, 300, 4))  # rank 0 prefills 300 tokens, rank 1 is idle
    steps = [r0.schedule_step(), r1.schedule_step()]
    assert steps[1] is None
    dt = group._price(steps)
    across = (300, 1) if not sizes else (300, 300)  # 300 is above the largest graph: no graph padding
    assert steps[0].shape.group_tokens == across
    dummy = cost.step_time(dummy_batch(across[1], across))
    assert dt == pytest.approx(max(steps[0].dt, dummy)) and dt == pytest.approx(steps[0].dt) and dummy < dt
    assert steps[0].stage_times == [dt]


def test_ranks_with_different_cuda_graph_sizes_are_refused():
    env = simpy.Environment()
    cost = _model("naive")
    r0, = _ranks(env, cost, (1, 2, 4))[:1]
    r1, = _ranks(env, cost, ())[1:]
    with pytest.raises(ValueError, match="must share one cudagraph_capture_sizes list"):
        LockStepGroup(env, [r0, r1])


def test_all2all_backend_config_field():
    base = {"name": "x", "model": {"name": "Qwen3-30B-A3B"}, "cost_model": {"kind": "operator"},
            "hardware": {"gpu": "H100-SXM5-80GB", "data_parallel_size": 2, "expert_parallel_size": 2},
            "cluster": {"num_instances": 2}}
    exp = parse_experiment(base)
    assert exp.hardware.all2all_backend == "allgather_reducescatter" == comm.DEFAULT_EP_BACKEND  # vLLM's default
    exp = parse_experiment({**base, "hardware": {**base["hardware"], "all2all_backend": "deepep_low_latency"}})
    assert build_operator_cost_model(exp, MOE, H100).all2all_backend == "deepep_low_latency"
    with pytest.raises(ConfigError) as e:
        parse_experiment({**base, "hardware": {**base["hardware"], "all2all_backend": "pplx"}})
    [line] = str(e.value).splitlines()
    assert line.startswith("<experiment>: hardware.all2all_backend:")
    assert all(f"'{b}'" in line for b in comm.EP_BACKENDS) and "'pplx'" in line
    with pytest.raises(ValueError, match="all2all_backend 'deepep': expected one of"):
        OperatorCostModel(MOE, H100, Parallelism(1, 1, 2, 2), all2all_backend="deepep")
