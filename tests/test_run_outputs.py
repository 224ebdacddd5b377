"""servelab run's outputs: bench_result.json as vllm bench serve --save-result writes it (aggregates by default,
per-request lists with --save-detailed, each request's real token gaps), the tables written without pandas exactly
as pandas writes them, -q, --version and report.md's wording."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from lab.cli.main import app

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "experiments" / "demo.yaml")
runner = CliRunner()


def _run(out: Path, *extra: str, n: int = 60):
    res = runner.invoke(app, ["run", DEMO, "--out", str(out), "-q", "--no-plots", "--set",
                              f"workload.num_requests={n}", *extra])
    assert res.exit_code == 0, res.output
    return res


def test_bench_result_holds_the_aggregates_by_default_and_is_small(tmp_path):
    _run(tmp_path / "o")
    text = (tmp_path / "o" / "bench_result.json").read_text()
    d = json.loads(text)
    assert not {"input_lens", "output_lens", "ttfts", "itls", "errors", "engine_ttfts"} & set(d)
    assert d["completed"] == 60 and d["failed"] == 0 and "p99_itl_ms" in d and "mean_ttft_ms" in d
    assert len(text) < 4000  # a few kB whatever the run's length


def test_save_detailed_writes_each_requests_real_token_gaps(tmp_path):
    _run(tmp_path / "o", "--save-detailed")
    d = json.loads((tmp_path / "o" / "bench_result.json").read_text())
    req = pd.read_parquet(tmp_path / "o" / "requests.parquet")
    fin = req[req["status"] == "finished"]
    assert len(d["itls"]) == len(d["ttfts"]) == len(d["output_lens"]) == d["completed"] == len(fin)
    assert "itls_estimated" not in d
    flat = np.concatenate([np.asarray(x, float) for x in d["itls"]])
    for p in (50, 90, 99):  # the file's own ITL percentiles are those of its per-request gaps
        assert np.percentile(flat, p) * 1e3 == pytest.approx(d[f"p{p}_itl_ms"], rel=1e-12)
    assert flat.mean() * 1e3 == pytest.approx(d["mean_itl_ms"], rel=1e-9)
    # TTFT + the gaps = E2EL, request by request; one gap per output after the first
    e2el = np.array(d["ttfts"]) + np.array([sum(x) for x in d["itls"]])
    assert e2el == pytest.approx(fin["e2el"].to_numpy(), rel=1e-12, abs=1e-12)
    assert [len(x) for x in d["itls"]] == [max(0, k - 1) for k in d["output_lens"]]
    # real gaps, not the request's TPOT repeated: gaps of one request differ
    assert sum(len(set(x)) > 1 for x in d["itls"]) > len(d["itls"]) // 2


def test_gaps_of_preempted_requests_are_their_token_times(monkeypatch):
    """A cache small enough to preempt: each request's recovered gaps (fast-forward run, from the step log) equal
    the gaps between the outputs that carried its tokens, recorded step by step in a run without fast-forward."""
    import lab.core.outputs as outputs
    from lab.experiment.config import load_experiment
    from lab.experiment.simulation import simulate
    from lab.report.token_gaps import request_token_gaps

    truth: dict = defaultdict(list)
    apply = outputs.StepOutputs.apply

    def recording(self, step, now):
        before = [r.num_output_tokens for r in step.requests]
        out = apply(self, step, now)
        for r, k in zip(step.requests, before):
            if r.num_output_tokens != k and r.last_token_time == now:
                truth[r.request_id].append(now)
        return out

    over = {"workload": {"num_requests": 120, "rate": 40}, "engine": {"num_gpu_blocks": 900},
            "simulation": {"record_events": True}}
    monkeypatch.setattr(outputs.StepOutputs, "apply", recording)
    step_by_step = simulate(load_experiment(DEMO, None, {**over, "simulation": {"fast_forward": False,
                                                                                "record_events": True}}))
    monkeypatch.setattr(outputs.StepOutputs, "apply", apply)
    res = simulate(load_experiment(DEMO, None, over))
    assert sum(r.num_preemptions for r in res.requests) > 20
    assert [r.finish_time for r in res.requests] == [r.finish_time for r in step_by_step.requests]
    fin = [r for r in res.requests if r.finish_time is not None]
    gaps = request_token_gaps(res, fin)
    assert gaps.estimated == []
    for r, g in zip(fin, gaps.gaps):
        assert np.array_equal(g, np.diff(truth[r.request_id])), r.request_id


def test_a_summarized_step_log_leaves_the_gaps_estimated_and_says_so(tmp_path):
    _run(tmp_path / "o", "--save-detailed", "--set", "output.step_log=summary", n=20)
    d = json.loads((tmp_path / "o" / "bench_result.json").read_text())
    assert d["itls_estimated"] == list(range(20)) and "summarized" in next(iter(d["itls_estimated_why"]))
    assert len(d["itls"]) == 20  # the TPOT repeated, TTFT + sum = E2EL still


def test_quiet_run_prints_one_line_naming_the_folder(tmp_path):
    res = _run(tmp_path / "o")
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {tmp_path / 'o'}/")


def test_quiet_validate_prints_one_line(tmp_path):
    n = 6
    (tmp_path / "measured.json").write_text(json.dumps({
        "input_lens": [200] * n, "output_lens": [20] * n, "ttfts": [0.05] * n, "itls": [[0.01] * 19] * n}))
    (tmp_path / "v.yaml").write_text(yaml.safe_dump({
        "name": "v", "workload": {"source": "vllm_bench", "path": "measured.json"},
        "validation": {"measured": "measured.json", "format": "vllm_bench"}}))
    res = runner.invoke(app, ["validate", str(tmp_path / "v.yaml"), "--out", str(tmp_path / "o"), "-q",
                              "--no-plots"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wrote ") and "validation.md" in lines[0]


def test_version_prints_the_package_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"servelab {version('servelab')}"


def test_report_md_states_the_slo_in_words_and_the_arrival_window(tmp_path):
    _run(tmp_path / "o")
    md = (tmp_path / "o" / "report.md").read_text()
    assert "SLO TTFT <= 0.5 s, TPOT <= 50 ms" in md and "ttft_s" not in md
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert (f"Achieved {s['arrival_window_request_throughput']:.2f} req/s over the arrival window (first to last "
            f"request sent, {s['arrival_window_s']:.1f} s; {s['arrival_window_in_flight']} requests in flight") in md
    assert f"{s['request_throughput']:.2f} req/s over the whole {s['duration_s']:.1f} s" in md
    req = pd.read_parquet(tmp_path / "o" / "requests.parquet")
    last = req["arrival_time"].max()
    assert s["arrival_window_s"] == pytest.approx(last - req["arrival_time"].min())
    done = (req["status"] == "finished") & (req["received_time"] <= last)
    assert s["arrival_window_request_throughput"] == pytest.approx(done.sum() / s["arrival_window_s"])
    assert s["arrival_window_in_flight"] == 60 - done.sum()


def test_tables_are_written_as_pandas_writes_them(tmp_path):
    from lab.report.table_files import write_csv, write_parquet

    cols = {"s": ["a", 'b,"c"', "", "é"], "i": np.array([1, -2, 0, 3], dtype=np.int64),
            "f": np.array([0.0, float("nan"), 1e-05, 1e16]), "g": np.array([1 / 3, 2.5, -0.0, 123456.789]),
            "b": np.array([True, False, True, False]), "f2": np.array([0.0, float("nan"), 1e-05, 1e16])}
    frame = pd.DataFrame(cols)
    write_csv(tmp_path / "mine.csv", cols)
    frame.to_csv(tmp_path / "pandas.csv", index=False)
    assert (tmp_path / "mine.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()
    plain = {k: v for k, v in cols.items() if k != "s"} | {"s": ["a", "b", "", "c"]}
    write_csv(tmp_path / "mine2.csv", plain)  # (the direct join, no field to quote)
    pd.DataFrame(plain).to_csv(tmp_path / "pandas2.csv", index=False)
    assert (tmp_path / "mine2.csv").read_bytes() == (tmp_path / "pandas2.csv").read_bytes()
    write_parquet(tmp_path / "mine.parquet", cols)
    frame.to_parquet(tmp_path / "pandas.parquet", index=False)
    a, b = pq.read_table(tmp_path / "mine.parquet"), pq.read_table(tmp_path / "pandas.parquet")
    assert a.replace_schema_metadata(None).equals(b.replace_schema_metadata(None))
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "mine.parquet"), frame)


def test_a_run_without_plots_does_not_import_pandas(tmp_path):
    code = ("import sys; from lab.cli.main import main; sys.argv = ['servelab', 'run', %r, '--out', %r, '-q', "
            "'--no-plots', '--set', 'workload.num_requests=20']\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('pandas' in sys.modules)") % (DEMO, str(tmp_path / "o"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "False"
