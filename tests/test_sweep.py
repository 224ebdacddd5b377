"""Sweeps: axes expand (cross, zip, ranges), replications get their own seeds, the tables have the axes and
confidence intervals, a re-run reuses complete runs, a failed run is recorded, a killed sweep resumes, and Ray gives
the pool's results."""

import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml

from lab.experiment.config import ConfigError
from lab.report.sweep import load_sweep, run_sweep

BASE = {"name": "b", "seed": 5,
        "workload": {"source": "synthetic", "num_requests": 30, "rate": 5.0,
                     "prompt_tokens": {"kind": "constant", "value": 128},
                     "output_tokens": {"kind": "lognormal", "median": 32, "sigma": 0.5, "max": 64}},
        "model": {"name": "Llama-3.1-8B"}, "simulation": {"progress": False, "record_events": False}}


def _write(tmp_path, **over):
    spec = {"name": "sw", "base": BASE, "axes": {"workload.rate": [2, 8], "engine.max_num_seqs": {"range": [4, 8, 4]}},
            "replications": 2, **over}
    path = tmp_path / "sw.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_axes_cross_and_zip_with_replications_and_seeds(tmp_path):
    spec, cmp, runs = load_sweep(_write(tmp_path))
    assert spec.points() == [{"workload.rate": 2, "engine.max_num_seqs": 4}, {"workload.rate": 2, "engine.max_num_seqs": 8},
                             {"workload.rate": 8, "engine.max_num_seqs": 4}, {"workload.rate": 8, "engine.max_num_seqs": 8}]
    assert len(runs) == 8
    seeds = sorted({r.data["seed"] for r in runs})
    assert seeds == [5, 6]
    spec, _, runs = load_sweep(_write(tmp_path, mode="zip", axes={"workload.rate": [1, 2], "seed": [0, 1]},
                                      replications=1))
    assert spec.points() == [{"workload.rate": 1, "seed": 0}, {"workload.rate": 2, "seed": 1}]


def test_tables_and_resume(tmp_path):
    spec, cmp, runs = load_sweep(_write(tmp_path))
    out = tmp_path / "out"
    per_run, summary = run_sweep(spec, cmp, runs, out, jobs=1)
    assert len(per_run) == 8 and {"workload.rate", "engine.max_num_seqs", "replication"} <= set(per_run.columns)
    assert len(summary) == 4 and summary["replications"].tolist() == [2, 2, 2, 2]
    row = summary.iloc[3]
    vals = per_run[per_run["point"] == 3]["ttft_mean_ms"]
    assert row["ttft_mean_ms"] == pytest.approx(vals.mean())
    assert row["ttft_mean_ms_ci95"] == pytest.approx(12.706 * vals.std(ddof=1) / 2 ** 0.5)
    assert pd.read_csv(out / "sweep.csv").shape[0] == 8
    again, _ = run_sweep(spec, cmp, runs, out, jobs=1)
    assert again.attrs["reused"] == 8 and again.equals(per_run)


def test_tables_have_percentiles_with_units_as_bench_result_json(tmp_path):
    spec, cmp, runs = load_sweep(_write(tmp_path, axes={"workload.rate": [4]}, replications=2,
                                        base={**BASE, "slo": {"ttft_s": 0.2, "tpot_s": 0.05}}))
    out = tmp_path / "out"
    per_run, _ = run_sweep(spec, cmp, runs, out, jobs=1)
    summary = pd.read_csv(out / "sweep_summary.csv")
    for m in ("ttft", "tpot", "itl", "e2el", "queue_time"):
        for stat in ("mean", "p50", "p90", "p95", "p99"):
            assert f"{m}_{stat}_ms" in per_run and f"{m}_{stat}_ms_ci95" in summary
    for col in ("request_throughput_req_s", "output_throughput_tok_s", "total_token_throughput_tok_s",
                "request_goodput_req_s", "slo_attainment_pct"):
        assert col in per_run and col in summary
    assert not [c for c in summary if c.endswith("_mean") or c in ("ttft_p99", "goodput")]  # no unitless names
    run = json.loads((out / "sweep" / "base" / "p0000_r0" / "summary.json").read_text())  # seconds, 0..1
    row = per_run.iloc[0]
    assert row["ttft_p90_ms"] == pytest.approx(run["ttft"]["p90"] * 1e3)
    assert row["itl_p99_ms"] == pytest.approx(run["itl"]["p99"] * 1e3)
    assert row["tpot_p50_ms"] == pytest.approx(run["tpot"]["median"] * 1e3)
    assert row["request_goodput_req_s"] == pytest.approx(run["goodput"])
    assert row["slo_attainment_pct"] == pytest.approx(run["slo_attainment"] * 100)
    assert summary["e2el_p99_ms"].iloc[0] == pytest.approx(per_run["e2el_p99_ms"].mean())


def test_bad_sweep_files(tmp_path):
    with pytest.raises(ConfigError, match="zip needs"):
        load_sweep(_write(tmp_path, mode="zip", axes={"workload.rate": [1, 2, 3], "seed": [0, 1]}))
    with pytest.raises(ConfigError, match="range"):
        load_sweep(_write(tmp_path, axes={"workload.rate": {"range": [5, 1, 1]}}))
    with pytest.raises(ConfigError, match="workload.rate"):
        load_sweep(_write(tmp_path, axes={"workload.rate": [-1]}))


def test_run_folders_hold_tables_only_unless_plots(tmp_path):
    spec, cmp, runs = load_sweep(_write(tmp_path, axes={"workload.rate": [4]}, replications=1))
    run_sweep(spec, cmp, runs, tmp_path / "out", jobs=1)
    folder = tmp_path / "out" / "sweep" / "base" / "p0000_r0"
    assert sorted(p.name for p in folder.iterdir()) == ["requests.parquet", "run.json", "summary.json"]
    assert json.loads((folder / "run.json").read_text())["plots"] is False
    _, _ = run_sweep(spec, cmp, runs, tmp_path / "out", jobs=1, plots=True)  # a run without plots is redone
    names = {p.name for p in folder.iterdir()}
    assert {"latency_cdf.png", "report.md", "steps.parquet"} <= names
    again, _ = run_sweep(spec, cmp, runs, tmp_path / "out", jobs=1)  # a run with plots serves a sweep without
    assert again.attrs["reused"] == 1


def test_failed_run_is_recorded_and_the_others_finish(tmp_path):
    good = tmp_path / "good.csv"
    good.write_text("arrival_time_s,prompt_tokens,output_tokens\n0.0,64,8\n0.1,64,8\n")
    base = {**BASE, "workload": {"source": "csv", "path": str(good)}}
    spec, cmp, runs = load_sweep(_write(tmp_path, base=base, replications=1,
                                        axes={"workload.path": [str(good), str(tmp_path / "missing.csv")]}))
    seen = []
    per_run, summary = run_sweep(spec, cmp, runs, tmp_path / "out", jobs=1, progress=lambda s: seen.append(
        (s.done, s.failed, s.last_error)))
    assert per_run["status"].tolist() == ["ok", "failed"]
    err = per_run["error"].iloc[1]
    assert err.startswith("WorkloadError: ") and "missing.csv" in err and "\n" not in err
    assert pd.isna(per_run["error"].iloc[0]) and per_run["num_finished"].iloc[0] == 2
    assert per_run.attrs["failed"] == [("p0001_r0", err)]
    assert seen[-1] == (1, 1, err) and summary["failed"].tolist() == [0, 1]
    assert not (tmp_path / "out" / "sweep" / "base" / "p0001_r0").exists()


def test_the_tables_are_replaced_as_one_set(tmp_path, monkeypatch):
    import lab.report.sweep as sweep_mod

    names = ["sweep.csv", "sweep.parquet", "sweep_summary.csv", "sweep.html"]
    out = tmp_path / "out"
    spec, cmp, runs = load_sweep(_write(tmp_path, axes={"workload.rate": [4, 8]}, replications=1))
    run_sweep(spec, cmp, runs, out, jobs=1)
    earlier = {n: (out / n).read_bytes() for n in names}
    records = _complete_runs(out)
    # another sweep into the folder (rate 8 -> 16), killed once three of its four files are written
    spec, cmp, runs = load_sweep(_write(tmp_path, axes={"workload.rate": [4, 16]}, replications=1))
    written = []

    def killed(folder, *args, **kwargs):
        written.extend(n for n in names if (folder / n).is_file())
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_mod, "write_sweep_html", killed)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, cmp, runs, out, jobs=1)
    assert written == names[:3]  # the new tables existed, and yet:
    assert {n: (out / n).read_bytes() for n in names} == earlier  # the earlier set, whole
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    monkeypatch.undo()
    per_run, summary = run_sweep(spec, cmp, runs, out, jobs=1)
    assert per_run.attrs["reused"] == 2  # rate 4 from the first sweep, rate 16 from the killed one
    assert pd.read_csv(out / "sweep.csv")["workload.rate"].tolist() == [4, 16]
    assert pd.read_csv(out / "sweep_summary.csv")["workload.rate"].tolist() == [4, 16]
    assert pd.read_parquet(out / "sweep.parquet").equals(per_run)
    assert _complete_runs(out)["p0000_r0"] == records["p0000_r0"]  # the run records carried over, untouched


def test_an_out_folder_that_is_not_an_output_is_refused_before_any_run(tmp_path):
    from lab.report.output_folder import OutputDirError

    spec, cmp, runs = load_sweep(_write(tmp_path, axes={"workload.rate": [4]}, replications=1))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(OutputDirError, match="not servelab outputs"):
        run_sweep(spec, cmp, runs, tmp_path / "mine", jobs=1)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_plain_progress_lines_off_a_terminal():
    from rich.console import Console

    from lab.cli.sweep_display import SweepDisplay
    from lab.report.sweep import SweepState

    buf = io.StringIO()
    with SweepDisplay(Console(file=buf, width=200), tty=False, every_s=3600, every_n=5) as show:
        state = SweepState(total=20, reused=3)
        show(state)  # nothing finished since the start: no line
        for k in range(1, 8):
            state.done, state.running, state.elapsed_s = k, 2, 2.0 * k
            state.eta_s = state.elapsed_s / k * (17 - k)
            state.last, state.last_error = f"p{k}", ("ValueError: bad" if k == 6 else None)
            show(state)
    lines = buf.getvalue().splitlines()
    assert lines == ["sweep: 5/20 runs: 2 done, 3 reused, 0 failed, 2 running; elapsed 0:04, ETA 0:30",
                     "failed: p6: ValueError: bad",
                     "sweep: 10/20 runs: 7 done, 3 reused, 0 failed, 2 running; elapsed 0:14, ETA 0:20"]


def test_ray_executor_missing_says_how_to_install(monkeypatch):
    import sys

    from lab.report.executors import ExecutorError, make_executor

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ExecutorError, match=r"--executor ray needs the ray package.*pip install 'servelab\[ray\]'"):
        make_executor("ray", 2)
    with pytest.raises(ExecutorError, match="--address is for --executor ray"):
        make_executor("pool", 2, "auto")


# Kill and resume, and Ray: 12 runs of ~0.15 s (300 requests), compared with one uninterrupted in-process sweep.
KILL_BASE = {**BASE, "workload": {**BASE["workload"], "num_requests": 300, "rate": 20.0}}


@pytest.fixture(scope="module")
def reference_sweep(tmp_path_factory):
    """(sweep file, the sweep.csv bytes of an uninterrupted sweep of it, its output folder)."""
    d = tmp_path_factory.mktemp("ref")
    path = _write(d, base=KILL_BASE, axes={"workload.rate": [10, 20, 30], "engine.max_num_seqs": [8, 32]})
    spec, cmp, runs = load_sweep(path)
    run_sweep(spec, cmp, runs, d / "out", jobs=1)
    return path, (d / "out" / "sweep.csv").read_bytes(), d / "out"


def _complete_runs(out):
    # (not the temporary folder of a run killed while writing it, ".<name>.tmp-<pid>": output_folder.atomic_dir)
    return {p.parent.name: p.stat().st_mtime_ns for p in (out / "sweep" / "base").glob("*/run.json")
            if not p.parent.name.startswith(".")}


def test_killed_sweep_resumes_without_redoing_complete_runs(reference_sweep, tmp_path):
    path, ref_csv, _ = reference_sweep
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lab", "sweep", str(path), "--jobs", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(_complete_runs(out) if (out / "sweep").is_dir() else {}) < 4 and proc.poll() is None:
        assert time.monotonic() < deadline, "the sweep did not finish 4 runs in 60 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _complete_runs(out)
    assert 4 <= len(before) < 12, f"kill came too late: {len(before)} of 12 runs complete"
    assert not (out / "sweep.csv").exists()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"12 runs ({len(before)} reused, {12 - len(before)} simulated, 0 failed)" in res.stdout
    after = _complete_runs(out)
    assert len(after) == 12 and all(after[v] == t for v, t in before.items())  # untouched
    assert not [p for p in (out / "sweep" / "base").iterdir() if ".tmp-" in p.name]
    assert (out / "sweep.csv").read_bytes() == ref_csv


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="ray is not installed (pip install 'servelab[ray]')")
def test_ray_executor_matches_the_pool_and_resumes(reference_sweep, tmp_path):
    import ray

    from lab.report.executors import RayExecutor

    path, ref_csv, ref_out = reference_sweep
    spec, cmp, runs = load_sweep(path)
    out = tmp_path / "out"
    shutil.copytree(ref_out / "sweep", out / "sweep")  # 10 runs complete, 2 left to Ray: resume and runs at once
    for v in ("p0001_r0", "p0004_r1"):
        shutil.rmtree(out / "sweep" / "base" / v)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a `ray start` one
    try:
        per_run, _ = run_sweep(spec, cmp, runs, out, executor=RayExecutor())
    finally:
        ray.shutdown()
    assert per_run.attrs["reused"] == 10 and (out / "sweep.csv").read_bytes() == ref_csv
    for v in ("p0001_r0", "p0004_r1"):
        assert json.loads((out / "sweep" / "base" / v / "run.json").read_text())["plots"] is False
        ours, ref = (pd.read_parquet(o / "sweep" / "base" / v / "requests.parquet") for o in (out, ref_out))
        assert ours.equals(ref)
