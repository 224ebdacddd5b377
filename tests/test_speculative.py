"""Speculative decoding on hand-worked cases: drafts in the budget and the KV, rollback after partial acceptance,
per-position counts, drafts after a non-final chunk, async placeholders, 0.33's padding, verify pricing, the block
count with drafter layers, and the experiment-level wiring (methods, defaults, refusals)."""

import pytest
import simpy

from lab.core.batch import BatchShape
from lab.core.kv_cache import KVCacheManager
from lab.core.request import Request
from lab.core.samples import WeightedSamples
from lab.core.sched_api import SchedulerConfig
from lab.core.speculation import Speculator, uniform
from lab.costmodel.hardware import load_hardware
from lab.costmodel.kv_capacity import derive_num_gpu_blocks
from lab.costmodel.model_arch import load_model
from lab.costmodel.operator import OperatorCostModel
from lab.costmodel.roofline import RooflineCostModel
from lab.costmodel.speculative import make_drafter
from lab.engine.instance import EngineOptions, Instance
from lab.experiment.config import ConfigError, parse_experiment
from lab.experiment.simulation import build_deployment, simulate
from policies.vllm_v1 import VLLMV1Scheduler
from tests.conftest import ConstantCost, req, submit


def engine(rates=(1.0,), k=3, async_=False, budget=64, block_size=4, blocks=128, lookahead=None, pad=False,
           prefix_caching=False, hit=1.0):
    env = simpy.Environment()
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=1024,
                             num_speculative_tokens=k, num_lookahead_tokens=k if lookahead is None else lookahead,
                             pad_new_one_token_requests=pad)
    kv = KVCacheManager(blocks, block_size, 1024, enable_prefix_caching=prefix_caching)
    cost = ConstantCost(1.0)
    spec = Speculator(k, rates, seed=7, hit_probability=hit)
    inst = Instance(env, 0, config, VLLMV1Scheduler(), kv, cost, WeightedSamples(), record_events=True,
                    options=EngineOptions(async_scheduling=async_, fast_forward=False), acceptance=spec)
    return env, inst, cost, spec


def test_a_decode_schedules_its_sampled_token_plus_k_drafts_in_the_budget():
    # step 1 prefills two 5-token prompts (10 of a 10-token budget); each samples and gets k = 3 drafts, which
    # step 2 (scheduled at t=1) takes: 1 + 3 tokens each, verify queries against their 5 computed tokens
    env, inst, cost, spec = engine(rates=(0.0,), budget=10)
    a, b = req(0, 5, 10), req(1, 5, 10)
    submit(env, inst, [a, b])
    env.run(until=0.5)
    assert (a.num_spec_tokens, b.num_spec_tokens) == (0, 0)
    env.run(until=2.5)
    shape = cost.shapes[1]
    assert shape.verify_new == [4, 4] and shape.verify_context == [5, 5] and shape.num_tokens == 8
    # step 3: every draft was rejected (rate 0): C back to 6 = num_tokens - 1, and 1 + 3 again
    assert cost.shapes[2].verify_new == [4, 4] and cost.shapes[2].verify_context == [6, 6]


def test_drafts_are_trimmed_to_n_plus_c_minus_num_tokens_when_the_budget_caps_n():
    env, inst, cost, _ = engine(rates=(0.0,), budget=6)
    a, b = req(0, 3, 10), req(1, 3, 10)
    submit(env, inst, [a, b])
    env.run(until=2.5)
    # step 2: a gets 1 + 3 = 4 tokens, b the 2 left: its last sampled token and 1 draft (trimmed from 3)
    shape = cost.shapes[1]
    assert shape.verify_new == [4, 2]
    assert b.num_draft_tokens == 1 and a.num_draft_tokens == 3


def test_partial_acceptance_rolls_c_back_by_the_rejected_drafts_and_emits_accepted_plus_one():
    # p1 = 1, p2 = 0: exactly one of three drafts is accepted every time
    env, inst, cost, spec = engine(rates=(1.0, 0.0))
    a = req(0, 8, 20)
    submit(env, inst, [a])
    env.run(until=1.5)
    # step 1 sampled 1 token; step 2 (in flight since t=1) computes it and 3 drafts: C 8 -> 12
    assert (a.num_output_tokens, a.num_computed_tokens) == (1, 12)
    env.run(until=2.5)
    # step 2 accepted 1 of 3: C back by 2 to 10, 1 + 1 tokens emitted (3 outputs, num_tokens 11, C = 11 - 1);
    # step 3, scheduled at t=2, starts from C = 10 and computes 1 + 3 again
    assert (a.num_output_tokens, a.num_tokens) == (3, 11)
    assert cost.shapes[2].verify_context == [10] and a.num_computed_tokens == 14
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (1, 3, 1)
    assert ("verified" in [e[1] for e in a.events])


def test_per_position_counts_and_the_seeded_stream_match_the_conditional_rates():
    spec = Speculator(3, (1.0, 1.0, 0.0), seed=1)
    r = req(0, 4, 4)
    for _ in range(5):
        assert spec.num_accepted(r, 3) == 2
    assert spec.accepted_per_pos == [5, 5, 0]
    rates = (0.8, 0.5, 0.25)
    spec = Speculator(3, rates, seed=3)
    many = [Request(i, 0.0, 4, 4) for i in range(4000)]
    total = sum(spec.num_accepted(r, 3) for r in many)
    assert total / 4000 == pytest.approx(spec.expected_accepted(3), rel=0.05)  # 0.8 + 0.4 + 0.1 = 1.3
    assert spec.accepted_per_pos[0] / 4000 == pytest.approx(0.8, abs=0.03)
    assert spec.accepted_per_pos[1] / 4000 == pytest.approx(0.4, abs=0.03)
    # the same seed and request give the same draws, whatever else was drawn before
    again = Speculator(3, rates, seed=3)
    assert [again.num_accepted(Request(i, 0.0, 4, 4), 3) for i in range(50)] == \
           [Speculator(3, rates, seed=3).num_accepted(Request(i, 0.0, 4, 4), 3) for i in range(50)]
    assert 0.0 <= uniform(3, 5, 7) < 1.0 and uniform(3, 5, 7) != uniform(3, 5, 8)


def test_acceptance_reads_each_draw_of_the_counter_stream_across_blocks_and_evictions():
    # uniforms are computed a block at a time and kept for at most MAX_STREAM_BLOCKS requests: each verification
    # must still read exactly uniform(seed, index, draw) for its draws, wherever a block starts or was dropped
    from lab.core.speculation import MAX_STREAM_BLOCKS, STREAM_BLOCK

    rates = (0.9, 0.8, 0.7, 0.6)
    spec = Speculator(4, rates, seed=11)
    reqs = [Request(i, 0.0, 4, 4) for i in range(MAX_STREAM_BLOCKS + 300)]
    reqs[5].acceptance_rate = 0.5
    reqs[7].spec_draws = STREAM_BLOCK - 2  # its first verification straddles a block's end
    draws = {r.index: r.spec_draws for r in reqs}

    def expected(r, k):
        accepted, d = 0, draws[r.index]
        while accepted < k:
            d += 1
            if uniform(11, r.index, d - 1) >= (r.acceptance_rate if r.acceptance_rate is not None else rates[accepted]):
                break
            accepted += 1
        draws[r.index] = d
        return accepted

    order = reqs[:10] * 60 + reqs + reqs[:10] * 5  # the first ten go past a block, are evicted, come back
    for step, r in enumerate(order):
        k = 1 + step % 4
        assert spec.num_accepted(r, k) == expected(r, k)
        assert r.spec_draws == draws[r.index]
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens == sum(r.num_accepted_tokens for r in reqs)


def test_lookahead_slots_are_allocated_for_the_drafter():
    # block size 4: a new request is admitted with its k = 3 lookahead slots (vLLM 0.33 effective_lookahead_tokens,
    # scheduler.py:1401-1406): its prefill of 8 tokens needs ceil(11 / 4) = 3 blocks; its first verify step
    # (C 8 -> 12) plus the lookahead slots needs ceil(15 / 4) = 4
    env, inst, cost, _ = engine(rates=(0.0,))
    a = req(0, 8, 20)
    submit(env, inst, [a])
    env.run(until=0.5)
    assert len(a.blocks) == 3
    env.run(until=1.5)
    assert len(a.blocks) == 4
    env2, inst2, _, _ = engine(rates=(0.0,), lookahead=0)
    b = req(0, 8, 20)
    submit(env2, inst2, [b])
    env2.run(until=1.5)
    assert len(b.blocks) == 3  # ceil(12 / 4): no lookahead slots


def test_every_admission_is_given_its_lookahead_slots():
    # vLLM 0.33 (scheduler.py:1401-1406, checked by the parity harness): a fresh request and one holding computed
    # state (e.g. its remote KV arrived) both reserve the k = 3 lookahead slots when admitted
    from policies.vllm_v1 import admission_lookahead

    env, inst, _, _ = engine(rates=(0.0,))
    fresh, holding = req(0, 8, 20), req(1, 8, 20)
    holding.num_computed_tokens = 7
    assert (admission_lookahead(inst.config, fresh), admission_lookahead(inst.config, holding)) == (3, 3)


def test_drafts_proposed_after_a_non_final_prefill_chunk_are_discarded():
    # a 20-token prompt in chunks of 8, 8, 4: only the final chunk samples, so only step 4 verifies drafts
    env, inst, cost, _ = engine(budget=8)
    a = req(0, 20, 5)
    submit(env, inst, [a])
    env.run(until=3.5)
    assert [s.prefill_new for s in cost.shapes[:3]] == [[8], [8], [4]]
    assert [s.verify_new for s in cost.shapes[:3]] == [[], [], []]
    assert cost.shapes[3].verify_new == [4] and cost.shapes[3].verify_context == [20]


def test_async_scheduling_holds_placeholders_and_schedules_the_next_verify_while_one_is_in_flight():
    # t=0: step 1 prefills 8 tokens; the request will sample, so it holds P = 1 and 3 placeholder drafts, and
    # step 2 is scheduled at once: n = 8 + 3 + 1 - 8 = 4 (its token from the GPU and 3 drafts), P = 1 + 4.
    # t=1: step 1 ends (P = 4); step 3 is scheduled on placeholders: n = 9 + 3 + 4 - 12 = 4, P = 8
    env, inst, cost, _ = engine(rates=(1.0,), async_=True)
    a = req(0, 8, 40)
    submit(env, inst, [a])
    env.run(until=1.5)
    assert cost.shapes[1].verify_new == [4] and cost.shapes[2].verify_new == [4]
    assert a.num_output_placeholders == 8 and a.num_spec_tokens == 3 and a.num_computed_tokens == 16
    env.run(until=2.5)
    assert a.num_output_tokens == 1 + 4  # step 2 ended at t=2: all 3 drafts accepted, 1 + 3 tokens


def test_vllm_033_pads_a_newly_admitted_one_token_request_to_one_plus_k_placeholder_drafts():
    # prompt of 9 tokens, block size 4, prefix caching: a second identical request hits 2 blocks (8 tokens) and
    # computes 1 token, padded to 1 + 3; the 3 placeholder drafts are never accepted and not counted
    env, inst, cost, spec = engine(rates=(1.0,), pad=True, prefix_caching=True)
    ids = list(range(9))
    a = Request(0, 0.0, 9, 1, prompt_token_ids=ids)
    b = Request(1, 1.5, 9, 2, prompt_token_ids=ids)
    submit(env, inst, [a, b])
    env.run(until=2.6)  # b's first step ran from t=1.5 to 2.5
    shape = cost.shapes[1]
    assert shape.verify_new == [4] and shape.verify_context == [8]
    # C rolled back by the 3 placeholders to 9 = num_tokens - 1: the next step verifies from there
    assert b.num_output_tokens == 1 and cost.shapes[2].verify_context == [9]
    assert b.num_drafts == 0 and spec.num_drafts == 0


def test_eagle_drops_one_more_block_from_a_prefix_hit():
    kv = KVCacheManager(64, 4, 1024, drop_last_hit_block=True)
    ids = list(range(13))
    a = Request(0, 0.0, 13, 1, prompt_token_ids=ids)
    assert kv.allocate_slots(a, 13)
    b = Request(1, 0.0, 13, 1, prompt_token_ids=ids)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8  # 3 full blocks could hit; the last is dropped
    plain = KVCacheManager(64, 4, 1024)
    assert plain.allocate_slots(Request(2, 0.0, 13, 1, prompt_token_ids=ids), 13)
    assert plain.get_computed_blocks(b)[1] == 12


def test_a_verify_query_is_priced_differently_from_a_prefill_chunk_of_the_same_tokens():
    llama = load_model("Llama-3.1-8B")
    h100 = load_hardware("H100-SXM5-80GB")
    for cm in (OperatorCostModel(llama, h100), RooflineCostModel(llama, h100)):
        verify = BatchShape.from_requests([4] * 32, [2000] * 32, [3] * 32)
        prefill = BatchShape.from_requests([4] * 32, [2000] * 32)
        decode = BatchShape.from_requests([1] * 32, [2003] * 32)
        tv, tp, td = cm.step_time(verify), cm.step_time(prefill), cm.step_time(decode)
        assert tv != tp
        # the verify reads each request's KV once, as a decode does: far closer to the decode than 4 decodes
        assert tv < 2 * td
        assert verify.num_logits == 128 and prefill.num_logits == 32


def test_drafter_layers_take_block_bytes_and_weights():
    llama = load_model("Llama-3.1-8B")
    h100 = load_hardware("H100-SXM5-80GB")
    d = make_drafter("eagle3", llama, "bf16", "bf16", 1)
    assert d.kv_bytes_per_token == 2 * 8 * 128 * 2  # one layer, 8 KV heads of 128, K and V, bf16
    base = derive_num_gpu_blocks(llama, h100)
    spec = derive_num_gpu_blocks(llama, h100, drafter_kv_bytes_per_token=d.kv_bytes_per_token,
                                 drafter_weight_bytes=d.weight_bytes)
    assert spec.bytes_per_block == base.bytes_per_block * 33 // 32
    assert spec.num_gpu_blocks == (base.available_bytes - d.weight_bytes) // spec.bytes_per_block
    ds = load_model("DeepSeek-V3")
    mtp = make_drafter("mtp", ds, "bf16", "fp8", 8)
    assert mtp.kv_bytes_per_token == ds.kv_bytes_per_token_per_layer("bf16", 8)  # one MTP layer of MLA latent
    with pytest.raises(ValueError, match="has no MTP layers"):
        make_drafter("mtp", llama, "bf16", "bf16", 1)


def _exp(**over):
    base = {"name": "spec", "seed": 3, "workload": {"source": "synthetic", "num_requests": 40, "rate": 2.0,
                                                   "prompt_tokens": {"kind": "constant", "value": 256},
                                                   "output_tokens": {"kind": "constant", "value": 64}},
            "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
            "simulation": {"progress": False}}
    base.update(over)
    return parse_experiment(base)


def test_eagle3_speeds_up_a_lightly_loaded_llama_and_reports_vllm_counters():
    plain = simulate(_exp())
    fast = simulate(_exp(speculative={"method": "eagle3", "num_speculative_tokens": 3}))
    tpot = lambda res: sum(r.finish_time - r.first_token_time for r in res.requests) / len(res.requests)
    assert tpot(fast) < 0.7 * tpot(plain)
    spec = [i.acceptance for i in fast.instances][0]
    assert spec.num_drafts == sum(r.num_drafts for r in fast.requests) > 0
    assert spec.accepted_per_pos[0] / spec.num_drafts == pytest.approx(0.7296, abs=0.03)
    assert all(r.num_output_tokens == 64 for r in fast.requests)
    again = simulate(_exp(speculative={"method": "eagle3", "num_speculative_tokens": 3}))
    assert [r.finish_time for r in again.requests] == [r.finish_time for r in fast.requests]


def test_methods_aliases_and_refusals():
    exp = _exp(model={"name": "DeepSeek-V3", "dtype": "fp8"}, hardware={"gpu": "H200-SXM-141GB",
               "tensor_parallel_size": 8}, speculative={"method": "deepseek_mtp", "num_speculative_tokens": 2})
    assert exp.speculative.method == "mtp"
    dep = build_deployment(exp)
    assert dep.scheduler_config.num_lookahead_tokens == 2 and dep.drafter.method == "mtp"
    with pytest.raises(ValueError, match="has no MTP layers"):
        build_deployment(_exp(speculative={"method": "mtp", "num_speculative_tokens": 1}))
    with pytest.raises(ConfigError, match="needs 'model'"):
        _exp(speculative={"method": "draft_model", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="does not support speculative decoding"):
        simulate(_exp(policy="orca", speculative={"method": "eagle", "num_speculative_tokens": 1}))
    with pytest.raises(ConfigError, match="async_scheduling: true with speculative.method ngram"):
        simulate(_exp(engine={"async_scheduling": True}, speculative={"method": "ngram", "num_speculative_tokens": 2}))
    ngram = build_deployment(_exp(speculative={"method": "ngram", "num_speculative_tokens": 2}))
    assert not ngram.engine_options.async_scheduling and ngram.scheduler_config.num_lookahead_tokens == 0


@pytest.mark.parametrize("method,extra", [("ngram", {}), ("eagle", {}), ("draft_model", {"model": "Qwen2.5-7B"}),
                                          ("eagle3", {"acceptance": {"kind": "per_request"}})])
def test_every_method_runs_to_completion_with_the_invariants(method, extra):
    res = simulate(_exp(speculative={"method": method, "num_speculative_tokens": 2, **extra}))
    assert all(r.num_output_tokens == r.max_tokens for r in res.requests)
    assert all(r.num_accepted_tokens <= r.num_draft_tokens <= 2 * r.num_drafts for r in res.requests)
    assert sum(i.acceptance.num_drafts for i in res.instances) > 0


def test_the_step_log_counts_verify_steps_as_decodes_with_their_drafts_apart():
    from lab.report.run_tables import steps_frame

    # two 64-token prompts 1 ms apart, k = 2, nothing accepted: step 1 prefills the first; step 2 prefills the
    # second beside the first's verify (1 + 2 tokens); then both verify, 1 + 2 tokens each, until the end
    res = simulate(_exp(workload={"source": "synthetic", "num_requests": 2, "rate": 1000.0,
                                  "prompt_tokens": {"kind": "constant", "value": 64},
                                  "output_tokens": {"kind": "constant", "value": 8}},
                        speculative={"method": "eagle", "num_speculative_tokens": 2,
                                     "acceptance": {"kind": "iid", "rate": 0.0}}))
    st = steps_frame(res)
    rows = list(zip(st.scheduled_tokens, st.prefill_tokens, st.decode_requests, st.spec_tokens))
    assert rows[:4] == [(64, 64, 0, 0), (3, 0, 1, 2), (67, 64, 1, 2), (6, 0, 2, 4)]
    assert (st.scheduled_tokens == st.prefill_tokens + st.decode_requests + st.spec_tokens).all()
    assert st.prefill_tokens.sum() == 128 and st.spec_tokens.sum() == sum(r.num_draft_tokens for r in res.requests)
    assert str(st.spec_tokens.dtype) == "int64"


def test_sglang_verifies_drafts_in_its_decode_batches():
    res = simulate(_exp(policy="sglang", speculative={"method": "eagle3", "num_speculative_tokens": 2}))
    assert all(r.num_output_tokens == 64 for r in res.requests)
    assert sum(r.num_drafts for r in res.requests) > 0


def test_per_request_acceptance_from_a_trace_column(tmp_path):
    from lab.workload.loaders import WorkloadError, load_csv

    path = tmp_path / "t.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens,acceptance_rate\n"
                    "0.0,64,33,1.0\n0.1,64,33,0.0\n")
    exp = _exp(workload={"source": "csv", "path": str(path)},
               speculative={"method": "eagle", "num_speculative_tokens": 2, "acceptance": {"kind": "per_request"}})
    res = simulate(exp)
    always, never = res.requests
    assert (always.acceptance_rate, never.acceptance_rate) == (1.0, 0.0)
    assert always.num_accepted_tokens == always.num_draft_tokens > 0  # every draft accepted: 3 tokens per step
    assert never.num_accepted_tokens == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_time_s,prompt_tokens,output_tokens,acceptance_rate\n0.0,64,33,1.5\n")
    with pytest.raises(WorkloadError, match=r"row 2: acceptance_rate must be a probability in \[0, 1\], got 1.5"):
        load_csv(bad)
