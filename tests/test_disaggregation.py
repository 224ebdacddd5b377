"""Prefill/decode disaggregation on hand-worked cases: bytes per token (GQA, MLA, MTP drafter), the TTFT
decomposition, the recomputed last token, pinned blocks freed after the read, lease expiry, and a shared link."""

import pytest
import simpy

from lab.cluster.transfer import Link, TransferCost
from lab.costmodel.model_arch import load_model
from lab.experiment.config import ConfigError, parse_experiment
from lab.experiment.simulation import simulate
from lab.report.metrics import PD_COLUMNS, requests_frame


def test_kv_bytes_per_token_gqa_and_mla():
    llama = load_model("Llama-3.1-8B")
    assert llama.kv_bytes_per_token("bf16", 1) == 2 * 32 * 8 * 128 * 2  # 2 x layers x kv_heads x head_dim x bf16
    ds = load_model("DeepSeek-V3")
    assert ds.kv_bytes_per_token("bf16", 1) == 61 * (512 + 64) * 2  # layers x (kv_lora_rank + rope_dim) x bf16
    assert ds.kv_bytes_per_token_per_layer("bf16", 1) == (512 + 64) * 2  # one MTP layer adds this


def test_two_transfers_on_one_link_take_twice_as_long_as_one():
    env = simpy.Environment()
    link = Link(env, 1e9)
    done = {}

    def go(name, nbytes, at):
        yield env.timeout(at)
        yield link.send(nbytes)
        done[name] = env.now

    env.process(go("alone", 1e9, 0.0))
    env.run()
    assert done["alone"] == pytest.approx(1.0)
    env2 = simpy.Environment()
    link = Link(env2, 1e9)
    env, done = env2, {}
    env.process(go("a", 1e9, 0.0))
    env.process(go("b", 1e9, 0.0))
    env.run()
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(2.0)
    # a late starter shares only while both are on the link: a (1 GB) alone for 0.5 s, then half rate
    env3 = simpy.Environment()
    link = Link(env3, 1e9)
    env, done = env3, {}
    env.process(go("a", 1e9, 0.0))
    env.process(go("b", 0.25e9, 0.5))
    env.run()
    assert done["b"] == pytest.approx(1.0) and done["a"] == pytest.approx(1.25)
    assert TransferCost(1.0, block_size=16, handshake_s=1e-3, per_block_s=1e-6, latency_s=0.0).fixed_s(33) == \
        pytest.approx(1e-3 + 3e-6)


def _pd(**over):
    base = {"name": "pd", "seed": 2,
            "workload": {"source": "synthetic", "num_requests": 30, "rate": 3.0,
                         "prompt_tokens": {"kind": "constant", "value": 1000},
                         "output_tokens": {"kind": "constant", "value": 20}},
            "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
            "engine": {"block_size": 16},
            "deployment": {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1},
                           "transfer": {"bandwidth_gbps": 10.0, "handshake_ms": 1.0, "per_block_us": 0.0,
                                        "latency_us": 0.0, "handover_ms": 5.0}},
            "simulation": {"progress": False}}
    for k, v in over.items():
        base[k] = v
    return parse_experiment(base)


def test_ttft_decomposes_exactly_and_d_recomputes_one_token():
    res = simulate(_pd())
    df = requests_frame(res.requests)
    parts = df[PD_COLUMNS[2:9]].sum(axis=1)
    assert (parts - df["engine_ttft"]).abs().max() < 1e-9  # the engine's TTFT; the client's adds the front end
    assert ((df["ttft"] - df["engine_ttft"]) - (0.0102 + 1e-5 * df["prompt_tokens"])).abs().max() < 1e-9
    r = res.requests[0]
    t = r.remote.times
    assert t["d_arrived"] - t["p_done"] == pytest.approx(5e-3)  # the handover
    # 1,000 tokens x 131,072 B over one 10 GB/s link, plus the 1 ms handshake
    assert t["transfer_end"] - t["transfer_start"] == pytest.approx(1e-3 + 1000 * 131072 / 10e9)
    assert r.remote.bytes == 1000 * 131072
    # D admitted it with C = 999 (the last prompt token recomputed) and sampled its own first token
    d = res.instances[1]
    shapes = [row for row in zip(d.steps.cols["scheduled_tokens"], d.steps.cols["prefill_tokens"])]
    assert shapes[0][0] == 1
    assert all(q.num_output_tokens == 20 for q in res.requests)
    assert [q.served_by for q in res.requests[:2]] == [[0, 1], [0, 1]]


def test_pinned_prefill_blocks_are_freed_after_the_read():
    res = simulate(_pd())
    p = res.instances[0]
    assert p.peak_pinned_blocks >= 63  # ceil(1000 / 16) blocks pinned at least once
    assert p.num_pinned_blocks == 0
    assert p.kv.num_free_blocks == p.kv.pool.num_gpu_blocks - 1  # all blocks back in the free queue
    assert res.cluster.bytes_transferred == pytest.approx(30 * 1000 * 131072)
    assert res.cluster.links[1].bytes_sent == pytest.approx(res.cluster.bytes_transferred)


def test_a_lease_that_expires_before_d_can_read_makes_d_recompute():
    # D has blocks for one 1,000-token request only and each decodes 400 tokens, so the second request waits for
    # D's blocks longer than the 0.2 s lease: P frees it, D recomputes its whole prompt
    res = simulate(_pd(workload={"source": "synthetic", "num_requests": 2, "rate": 1000.0,
                                 "prompt_tokens": {"kind": "constant", "value": 1000},
                                 "output_tokens": {"kind": "constant", "value": 400}},
                       deployment={"mode": "disaggregated", "prefill": {"count": 1},
                                   "decode": {"count": 1, "engine": {"num_gpu_blocks": 90}},
                                   "transfer": {"kv_lease_s": 0.2}}))
    second = res.requests[1]
    assert second.remote.expired and second.remote.bytes == 0
    assert res.cluster.num_lease_expiries == 1
    assert res.instances[0].num_pinned_blocks == 0
    assert all(q.num_output_tokens == 400 for q in res.requests)
    df = requests_frame(res.requests)
    assert bool(df["kv_recomputed"].iloc[1]) and not bool(df["kv_recomputed"].iloc[0])


def test_a_request_rejected_on_d_has_its_rejection_on_d_in_the_event_log():
    from lab.report.run_tables import events_frame

    # D holds 39 blocks, fewer than a 1,000-token prompt needs: P serves both requests, D rejects them
    res = simulate(_pd(workload={"source": "synthetic", "num_requests": 2, "rate": 1.0,
                                 "prompt_tokens": {"kind": "constant", "value": 1000},
                                 "output_tokens": {"kind": "constant", "value": 20}},
                       deployment={"mode": "disaggregated", "prefill": {"count": 1},
                                   "decode": {"count": 1, "engine": {"num_gpu_blocks": 40}}},
                       simulation={"progress": False, "record_events": True}))
    assert all(q.reason.startswith("needs 64 KV blocks") and q.served_by == [0, 1] for q in res.requests)
    ev = events_frame(res)
    for _, g in ev.groupby("request_id"):
        where = dict(zip(g["event"], g["instance"]))
        assert list(g["event"]) == ["arrived", "scheduled", "first_token", "handed_off", "rejected"]
        assert (where["arrived"], where["handed_off"], where["rejected"]) == (0, 0, 1)
    assert res.instances[0].num_pinned_blocks == 0


def test_mtp_drafter_kv_is_sent_unless_switched_off():
    ds = {"name": "DeepSeek-V3", "dtype": "fp8", "kv_cache_dtype": "bf16"}
    hw = {"gpu": "H200-SXM-141GB", "tensor_parallel_size": 8}
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    wl = {"source": "synthetic", "num_requests": 4, "rate": 1.0, "prompt_tokens": {"kind": "constant", "value": 500},
          "output_tokens": {"kind": "constant", "value": 8}}
    on = simulate(_pd(model=ds, hardware=hw, speculative=spec, workload=wl))
    per_token = 61 * 576 * 2
    assert on.requests[0].remote.bytes == 500 * (per_token + 576 * 2)
    assert on.cluster.drafter_bytes_transferred == 4 * 500 * 576 * 2
    off = simulate(_pd(model=ds, hardware=hw, speculative=spec, workload=wl,
                       deployment={"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1},
                                   "transfer": {"transfer_drafter_kv": False}}))
    assert off.requests[0].remote.bytes == 500 * per_token and off.cluster.drafter_bytes_transferred == 0


def test_disaggregated_config_errors():
    with pytest.raises(ConfigError, match="needs both 'prefill' and 'decode'"):
        _pd(deployment={"mode": "disaggregated", "prefill": {"count": 1}})
    with pytest.raises(ConfigError, match="remove 'pools'"):
        _pd(pools=[{"name": "a"}])
    with pytest.raises(ConfigError, match="set deployment.prefill.count"):
        _pd(cluster={"num_instances": 2})
