"""KV offloading (the CPU tier, lab/core/kv_offload.py): a prefix evicted from the GPU comes back from CPU at the
host-link time, the tier's capacity and LRU order, stores that have not finished are no hits, and the option's
wiring (config errors, counters, determinism, off = unchanged)."""

import pandas as pd
import pytest

from lab.core.kv_offload import CPUBlockTier, KVOffloader, cpu_tier_blocks
from lab.experiment.config import ConfigError, parse_experiment
from lab.experiment.simulation import simulate
from lab.report.run_summary import collect
from tests.conftest import make_engine, req, submit

BS = 4  # tokens per block in the hand-worked engine
BW = 4000.0  # host-link bytes/s: a 1000-byte block takes 0.25 s
LAT = 0.01  # seconds per copy


def offloaded_engine(num_cpu_blocks: int = 8, **kw):
    env, inst, cost = make_engine(num_gpu_blocks=5, block_size=BS, **kw)  # 4 usable GPU blocks
    inst.configure_kv_offload(KVOffloader(num_cpu_blocks, BS, 1000, 1, BW, LAT, max_concurrent_loads=8))
    return env, inst


def test_a_prefix_evicted_from_the_gpu_is_loaded_from_cpu_and_its_first_step_starts_at_the_host_link_time():
    # A (8 tokens = 2 blocks) runs 0-1 s; its 2 blocks are stored from its step's end: done 1 + 0.01 + 2 x 0.25 =
    # 1.51 s. B (16 other tokens) takes all 4 GPU blocks at t=2, evicting A's from the GPU. C = A's 8 tokens + 4
    # more arrives at t=5: no GPU hit, 2 blocks in CPU; the load ends at 5 + 0.01 + 0.5 = 5.51 s and C's first step
    # (its last 4 tokens only) starts then, ending at 6.51 s.
    env, inst = offloaded_engine()
    a = req(0, 8, 1, prompt_token_ids=list(range(8)))
    b = req(1, 16, 1, t=2.0, prompt_token_ids=list(range(100, 116)))
    c = req(2, 12, 1, t=5.0, prompt_token_ids=list(range(8)) + [7, 7, 7, 7])
    submit(env, inst, [a, b, c])
    env.run()
    off = inst.kv_offload
    assert c.prefix_hit_tokens == 0 and c.cpu_loaded_tokens == 8
    assert c.first_scheduled_time == pytest.approx(5.51, abs=1e-12)
    assert c.first_token_time == pytest.approx(6.51, abs=1e-12)
    cols = inst.steps.cols
    assert list(cols["start"])[-1] == pytest.approx(5.51, abs=1e-12)
    assert list(cols["scheduled_tokens"])[-1] == 4  # only the tokens after the loaded prefix are computed
    assert (off.cpu_hit_requests, off.cpu_hit_tokens, off.blocks_loaded) == (1, 8, 2)
    assert off.blocks_stored == 2 + 4 + 1  # A's 2, B's 4, C's third block
    assert off.bytes_loaded == 2000 and not off.loads
    assert [e[1] for e in c.events][:3] == ["arrived", "cpu_load", "scheduled"]


def test_without_the_cpu_tier_the_same_request_recomputes_its_prefix():
    env, inst, _ = make_engine(num_gpu_blocks=5, block_size=BS)
    a = req(0, 8, 1, prompt_token_ids=list(range(8)))
    b = req(1, 16, 1, t=2.0, prompt_token_ids=list(range(100, 116)))
    c = req(2, 12, 1, t=5.0, prompt_token_ids=list(range(8)) + [7, 7, 7, 7])
    submit(env, inst, [a, b, c])
    env.run()
    assert (c.first_scheduled_time, c.first_token_time) == (5.0, 6.0)
    assert list(inst.steps.cols["scheduled_tokens"])[-1] == 12


def test_a_store_that_has_not_finished_is_no_hit():
    off = KVOffloader(8, BS, 1000, 1, BW, LAT)
    r = req(0, 12, 1, prompt_token_ids=list(range(12)))
    r.num_computed_tokens = 12
    off.schedule_stores("step", [r], now=0.0)  # offered, copy not timed: in the map, not ready
    assert len(off.tier) == 3 and off.lookup(req(1, 13, 1, prompt_token_ids=list(range(13))), 0, 100.0) == 0
    off.step_ended("step", [r], end=1.0)  # copy 1.0 -> 1.0 + 0.01 + 3 x 0.25 = 1.76 s
    probe = req(2, 13, 1, prompt_token_ids=list(range(13)))
    assert off.lookup(probe, 0, 1.75) == 0
    assert off.lookup(probe, 0, 1.76) == 12
    assert off.lookup(probe, 4, 1.76) == 8  # after a one-block GPU hit


def test_cpu_tier_capacity_and_lru_order():
    t = CPUBlockTier(3)
    assert t.prepare_store([1, 2, 3], 0.0) == [1, 2, 3]
    t.complete_store([1, 2, 3], 0.0)
    t.touch([1])  # 1 becomes the most recent
    assert t.order() == [2, 3, 1]
    assert t.prepare_store([4], 1.0) == [4] and t.order() == [3, 1, 4] and t.num_evictions == 1
    assert t.prepare_store([1, 4], 1.0) == []  # already stored: nothing to copy, nothing evicted
    t.begin_load([3])  # a block being loaded is not evictable; 4 is not ready
    assert t.prepare_store([5], 1.0) == [5] and t.order() == [3, 4, 5]  # 1 (ready, idle) went
    assert t.prepare_store([6], 1.0) is None and t.order() == [3, 4, 5]  # 3 loading, 4 and 5 not ready
    t.end_load([3])
    assert t.prepare_store([6], 1.0) == [6] and t.order() == [4, 5, 6]


def test_touch_keeps_a_prefix_longest():
    t = CPUBlockTier(4)
    t.prepare_store([1, 2, 3, 4], 0.0)
    t.complete_store([1, 2, 3, 4], 0.0)
    t.touch([3, 4])  # a request's blocks: its first is the most recent
    assert t.order() == [1, 2, 4, 3]


def test_cpu_tier_blocks_follow_vllm_cpu_bytes_to_use():
    # Llama-3.1-8B bf16: 2 MiB per 16-token block on one GPU; 16 GiB hold 8192 blocks, over TP2 half as many
    assert cpu_tier_blocks(16, 2 * 2**20, 1) == 8192
    assert cpu_tier_blocks(16, 2**20, 2) == 8192
    assert cpu_tier_blocks(0.5, 2 * 2**20, 1) == 256


def _starved(**engine):
    return {"name": "ko", "seed": 3, "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
            "engine": {"num_gpu_blocks": 120, "max_num_seqs": 32, **engine},
            "workload": {"num_requests": 60, "rate": 40.0,
                         "prompt_tokens": {"kind": "uniform", "low": 100, "high": 300},
                         "output_tokens": {"kind": "uniform", "low": 50, "high": 150}},
            "simulation": {"progress": False}}


def _table(res):
    req, _ = collect(res)
    return req


def test_off_is_unchanged_and_on_reloads_preempted_requests_deterministically():
    unset = _table(simulate(parse_experiment(_starved())))
    zero_res = simulate(parse_experiment(_starved(kv_offloading_size=0)))
    pd.testing.assert_frame_equal(unset, _table(zero_res))
    assert all(i.kv_offload is None for i in zero_res.instances) and "cpu_loaded_tokens" not in unset
    on_res = simulate(parse_experiment(_starved(kv_offloading_size=4)))
    on = _table(on_res)
    assert unset["num_preemptions"].sum() > 0
    # preempted requests recompute nothing they had stored: their own blocks come back from CPU
    assert (on.loc[on["num_preemptions"] > 0, "cpu_loaded_tokens"] > 0).any()
    _, summary = collect(on_res)
    ko = summary["kv_offload"]
    assert ko["cpu_hit_tokens"] == on["cpu_loaded_tokens"].sum() > 0
    assert ko["bytes_loaded"] == ko["blocks_loaded"] * 2 * 2**20 and ko["bytes_stored"] > ko["bytes_loaded"]
    prefill = lambda res: sum(sum(i.steps.cols["prefill_tokens"]) for i in res.instances)  # noqa: E731
    assert prefill(on_res) < prefill(zero_res)
    pd.testing.assert_frame_equal(on, _table(simulate(parse_experiment(_starved(kv_offloading_size=4)))))


@pytest.mark.parametrize("engine, policy, field", [
    ({"kv_offloading_size": -1}, {}, "engine.kv_offloading_size"),
    ({"kv_offloading_size": 4, "kv_offloading_backend": "lmcache"}, {}, "engine.kv_offloading_backend"),
])
def test_bad_offloading_fields_name_the_field(engine, policy, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_experiment({**_starved(**engine), "policy": policy} if policy else _starved(**engine))


@pytest.mark.parametrize("policy, what", [
    ({"preemption": {"mode": "swap"}}, "swap"),
    ({"scheduler": "sarathi"}, "sarathi"),
])
def test_offloading_refuses_what_it_does_not_model(policy, what):
    exp = parse_experiment({**_starved(kv_offloading_size=1), "policy": policy})
    with pytest.raises(ValueError, match=rf"engine\.kv_offloading_size.*{what}"):
        simulate(exp)


def test_a_tier_too_small_for_one_block_is_an_error():
    exp = parse_experiment(_starved(kv_offloading_size=1e-6))
    with pytest.raises(ValueError, match=r"engine\.kv_offloading_size.*no KV block"):
        simulate(exp)


def test_kv_loaded_from_the_cpu_tier_that_no_schedule_can_admit_is_dropped_and_recomputed():
    # make composition (seed 4, draw 4930): with nothing running, a request holding KV loaded from the CPU tier
    # could not be admitted (9 GPU blocks); the engine drops held KV to break the stall, which assumed remote KV
    # (AttributeError on request.remote). It now frees the blocks and recomputes, as for remote KV.
    from lab.experiment.config import parse_experiment
    from lab.experiment.simulation import simulate

    exp = parse_experiment({
        "name": "cpu-held", "seed": 793,
        "workload": {"source": "sessions", "num_requests": 5, "rate": 20.0,
                     "turns": {"kind": "uniform", "low": 1, "high": 4, "max": 4},
                     "prompt_tokens": {"kind": "uniform", "low": 1, "high": 107, "max": 107},
                     "turn_tokens": {"kind": "uniform", "low": 1, "high": 16, "max": 16},
                     "output_tokens": {"kind": "uniform", "low": 1, "high": 26, "max": 26}},
        "model": {"name": "Llama-3.1-8B"},
        "engine": {"block_size": 16, "num_gpu_blocks": 9, "max_num_seqs": 11, "max_model_len": 2048,
                   "max_num_batched_tokens": 186, "scheduler_reserve_full_isl": False, "kv_offloading_size": 0.05},
        "policy": {"scheduler": "vllm_v1"},
        "simulation": {"progress": False, "record_events": True}})
    res = simulate(exp)
    assert all(r.finish_time is not None or r.reason for r in res.requests)
    dropped = [e for r in res.requests for e in (r.events or []) if "KV loaded from the CPU tier dropped" in str(e)]
    assert dropped
