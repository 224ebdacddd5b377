"""vLLM V1 scheduling on hand-worked cases (shared/specs/vllm-v1-scheduling.md §1-2).

Every engine here has a constant step time of 1 s, so step k runs over [k-1, k] and its tokens appear at time k.
"""

from lab.core.request import RequestStatus
from tests.conftest import make_engine, req, submit


def run(env, inst, reqs, until=None):
    submit(env, inst, reqs)
    env.run(until=until)


def steps(inst):
    c = inst.steps.cols
    return list(zip(c["scheduled_tokens"], c["prefill_tokens"], c["decode_requests"], c["batch_size"]))


def test_chunked_prefill_splits_a_prompt_over_steps_one_chunk_per_step():
    env, inst, cost = make_engine(max_num_batched_tokens=8)
    a = req(0, 20, 3)
    run(env, inst, [a])
    # 20-token prompt with an 8-token budget: chunks 8, 8, 4, then two decodes
    assert [s.num_tokens for s in cost.shapes] == [8, 8, 4, 1, 1]
    assert cost.shapes[1].prefill_context == [8] and cost.shapes[2].prefill_context == [16]
    assert a.first_token_time == 3.0 and a.finish_time == 5.0
    assert a.first_scheduled_time == 0.0


def test_running_requests_take_the_budget_first_and_waiting_gets_the_rest():
    env, inst, cost = make_engine(max_num_batched_tokens=10)
    a = req(0, 4, 5, t=0.0)
    b = req(1, 30, 2, t=0.5)
    run(env, inst, [a, b])
    # step 1 [0,1]: a prefills 4. b arrives at 0.5.
    # step 2 [1,2]: a decodes 1, b gets the remaining 9. step 3: a 1 + b 9, step 4: a 1 + b 9,
    # step 5: a 1 (its last token) + b 3 (b's prompt done) ...
    shapes = cost.shapes
    assert shapes[0].num_tokens == 4
    assert (shapes[1].num_decodes, shapes[1].prefill_new) == (1, [9])
    assert (shapes[2].num_decodes, shapes[2].prefill_new) == (1, [9])
    assert (shapes[4].num_decodes, shapes[4].prefill_new) == (1, [3])
    assert a.finish_time == 5.0
    assert b.first_token_time == 5.0


def test_without_chunked_prefill_a_waiting_request_waits_until_its_whole_prompt_fits():
    env, inst, cost = make_engine(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a = req(0, 4, 4, t=0.0)
    b = req(1, 10, 2, t=0.5)
    run(env, inst, [a, b])
    # b needs 10 tokens but a's decode takes 1 of the 10: b is admitted only after a finishes (t = 4)
    assert b.first_scheduled_time == 4.0
    assert all(len(s.prefill_new) <= 1 for s in cost.shapes)
    assert [s.num_tokens for s in cost.shapes][:5] == [4, 1, 1, 1, 10]


def test_max_num_seqs_caps_the_running_list():
    env, inst, cost = make_engine(max_num_seqs=2, max_num_batched_tokens=100)
    rs = [req(i, 4, 3) for i in range(3)]
    run(env, inst, rs)
    assert cost.shapes[0].num_seqs == 2
    assert rs[2].first_scheduled_time == 3.0  # admitted once one of the first two finished at t = 3


def test_long_prefill_threshold_caps_tokens_per_request_when_contended():
    env, inst, cost = make_engine(max_num_batched_tokens=100, long_prefill_token_threshold=6)
    a = req(0, 20, 2)
    b = req(1, 20, 2)
    run(env, inst, [a, b])
    assert cost.shapes[0].prefill_new == [6, 6]
    # a lone request is not capped (vLLM 0.33)
    env, inst, cost = make_engine(max_num_batched_tokens=100, long_prefill_token_threshold=6)
    run(env, inst, [req(0, 20, 2)])
    assert cost.shapes[0].prefill_new == [20]
    # legacy: always capped
    env, inst, cost = make_engine(max_num_batched_tokens=100, long_prefill_token_threshold=6,
                                  threshold_only_when_contended=False)
    run(env, inst, [req(0, 20, 2)])
    assert cost.shapes[0].prefill_new == [6]


def test_preemption_picks_the_last_running_request_and_requeues_it_at_the_head():
    # 7 usable blocks of 4 tokens = 28 token slots.
    env, inst, cost = make_engine(num_gpu_blocks=8, block_size=4, max_num_batched_tokens=100,
                                  scheduler_reserve_full_isl=False)
    a = req(0, 8, 10, t=0.0)   # 2 blocks, grows
    b = req(1, 8, 10, t=0.0)   # 2 blocks, grows
    c = req(2, 11, 10, t=0.0)  # 3 blocks, grows
    d = req(3, 4, 2, t=0.1)    # arrives later; waits behind the preempted request
    submit(env, inst, [a, b, c, d])
    env.run(until=2.5)
    # step 1: a, b, c prefill: 2 + 2 + 3 = 7 blocks, the cache is full.
    # step 2 (t=1): a needs a 3rd block for token 9 -> preempt the last running request, c.
    assert c.num_preemptions == 1 and c.status == RequestStatus.PREEMPTED
    assert a.num_preemptions == 0 and b.num_preemptions == 0
    assert list(inst.waiting)[0] is c and list(inst.waiting)[1] is d
    assert c.num_computed_tokens == 0
    assert inst.steps.cols["num_preempted"][1] == 1
    # the step that preempted admits nobody from the waiting queue, even though blocks were freed
    assert cost.shapes[1].num_seqs == 2
    env.run()
    assert all(r.status == RequestStatus.FINISHED for r in (a, b, c, d))
    ev = [e[1] for e in c.events]
    assert ev[:4] == ["arrived", "scheduled", "first_token", "preempted"] and "resumed" in ev


def test_resumed_request_recomputes_prompt_and_outputs_and_keeps_its_tokens():
    env, inst, cost = make_engine(num_gpu_blocks=8, block_size=4, max_num_batched_tokens=100,
                                  scheduler_reserve_full_isl=False, prefix_caching=False)
    a = req(0, 8, 10)
    b = req(1, 8, 10)
    c = req(2, 11, 10)
    run(env, inst, [a, b, c])
    assert c.num_preemptions >= 1
    assert c.num_output_tokens == 10 and c.status == RequestStatus.FINISHED
    # its resume step recomputed prompt + the token it had generated (n = num_tokens - 0 = 12)
    assert any(s.prefill_new and 12 in s.prefill_new for s in cost.shapes)


def test_the_last_running_request_can_preempt_itself():
    env, inst, cost = make_engine(num_gpu_blocks=8, block_size=4, max_num_batched_tokens=100,
                                  scheduler_reserve_full_isl=False)
    a = req(0, 11, 4)  # 3 blocks with one spare slot
    b = req(1, 16, 4)  # 4 blocks, full: its first decode needs a 5th block
    run(env, inst, [a, b], until=2.5)
    # step 2: a fits its token in its spare slot; b finds no free block, is itself the last running request,
    # preempts itself and phase 1 stops
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert cost.shapes[1].num_seqs == 1 and cost.shapes[1].num_decodes == 1
    env.run()
    assert a.status == b.status == RequestStatus.FINISHED


def test_priority_policy_preempts_the_lowest_priority_request():
    env, inst, cost = make_engine(num_gpu_blocks=8, block_size=4, max_num_batched_tokens=100,
                                  scheduler_reserve_full_isl=False, queue_policy="priority")
    a = req(0, 8, 10, priority=5)   # lowest priority, admitted first
    b = req(1, 8, 10, priority=0)
    c = req(2, 11, 10, priority=1)
    submit(env, inst, [a, b, c])
    env.run(until=2.0)
    # admission order is by priority (b, c, a); when blocks run out the victim is a (priority 5), not the last one
    assert a.num_preemptions == 1 and b.num_preemptions == 0 and c.num_preemptions == 0


def test_priority_queue_admits_lower_values_first():
    env, inst, cost = make_engine(max_num_seqs=1, max_num_batched_tokens=100, queue_policy="priority")
    first = req(0, 4, 2, t=0.0, priority=3)
    late_hi = req(1, 4, 2, t=0.2, priority=0)
    late_lo = req(2, 4, 2, t=0.1, priority=9)
    run(env, inst, [first, late_hi, late_lo])
    assert late_hi.first_scheduled_time < late_lo.first_scheduled_time


def test_full_isl_gate_holds_back_a_request_whose_whole_prompt_does_not_fit():
    env, inst, cost = make_engine(num_gpu_blocks=8, block_size=4, max_num_batched_tokens=8,
                                  scheduler_reserve_full_isl=True)
    a = req(0, 16, 3)  # 4 blocks
    b = req(1, 16, 3)  # whole prompt needs 4 more blocks: only 3 free -> waits even though its first chunk fits
    run(env, inst, [a, b])
    assert b.first_scheduled_time >= a.finish_time
    assert a.num_preemptions == 0 and b.num_preemptions == 0


def test_prefix_hit_is_recorded_and_skips_computation():
    env, inst, cost = make_engine(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=100)
    ids = list(range(1, 17))
    a = req(0, 16, 2, t=0.0, prompt_token_ids=ids)
    b = req(1, 16, 2, t=5.0, prompt_token_ids=list(ids))
    run(env, inst, [a, b])
    # a fully cached 16-token prompt: hit = (16 - 1) // 4 * 4 = 12 tokens, the last block is recomputed
    assert a.prefix_hit_tokens == 0 and b.prefix_hit_tokens == 12
    b_first = [s for s in cost.shapes if s.num_tokens and s.prefill_context == [12]]
    assert b_first and b_first[0].prefill_new == [4]


def test_requests_longer_than_max_model_len_are_rejected_with_a_reason():
    env, inst, cost = make_engine(max_model_len=32)
    ok = req(0, 20, 12)
    too_long = req(1, 20, 13)
    run(env, inst, [ok, too_long])
    assert ok.status == RequestStatus.FINISHED
    assert too_long.status == RequestStatus.REJECTED
    assert "max_model_len" in too_long.reason


def test_requests_that_can_never_fit_the_kv_cache_are_rejected():
    env, inst, cost = make_engine(num_gpu_blocks=5, block_size=4)  # 16 token slots
    r = req(0, 10, 8)  # needs 17 slots
    run(env, inst, [r])
    assert r.status == RequestStatus.REJECTED and "KV blocks" in r.reason


def test_every_request_ends_finished_rejected_or_unfinished_at_a_horizon():
    env, inst, cost = make_engine(max_model_len=64)
    rs = [req(i, 10, 20, t=float(i)) for i in range(5)] + [req(5, 60, 10)]
    submit(env, inst, rs)
    env.run(until=8.0)
    statuses = [r.status for r in rs]
    assert statuses[5] == RequestStatus.REJECTED
    assert RequestStatus.RUNNING in statuses  # still running at the horizon
