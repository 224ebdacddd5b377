"""Closed-loop clients on a hand-worked timeline (1 s per step), and the workload fields that drive them."""

import json

import pytest

from lab.cluster.frontend import sent_time

from lab.experiment.config import ConfigError, parse_experiment
from lab.experiment.simulation import closed_loop_concurrency, simulate
from lab.report.metrics import requests_frame
from lab.workload.closed_loop import ClosedLoopClients
from tests.conftest import make_engine, req


def _clients(concurrency, think, warmup, n=4):
    env, inst, _ = make_engine()
    reqs = [req(i, 4, 2) for i in range(n)]
    cleared = []
    clients = ClosedLoopClients(env, reqs, concurrency, inst.add_request, think, warmup,
                                on_measure_start=lambda: cleared.append(env.now))
    inst.on_done = inst.outputs.on_done = clients.completed
    env.process(clients.run())
    env.run()
    return reqs, cleared


def test_two_clients_with_think_time_send_the_next_requests_half_a_second_after_completions():
    # t=0: r0, r1 sent; step 1 prefills both (first tokens at 1), step 2 decodes (both finish at 2); each slot
    # frees 0.5 s later, so r2 and r3 are sent at 2.5, first token at 3.5, finish at 4.5
    reqs, _ = _clients(2, 0.5, 0)
    assert [r.arrival_time for r in reqs] == [0.0, 0.0, 2.5, 2.5]
    assert [r.first_token_time - r.arrival_time for r in reqs] == [1.0, 1.0, 1.0, 1.0]  # TTFT from the send
    assert [r.finish_time for r in reqs] == [2.0, 2.0, 4.5, 4.5]


def test_one_client_sends_strictly_one_after_another():
    reqs, _ = _clients(1, 0.0, 0, n=3)
    assert [r.arrival_time for r in reqs] == [0.0, 2.0, 4.0]


def test_warm_up_requests_run_first_and_are_left_out_of_the_metrics():
    reqs, cleared = _clients(2, 0.5, 2)
    assert [r.warmup for r in reqs] == [True, True, False, False]
    assert cleared == [2.0]  # the measured phase starts when the last warm-up request completes (ITL cleared)
    assert [r.arrival_time for r in reqs[2:]] == [2.5, 2.5]  # and the slots are free after the think time


def _exp(fast_forward=True, **workload):
    return parse_experiment({"name": "cl", "workload": {"source": "synthetic", "num_requests": 40,
                                                        "prompt_tokens": {"kind": "constant", "value": 256},
                                                        "output_tokens": {"kind": "constant", "value": 32},
                                                        **workload},
                             "model": {"name": "Llama-3.1-8B"},
                             # the client's own times: no API-server time between it and the engine
                             "frontend": {"request_s": 0.0, "per_prompt_token_s": 0.0, "per_output_token_s": 0.0},
                             "simulation": {"progress": False, "fast_forward": fast_forward}})


def test_concurrency_bounds_the_requests_in_flight_and_fast_forward_is_exact():
    for n in (1, 8):
        res = simulate(_exp(concurrency=n, num_warmup=2))
        spans = sorted((r.arrival_time, r.finish_time) for r in res.requests)
        for t, _ in spans:  # at every send, at most n requests (including it) are in flight
            assert sum(1 for a, f in spans if a <= t < f) <= n
        slow = simulate(_exp(False, concurrency=n, num_warmup=2))
        assert [r.finish_time for r in slow.requests] == [r.finish_time for r in res.requests]
        df = requests_frame(res.requests)
        assert int(df["warmup"].sum()) == 2 and len(df) == 42


def test_warm_up_requests_are_extra_copies_of_the_first_request_as_vllm_bench_serve_sends_them(tmp_path):
    from lab.report.run_report import write_report

    exp = parse_experiment({"name": "w", "workload": {"source": "synthetic", "num_requests": 10, "concurrency": 2,
                                                       "num_warmup": 3, "prompt_tokens": {"kind": "uniform",
                                                                                          "low": 100, "high": 400},
                                                       "output_tokens": {"kind": "constant", "value": 8}},
                            "model": {"name": "Llama-3.1-8B"}, "simulation": {"progress": False}})
    res = simulate(exp)
    warm = [r for r in res.requests if r.warmup]
    measured = [r for r in res.requests if not r.warmup]
    assert [r.request_id for r in warm] == ["warmup-0", "warmup-1", "warmup-2"] and len(measured) == 10
    assert {(r.prompt_len, r.max_tokens) for r in warm} == {(measured[0].prompt_len, measured[0].max_tokens)}
    assert min(r.arrival_time for r in measured) >= max(r.finish_time for r in warm)  # the clock starts after
    assert len({r.index for r in res.requests}) == 13
    summary = write_report(res, tmp_path / "out", plots=False)
    assert summary["num_requests"] == 10 and summary["num_warmup"] == 3
    assert sum(i["num_requests"] for i in summary["instances"]) == 10  # per instance, warm-ups excluded too


def test_warm_up_copies_accept_drafts_at_the_workloads_per_request_rate():
    # per-request acceptance 0: no request accepts a draft, the warm-up copies of the first one included
    exp = parse_experiment({"name": "w", "workload": {"source": "synthetic", "num_requests": 3, "concurrency": 2,
                                                       "num_warmup": 2,
                                                       "prompt_tokens": {"kind": "constant", "value": 64},
                                                       "output_tokens": {"kind": "constant", "value": 16}},
                            "model": {"name": "Llama-3.1-8B"}, "simulation": {"progress": False},
                            "speculative": {"method": "eagle", "num_speculative_tokens": 2,
                                            "acceptance": {"kind": "per_request",
                                                           "distribution": {"kind": "constant", "value": 0.0}}}})
    res = simulate(exp)
    warm = [r for r in res.requests if r.warmup]
    assert len(warm) == 2 and all(r.acceptance_rate == 0.0 for r in res.requests)
    assert all(r.num_draft_tokens > 0 and r.num_accepted_tokens == 0 for r in res.requests)
    assert sum(i.acceptance.num_accepted_tokens for i in res.instances) == 0


def test_a_vllm_bench_result_run_with_max_concurrency_is_replayed_closed_loop(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"input_lens": [100] * 6, "output_lens": [10] * 6, "request_rate": "inf",
                                "max_concurrency": 2}))
    exp = parse_experiment({"name": "b", "workload": {"source": "vllm_bench", "path": str(path)},
                            "model": {"name": "Llama-3.1-8B"}, "simulation": {"progress": False}})
    assert closed_loop_concurrency(exp) == 2
    res = simulate(exp)
    sends = sorted(sent_time(r) for r in res.requests)  # the client's sends (the engine sees them after the front end)
    assert sends[:2] == [0.0, 0.0] and sends[2] > 0  # the third waits for a slot


def test_closed_loop_fields_need_a_concurrency():
    with pytest.raises(ConfigError, match="set 'concurrency'"):
        _exp(think_time_s=1.0)
    with pytest.raises(ConfigError, match="concurrency"):
        _exp(concurrency=0)


def test_a_run_writes_vllm_bench_serve_result_json_that_validate_reads_back(tmp_path):
    from lab.report.run_report import write_report
    from lab.report.validate import _load_vllm_bench

    res = simulate(_exp(concurrency=4, num_warmup=2))
    write_report(res, tmp_path / "out", plots=False, detailed=True)  # --save-detailed: validate needs the lists
    d = json.loads((tmp_path / "out" / "bench_result.json").read_text())
    # vllm bench serve --num-warmups: 2 extra requests, all 40 measured
    assert d["completed"] == 40 and d["max_concurrency"] == 4 and d["request_rate"] == "inf" and d["num_warmups"] == 2
    for key in ("mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "output_throughput", "duration"):
        assert key in d
    back = _load_vllm_bench(tmp_path / "out" / "bench_result.json")
    fin = [r for r in res.requests if not r.warmup]
    e2el = sorted(r.finish_time - r.arrival_time for r in fin)
    assert sorted(back["e2el"]) == pytest.approx(e2el)  # TTFT + sum(ITL) = E2EL per request


def test_sessions_send_each_turn_after_the_previous_answer_and_reuse_the_conversation_prefix():
    exp = parse_experiment({"name": "s", "workload": {
        "source": "sessions", "num_requests": 3, "rate": 1.0, "think_time_s": 0.5,
        "turns": {"kind": "constant", "value": 3}, "prompt_tokens": {"kind": "constant", "value": 200},
        "turn_tokens": {"kind": "constant", "value": 40}, "output_tokens": {"kind": "constant", "value": 20}},
        "model": {"name": "Llama-3.1-8B"}, "engine": {"block_size": 16}, "simulation": {"progress": False},
        "frontend": {"request_s": 0.0, "per_prompt_token_s": 0.0, "per_output_token_s": 0.0}})
    res = simulate(exp)
    by_session: dict = {}
    for r in res.requests:
        by_session.setdefault(r.session_id, []).append(r)
    assert len(by_session) == 3 and all(len(v) == 3 for v in by_session.values())
    for turns in by_session.values():
        assert [t.prompt_len for t in turns] == [200, 260, 320]  # history (prompt + answer) + 40 new tokens
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.arrival_time == pytest.approx(prev.finish_time + 0.5)
            assert nxt.prompt_token_ids[:prev.prompt_len] == prev.prompt_token_ids
            history = prev.prompt_len + prev.max_tokens
            assert nxt.prefix_hit_tokens == history // 16 * 16  # the conversation so far hits the prefix cache
    assert all(r.num_output_tokens == 20 for r in res.requests)


def test_sessions_that_the_horizon_cuts_name_their_unsent_turns():
    exp = parse_experiment({"name": "s", "workload": {
        "source": "sessions", "num_requests": 2, "rate": 1.0, "think_time_s": 5.0,
        "turns": {"kind": "constant", "value": 4}},
        "model": {"name": "Llama-3.1-8B"}, "simulation": {"progress": False, "horizon_s": 3.0}})
    res = simulate(exp)
    unsent = [r for r in res.requests if r.reason.startswith("not sent")]
    assert unsent and all(r.first_scheduled_time is None for r in unsent)
