"""What the client sees: the API server's time before the engine and after each token (lab/cluster/frontend.py),
the client and engine views of TTFT and E2EL, and CPU overhead under async scheduling that shows when it is longer
than the GPU step it overlaps (lab/engine/instance.py ``price_step``). Hand-worked timelines, 1 s GPU steps."""

import pytest

from lab.cluster.frontend import FrontEnd, FrontEndCost
from lab.engine.instance import EngineOptions
from lab.experiment.config import ConfigError, parse_experiment
from lab.experiment.simulation import simulate
from lab.report.metrics import requests_frame, summarize
from lab.workload.closed_loop import ClosedLoopClients
from tests.conftest import make_engine, req

FE = FrontEndCost(request_s=0.1, per_prompt_token_s=0.01, per_output_token_s=0.05)


def _send(env, frontend, reqs):
    def clients():
        for r in reqs:
            if r.arrival_time > env.now:
                yield env.timeout(r.arrival_time - env.now)
            frontend.submit(r)
    env.process(clients())


def test_client_ttft_is_front_end_time_plus_engine_ttft_plus_first_token_streaming():
    # a (4-token prompt) is sent at 0 and reaches the engine at 0.1 + 4 x 0.01 = 0.14; b (8 tokens) is sent at 0.2
    # and reaches it at 0.38. Step 1 (0.14-1.14) prefills a; step 2 (1.14-2.14) decodes a (a finishes) and
    # prefills b; step 3 (2.14-3.14) decodes b. Each token reaches the client 0.05 s after the engine emits it.
    env, inst, _ = make_engine()
    a, b = req(0, 4, 2, t=0.0), req(1, 8, 2, t=0.2)
    _send(env, FrontEnd(env, FE, inst.add_request), [a, b])
    env.run()
    assert (a.arrival_time, b.arrival_time) == (pytest.approx(0.14), pytest.approx(0.38))
    df = requests_frame([a, b])
    assert df["arrival_time"].tolist() == [0.0, 0.2]  # the client's sends
    assert df["engine_arrival_time"].tolist() == pytest.approx([0.14, 0.38])
    assert df["engine_ttft"].tolist() == pytest.approx([1.0, 2.14 - 0.38])
    assert df["ttft"].tolist() == pytest.approx([0.14 + 1.0 + 0.05, 0.18 + (2.14 - 0.38) + 0.05])
    assert df["e2el"].tolist() == pytest.approx([2.14 + 0.05, 3.14 + 0.05 - 0.2])
    assert df["engine_e2el"].tolist() == pytest.approx([2.0, 3.14 - 0.38])
    assert df["tpot"].tolist() == pytest.approx([1.0, 1.0])  # the front-end adds the same time to every token
    assert df["queue_time"].tolist() == pytest.approx([0.0, 1.14 - 0.38])  # engine-side
    s = summarize(df, [1.0, 1.0])
    assert s["duration_s"] == pytest.approx(3.19)  # first send to the last token received
    assert s["ttft"]["mean"] == pytest.approx((1.19 + 1.99) / 2)
    assert s["engine_latency"]["ttft"]["mean"] == pytest.approx((1.0 + 1.76) / 2)


def _exp(**kw):
    return parse_experiment({"name": "fe", "workload": {"source": "synthetic", "num_requests": 30, "rate": 20.0},
                             "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
                             "simulation": {"progress": False}, **kw})


def test_zero_front_end_gives_exactly_the_engine_view_and_the_old_times():
    res = simulate(_exp(frontend={"request_s": 0.0, "per_prompt_token_s": 0.0, "per_output_token_s": 0.0}))
    df = requests_frame(res.requests)
    assert all(r.sent_time is None and r.stream_s == 0.0 for r in res.requests)
    assert df["arrival_time"].equals(df["engine_arrival_time"])
    assert df["ttft"].equals(df["engine_ttft"]) and df["e2el"].equals(df["engine_e2el"])
    assert df["ttft"].equals(df["first_token_time"] - df["arrival_time"])  # the definitions before the front-end
    assert df["received_time"].equals(df["finish_time"])
    with_fe = requests_frame(simulate(_exp(frontend={"request_s": 0.0, "per_prompt_token_s": 0.0,
                                                     "per_output_token_s": 0.002})).requests)
    assert with_fe["engine_ttft"].equals(df["engine_ttft"])  # only after the engine: the engine's run is unchanged
    assert (with_fe["ttft"] - df["ttft"]).to_numpy() == pytest.approx(0.002)


def test_closed_loop_client_sends_next_request_at_receipt_of_last_token_plus_think_time():
    env, inst, _ = make_engine()
    reqs = [req(i, 4, 2) for i in range(3)]
    frontend = FrontEnd(env, FE, inst.add_request)
    clients = ClosedLoopClients(env, reqs, 1, frontend.submit, think_time_s=0.5)
    inst.on_done = inst.outputs.on_done = clients.completed
    env.process(clients.run())
    env.run()
    for prev, nxt in zip(reqs, reqs[1:]):
        assert nxt.sent_time == prev.finish_time + 0.05 + 0.5  # exactly: received, then thought
        assert nxt.arrival_time == nxt.sent_time + (0.1 + 4 * 0.01)
    assert reqs[0].finish_time == pytest.approx(0.14 + 2.0)
    assert reqs[1].sent_time == pytest.approx(2.69)


def _async_one_request(cpu_s):
    env, inst, _ = make_engine(options=EngineOptions(async_scheduling=True, cpu_base_s=cpu_s, fast_forward=False))
    a = req(0, 4, 3)
    inst.add_request(a)
    env.run()
    starts = list(inst.steps.cols["start"])
    return a, starts


def test_async_cpu_shorter_than_the_gpu_step_is_hidden_except_after_idle():
    # step 1's CPU work (0.5 s) has nothing to overlap: GPU starts at 0.5. Step 2 is scheduled at 0 too (async
    # lookahead) and its CPU work (0.5-1.0) ends before step 1 does; step 3's (1.5-2.0) before step 2 ends
    a, starts = _async_one_request(0.5)
    assert starts == [0.5, 1.5, 2.5]
    assert (a.first_token_time, a.finish_time) == (1.5, 3.5)


def test_async_cpu_longer_than_the_gpu_step_sets_the_pace():
    # 2 s of CPU per 1 s GPU step: step 1 GPU at 2-3, step 2's CPU 2-4 -> GPU 4-5, step 3's CPU 4-6 -> GPU 6-7
    a, starts = _async_one_request(2.0)
    assert starts == [2.0, 4.0, 6.0]
    assert (a.first_token_time, a.finish_time) == (3.0, 7.0)


def test_sync_cpu_adds_a_per_new_request_term_for_each_request_the_schedule_admits():
    env, inst, _ = make_engine(options=EngineOptions(cpu_per_new_request_s=0.25, fast_forward=False))
    for i in range(2):
        inst.add_request(req(i, 4, 2))
    env.run()
    assert list(inst.steps.cols["duration"]) == [1.5, 1.0]  # two admitted, then a decode step admitting none


def test_fast_forward_stays_exact_when_async_cpu_shows():
    # ~7 ms of CPU per step against 7-8 ms decode steps of an 8B model on an H100: some steps wait for the CPU
    # (their start is later than the previous step's end), others are hidden and fast-forwarded
    kw = {"engine": {"cpu_overhead": {"base_s": 0.007}}}
    res = simulate(_exp(**kw))
    starts, durations = res.instances[0].steps.cols["start"], res.instances[0].steps.cols["duration"]
    waited = sum(b > a + d + 1e-12 and b - a - d < 5e-3 for a, d, b in zip(starts, durations, starts[1:]))
    assert waited > 0 and res.instances[0].jump.num_jumps > 0
    slow = simulate(_exp(simulation={"progress": False, "fast_forward": False}, **kw))
    assert requests_frame(res.requests).equals(requests_frame(slow.requests))


@pytest.mark.parametrize("section, field, value", [
    ("frontend", "request_s", -0.001), ("frontend", "per_prompt_token_s", "fast"),
    ("frontend", "per_output_token_s", float("inf")), ("frontend", "per_output_token_s", float("nan")),
    ("frontend", "reqest_s", 0.001),
])
def test_bad_front_end_values_are_one_line_errors_naming_the_field(section, field, value):
    with pytest.raises(ConfigError) as e:
        _exp(**{section: {field: value}})
    lines = str(e.value).splitlines()
    assert len(lines) == 1 and f": {section}.{field}:" in lines[0]


def test_a_negative_per_new_request_cpu_time_names_its_field():
    with pytest.raises(ConfigError, match=r"engine\.cpu_overhead\.per_new_request_s"):
        _exp(engine={"cpu_overhead": {"per_new_request_s": -1e-4}})
    with pytest.raises(ValueError, match=r"frontend\.request_s must be a finite number of seconds >= 0"):
        FrontEndCost(request_s=-1.0)


@pytest.mark.parametrize("name", ["llmservingsim_rtx4090_llama8b", "llmservingsim_rtxpro6000_llama8b"])
def test_the_validation_runs_keep_zero_front_end_time_explicitly(name):
    # their measured TTFT runs from the engine's queue entry (queued_ts): a front-end term would be counted twice
    from pathlib import Path

    import yaml

    from lab.experiment.simulation import frontend_cost

    path = Path(__file__).resolve().parent.parent / "experiments" / f"{name}.yaml"
    assert "frontend" in yaml.safe_load(path.read_text())
    assert frontend_cost(parse_experiment(yaml.safe_load(path.read_text()), str(path), path.parent)).is_zero


def test_front_end_defaults_are_vllms_measured_api_server_times_per_version():
    from lab.cluster.frontend import FRONTEND_DEFAULTS
    from lab.experiment.simulation import frontend_cost

    for version in ("0.33", "0.19", "0.11"):
        cost = frontend_cost(_exp(engine={"vllm_version": version}))
        assert cost.request_s == FRONTEND_DEFAULTS[version]["request_s"] == pytest.approx(0.0102)
        assert cost.per_prompt_token_s == pytest.approx(1e-5) and cost.per_output_token_s == 0.0
    assert frontend_cost(_exp(frontend={"request_s": 0.0})).per_prompt_token_s == pytest.approx(1e-5)


def test_default_front_end_shifts_an_open_loop_stream_and_keeps_the_fast_forward_exact():
    exp = _exp(workload={"source": "synthetic", "num_requests": 30, "rate": 20.0})
    res = simulate(exp)
    df = requests_frame(res.requests)
    delay = 0.0102 + 1e-5 * df["prompt_tokens"]
    assert (df["engine_arrival_time"] - df["arrival_time"]).to_numpy() == pytest.approx(delay.to_numpy())
    assert (df["ttft"] - df["engine_ttft"]).to_numpy() == pytest.approx(delay.to_numpy())
    step = requests_frame(simulate(exp.model_copy(update={"simulation": exp.simulation.model_copy(
        update={"fast_forward": False})})).requests)
    assert step["ttft"].equals(df["ttft"]) and step["e2el"].equals(df["e2el"])


def test_an_idle_engine_starts_a_delivered_request_at_its_arrival_not_an_ulp_before():
    # found by tests/test_invariants_property.py: the front end's delivery (a SimPy timeout) may fire one ulp before
    # the request's arrival_time; the engine must not schedule it before it arrived
    from lab.experiment.config import parse_experiment
    from lab.experiment.simulation import simulate

    exp = parse_experiment({
        "name": "ulp", "seed": 10000,
        "workload": {"source": "synthetic", "num_requests": 21, "rate": 18.0,
                     "prompt_tokens": {"kind": "uniform", "low": 1, "high": 197, "max": 197},
                     "output_tokens": {"kind": "uniform", "low": 1, "high": 1, "max": 1}},
        "model": {"name": "Llama-3.1-8B"},
        "engine": {"block_size": 4, "num_gpu_blocks": 52, "max_num_seqs": 1, "max_num_batched_tokens": 4,
                   "enable_prefix_caching": False, "async_scheduling": False, "cudagraph": False,
                   "max_model_len": 4096},
        "policy": {"scheduler": "orca"}})
    res = simulate(exp)
    assert all(r.arrival_time <= r.first_scheduled_time <= r.first_token_time for r in res.requests)
