"""Preemption and rescheduling: recompute vs swap (PCIe time both ways), victim rules, requeue position, and the
per-request record of every scheduling, preemption and resumption (constant 1-s steps, tests/conftest.py)."""

import pytest

from lab.core.request import RequestStatus
from policies.common import pick_victim
from policies.vllm_v1 import VLLMV1Scheduler
from tests.conftest import make_engine, req, submit

# 7 usable blocks of 4 tokens. Step 1 prefills a (8), b (8) and c (11): 2 + 2 + 3 blocks, the cache is full; at
# t = 1 a needs a 3rd block for its 9th token and the last admitted request, c, is preempted.
CFG = dict(num_gpu_blocks=8, block_size=4, max_num_batched_tokens=100, scheduler_reserve_full_isl=False)


def trio():
    return req(0, 8, 10), req(1, 8, 10), req(2, 11, 10)


def swap_engine(swap_space_bytes=1e9, **cfg):
    env, inst, cost = make_engine(preemption_mode="swap", **{**CFG, **cfg})
    inst.configure_swap(kv_bytes_per_token=1000, pcie_bandwidth=1e6, swap_space_bytes=swap_space_bytes)  # 1 ms/token
    return env, inst, cost


def test_swap_preemption_costs_the_pcie_time_both_ways_and_never_recomputes():
    env, inst, cost = swap_engine()
    a, b, c = trio()
    submit(env, inst, [a, b, c])
    env.run(until=2.5)
    # step 2 swapped c's 11 computed tokens out: 11 x 1000 B at 1 MB/s = 11 ms added to that step
    assert inst.steps.cols["duration"][1] == pytest.approx(1.011)
    assert inst.steps.cols["transfer_s"][1] == pytest.approx(0.011)
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 11 and c.swapped_tokens == 11
    assert c.blocks == [] and inst.swap.used_tokens == 11
    env.run()
    assert all(r.status == RequestStatus.FINISHED and r.num_output_tokens == 10 for r in (a, b, c))
    # nothing is ever recomputed: after the first step every scheduled request gets exactly one token
    assert all(s.num_tokens == s.num_decodes for s in cost.shapes[1:])
    resumed = [e for e in c.events if e[1] == "resumed"]
    assert resumed[0][2] == "swap-in 11 tokens (11.000 ms over PCIe)"
    # every swap-out has its swap-in: the host link carried each swapped token twice
    swapped = sum(int(e[2].split()[1]) for r in (a, b, c) for e in r.events if e[1] == "preempted")
    assert sum(inst.steps.cols["transfer_s"]) == pytest.approx(2 * swapped * 1e-3)
    assert inst.swap.used_tokens == 0


def test_recompute_preemption_drops_the_kv_and_recomputes_prompt_and_outputs():
    env, inst, cost = make_engine(prefix_caching=False, **CFG)
    a, b, c = trio()
    submit(env, inst, [a, b, c])
    env.run()
    assert sum(inst.steps.cols["transfer_s"]) == 0.0
    assert any(12 in s.prefill_new for s in cost.shapes)  # c's 11 prompt tokens + its 1 output, again
    pre = [e for e in c.events if e[1] == "preempted"][0]
    assert pre[2].startswith("recompute, 11 computed tokens dropped; KV cache full: request 0")


def test_swap_falls_back_to_recompute_when_the_cpu_swap_space_is_full():
    env, inst, cost = swap_engine(swap_space_bytes=5000)  # room for 5 tokens
    a, b, c = trio()
    submit(env, inst, [a, b, c])
    env.run(until=2.5)
    assert c.num_computed_tokens == 0 and c.swapped_tokens == 0 and inst.steps.cols["transfer_s"][1] == 0
    assert "(CPU swap space full)" in [e for e in c.events if e[1] == "preempted"][0][2]


@pytest.mark.parametrize("rule,victim", [("last", 2), ("most_kv", 2), ("least_progress", 2)])
def test_victim_rules_pick_on_an_engine(rule, victim):
    env, inst, cost = make_engine(preemption_victim=rule, **CFG)
    rs = trio()
    submit(env, inst, list(rs))
    env.run(until=1.5)
    assert [r.num_preemptions for r in rs] == [int(i == victim) for i in range(3)]


def test_victim_rules_on_a_running_list():
    a, b, c = req(0, 8, 10, priority=1), req(1, 30, 10, priority=5), req(2, 4, 10, priority=0)
    a.blocks, b.blocks, c.blocks = [0] * 3, [0] * 8, [0] * 2
    a.num_output_tokens, b.num_output_tokens, c.num_output_tokens = 5, 1, 1
    running = [a, b, c]
    assert pick_victim(running, "last") is c
    assert pick_victim(running, "lowest_priority") is b
    assert pick_victim(running, "most_kv") is b
    assert pick_victim(running, "least_progress") is b  # 1 token generated like c, but the longer prompt
    with pytest.raises(ValueError, match="unknown victim rule"):
        pick_victim(running, "oldest")


def test_an_already_scheduled_victim_is_unscheduled_and_its_tokens_refunded():
    # lowest_priority picks a (priority 5, admitted first, scheduled before b asks for a block): a leaves this
    # step's batch
    env, inst, cost = make_engine(preemption_victim="lowest_priority", **CFG)
    a, b, c = req(0, 11, 10, priority=5), req(1, 8, 10), req(2, 8, 10)
    submit(env, inst, [a, b, c])
    env.run(until=2.5)
    # step 2: a (3 blocks, has a spare slot) is scheduled; b needs a 3rd block: the lowest priority is a's
    assert a.num_preemptions == 1 and b.num_preemptions == 0
    assert cost.shapes[1].num_seqs == 2 and inst.steps.cols["num_preempted"][1] == 1


def test_requeue_tail_puts_the_preempted_request_behind_waiting_ones():
    env, inst, cost = make_engine(preemption_requeue="tail", **CFG)
    a, b, c = trio()
    d = req(3, 4, 2, t=0.1)
    submit(env, inst, [a, b, c, d])
    env.run(until=1.5)
    assert list(inst.waiting) == [d, c]
    env, inst, cost = make_engine(**CFG)  # vLLM: back at the head
    a, b, c = trio()
    d = req(3, 4, 2, t=0.1)
    submit(env, inst, [a, b, c, d])
    env.run(until=1.5)
    assert list(inst.waiting) == [c, d]


def test_every_scheduling_preemption_and_resumption_is_recorded_with_its_reason():
    env, inst, cost = make_engine(**CFG)
    a, b, c = trio()
    submit(env, inst, [a, b, c])
    env.run()
    kinds = [e[1] for e in c.events]
    assert kinds[:5] == ["arrived", "scheduled", "first_token", "preempted", "resumed"] and kinds[-1] == "finished"
    assert kinds.count("preempted") == c.num_preemptions == kinds.count("resumed")
    details = {e[1]: e[2] for e in c.events if len(e) > 2}
    assert details["scheduled"] == "prefix hit 0 of 11 tokens"
    assert "victim rule last" in details["preempted"]
    assert details["resumed"].startswith("recompute ")


def test_vllm_v1_default_victims_are_unchanged():
    # auto = last under FCFS, lowest priority under the priority queue (test_scheduler.py has the full cases)
    env, inst, _ = make_engine(**CFG, queue_policy="priority", scheduler=VLLMV1Scheduler())
    a, b, c = req(0, 8, 10, priority=5), req(1, 8, 10, priority=0), req(2, 11, 10, priority=1)
    submit(env, inst, [a, b, c])
    env.run(until=2.0)
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (1, 0, 0)


def test_swap_in_an_experiment_uses_the_models_kv_bytes_and_the_gpus_pcie_bandwidth():
    from lab.experiment.config import parse_experiment
    from lab.report.run_summary import collect
    from lab.experiment.simulation import simulate

    exp = parse_experiment({
        "name": "swap", "engine": {"num_gpu_blocks": 200, "scheduler_reserve_full_isl": False},
        "workload": {"num_requests": 40, "rate": 50, "prompt_tokens": {"kind": "constant", "value": 300, "max": 300},
                     "output_tokens": {"kind": "constant", "value": 200, "max": 200}},
        "policy": {"preemption": {"mode": "swap"}}, "simulation": {"progress": False}})
    res = simulate(exp)
    _, summary = collect(res)
    assert summary["num_finished"] == 40 and summary["num_swaps"] > 0
    swapped = sum(int(e[2].split()[1]) for r in res.requests for e in r.events if e[1] == "preempted")
    per_token = 2 * 8 * 128 * 32 / 64e9 * 2  # Llama-3.1-8B bf16 KV bytes per token over H100 PCIe 5.0 (64 GB/s)
    assert summary["engine"]["transfer_s"] == pytest.approx(2 * swapped * per_token)


def test_most_kv_never_preempts_a_request_admitted_before_the_requester():
    # the same trio under most_kv: b may only preempt itself or c (admitted after it), so a, which holds the most
    # KV, keeps running and the oldest request always progresses (no preemption livelock)
    env, inst, cost = make_engine(preemption_victim="most_kv", **CFG)
    a, b, c = req(0, 11, 10), req(1, 8, 10), req(2, 8, 10)
    submit(env, inst, [a, b, c])
    env.run(until=2.5)
    assert a.num_preemptions == 0 and b.num_preemptions + c.num_preemptions >= 1
    running = [a, b, c]
    a.blocks, b.blocks, c.blocks = [0] * 9, [0] * 3, [0] * 2
    assert pick_victim(running, "most_kv") is a
    assert pick_victim(running, "most_kv", requester=b) is b
    assert pick_victim(running, "least_progress", requester=c) is c
