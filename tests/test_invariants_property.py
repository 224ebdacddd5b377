"""Random small experiments across every scheduler, preemption mode, victim rule and router (and speculative
decoding and PD disaggregation), checked against the engine's invariants (hypothesis).

Invariants: every request of the trace comes back once, finished (with exactly its output tokens), rejected with
a reason, or unfinished with a reason; lifecycle times are ordered and TTFT <= E2EL; at the end every KV block is
back in the free queue; the scheduler contract (budget, max_num_seqs, KV for scheduled tokens) is enforced by the
engine at every step, so a violation fails the run; and fast-forward gives the same result as step by step.
"""

import math

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lab.core.request import RequestStatus
from lab.experiment.config import parse_experiment
from lab.experiment.simulation import simulate
from lab.experiment.support import refusals
from policies import scheduler_names

ROUTERS = ["round_robin", "least_requests", "least_tokens", "power_of_two", "prefix_aware"]


@st.composite
def experiments(draw):
    scheduler = draw(st.sampled_from(scheduler_names()))
    block = draw(st.sampled_from([4, 16]))
    max_prompt = draw(st.integers(8, 200))
    max_out = draw(st.integers(1, 40))
    seqs = draw(st.integers(1, 12))
    # the cache holds at least one whole request, so nothing is rejected for size unless the draw says so
    need = -(-(max_prompt + max_out) // block) + 1
    blocks = draw(st.integers(need + 1, need * 6))
    engine = {"block_size": block, "num_gpu_blocks": blocks, "max_num_seqs": seqs,
              "max_num_batched_tokens": draw(st.integers(max(seqs, block), 512)),
              "enable_prefix_caching": draw(st.booleans()), "async_scheduling": draw(st.booleans()),
              "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 16, 64])),
              "scheduler_reserve_full_isl": draw(st.booleans()), "cudagraph": draw(st.booleans()),
              "max_model_len": 4096}
    exp = {
        "name": "prop", "seed": draw(st.integers(0, 10_000)),
        "workload": {"source": "synthetic", "num_requests": draw(st.integers(1, 24)),
                     "rate": draw(st.floats(0.5, 400.0)),
                     "prompt_tokens": {"kind": "uniform", "low": 1, "high": max_prompt, "max": max_prompt},
                     "output_tokens": {"kind": "uniform", "low": 1, "high": max_out, "max": max_out},
                     "num_priorities": draw(st.integers(1, 3))},
        "model": {"name": "Llama-3.1-8B"}, "engine": engine,
        "policy": {"scheduler": scheduler, "queue": draw(st.sampled_from(["fcfs", "priority"])),
                   "preemption": {"mode": draw(st.sampled_from(["recompute", "swap"])),
                                  "victim": draw(st.sampled_from(["auto", "last", "most_kv", "least_progress"]))}},
        "simulation": {"progress": False, "record_events": False},
    }
    if draw(st.booleans()):  # closed loop: N clients, a think time, a warm-up
        n = exp["workload"]["num_requests"]
        exp["workload"].update(concurrency=draw(st.integers(1, 6)), think_time_s=draw(st.sampled_from([0.0, 0.01])),
                               num_warmup=draw(st.integers(0, max(0, n - 1))) if n > 1 else 0)
    layout = draw(st.sampled_from(["one", "cluster", "pd"]))
    if layout == "cluster":
        exp["cluster"] = {"num_instances": draw(st.integers(2, 3)), "router": draw(st.sampled_from(ROUTERS))}
    elif layout == "pd":
        exp["deployment"] = {"mode": "disaggregated", "prefill": {"count": draw(st.integers(1, 2))},
                             "decode": {"count": draw(st.integers(1, 2))},
                             "transfer": {"kv_lease_s": draw(st.sampled_from([0.05, 30.0]))}}
    if scheduler in ("vllm_v1", "sjf", "sglang") and draw(st.booleans()):
        exp["speculative"] = {"method": draw(st.sampled_from(["eagle", "ngram"])),
                              "num_speculative_tokens": draw(st.integers(1, 4))}
        if exp["speculative"]["method"] == "ngram":
            exp["engine"]["async_scheduling"] = False
    offloadable = scheduler in ("vllm_v1", "sjf") and layout != "pd"
    if offloadable and exp["policy"]["preemption"]["mode"] == "recompute" and draw(st.booleans()):
        # 0.003 GiB: one block of 16 tokens (2.2 MB with an EAGLE drafter's layer), and up
        exp["engine"]["kv_offloading_size"] = draw(st.sampled_from([0.003, 0.05, 1.0]))
    return exp


def _check(res) -> None:
    ids = [r.request_id for r in res.requests]
    assert len(ids) == len(set(ids))
    for r in res.requests:
        if r.status == RequestStatus.FINISHED:
            assert r.num_output_tokens == r.max_tokens, r
            assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time, r
        elif r.status == RequestStatus.REJECTED:
            assert r.reason, r
            # the cache holds any one request of these workloads: an "empty cache" rejection is a false one
            assert "empty KV cache" not in r.reason, (r, r.reason)
        else:
            assert r.reason, r  # unfinished at the horizon, with why
        if r.num_drafts:
            assert 0 <= r.num_accepted_tokens <= r.num_draft_tokens
    for inst in res.instances:
        assert inst.kv.num_free_blocks == inst.kv.pool.num_gpu_blocks - 1, inst.instance_id
        assert inst.num_pinned_blocks == 0
        assert inst.kv_offload is None or not inst.kv_offload.loads  # every CPU-tier load ended


def _outcome(res):
    return [(r.request_id, r.status, r.num_output_tokens, r.finish_time) for r in res.requests]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(experiments())
def test_random_experiments_keep_the_invariants(data):
    exp = parse_experiment(data)
    assume(not refusals(exp))  # a combination the support matrix refuses (tests/test_composition_matrix.py)
    res = simulate(exp)
    _check(res)
    assert all(r.status != RequestStatus.WAITING or r.reason for r in res.requests)
    ttft = [r.first_token_time - r.arrival_time for r in res.requests if r.status == RequestStatus.FINISHED]
    e2el = [r.finish_time - r.arrival_time for r in res.requests if r.status == RequestStatus.FINISHED]
    assert all(a <= b + 1e-12 and not math.isnan(a) for a, b in zip(ttft, e2el))
    slow = dict(data, simulation={"progress": False, "record_events": False, "fast_forward": False})
    assert _outcome(simulate(parse_experiment(slow))) == _outcome(res)  # fast-forward is exact
