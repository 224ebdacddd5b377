"""The scheduler knobs people tune (issue 41), each rule on a hand-worked case.

Engines step in 1 s (tests/conftest.py ``make_engine``): step k runs over [k-1, k] and its tokens appear at k.
"""

import pytest

from lab.core.batch import BatchShape
from lab.costmodel.batch_expansion import expanded
from lab.experiment.config import ConfigError, parse_experiment, scheduler_name
from lab.experiment.simulation import build_deployment
from lab.experiment.support import refusals
from policies.vllm_v0 import VLLMV0Scheduler
from tests.conftest import make_engine, req, submit


def run(env, inst, reqs, until=None):
    submit(env, inst, reqs)
    env.run(until=until)


# ---- head-of-line blocking: engine.skip_blocked_waiting ----
def _hol(skip):
    # 8 usable blocks of 4 tokens; a (12-token prompt) holds 4 blocks from its first decode on, b (24 tokens, 6
    # blocks) does not fit the 4 left, c (4 tokens, 1 block) does
    env, inst, _ = make_engine(num_gpu_blocks=9, block_size=4, max_num_batched_tokens=100,
                               scheduler_reserve_full_isl=False, skip_blocked_waiting=skip)
    a, b, c = req(0, 12, 8), req(1, 24, 2, t=0.5), req(2, 4, 2, t=0.5)
    run(env, inst, [a, b, c])
    return a, b, c


def test_waiting_admission_stops_at_the_first_request_that_does_not_fit():
    # vLLM (every version) and SGLang: c waits behind b until a finishes at t = 8 and frees its blocks
    a, b, c = _hol(0)
    assert a.finish_time == 8.0
    assert b.first_scheduled_time == 8.0 and c.first_scheduled_time == 8.0


def test_skip_blocked_waiting_admits_past_the_blocked_head_which_keeps_its_place():
    # at t = 1 b does not fit: admission passes over it and admits c (1 block); b still goes first when a finishes
    a, b, c = _hol(1)
    assert c.first_scheduled_time == 1.0 and c.finish_time == 3.0
    assert b.first_scheduled_time == 8.0


# ---- priority with a full max_num_seqs: engine.priority_preemption ----
def _priority(rule, scheduler=None, prio_c=0, **cfg):
    env, inst, _ = make_engine(max_num_seqs=2, max_num_batched_tokens=64, queue_policy="priority",
                               priority_preemption=rule, scheduler=scheduler, **cfg)
    a, b = req(0, 4, 10, priority=1), req(1, 4, 10, priority=1)
    c = req(2, 4, 2, t=0.5, priority=prio_c)
    run(env, inst, [a, b, c])
    return a, b, c


def test_vllm_v1_never_preempts_for_a_waiting_request():
    a, b, c = _priority("none")
    assert c.first_scheduled_time == 10.0  # a and b finish at t = 10
    assert a.num_preemptions == b.num_preemptions == 0


def test_priority_preemption_at_max_num_seqs_takes_the_lowest_priority_slot():
    # t = 1: the running list is full; c (priority 0) outranks b (priority 1, the later of the two): b is preempted
    # (recompute) and c admitted in the same step
    a, b, c = _priority("max_num_seqs")
    assert c.first_scheduled_time == 1.0 and c.finish_time == 3.0
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)


def test_equal_priorities_never_preempt_each_other():
    a, b, c = _priority("max_num_seqs", prio_c=1)
    assert c.first_scheduled_time == 10.0 and b.num_preemptions == 0


def test_vllm_v0_priority_preemption_frees_a_slot_and_admits_at_the_next_prefill_step():
    # V0 without chunking: at t = 1 nothing can be prefilled (max_num_seqs full), so _schedule_priority_preemption
    # preempts b; a decodes in that step; the next step (t = 2) is c's prefill alone
    a, b, c = _priority("v0", scheduler=VLLMV0Scheduler(), enable_chunked_prefill=False)
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert c.first_scheduled_time == 2.0


# ---- the draft model's budget slot: draft_slot_budget ----
@pytest.mark.parametrize("rule,chunks", [("reserved", [12, 8]), ("per_request", [15, 5])])
def test_draft_slots_are_reserved_up_front_or_charged_per_request(rule, chunks):
    # budget 16, 4 sequences, 1 slot each: reserved takes 4 x 1 off every step (vLLM before PR #51725); per request
    # takes 1 per scheduled request (a lone prompt: 15)
    env, inst, cost = make_engine(max_num_batched_tokens=16, max_num_seqs=4, draft_slots_per_request=1,
                                  draft_slot_budget=rule)
    run(env, inst, [req(0, 20, 1)])
    assert [s.num_tokens for s in cost.shapes] == chunks


# ---- vLLM V0: prefill-only steps, partial prefills ----
def test_vllm_v0_without_chunking_runs_a_prefill_step_alone():
    env, inst, cost = make_engine(max_num_batched_tokens=64, scheduler=VLLMV0Scheduler(), enable_chunked_prefill=False)
    a, b = req(0, 4, 5), req(1, 8, 2, t=1.5)
    run(env, inst, [a, b])
    s = cost.shapes
    # [0,1] a's prompt; [1,2] a decodes; [2,3] b's prompt alone (a does not decode); then both decode
    assert (s[2].prefill_new, s[2].num_decodes) == ([8], 0)
    assert s[3].num_decodes == 2
    assert a.finish_time == 6.0  # 5 outputs at 1, 2, 4, 5, 6: one step lost to b's prefill


def test_vllm_v0_with_chunked_prefill_allocates_the_whole_prompt_at_admission():
    env, inst, cost = make_engine(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=8,
                                  scheduler=VLLMV0Scheduler(), enable_chunked_prefill=True, v0_watermark=0.0)
    a = req(0, 20, 2)
    run(env, inst, [a], until=0.5)
    assert len(a.blocks) == 5  # 20 tokens in 4-token blocks, though only 8 were scheduled


def _partial(partial):
    # budget 16; a and b are long (40, 30 > threshold 10), c short (8)
    env, inst, cost = make_engine(max_num_batched_tokens=16, scheduler=VLLMV0Scheduler(), enable_chunked_prefill=True,
                                  num_gpu_blocks=64, v0_watermark=0.0, long_prefill_token_threshold=10,
                                  max_num_partial_prefills=partial, max_long_partial_prefills=1)
    a, b, c = req(0, 40, 2), req(1, 30, 2), req(2, 8, 2)
    run(env, inst, [a, b, c])
    return a, b, c, cost.shapes


def test_without_partial_prefills_a_short_prompt_waits_behind_long_ones():
    a, b, c, s = _partial(1)
    assert s[0].prefill_new == [16]  # a takes the whole budget
    assert c.first_token_time > 4.0


def test_partial_prefills_split_the_budget_and_let_a_short_prompt_pass_a_long_one():
    # two prompts can prefill (a, and c: b is long while a, long, prefills): each chunk is 16 // 2 = 8; b keeps its
    # place and starts when a is done
    a, b, c, s = _partial(2)
    assert sorted(s[0].prefill_new) == [8, 8]
    assert c.first_token_time == 1.0
    assert b.first_scheduled_time > a.first_scheduled_time


# ---- V0's batch-expansion scoring ----
def test_batch_expansion_prices_a_verify_as_one_decode_per_position():
    shape = BatchShape(5, 2, decode_context=[50], num_decodes=1, decode_sum=50, decode_max=50, decode_min=50,
                       verify_new=[4], verify_context=[100])
    e = expanded(shape)
    assert e.decode_context == [50, 100, 101, 102, 103]
    assert (e.num_tokens, e.num_seqs, e.verify_new, e.decode_sum) == (5, 5, [], 456)


# ---- the era's defaults and what composes ----
BASE = {"name": "k", "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "A100-80GB-SXM4"},
        "workload": {"source": "synthetic", "num_requests": 4, "rate": 1.0}}


def _exp(**engine):
    return parse_experiment({**BASE, "engine": engine}, source="k.yaml")


def test_vllm_v0_era_defaults():
    e = _exp(vllm_version="0.6", max_model_len=4096)
    assert scheduler_name(e) == "vllm_v0"
    d = build_deployment(e)
    c = d.scheduler_config
    assert not c.enable_chunked_prefill and not d.enable_prefix_caching
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.priority_preemption) == (4096, 256, "v0")
    long = build_deployment(_exp(vllm_version="0.6")).scheduler_config  # 131,072 > 32K: chunked, budget 512
    assert long.enable_chunked_prefill and long.max_num_batched_tokens == 512
    v1 = build_deployment(_exp(max_model_len=4096)).scheduler_config
    assert v1.enable_chunked_prefill and v1.priority_preemption == "none" and v1.draft_slot_budget == "per_request"


def test_partial_prefills_default_threshold_is_four_percent_of_max_model_len():
    c = build_deployment(_exp(vllm_version="0.6", max_model_len=8192, enable_chunked_prefill=True,
                              max_num_partial_prefills=2)).scheduler_config
    assert c.long_prefill_token_threshold == 327


def test_knobs_outside_their_era_are_refused():
    assert any("Concurrent Partial Prefill" in r for r in refusals(_exp(max_num_partial_prefills=2)))
    assert any("V0's rule is V0's" in r
               for r in refusals(parse_experiment({**BASE, "engine": {"priority_preemption": "v0"},
                                                   "policy": {"queue": "priority"}}, source="k.yaml")))
    sg = parse_experiment({**BASE, "engine": {"skip_blocked_waiting": 2}, "policy": {"scheduler": "sglang"}},
                          source="k.yaml")
    assert any("skips_blocked_waiting" in r for r in refusals(sg))
    with pytest.raises(ConfigError, match="max_long_partial_prefills"):
        _exp(max_num_partial_prefills=2, max_long_partial_prefills=3)


# ---- SGLang against its current source ----
def _sglang_retraction(rule):
    from policies.sglang import SGLangScheduler
    # 12 usable blocks of 4; three 8-token prompts admitted together (clip 1: each reserves one token), each holding
    # 4 blocks at 16 tokens: at t = 9 every decode needs a fifth block and none is free
    sched = SGLangScheduler(SGLangScheduler.Options(clip_max_new_tokens=1, retract_rule=rule))
    env, inst, _ = make_engine(num_gpu_blocks=13, block_size=4, max_num_batched_tokens=100, scheduler=sched)
    rs = [req(i, 8, 20) for i in range(3)]
    run(env, inst, rs)
    return sorted((e[0], r.request_id) for r in rs for e in r.events if e[1] == "preempted")


def test_sglang_retracts_until_the_next_decode_fits():
    # sglang 0.5 retract_decode loops on check_decode_mem: one retraction (the request with the fewest outputs and,
    # among equals, the last) frees 4 blocks, enough for the other two decodes
    assert [e for e in _sglang_retraction("next_decode") if e[0] == 9.0] == [(9.0, "2")]
    # the older rule wanted 20 free tokens per remaining request: 16 < 40, so a second retraction
    assert [e for e in _sglang_retraction("decode_steps") if e[0] == 9.0] == [(9.0, "1"), (9.0, "2")]


def test_sglang_prefill_decode_interval_forces_decodes_after_a_prefill():
    from policies.sglang import SGLangScheduler

    def shapes(interval):
        env, inst, cost = make_engine(max_num_batched_tokens=100,
                                      scheduler=SGLangScheduler(SGLangScheduler.Options(prefill_decode_interval=interval)))
        run(env, inst, [req(0, 4, 6), req(1, 8, 2, t=1.5), req(2, 8, 2, t=2.5)])
        return [(s.prefill_new, s.num_decodes) for s in cost.shapes][:5]
    # prefill first: c's prompt right after b's; with an interval of 1 a decode step comes between
    assert shapes(0)[2:4] == [([8], 0), ([8], 0)]
    assert shapes(1)[2:5] == [([8], 0), ([], 2), ([8], 0)]


def test_sglang_overlap_scheduler_hides_the_cpu_time():
    from lab.engine.instance import EngineOptions
    from policies.sglang import SGLangScheduler
    for overlap, finish in ((False, 7.5), (True, 5.5)):  # 1 s steps, 0.5 s of CPU work per step, 5 tokens
        env, inst, _ = make_engine(max_num_batched_tokens=100, scheduler=SGLangScheduler(),
                                   options=EngineOptions(async_scheduling=overlap, cpu_base_s=0.5))
        a = req(0, 4, 5)
        run(env, inst, [a])
        assert a.finish_time == finish


def test_sglang_max_running_requests_default_follows_its_kv_pool():
    from policies.sglang import sglang_max_running_requests
    assert sglang_max_running_requests(460_000, 131_072) == 2048  # slot pool floor
    assert sglang_max_running_requests(100_000, 4_096) == 4096  # slot pool cap
    assert sglang_max_running_requests(3_000, 4_096) == 1500  # half the pool
    d = build_deployment(parse_experiment({**BASE, "engine": {"num_gpu_blocks": 1001, "max_model_len": 4096},
                                           "policy": {"scheduler": "sglang"}}, source="k.yaml"))
    assert d.scheduler_config.max_num_seqs == 2048 and d.engine_options.async_scheduling  # 16,000 tokens


# ---- prefill/decode disaggregation: first-token placement, one-token requests, the router's terms ----
def _pd(**transfer):
    from lab.experiment.simulation import simulate
    d = {**BASE, "hardware": {"gpu": "H100-SXM5-80GB"}, "engine": {"max_model_len": 4096},
         "frontend": {"request_s": 0.0, "per_prompt_token_s": 0.0, "per_output_token_s": 0.0},
         "workload": {"source": "synthetic", "num_requests": 6, "rate": 2.0,
                      "prompt_tokens": {"kind": "constant", "value": 300},
                      "output_tokens": {"kind": "constant", "value": 5}},
         "deployment": {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1},
                        "transfer": transfer},
         "simulation": {"record_events": True}}
    res = simulate(parse_experiment(d, source="k.yaml"))
    return [r for r in res.requests]


def test_first_token_placement():
    # vLLM NIXL: D recomputes the last prompt token and samples the first token in its first step
    for r in _pd(first_token="decode_recomputes"):
        t = r.remote.times
        assert r.first_token_time > t["d_ready"] and r.served_by == [0, 1]
    # SGLang: P's token comes with the KV; D emits it when it learns the read ended, and decodes from token 2
    for r in _pd(first_token="with_kv"):
        assert r.first_token_time == r.remote.times["d_ready"] and r.num_output_tokens == 5
    # DistServe: P's token is the first output, at P's step end; the gap to the second holds the transfer
    for r in _pd(first_token="from_prefill"):
        t = r.remote.times
        assert r.first_token_time == t["p_done"] and r.num_output_tokens == 5
        assert any(e[1] == "first_token" and e[0] == t["p_done"] for e in r.events)


def test_a_one_token_request_finishes_on_prefill():
    from lab.experiment.simulation import simulate
    d = {**BASE, "hardware": {"gpu": "H100-SXM5-80GB"}, "engine": {"max_model_len": 4096},
         "workload": {"source": "synthetic", "num_requests": 3, "rate": 2.0,
                      "prompt_tokens": {"kind": "constant", "value": 300},
                      "output_tokens": {"kind": "constant", "value": 1}},
         "deployment": {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}}
    for r in simulate(parse_experiment(d, source="k.yaml")).requests:
        assert r.status.name == "FINISHED" and r.served_by == [0] and r.remote is None


def test_the_router_dispatch_and_bootstrap_are_their_own_terms():
    # sequential (vLLM's toy proxy): P's response, then the dispatch to D: handover + dispatch between P and D
    for r in _pd(router="sequential", handover_ms=20, dispatch_ms=3, bootstrap_ms=50):
        t = r.remote.times
        assert t["d_arrived"] - t["p_done"] == pytest.approx(0.023)
        assert r.arrival_time - r.sent_time == pytest.approx(0.003)  # the dispatch to P; no bootstrap
    # parallel (SGLang's router): D has the request already; P waits for the bootstrap before prefilling
    for r in _pd(router="parallel", handover_ms=20, dispatch_ms=3, bootstrap_ms=50):
        t = r.remote.times
        assert t["d_arrived"] == t["p_done"]
        assert r.arrival_time - r.sent_time == pytest.approx(0.053)


# ---- servelab search over PD placements, ranked per GPU ----
def test_placement_grid_makes_disaggregated_candidates_and_per_gpu_ranks_them(tmp_path):
    from lab.report.search import _cheapest_first
    from lab.report.search_report import SearchResult
    from lab.report.search_spec import SearchSpec, candidate_experiments
    spec = SearchSpec.model_validate({
        "base": {**BASE, "deployment": {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}},
        "find": "max_rate", "low": 1, "high": 8, "slo": {"ttft_s": 0.25, "tpot_s": 0.1, "attainment": 0.9},
        "rank": "per_gpu", "placement": {"prefill": {"count": [1, 2]}, "decode": {"count": [1], "tensor_parallel_size": [1, 2]}},
        "candidates": {"colocated": {"deployment": {"mode": "colocated", "prefill": None, "decode": None}}}})
    cands, _ = candidate_experiments(spec, tmp_path / "s.yaml")
    names = [n for n, _ in cands]
    assert names == ["colocated", "p1tp1-d1tp1", "p1tp1-d1tp2", "p2tp1-d1tp1", "p2tp1-d1tp2"]
    data = dict(cands)["p2tp1-d1tp2"]
    exp = parse_experiment(data, source="s.yaml")
    assert exp.deployment.prefill.count == 2 and exp.deployment.decode.hardware["tensor_parallel_size"] == 2
    # 6 req/s on 3 GPUs (2 per GPU) ranks after 3 req/s on 1 GPU, before 4 req/s on 4 GPUs
    rs = [SearchResult("a", 6.0, 3, per_gpu=2.0), SearchResult("b", 3.0, 1, per_gpu=3.0),
          SearchResult("c", 4.0, 4, per_gpu=1.0), SearchResult("d", None, None)]
    assert [r.candidate for r in sorted(rs, key=lambda r: _cheapest_first(spec, r))] == ["b", "a", "c", "d"]
    with pytest.raises(Exception, match="rank per_gpu"):
        SearchSpec.model_validate({"base": {}, "find": "min_instances", "low": 1, "high": 4, "rank": "per_gpu",
                                   "slo": {"ttft_s": 1, "percentile": 90}})
