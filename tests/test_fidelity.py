"""Issue-3 behaviour: async scheduling, CPU overhead, CUDA-graph padding, KV capacity, validation metrics."""

import json

import numpy as np
import pandas as pd
import pytest

from lab.costmodel.hardware import load_hardware
from lab.costmodel.kv_capacity import activation_peak_bytes, derive_num_gpu_blocks
from lab.costmodel.model_arch import load_model
from lab.engine.instance import EngineOptions
from lab.report.validate import compare, load_measured, simulated_timeseries
from lab.workload.loaders import load_vllm_bench
from tests.conftest import make_engine, req, submit


def engine(**kw):
    opts = {k: kw.pop(k) for k in list(kw) if k in EngineOptions.__dataclass_fields__}
    return make_engine(options=EngineOptions(**{"fast_forward": False, **opts}), **kw)


def test_async_scheduling_keeps_decodes_back_to_back_and_never_schedules_past_the_last_token():
    env, inst, cost = engine(async_scheduling=True)
    a = req(0, 4, 3)
    submit(env, inst, [a])
    env.run()
    # prefill [0,1], decodes [1,2], [2,3]: the decode for step 2 was scheduled at t=0 while step 1 ran
    assert (a.first_token_time, a.finish_time) == (1.0, 3.0)
    assert len(cost.shapes) == 3  # no wasted step past max_tokens


def test_async_scheduling_admits_an_arrival_one_step_later():
    for use_async, first_token in ((False, 2.0), (True, 3.0)):
        env, inst, cost = engine(async_scheduling=use_async)
        a, b = req(0, 4, 5, t=0.0), req(1, 4, 2, t=0.5)
        submit(env, inst, [a, b])
        env.run()
        # b arrives while step 1 runs. Sync: scheduled at t=1 into step [1,2]. Async: step [1,2] was already
        # scheduled at t=0, so b is scheduled at t=1 into step [2,3].
        assert b.first_scheduled_time == 1.0
        assert b.first_token_time == first_token


def test_cpu_overhead_adds_to_sync_steps_and_hides_behind_async_steps():
    env, inst, cost = engine(dt=1.0, async_scheduling=False, cpu_base_s=0.25)
    a = req(0, 4, 3)
    submit(env, inst, [a])
    env.run()
    assert a.finish_time == pytest.approx(3.75)
    # async: only the first step waits for its CPU work (nothing in flight to overlap); later ones are hidden
    env, inst, cost = engine(dt=1.0, async_scheduling=True, cpu_base_s=0.25)
    a = req(0, 4, 3)
    submit(env, inst, [a])
    env.run()
    assert a.finish_time == pytest.approx(3.25)
    # CPU-bound: each step's GPU work starts 1.5 s after the previous one's (1.5, 3.0, 4.5): the CPU sets the pace
    env, inst, cost = engine(dt=1.0, async_scheduling=True, cpu_base_s=1.5)
    a = req(0, 4, 3)
    submit(env, inst, [a])
    env.run()
    assert a.finish_time == pytest.approx(5.5)


def test_preempted_request_drops_the_token_of_its_step_in_flight():
    env, inst, cost = engine(num_gpu_blocks=8, block_size=4, max_num_batched_tokens=100,
                             scheduler_reserve_full_isl=False, async_scheduling=True)
    rs = [req(0, 8, 10), req(1, 8, 10), req(2, 11, 10)]
    submit(env, inst, rs)
    env.run()
    assert rs[2].num_preemptions >= 1
    assert all(r.num_output_tokens == 10 and r.num_output_placeholders == 0 for r in rs)


def test_cudagraph_padding_rounds_token_counts_up_to_the_capture_size():
    env, inst, cost = engine(cudagraph_sizes=(1, 2, 4, 8))
    submit(env, inst, [req(i, 4, 2) for i in range(3)])
    env.run()
    assert cost.shapes[0].num_tokens == 12 and cost.shapes[0].padded_tokens == 0  # above the largest size: eager
    assert cost.shapes[1].num_tokens == 3 and cost.shapes[1].padded_tokens == 4
    assert cost.shapes[1].dense_tokens == 4


def test_kv_capacity_formula_against_hand_computation():
    m, h = load_model("Llama-3.1-8B"), load_hardware("H100-SXM5-80GB")
    cap = derive_num_gpu_blocks(m, h, block_size=16, gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                                max_num_seqs=256, non_torch_bytes=870_000_000)
    requested = int(85_520_809_984 * 0.9)
    weights = 8_029_995_008 * 2
    forward = 8192 * (2 * 4096 + 3 * 14336) * 2          # MLP live set of the profile run
    sampler = 256 * 128256 * 4 * 2                        # fp32 logits + one softmax copy
    act = max(forward, sampler) + min(forward, sampler) // 2
    per_block = 2 * 16 * 8 * 128 * 2 * 32                 # K and V, 16 tokens, 8 KV heads x 128, bf16, 32 layers
    assert activation_peak_bytes(m, 8192, 256) == act
    assert cap.bytes_per_block == per_block
    assert cap.num_gpu_blocks == (requested - weights - act - 870_000_000) // per_block
    # TP2 halves the KV heads and weights per rank
    cap2 = derive_num_gpu_blocks(m, h, block_size=16, gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                                 max_num_seqs=256, tp=2)
    assert cap2.bytes_per_block == per_block // 2 and cap2.weight_bytes == weights // 2


def test_validation_errors_on_a_tiny_pair_with_known_answers():
    measured = pd.DataFrame({"request_id": ["a", "b", "c"], "ttft": [1.0, 2.0, 3.0], "tpot": [0.1, 0.1, 0.1],
                             "e2el": [10.0, 20.0, 30.0]})
    simulated = pd.DataFrame({"request_id": ["a", "b", "c", "d"], "ttft": [1.1, 2.2, 3.3, 9.0],
                              "tpot": [0.1, 0.1, 0.1, 0.1], "e2el": [9.0, 18.0, 27.0, 1.0],
                              "status": ["finished"] * 3 + ["unfinished"]})
    r = compare(measured, simulated)
    assert r["num_compared"] == 3
    assert r["metrics"]["ttft"]["mean"]["error_pct"] == pytest.approx(10.0)
    assert r["metrics"]["ttft"]["p50"]["error_pct"] == pytest.approx(10.0)
    assert r["metrics"]["tpot"]["mean"]["error_pct"] == pytest.approx(0.0)
    assert r["metrics"]["e2el"]["p90"]["error_pct"] == pytest.approx(-10.0)
    assert r["per_request_error_pct"]["ttft"]["mean"] == pytest.approx(10.0)
    assert r["per_request_error_pct"]["e2el"]["abs_p90"] == pytest.approx(10.0)


def test_vllm_bench_detailed_json_as_measured_run_and_as_workload(tmp_path):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"request_rate": 4.0, "burstiness": 1.0, "input_lens": [100, 200],
                             "output_lens": [3, 1], "ttfts": [0.05, 0.08], "itls": [[0.01, 0.02], []],
                             "errors": ["", ""]}))
    m = load_measured(p, "vllm_bench")
    assert list(m["request_id"]) == ["0", "1"]
    assert m["e2el"].tolist() == pytest.approx([0.08, 0.08])
    assert m["tpot"].iloc[0] == pytest.approx(0.015) and np.isnan(m["tpot"].iloc[1])
    reqs = load_vllm_bench(p, seed=1)
    assert [(r.request_id, r.prompt_len, r.max_tokens) for r in reqs] == [("0", 100, 3), ("1", 200, 1)]
    assert reqs[0].arrival_time == 0.0 and reqs[1].arrival_time > 0


def test_simulated_timeseries_counts_prompts_once_at_their_first_token():
    steps = pd.DataFrame({"start": [0.0, 0.5, 1.2], "duration": [0.4, 0.4, 0.4], "prefill_tokens": [100, 0, 50],
                          "output_tokens": [1, 2, 2], "num_running": [1, 2, 2], "num_waiting": [1, 0, 0],
                          "kv_usage": [0.1, 0.2, 0.3]})
    reqs = pd.DataFrame({"first_token_time": [0.4, 1.6], "prompt_tokens": [100, 80]})
    ts = simulated_timeseries(steps, reqs)
    assert ts["t"].tolist() == [1.0, 2.0]
    assert ts["prompt_throughput"].tolist() == [100, 80]
    assert ts["gen_throughput"].tolist() == [3, 2]
    assert ts["running"].tolist() == [2, 2] and ts["kv_cache_pct"].tolist() == pytest.approx([20.0, 30.0])
