"""Instance schedulers on hand-worked cases: the defining behaviour of each policy.

As in test_scheduler.py, every engine step takes 1 s (tests/conftest.py), so step k runs over [k-1, k] and its
tokens appear at time k. Shapes are listed as (tokens, prefill chunks, decodes).
"""

import pytest

from lab.core.request import RequestStatus
from policies.orca import OrcaScheduler
from policies.sarathi import SarathiScheduler
from policies.sglang import LongestOutputFirstQueue, SGLangScheduler, dfs_weight_order
from policies.sjf import LengthPredictor, SJFQueue, SJFScheduler
from policies.static_batching import StaticBatchingScheduler
from policies.vllm_v1 import VLLMV1Scheduler
from tests.conftest import make_engine, req, submit
from lab.core.sched_api import SchedulerBase


def run(scheduler, reqs, until=None, **cfg):
    env, inst, cost = make_engine(scheduler=scheduler, **cfg)
    submit(env, inst, reqs)
    env.run(until=until)
    return env, inst, cost


def shapes(cost):
    return [(s.num_tokens, s.prefill_new, s.num_decodes) for s in cost.shapes]


# ---------------- Sarathi-Serve ----------------

def test_sarathi_decodes_every_step_while_a_long_prompt_is_chunked_into_the_token_budget():
    a = req(0, 4, 6)
    b = req(1, 20, 2, t=1.5)
    _, _, cost = run(SarathiScheduler(SarathiScheduler.Options(chunk_size=8)), [a, b])
    # step 1: a's prompt; step 2: a decodes (b arrives at 1.5); steps 3-5: a decodes 1 token and b's prompt fills the
    # rest of the 8-token budget (7, 7, 6); step 6: both decode.
    assert shapes(cost) == [(4, [4], 0), (1, [], 1), (8, [7], 1), (8, [7], 1), (7, [6], 1), (2, [], 2)]
    assert a.finish_time == 6.0 and b.first_token_time == 5.0 and b.finish_time == 6.0
    # a's inter-token gaps are all one step: its decode was never stalled
    assert a.finish_time - a.first_token_time == a.max_tokens - 1


class Recorder(SchedulerBase):
    """Wraps a scheduler; per step records the requests that were decoding when it was called and what it ran."""

    def __init__(self, inner):
        self.inner = inner
        self.steps = []

    def make_queue(self, config):
        return self.inner.make_queue(config)

    def schedule(self, engine):
        decoding = [r for r in engine.running if r.num_output_tokens > 0 and r.num_tokens - r.num_computed_tokens == 1]
        out = self.inner.schedule(engine)
        self.steps.append((decoding, {id(r): n for r, n in zip(out.requests, out.num_new_tokens)}))
        return out


def test_sarathi_never_stalls_a_decode_even_when_decodes_fill_the_budget():
    # a 4-token budget, three short requests decoding and a long prompt arriving: every decoding request runs in
    # every step (Sarathi counts decodes without checking the budget), prefills only get what the decodes leave
    rs = [req(i, 4, 8, t=float(i)) for i in range(3)] + [req(3, 30, 2, t=3.5)]
    rec = Recorder(SarathiScheduler(SarathiScheduler.Options(chunk_size=4)))
    run(rec, rs, max_num_seqs=8)
    assert all(r.status == RequestStatus.FINISHED for r in rs)
    for decoding, ran in rec.steps:
        assert all(ran.get(id(r)) == 1 for r in decoding)
        assert sum(ran.values()) <= max(4, len(decoding))
    assert any(len(d) == 3 for d, _ in rec.steps)  # there were steps with 3 decodes and nothing left for prefill
    # SGLang's prefill-first steps do leave decodes out on the same workload
    rs = [req(i, 4, 8, t=float(i)) for i in range(3)] + [req(3, 30, 2, t=3.5)]
    rec = Recorder(SGLangScheduler(SGLangScheduler.Options(chunked_prefill_size=4)))
    run(rec, rs, max_num_seqs=8)
    assert any(any(id(r) not in ran for r in decoding) for decoding, ran in rec.steps)


def test_sarathi_allocates_the_whole_prompt_at_admission():
    a = req(0, 20, 2)
    env, inst, cost = make_engine(scheduler=SarathiScheduler(SarathiScheduler.Options(chunk_size=8, watermark=0)))
    submit(env, inst, [a])
    env.run(until=0.5)
    assert len(a.blocks) == 5 and a.num_computed_tokens == 8  # 20 tokens / 4 per block, though only 8 computed


# ---------------- Orca ----------------

def test_orca_never_chunks_a_prompt():
    _, _, cost = run(OrcaScheduler(), [req(0, 40, 3)], max_num_batched_tokens=16)
    assert shapes(cost) == [(40, [40], 0), (1, [], 1), (1, [], 1)]
    _, _, cost = run(VLLMV1Scheduler(), [req(0, 40, 3)], max_num_batched_tokens=16)
    assert [s.prefill_new for s in cost.shapes[:3]] == [[16], [16], [8]]


def test_orca_reserves_prompt_plus_max_tokens_and_never_preempts():
    # 8 usable blocks of 4 tokens. a needs 8 + 10 - 1 = 17 slots (5 blocks), b 8 + 12 - 1 = 19 (5 blocks).
    def pair():
        return req(0, 8, 10), req(1, 8, 12, t=0.5)

    a, b = pair()
    _, inst, _ = run(OrcaScheduler(), [a, b], num_gpu_blocks=9, block_size=4, max_num_batched_tokens=100)
    assert b.first_scheduled_time == a.finish_time == 10.0  # b waits until a's reservation is released
    assert inst.num_preemptions == 0
    a, b = pair()  # vLLM V1 admits b at once and has to preempt it when both grow
    _, inst, _ = run(VLLMV1Scheduler(), [a, b], num_gpu_blocks=9, block_size=4, max_num_batched_tokens=100,
                     scheduler_reserve_full_isl=False)
    assert b.first_scheduled_time == 1.0 and b.num_preemptions == 1


# ---------------- static batching ----------------

def test_static_batching_admits_nothing_until_its_batch_drains():
    a, b, c = req(0, 4, 2), req(1, 4, 5), req(2, 4, 1, t=0.5)
    _, _, cost = run(StaticBatchingScheduler(), [a, b, c], max_num_seqs=2)
    # batch {a, b}: a finishes at 2, b at 5; c (arrived at 0.5) starts only when b is done, although a slot freed at 2
    assert a.finish_time == 2.0 and b.finish_time == 5.0
    assert c.first_scheduled_time == 5.0 and c.finish_time == 6.0
    assert [s.num_seqs for s in cost.shapes] == [2, 2, 1, 1, 1, 1]
    a, b, c = req(0, 4, 2), req(1, 4, 5), req(2, 4, 1, t=0.5)
    run(VLLMV1Scheduler(), [a, b, c], max_num_seqs=2)
    assert c.first_scheduled_time == 2.0  # continuous batching fills the slot at once


# ---------------- SGLang ----------------

def test_sglang_prefill_first_runs_a_new_prefill_alone_and_stalls_decodes():
    a, b = req(0, 4, 5), req(1, 8, 2, t=1.5)
    _, _, cost = run(SGLangScheduler(), [a, b])
    # step 3: b's prefill runs alone; a (decoding) skips a step
    assert shapes(cost) == [(4, [4], 0), (1, [], 1), (8, [8], 0), (2, [], 2), (1, [], 1), (1, [], 1)]
    assert a.finish_time == 6.0  # 5 tokens took 6 steps
    a, b = req(0, 4, 5), req(1, 8, 2, t=1.5)  # enable_mixed_chunk puts the decodes into the prefill step
    _, _, cost = run(SGLangScheduler(SGLangScheduler.Options(enable_mixed_chunk=True)), [a, b])
    assert shapes(cost)[2] == (9, [8], 1) and a.finish_time == 5.0


def test_sglang_keeps_one_chunked_request_at_a_time():
    a, b = req(0, 20, 3), req(1, 20, 3)
    _, _, cost = run(SGLangScheduler(SGLangScheduler.Options(chunked_prefill_size=8)), [a, b])
    # a is chunked (8, 8) while b waits; a's last 4 tokens leave room for b's first 4, b becomes the chunked
    # request and continues alone (a does not decode while b's prefill runs: prefill first)
    assert shapes(cost)[:5] == [(8, [8], 0), (8, [8], 0), (8, [4, 4], 0), (8, [8], 0), (8, [8], 0)]
    assert shapes(cost)[5] == (2, [], 2)


def test_sglang_retraction_frees_kv_requeues_at_the_tail_and_resets_the_ratio():
    # 8 usable blocks of 4 tokens (32 slots); a needs 19, b 21 slots: they cannot both finish.
    sched = SGLangScheduler(SGLangScheduler.Options(init_new_token_ratio=0.1, retract_decode_steps=1))
    a, b = req(0, 8, 12), req(1, 10, 12, t=0.5)
    env, inst, cost = run(sched, [a, b], until=7.5, num_gpu_blocks=9, block_size=4, max_num_batched_tokens=100)
    # b was admitted because only 0.1 x a's remaining 11 tokens were reserved; both decode from t = 2
    assert b.first_scheduled_time == 1.0 and b.status == RequestStatus.RUNNING and inst.kv.num_free_blocks == 0
    env.run(until=8.5)
    # t = 7: a (7 generated) and b (6 generated) both need a new block, none is free: SGLang retracts the request
    # with fewer generated tokens (b), frees its 4 blocks and puts it at the tail of the waiting queue
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.blocks == [] and b.num_computed_tokens == 0 and list(inst.waiting) == [b]
    assert "SGLang retraction" in b.events[-1][2]
    # (Σ generated + 1 step x 1 request) / (Σ max_new + 1), sglang 0.5 retract_decode
    assert sched.new_token_ratio == pytest.approx((7 + 1) / (12 + 1))
    env.run()
    assert a.status == b.status == RequestStatus.FINISHED
    resumed = [e for e in b.events if e[1] == "resumed"][0]
    assert "prefix hit 12" in resumed[2]  # b re-hits its own cached blocks (radix-cache reuse)


def test_sglang_lpm_admits_the_longest_prefix_match_first():
    ids = list(range(1, 33))
    sched = SGLangScheduler(SGLangScheduler.Options(schedule_policy="lpm"))
    warm = req(0, 32, 1, t=0.0, prompt_token_ids=ids)                       # caches the prefix
    blocker = req(1, 4, 4, t=1.0)                                           # holds the only seat
    cold = req(2, 32, 1, t=1.5, prompt_token_ids=list(range(100, 132)))     # arrives first, no match
    hot = req(3, 32, 1, t=1.6, prompt_token_ids=ids[:28] + [999] * 4)       # matches 28 tokens
    run(sched, [warm, blocker, cold, hot], max_num_seqs=1, max_num_batched_tokens=100)
    assert hot.first_scheduled_time < cold.first_scheduled_time and hot.prefix_hit_tokens == 28
    sched = SGLangScheduler()  # fcfs
    warm, blocker = req(0, 32, 1, prompt_token_ids=ids), req(1, 4, 4, t=1.0)
    cold = req(2, 32, 1, t=1.5, prompt_token_ids=list(range(100, 132)))
    hot = req(3, 32, 1, t=1.6, prompt_token_ids=ids[:28] + [999] * 4)
    run(sched, [warm, blocker, cold, hot], max_num_seqs=1, max_num_batched_tokens=100)
    assert cold.first_scheduled_time < hot.first_scheduled_time


def test_dfs_weight_visits_the_heaviest_subtree_first_and_children_before_their_node():
    # prefix tree of matched blocks: root -> A -> {B, C}; two requests end at B, one at C, one at A, one at root
    class R:
        def __init__(self, chain):
            self.block_hashes = chain

    reqs = [R([]), R(["A", "C"]), R(["A"]), R(["A", "B"]), R(["A", "B"])]
    order = dfs_weight_order(reqs, [len(r.block_hashes) for r in reqs])
    assert order == [3, 4, 1, 2, 0]  # B (weight 2) before C (1), then A's own, then the root's


def test_sglang_dfs_weight_serves_the_prefix_shared_by_more_waiting_requests_first():
    P, Q = list(range(1, 17)), list(range(101, 117))

    def workload():
        return [req(0, 20, 1, prompt_token_ids=P + [900] * 4), req(1, 20, 1, t=0.5, prompt_token_ids=Q + [901] * 4),
                req(2, 4, 6, t=2.0),                                           # holds the only seat
                req(3, 20, 1, t=2.1, prompt_token_ids=Q + [902] * 4),          # q1: Q subtree (weight 1)
                req(4, 20, 1, t=2.2, prompt_token_ids=P + [903] * 4),          # p1, p2: P subtree (weight 2)
                req(5, 20, 1, t=2.3, prompt_token_ids=P + [904] * 4)]

    rs = workload()
    run(SGLangScheduler(SGLangScheduler.Options(schedule_policy="dfs-weight")), rs, max_num_seqs=1,
        max_num_batched_tokens=100)
    # when the seat frees (t = 8): P's subtree holds 2 waiting requests, Q's 1 -> p1 first although q1 is older;
    # the step after, P and Q hold one each and the tie goes to the first seen (q1)
    assert rs[4].first_scheduled_time == 8.0 and rs[3].first_scheduled_time == 9.0
    assert rs[3].prefix_hit_tokens == rs[4].prefix_hit_tokens == 16
    rs = workload()
    run(SGLangScheduler(), rs, max_num_seqs=1, max_num_batched_tokens=100)  # fcfs
    assert rs[3].first_scheduled_time < rs[4].first_scheduled_time


def test_sglang_lof_queue_serves_the_longest_output_first():
    q = LongestOutputFirstQueue()
    for r in (req(0, 4, 10), req(1, 4, 300), req(2, 4, 50)):
        q.add(r)
    assert [q.pop().index for _ in range(3)] == [1, 2, 0]


# ---------------- shortest job first ----------------

def test_sjf_admits_the_shortest_predicted_output_first():
    blocker = req(0, 4, 3)
    long_, short, mid = req(1, 4, 50, t=0.1), req(2, 4, 5, t=0.2), req(3, 4, 20, t=0.3)
    run(SJFScheduler(), [blocker, long_, short, mid], max_num_seqs=1)
    assert short.first_scheduled_time < mid.first_scheduled_time < long_.first_scheduled_time
    blocker = req(0, 4, 3)
    long_, short, mid = req(1, 4, 50, t=0.1), req(2, 4, 5, t=0.2), req(3, 4, 20, t=0.3)
    run(VLLMV1Scheduler(), [blocker, long_, short, mid], max_num_seqs=1)
    assert long_.first_scheduled_time < short.first_scheduled_time


def test_sjf_starvation_protection_serves_a_request_that_waited_too_long():
    # one seat; a stream of short requests would starve the long one forever without protection
    def workload():
        return [req(0, 4, 2)] + [req(1, 4, 40, t=0.1)] + [req(i, 4, 2, t=0.2 + 0.5 * i) for i in range(2, 30)]

    rs = workload()
    run(SJFScheduler(SJFScheduler.Options(starvation_s=None)), rs, max_num_seqs=1)
    assert rs[1].first_scheduled_time > rs[-1].first_scheduled_time  # starved until the stream ends
    rs = workload()
    run(SJFScheduler(SJFScheduler.Options(starvation_s=5.0)), rs, max_num_seqs=1)
    assert 5.1 <= rs[1].first_scheduled_time <= 8.0  # promoted once it has waited 5 s


def test_length_predictors():
    r = req(7, 4, 100)
    assert LengthPredictor("oracle").predict(r) == 100
    noisy = LengthPredictor("noisy", noise_sigma=0.5, seed=3)
    p = noisy.predict(r)
    assert p != 100 and p == LengthPredictor("noisy", noise_sigma=0.5, seed=3).predict(r)  # seeded per request
    assert LengthPredictor("noisy", noise_sigma=0.5, seed=4).predict(r) != p
    b = LengthPredictor("bucketed", noise_sigma=0, buckets=[32, 128, 512])
    assert [b.predict(req(0, 4, n)) for n in (1, 32, 33, 128, 500, 5000)] == [0, 0, 1, 1, 2, 3]


def test_sjf_queue_bucketed_ties_are_fcfs_and_preempted_requests_go_first():
    q = SJFQueue(LengthPredictor("bucketed", noise_sigma=0, buckets=[64, 1024]), starvation_s=None)
    a, b, c = req(0, 4, 60, t=0.0), req(1, 4, 10, t=1.0), req(2, 4, 500, t=2.0)
    for r in (a, b, c):
        q.add(r)
    assert q.pop() is a  # a and b share the first bucket: arrival order
    q.prepend(c)
    assert q.peek() is c and len(q) == 2 and list(q) == [c, b]
    q.remove(c)
    assert q.pop() is b and not q
