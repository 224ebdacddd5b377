"""Trace loaders and the synthetic generator: formats, ordering, determinism and clear errors."""

import gzip
import json

import pytest

from lab.workload import loaders, synthetic
from tests.conftest import needs_data, DATA_DIR


def test_plain_csv_sorts_by_arrival_and_keeps_ids(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens,priority,request_id\n2.0,10,5,1,x\n0.5,20,3,0,y\n")
    rs = loaders.load_csv(p)
    assert [r.request_id for r in rs] == ["y", "x"]
    assert [r.index for r in rs] == [0, 1]
    assert (rs[0].arrival_time, rs[0].prompt_len, rs[0].max_tokens, rs[1].priority) == (0.5, 20, 3, 1)


def test_plain_csv_columns_follow_their_rows_through_the_sort(tmp_path):
    """Each column is reordered by arrival once, as a whole: every request keeps its own row's values (session,
    acceptance rate), the ids default to the rows' positions and the priorities to 0, all as Python numbers."""
    p = tmp_path / "t.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens,session_id,acceptance_rate\n"
                 "3.0,30,3,c,0.3\n1.0,10,1,,0.1\n2.0,20,2,b,0.2\n1.0,11,4,a,0.4\n")
    rs = loaders.load_csv(p)
    got = [(r.index, r.request_id, r.arrival_time, r.prompt_len, r.max_tokens, r.priority, r.session_id,
            r.acceptance_rate) for r in rs]
    assert got == [(0, "1", 1.0, 10, 1, 0, None, 0.1), (1, "3", 1.0, 11, 4, 0, "a", 0.4),
                   (2, "2", 2.0, 20, 2, 0, "b", 0.2), (3, "0", 3.0, 30, 3, 0, "c", 0.3)]
    assert all(type(r.arrival_time) is float and type(r.prompt_len) is int for r in rs)


def test_a_request_takes_numpy_counts_and_keeps_python_ints():
    """Scripts build requests from numpy arrays: the counts are kept as ints (the compiled Request stores ints, so
    either core must convert them), and a count below 1 or a fractional index is refused."""
    import numpy as np

    from lab.core.request import Request

    r = Request(np.int64(3), np.float64(1.5), np.int64(20), np.int32(4), priority=np.int64(2),
                hash_block_size=np.int64(16))
    got = (r.index, r.arrival_time, r.prompt_len, r.max_tokens, r.priority, r.hash_block_size, r.request_id)
    assert got == (3, 1.5, 20, 4, 2, 16, "3")
    assert all(type(v) is int for v in (r.index, r.prompt_len, r.max_tokens, r.priority, r.hash_block_size))
    with pytest.raises(ValueError, match="request 0: output_tokens must be >= 1, got 0"):
        Request(0, 0.0, 5, np.int64(0))
    with pytest.raises(TypeError):
        Request(1.5, 0.0, 5, 3)


@pytest.mark.parametrize("body,msg", [
    ("arrival_time_s,prompt_tokens\n0,1\n", "missing column"),
    ("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,0,5\n", "row 3: prompt_tokens must be an integer >= 1, got 0"),
    ("arrival_time_s,prompt_tokens,output_tokens\n0,10,x\n", "row 2: output_tokens must be an integer >= 1, got 'x'"),
    ("arrival_time_s,prompt_tokens,output_tokens\n-1,10,2\n", "row 2: arrival_time_s must be a number >= 0, got -1"),
    ("arrival_time_s,prompt_tokens,output_tokens\n0,100.7,2\n", "row 2: prompt_tokens must be an integer >= 1, got 100.7"),
    ("arrival_time_s,prompt_tokens,output_tokens,priority\n0,10,2,high\n", "row 2: priority must be an integer, got 'high'"),
    ("arrival_time_s,prompt_tokens,output_tokens\n0,10,2\n1,2,3,4,5\n", "not a well-formed CSV"),
    ("arrival_time_s,prompt_tokens,output_tokens\n", "no requests"),
    ("", "the file is empty"),
])
def test_plain_csv_errors_name_the_file_and_row(tmp_path, body, msg):
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(loaders.WorkloadError, match=msg) as e:
        loaders.load_csv(p)
    assert "bad.csv" in str(e.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(loaders.WorkloadError, match="does not exist"):
        loaders.load_azure(tmp_path / "nope.csv")


def test_azure_format(tmp_path):
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n")
    rs = loaders.load_azure(p)
    assert rs[0].arrival_time == 0.0
    assert rs[1].arrival_time == pytest.approx(4.314579)
    assert (rs[1].prompt_len, rs[1].max_tokens) == (396, 109)


def test_mooncake_format_with_jitter(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"timestamp": 3000, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [0, 2]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    rs = loaders.load_mooncake(p)
    assert [r.request_id for r in rs] == ["1", "0"]
    assert rs[1].arrival_time == 3.0 and rs[0].hash_ids == [0, 2] and rs[0].hash_block_size == 512
    j1 = loaders.load_mooncake(p, jitter_s=3.0, seed=1)
    j2 = loaders.load_mooncake(p, jitter_s=3.0, seed=1)
    assert [r.arrival_time for r in j1] == [r.arrival_time for r in j2]


def test_mooncake_bad_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2}\n{"timestamp": 1, "input_length": 10}\n')
    with pytest.raises(loaders.WorkloadError, match="line 2: missing key 'output_length'"):
        loaders.load_mooncake(p)


def test_llmservingsim_format_gz(tmp_path):
    p = tmp_path / "w.jsonl.gz"
    rows = [{"input_toks": 3, "output_toks": 2, "arrival_time_ns": 5_000_000_000, "input_tok_ids": [1, 2, 3],
             "output_tok_ids": [4, 5]}]
    with gzip.open(p, "wt") as f:
        f.write(json.dumps(rows[0]) + "\n")
    (r,) = loaders.load_llmservingsim(p)
    assert r.arrival_time == 5.0 and r.prompt_token_ids == [1, 2, 3] and r.request_id == "bench-0"


def test_llmservingsim_token_count_mismatch(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"input_toks": 4, "output_toks": 2, "arrival_time_ns": 0, "input_tok_ids": [1]}))
    with pytest.raises(loaders.WorkloadError, match="input_tok_ids has 1 ids but input_toks is 4"):
        loaders.load_llmservingsim(p)


def test_synthetic_is_seeded_and_shaped():
    d = synthetic.LengthDist(kind="lognormal", median=500, sigma=0.5, max=4000)
    a = synthetic.generate(2000, 10.0, d, d, seed=3)
    b = synthetic.generate(2000, 10.0, d, d, seed=3)
    c = synthetic.generate(2000, 10.0, d, d, seed=4)
    assert [(r.arrival_time, r.prompt_len) for r in a] == [(r.arrival_time, r.prompt_len) for r in b]
    assert [r.prompt_len for r in a] != [r.prompt_len for r in c]
    assert a[0].arrival_time == 0.0
    rate = len(a) / a[-1].arrival_time
    assert 9.0 < rate < 11.0
    med = sorted(r.prompt_len for r in a)[1000]
    assert 450 < med < 550
    assert max(r.prompt_len for r in a) <= 4000


def test_synthetic_rejects_bad_parameters():
    d = synthetic.LengthDist()
    with pytest.raises(ValueError, match="rate"):
        synthetic.generate(10, 0.0, d, d)
    with pytest.raises(ValueError, match="unknown length distribution"):
        synthetic.LengthDist(kind="zipf").sample(__import__("numpy").random.default_rng(0), 3)


@needs_data("traces", "azure_llm_2023", "AzureLLMInferenceTrace_conv.csv")
def test_real_azure_conv_trace_loads_whole():
    rs = loaders.load_azure(DATA_DIR / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")
    assert len(rs) == 19366
    assert rs[-1].arrival_time == pytest.approx(3502.0, abs=2.0)


def test_every_trace_request_is_accounted_for_at_a_horizon(tmp_path):
    from lab.experiment.config import parse_experiment
    from lab.experiment.simulation import build_requests, simulate

    p = tmp_path / "t.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,100,5000\n0.5,100,2\n50,100,2\n")
    exp = parse_experiment({"name": "h", "workload": {"source": "csv", "path": str(p)},
                            "simulation": {"horizon_s": 10.0, "progress": False}}, base_dir=tmp_path)
    reqs = build_requests(exp)
    simulate(exp, reqs)
    by_id = {r.request_id: r for r in reqs}
    assert by_id["1"].finish_time is not None
    assert by_id["0"].reason == "still running at the horizon"
    assert by_id["2"].reason == "arrives after the horizon"


def test_every_trace_needs_finite_non_negative_arrivals_and_unique_ids(tmp_path):
    import pytest

    from lab.core.request import Request
    from lab.workload.loaders import WorkloadError, check_requests

    ok = [Request(0, 0.0, 4, 2, request_id="a"), Request(1, 0.5, 4, 2, request_id="b")]
    check_requests("t.csv", ok)
    for bad, message in (([Request(0, float("nan"), 4, 2)], r"t.csv: request 0 \(id '0'\): arrival time nan"),
                         ([Request(0, -1.0, 4, 2)], "arrival time -1.0; expected a finite number of seconds >= 0"),
                         ([Request(0, 0.0, 4, 2, request_id="x"), Request(1, 1.0, 4, 2, request_id="x")],
                          "request 1: id 'x' repeats request 0's")):
        with pytest.raises(WorkloadError, match=message):
            check_requests("t.csv", bad)


def test_requests_are_built_with_rare_collections_and_the_thresholds_restored(monkeypatch):
    # building millions of long-lived requests at Python's default threshold re-traverses them at every collection
    import gc

    from lab.experiment import simulation
    from lab.experiment.config import parse_experiment

    seen = []
    original = synthetic.generate
    monkeypatch.setattr(synthetic, "generate", lambda *a, **k: (seen.append(gc.get_threshold()), original(*a, **k))[1])
    before = gc.get_threshold()
    exp = parse_experiment({"name": "g", "workload": {"source": "synthetic", "num_requests": 20, "rate": 5.0}})
    assert len(simulation.build_requests(exp)) == 20
    assert seen == [(simulation._GC_THRESHOLD, 100, 100)] and gc.get_threshold() == before
