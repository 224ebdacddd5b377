"""The engine core on hand-worked timelines: micro-batches in flight under pipeline parallelism, a step that emits
several tokens with a rollback, lock-stepped DP ranks, and a hand-off between pools."""

import pytest
import simpy

from lab.cluster.lockstep import LockStepGroup
from lab.core.batch import BatchShape
from lab.core.kv_cache import KVCacheManager
from lab.core.samples import WeightedSamples
from lab.core.sched_api import SchedulerBase, SchedulerConfig, SchedulerContractError, SchedulerOutput
from lab.costmodel.base import CostModelBase
from lab.engine.instance import EngineOptions, Instance
from lab.engine.window import InFlightWindow, delay_until, max_concurrent_batches
from lab.experiment.config import parse_experiment
from lab.experiment.simulation import simulate
from policies.common import is_running
from policies.vllm_v1 import VLLMV1Scheduler
from tests.conftest import make_engine, req, submit


def pp2(**kw):
    """An instance with two pipeline stages of 0.5 s each (a constant 1 s step split by layers)."""
    return make_engine(options=EngineOptions(fast_forward=False, stage_layers=(1, 1), **kw.pop("opts", {})), **kw)


def step_rows(inst):
    c = inst.steps.cols
    return list(zip(c["start"], c["duration"], c["scheduled_tokens"], c["micro_batch"]))


def test_window_depth_follows_vllm():
    assert [max_concurrent_batches(1, False), max_concurrent_batches(1, True)] == [1, 2]
    assert [max_concurrent_batches(4, False), max_concurrent_batches(4, True)] == [4, 5]


def test_pp2_with_one_request_runs_one_micro_batch_at_a_time():
    # concurrency 1: each step passes both stages (0.5 s + 0.5 s) before the next can be scheduled: the request
    # sees the whole model's time per token, as on one GPU, and each stage idles half the time (bubbles)
    env, inst, _ = pp2()
    a = req(0, 4, 3)
    submit(env, inst, [a])
    env.run()
    assert inst.window.depth == 2
    assert (a.first_token_time, a.finish_time) == (1.0, 3.0)
    assert step_rows(inst) == [(0.0, 1.0, 4, 0), (1.0, 1.0, 1, 1), (2.0, 1.0, 1, 0)]
    assert inst.busy_time == pytest.approx(1.5)  # the busiest stage works 0.5 s of every 1 s


def test_pp2_with_four_requests_overlaps_two_micro_batches():
    # an 8-token budget puts a, b in micro-batch 1 and c, d in micro-batch 2, both submitted at t=0: stage 0 runs
    # them back to back, stage 1 follows half a step later. Afterwards each pair decodes in its own micro-batch
    # (a request whose step is in flight is skipped), so a token leaves the pipeline every 0.5 s
    env, inst, _ = pp2(max_num_batched_tokens=8)
    a, b, c, d = (req(i, 4, 3) for i in range(4))
    submit(env, inst, [a, b, c, d])
    env.run()
    assert [(r.first_token_time, r.finish_time) for r in (a, b, c, d)] == [(1.0, 3.0), (1.0, 3.0), (1.5, 3.5),
                                                                           (1.5, 3.5)]
    assert step_rows(inst) == [(0.0, 1.0, 8, 0), (0.5, 1.0, 8, 1), (1.0, 1.0, 2, 0), (1.5, 1.0, 2, 1),
                               (2.0, 1.0, 2, 0), (2.5, 1.0, 2, 1)]
    # 12 tokens in 3.5 s; one micro-batch at a time would need 6 steps of 1 s
    assert inst.env.now == 3.5


def test_pp2_pipelines_consecutive_prefill_chunks_of_one_request():
    # a 16-token prompt in 8-token chunks: chunk 2 is scheduled while chunk 1 is in flight (C < num_tokens), so
    # it enters stage 0 as soon as chunk 1 leaves it: first token at 1.5 s instead of 2 s
    env, inst, _ = pp2(max_num_batched_tokens=8)
    a = req(0, 16, 2)
    submit(env, inst, [a])
    env.run()
    assert step_rows(inst)[:2] == [(0.0, 1.0, 8, 0), (0.5, 1.0, 8, 1)]
    assert (a.first_token_time, a.finish_time) == (1.5, 2.5)


def test_async_pp2_keeps_pp_plus_one_batches_and_waits_pp_steps_before_a_decode_is_eligible():
    env, inst, _ = pp2(opts={"async_scheduling": True})
    assert inst.window.depth == 3 and inst.pipeline_async
    a = req(0, 4, 4)
    submit(env, inst, [a])
    env.run()
    # the decode scheduled right behind the prefill (placeholder) is eligible again only 2 scheduler steps later
    assert a.num_output_tokens == 4 and a.finish_time is not None
    starts = [row[0] for row in step_rows(inst)]
    assert starts == sorted(starts) and len(starts) == 4


def test_async_pp2_a_decode_never_enters_the_pipeline_before_its_previous_token_leaves_it():
    # four requests in two micro-batches under async PP2: a request's next decode consumes the token its previous
    # micro-batch samples, so every token takes at least the whole pipeline (1 s) after the one before it
    env, inst, _ = pp2(opts={"async_scheduling": True}, max_num_batched_tokens=4, max_num_seqs=2)
    reqs = [req(i, 4, 3) for i in range(4)]
    submit(env, inst, reqs)
    env.run()
    assert all(r.finish_time is not None for r in reqs)
    assert min((r.finish_time - r.first_token_time) / 2 for r in reqs) >= 1.0


class _Drafting(SchedulerBase):
    """vLLM V1, except that request 0, once decoding, is scheduled with 4 draft tokens (1 + 4 query tokens)."""

    supports_async = False

    def __init__(self):
        self.inner = VLLMV1Scheduler()

    def schedule(self, engine):
        decoding = [r for r in engine.running if r.index == 0 and r.num_output_tokens]
        out = SchedulerOutput()
        for r in decoding:
            assert engine.kv.allocate_slots(r, 5)
            out.add(r, 5)
            out.num_spec_tokens[r] = 4
        rest = self.inner.schedule(engine)
        for r, n in zip(rest.requests, rest.num_new_tokens):
            if r not in out.requests:
                out.add(r, n)
        return out


class _AcceptTwo:
    num_speculative_tokens = 4

    def propose(self, request):
        return 0  # _Drafting schedules its own drafts

    def num_accepted(self, request, num_draft_tokens):
        return 2


def test_a_step_emits_three_tokens_for_one_request_and_one_for_another_with_a_rollback_of_two():
    env = simpy.Environment()
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=1024, num_speculative_tokens=4)
    kv = KVCacheManager(64, 4, 1024)
    from tests.conftest import ConstantCost

    cost = ConstantCost(1.0)
    itl = WeightedSamples()
    inst = Instance(env, 0, config, _Drafting(), kv, cost, itl, options=EngineOptions(fast_forward=False),
                    acceptance=_AcceptTwo(), record_events=True)
    a, b = req(0, 4, 10), req(1, 4, 10)
    submit(env, inst, [a, b])
    env.run(until=1.5)  # step 1: both prefill (one token each)
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 1)
    env.run(until=2.5)  # step 2: a verifies 1 + 4 tokens, 2 drafts accepted: 3 tokens, C rolls back by 2
    assert (a.num_output_tokens, b.num_output_tokens) == (4, 2)
    shape = cost.shapes[1]
    assert (shape.verify_new, shape.verify_context, shape.num_decodes, shape.num_tokens) == ([5], [4], 1, 6)
    # step 3 (scheduled at t=2, in flight now) starts from the rolled-back C: 4 + 5 - 2 = 7 = num_tokens - 1
    assert cost.shapes[2].verify_context == [7] and cost.shapes[2].decode_context == [5]
    assert a.num_computed_tokens == 7 + 5 and a.num_tokens == 8
    assert inst.steps.cols["output_tokens"][1] == 4
    # one ITL sample per step output, whatever the number of tokens it carries
    assert itl.describe((50,))["count"] == 2


def test_a_draft_count_outside_the_drafts_is_an_error():
    class Bad:
        num_speculative_tokens = 4

        def propose(self, request):
            return 0

        def num_accepted(self, request, num_draft_tokens):
            return num_draft_tokens + 1

    env = simpy.Environment()
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=1024, num_speculative_tokens=4)
    from tests.conftest import ConstantCost

    inst = Instance(env, 0, config, _Drafting(), KVCacheManager(64, 4, 1024), ConstantCost(1.0), WeightedSamples(),
                    options=EngineOptions(fast_forward=False), acceptance=Bad())
    submit(env, inst, [req(0, 4, 10)])
    with pytest.raises(ValueError, match="returned 5 accepted of 4 draft tokens"):
        env.run()


class _LinearCost(CostModelBase):
    """0.1 s + 1 ms per dense token: a prefill step is much longer than a decode."""

    name = "linear"

    def step_time(self, shape: BatchShape) -> float:
        return 0.1 + 0.001 * shape.dense_tokens


def _ranks(env, n, dt_cost):
    out = []
    for i in range(n):
        config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096)
        out.append(Instance(env, i, config, VLLMV1Scheduler(), KVCacheManager(256, 16, 4096), dt_cost,
                            WeightedSamples(), options=EngineOptions(fast_forward=False), start=False))
    return out


def test_two_lock_stepped_ranks_the_decoder_waits_for_the_prefill():
    # rank 0 decodes a request; at t=0.35 rank 1 gets a 400-token prompt. The step in which rank 1 prefills lasts
    # 0.1 + 0.4 s for both ranks: rank 0's one-token decode is padded to 400 tokens and waits for the slowest
    env = simpy.Environment()
    cost = _LinearCost()
    r0, r1 = _ranks(env, 2, cost)
    group = LockStepGroup(env, [r0, r1])
    dec = req(0, 4, 6)
    pre = req(1, 400, 2, t=0.35)

    def arrivals():
        r0.add_request(dec)
        yield env.timeout(0.35)
        r1.add_request(pre)

    env.process(arrivals())
    env.run()
    d0 = list(r0.steps.cols["duration"])
    d1 = list(r1.steps.cols["duration"])
    # rank 0 alone: 0.104 (prefill of 4), then 0.101 per decode; rank 1's prefill step is 0.5 s on both ranks
    assert d0[:3] == pytest.approx([0.104, 0.101, 0.101])  # rank 1 idle: a dummy batch as large as rank 0's
    assert 0.5 in [round(x, 9) for x in d0] and d1[0] == pytest.approx(0.5)
    i = [round(x, 9) for x in d0].index(0.5)
    assert r0.steps.cols["start"][i] == r1.steps.cols["start"][0]
    assert group.num_dummy_steps[1] >= 3 and group.num_dummy_steps[0] == 0
    assert pre.first_token_time == pytest.approx(r1.steps.cols["start"][0] + 0.5)


def test_without_lock_step_the_decoder_does_not_wait():
    env = simpy.Environment()
    cost = _LinearCost()
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096)
    r0 = Instance(env, 0, config, VLLMV1Scheduler(), KVCacheManager(256, 16, 4096), cost, WeightedSamples(),
                  options=EngineOptions(fast_forward=False))
    dec = req(0, 4, 6)
    submit(env, r0, [dec])
    env.run()
    assert max(r0.steps.cols["duration"]) == pytest.approx(0.104)


def test_lock_step_is_the_default_with_dp_and_ep_and_changes_the_timeline():
    base = {"name": "x", "model": {"name": "Qwen3-30B-A3B"}, "cost_model": {"kind": "operator"},
            "hardware": {"gpu": "H100-SXM5-80GB", "data_parallel_size": 2, "expert_parallel_size": 2},
            "cluster": {"num_instances": 2},
            "workload": {"num_requests": 40, "rate": 20.0,
                         "prompt_tokens": {"kind": "constant", "value": 2000},
                         "output_tokens": {"kind": "constant", "value": 40}},
            "simulation": {"progress": False}}
    on = simulate(parse_experiment(base))
    off = simulate(parse_experiment({**base, "hardware": {**base["hardware"], "data_parallel_lock_step": False}}))
    assert len(on.groups) == 1 and not off.groups
    mean_tpot = lambda res: sum((r.finish_time - r.first_token_time) / (r.max_tokens - 1) for r in res.requests) / 40
    assert mean_tpot(on) > mean_tpot(off)  # decoders wait for the other rank's prefills


def test_a_request_handed_from_one_pool_to_another_keeps_its_tokens_and_timings():
    data = {"name": "pools", "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
            "engine": {"max_num_batched_tokens": 2048, "max_num_seqs": 16},
            "workload": {"num_requests": 6, "rate": 2.0, "prompt_tokens": {"kind": "constant", "value": 300},
                         "output_tokens": {"kind": "constant", "value": 20}},
            "pools": [{"name": "first", "hand_off": {"to": "second", "after_output_tokens": 1, "delay_s": 0.01}},
                      {"name": "second", "num_instances": 2, "engine": {"max_num_seqs": 4}}],
            "simulation": {"progress": False, "record_events": True}}
    res = simulate(parse_experiment(data))
    assert [i.pool for i in res.instances] == ["first", "second", "second"]
    assert res.cluster.num_hand_offs == 6
    second_steps = [s for inst in res.instances[1:] for s in inst.steps.cols["prefill_tokens"]]
    assert max(second_steps) == 0  # the second pool never recomputes a prompt: C came with the request
    for r in res.requests:
        kinds = [e[1] for e in r.events]
        assert kinds[:4] == ["arrived", "scheduled", "first_token", "handed_off"] and kinds[-1] == "finished"
        assert "received" in kinds and r.pool == "second" and r.num_output_tokens == 20
        handed = next(e[0] for e in r.events if e[1] == "handed_off")
        received = next(e[0] for e in r.events if e[1] == "received")
        assert received == pytest.approx(handed + 0.01)
        assert r.arrival_time < r.first_token_time == handed < r.finish_time  # the first token leaves with it


def test_pools_errors_name_the_pool_and_field():
    from lab.experiment.config import ConfigError, pool_experiments

    with pytest.raises(ConfigError, match=r"pools\[0\].hand_off.to: unknown pool 'nowhere'"):
        parse_experiment({"name": "x", "pools": [{"name": "a", "hand_off": {"to": "nowhere"}}]})
    with pytest.raises(ConfigError, match=r"pools\[0\] a\]: engine.max_num_seqs"):
        parse_experiment({"name": "x", "pools": [{"name": "a", "engine": {"max_num_seqs": 0}}]})
    exp = parse_experiment({"name": "x", "pools": [{"name": "a", "num_instances": 2, "engine": {"max_num_seqs": 7}}]})
    (pool, sub), = pool_experiments(exp)
    assert pool.name == "a" and sub.engine.max_num_seqs == 7 and sub.cluster.num_instances == 2


class _OverBudget(SchedulerBase):
    def schedule(self, engine):
        out = SchedulerOutput()
        for r in list(engine.waiting):
            engine.waiting.remove(r)
            engine.kv.allocate_slots(r, r.num_tokens)
            engine.admit(r, 0)
            out.add(r, r.num_tokens)
        return out


class _Twice(SchedulerBase):
    def schedule(self, engine):
        out = SchedulerOutput()
        for r in list(engine.waiting):
            engine.waiting.remove(r)
            engine.kv.allocate_slots(r, 2)
            engine.admit(r, 0)
        for r in engine.running:
            if is_running(r):
                out.add(r, 1)
                out.add(r, 1)
        return out


class _NoKV(SchedulerBase):
    def schedule(self, engine):
        out = SchedulerOutput()
        for r in list(engine.waiting):
            engine.waiting.remove(r)
            engine.admit(r, 0)
            out.add(r, 2)
        return out


@pytest.mark.parametrize("scheduler,rule", [
    (_OverBudget(), r"40 tokens scheduled, over the step budget \(16\)"),
    (_Twice(), "a request is scheduled twice"),
    (_NoKV(), "request 0 scheduled with 2 tokens but KV blocks for only 0"),
])
def test_the_engine_stops_a_scheduler_that_breaks_the_contract(scheduler, rule):
    env, inst, _ = make_engine(scheduler=scheduler)
    submit(env, inst, [req(0, 20, 2), req(1, 20, 2)])
    with pytest.raises(SchedulerContractError,
                       match=f"scheduler _\\w+ \\(.*test_engine_core.py\\) broke the scheduler contract: {rule}"):
        env.run()


def test_delay_until_never_overshoots():
    import random

    rng = random.Random(3)
    for _ in range(20000):
        now = rng.random() * rng.choice([1.0, 1e3, 1e6])
        t = now + rng.random() * rng.choice([1e-4, 1.0, 1e4])
        d = delay_until(now, t)
        assert d >= 0 and now + d <= t and t - (now + d) <= 2 * (abs(t) * 2.3e-16)


def test_in_flight_window_orders_stages():
    w = InFlightWindow(3, 2)
    from lab.core.step import ScheduledStep

    steps = [ScheduledStep([], [], [], BatchShape(), [0.5, 0.25], 0.0, 0, 0) for _ in range(3)]
    for s in steps:
        w.submit(s, 0.0)
    assert [(s.start, s.end) for s in steps] == [(0.0, 0.75), (0.5, 1.25), (1.0, 1.75)]


def test_sglang_never_runs_more_than_max_num_seqs_when_a_chunked_prefill_ends():
    # shared/repro/sglang_max_num_seqs.yaml: the step that finishes a chunked prefill admitted one more request
    from policies.sglang import SGLangScheduler

    env, inst, _ = make_engine(scheduler=SGLangScheduler(), num_gpu_blocks=256, block_size=1,
                               max_num_batched_tokens=16, max_num_seqs=1)
    a, b = req(0, 40, 3), req(1, 5, 3)
    submit(env, inst, [a, b])
    env.run()  # the engine's contract check raises if two requests ever run
    assert a.finish_time is not None and b.finish_time is not None and b.first_scheduled_time >= a.finish_time


def test_pp2_throughput_approaches_twice_one_stage_when_requests_fill_both_micro_batches():
    # four waiting requests and an 8-token budget fill both micro-batches and stay there: the pipeline completes a
    # micro-batch every 0.5 s (one stage's time) instead of every 1 s, so 4 x 20 tokens take 20.5 s, not 40 s
    env, inst, _ = pp2(max_num_batched_tokens=8)
    reqs = [req(i, 4, 20) for i in range(4)]
    submit(env, inst, reqs)
    env.run()
    assert [r.finish_time for r in reqs] == [20.0, 20.0, 20.5, 20.5]
    assert all((r.finish_time - r.first_token_time) / 19 == pytest.approx(1.0) for r in reqs)  # TPOT: whole pipeline
    assert len(inst.steps) == 40 and inst.busy_time == pytest.approx(20.0)


def test_pp2_an_arrival_while_the_engine_blocks_on_its_oldest_batch_joins_the_next_schedule():
    # vLLM's step_with_batch_queue blocks on the oldest batch when nothing else can be scheduled; requests that
    # arrive meanwhile are scheduled when it returns, here together with a's decode (one micro-batch, no overlap)
    env, inst, _ = pp2()
    a, b = req(0, 4, 20), req(1, 4, 20, t=0.2)
    submit(env, inst, [a, b])
    env.run()
    assert b.first_scheduled_time == 1.0 and (a.finish_time, b.finish_time) == (20.0, 21.0)


def test_a_handed_off_requests_events_and_rows_name_every_instance_that_served_it():
    from lab.report.metrics import requests_frame
    from lab.report.run_summary import collect
    from lab.report.run_tables import events_frame

    data = {"name": "pools", "model": {"name": "Llama-3.1-8B"}, "engine": {"max_num_seqs": 16},
            "workload": {"num_requests": 4, "rate": 2.0, "prompt_tokens": {"kind": "constant", "value": 100},
                         "output_tokens": {"kind": "constant", "value": 5}},
            "pools": [{"name": "p", "hand_off": {"to": "d"}}, {"name": "d"}],
            "simulation": {"progress": False, "record_events": True}}
    res = simulate(parse_experiment(data))
    ev = events_frame(res)
    first = ev[ev.request_id == "0"].set_index("event")["instance"]
    assert (first["arrived"], first["first_token"], first["handed_off"]) == (0, 0, 0)
    assert (first["received"], first["finished"]) == (1, 1)
    req = requests_frame(res.requests)
    assert set(req.served_by) == {"0,1"} and set(req.pool) == {"d"}
    _, summary = collect(res)
    assert [i["num_requests"] for i in summary["instances"]] == [4, 4]
    assert summary["deployment"]["hand_offs"] == 4 and [p["name"] for p in summary["deployment"]["pools"]] == ["p", "d"]


def test_layout_errors_name_the_field():
    from lab.experiment.config import ConfigError

    with pytest.raises(ConfigError, match="data_parallel_lock_step: lock-step needs data_parallel_size > 1"):
        parse_experiment({"name": "x", "hardware": {"data_parallel_lock_step": True}})
    with pytest.raises(ValueError, match=r"hardware.pipeline_parallel_size: 64 pipeline stages exceed the model's 32 layers"):
        simulate(parse_experiment({"name": "x", "hardware": {"pipeline_parallel_size": 64},
                                   "simulation": {"progress": False}}))
    with pytest.raises(ValueError, match=r"pools\[1\] d: hardware.pipeline_parallel_size"):
        simulate(parse_experiment({"name": "x", "pools": [{"name": "p"}, {"name": "d", "hardware": {
            "pipeline_parallel_size": 64}}], "simulation": {"progress": False}}))


def test_pool_policy_errors_name_the_pools_own_field():
    from lab.experiment.config import ConfigError

    with pytest.raises(ConfigError, match=r"pools\[1\] d\]: pools\[1\].router: unknown router 'least_rquests'"):
        parse_experiment({"name": "x", "pools": [{"name": "p", "hand_off": {"to": "d"}},
                                                 {"name": "d", "router": "least_rquests"}]})


@pytest.mark.parametrize("answer", [-1, 99, None, 1.0, True])
def test_a_router_returning_no_valid_instance_stops_the_run(monkeypatch, answer):
    import policies
    from lab.cluster.cluster import RouterError
    from lab.core.sched_api import RouterBase

    class Bad(RouterBase):
        def route(self, request, instances, now):
            return answer

    monkeypatch.setitem(policies._ROUTERS, "bad_router", Bad)
    exp = parse_experiment({"name": "x", "cluster": {"num_instances": 2, "router": "bad_router"},
                            "workload": {"num_requests": 3}, "simulation": {"progress": False}})
    with pytest.raises(RouterError, match=f"router Bad returned {answer!r}; expected an instance index 0..1"):
        simulate(exp)
