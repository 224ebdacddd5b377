"""Output folders are written atomically: no stale files after a re-run, nothing half-written after kill -9, a clear
error for --out at a file, compare runs resumed when unchanged, spill folders removed, workers gone with the parent."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from lab.cli.main import app

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "experiments" / "demo.yaml")
runner = CliRunner()
BIG = 10_000  # demo requests that take ~1-3 s to simulate on a 2-core machine


def _run(out: Path, *extra: str, n: int = 60):
    """servelab run (in this process) of the demo with ``n`` requests into ``out``."""
    return runner.invoke(app, ["run", DEMO, "--out", str(out), "-q", "--set", f"workload.num_requests={n}", *extra])


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lab", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _spawn_run(out: Path, n: int) -> subprocess.Popen:
    return _spawn(["run", DEMO, "--out", str(out), "-q", "--no-plots", "--set", f"workload.num_requests={n}"])


def _siblings(out: Path) -> list[str]:
    """Temporary or set-aside folders of ``out`` left in its parent."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _complete(out: Path, n: int) -> bool:
    """``out`` is a complete report of an ``n``-request run."""
    s = json.loads((out / "summary.json").read_text())
    return s["num_requests"] == n and len(pd.read_csv(out / "requests.csv")) == n and (out / "report.md").is_file()


def test_rerun_replaces_the_folder_and_leaves_no_stale_file(tmp_path):
    out = tmp_path / "out"
    res = _run(out)
    assert res.exit_code == 0, res.output
    assert {"latency_cdf.png", "timeseries.png", "events.parquet"} <= {p.name for p in out.iterdir()}
    (out / "latency_cdf.png").write_bytes(b"stale")  # an earlier run's files, and one the user left
    (out / "stray.txt").write_text("not written by this run")
    res = _run(out, "--no-plots", "--set", "simulation.record_events=false", n=40)
    assert res.exit_code == 0, res.output
    names = {p.name for p in out.iterdir()}
    assert names == {"requests.parquet", "requests.csv", "steps.parquet", "summary.json", "report.md",
                     "report.html", "bench_result.json"}, names
    assert _complete(out, 40) and _siblings(out) == []


def test_a_folder_that_is_not_an_output_is_refused_not_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    res = _run(tmp_path)
    assert res.exit_code == 2 and "not servelab outputs" in res.output and "notes.txt" in res.output
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "summary.json").exists()


def test_kill_9_leaves_no_folder_or_the_previous_one_and_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "out"
    p = _spawn_run(out, 10 * BIG)  # killed while it simulates (a run of many seconds): nothing at all
    time.sleep(1.0)
    p.kill()
    p.wait()
    assert not out.exists() and _siblings(out) == []

    assert _run(out).exit_code == 0  # a previous complete folder
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    p = _spawn_run(out, BIG)  # killed while it writes its files (its temporary folder exists)
    tmp = tmp_path / f".out.tmp-{p.pid}"
    deadline = time.monotonic() + 60
    while not tmp.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.15)  # some of its files written
    p.kill()
    p.wait()
    if _complete(out, 60):  # the previous folder, untouched ...
        assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    else:  # ... or (it finished before the kill landed) the new one, complete
        assert _complete(out, BIG)
    assert _siblings(out) in ([], [tmp.name])

    res = _run(out, n=30)  # the next run succeeds and removes the dead run's temporary folder
    assert res.exit_code == 0, res.output
    assert _complete(out, 30) and _siblings(out) == []


def test_out_at_a_file_fails_at_once_with_one_line(tmp_path):
    f = tmp_path / "report.txt"
    f.write_text("x")
    t0 = time.monotonic()  # 5 million requests: fails before simulating, or it would take minutes
    res = subprocess.run([sys.executable, "-m", "lab", "run", DEMO, "--out", str(f), "-q", "--set",
                          "workload.num_requests=5000000"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and str(f) in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert f.read_text() == "x"
    cmp = tmp_path / "cmp.yaml"
    cmp.write_text(_comparison())
    res = runner.invoke(app, ["compare", str(cmp), "--out", str(f), "-q"])
    assert res.exit_code == 2 and str(f) in res.output and f.read_text() == "x"


def _comparison(c_seqs: int = 4, n: int = 30) -> str:
    return f"""
name: tiny
base:
  seed: 0
  model: {{name: Llama-3.1-8B}}
  hardware: {{gpu: H100-SXM5-80GB}}
  cost_model: {{kind: roofline}}
  workload: {{source: synthetic, rate: 20, prompt_tokens: {{kind: constant, value: 500, max: 500}},
             output_tokens: {{kind: constant, value: 30, max: 30}}}}
traces:
  few: {{workload: {{num_requests: {n}}}}}
groups:
  sched:
    traces: [few]
    variants:
      a: {{}}
      b: {{policy: {{scheduler: sarathi}}}}
      c: {{engine: {{max_num_seqs: {c_seqs}}}}}
"""


def _mtimes(out: Path) -> dict[str, int]:
    return {v: (out / "sched" / "few" / v / "summary.json").stat().st_mtime_ns for v in "abc"}


def test_compare_resumes_unchanged_runs_and_redoes_changed_ones(tmp_path):
    cmp = tmp_path / "cmp.yaml"
    cmp.write_text(_comparison())
    out = tmp_path / "out"

    def compare(*extra: str) -> str:
        res = runner.invoke(app, ["compare", str(cmp), "--out", str(out), "--no-plots", *extra])
        assert res.exit_code == 0, res.output
        return res.output

    assert "0 runs reused, 3 simulated" in compare("-j", "2")
    first, table = _mtimes(out), pd.read_csv(out / "comparison.csv")
    text = compare("-j", "2")
    assert "3 runs reused, 0 simulated" in text and text.count("reused, configuration unchanged") == 3
    assert _mtimes(out) == first
    pd.testing.assert_frame_equal(pd.read_csv(out / "comparison.csv"), table)  # read back = as simulated

    cmp.write_text(_comparison(c_seqs=8))  # one variant changed: only it runs again
    assert "2 runs reused, 1 simulated" in compare()
    now = _mtimes(out)
    assert now["a"] == first["a"] and now["b"] == first["b"] and now["c"] != first["c"]
    (out / "sched" / "few" / "b" / "run.json").unlink()  # an incomplete (or pre-resume) folder: redone
    assert "2 runs reused, 1 simulated" in compare()
    assert "0 runs reused, 3 simulated" in compare("--fresh")
    assert all(v != now[k] for k, v in _mtimes(out).items())
    assert not [p for p in out.rglob(".*tmp-*")]


@pytest.fixture
def spill_dirs(tmp_path, monkeypatch):
    """The step-log spill folders runs create (in a private temporary folder)."""
    base = tmp_path / "tmpdir"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    made = []
    real = tempfile.mkdtemp

    def mkdtemp(*a, **k):
        made.append(Path(real(*a, **k)))
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return made


def test_the_spill_folder_is_removed_after_the_run_and_when_it_fails(tmp_path, spill_dirs, monkeypatch):
    res = _run(tmp_path / "out0", "--no-plots", "--set", "simulation.step_log=spill")
    assert res.exit_code == 0, res.output
    assert spill_dirs == []  # a run whose rows fit in memory makes no spill folder
    import lab.core.step_log as step_log

    monkeypatch.setattr(step_log, "RUN_ROW_BUDGET", 64)  # (every instance then spills)
    monkeypatch.setattr(step_log, "ROW_BUDGET", 64)
    res = _run(tmp_path / "out", "--no-plots", "--set", "simulation.step_log=spill")
    assert res.exit_code == 0, res.output
    assert len(spill_dirs) == 1 and spill_dirs[0].name.startswith("servelab_steps_") and not spill_dirs[0].exists()
    assert _complete(tmp_path / "out", 60)

    import lab.experiment.simulation as simulation

    def boom(env, horizon):
        env.run(until=60.0)  # (past the first spill)
        raise RuntimeError("the run failed")

    monkeypatch.setattr(simulation, "_run_env", boom)
    res = _run(tmp_path / "out2", "--set", "simulation.step_log=spill")
    assert isinstance(res.exception, RuntimeError) and len(spill_dirs) == 2 and not spill_dirs[1].exists()
    assert not (tmp_path / "out2").exists()


def _children(pid: int) -> list[int]:
    """Live (not zombie) child processes of ``pid``, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid and stat[0] != "Z":
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_compare_workers_do_not_outlive_the_parent(tmp_path, sig):
    cmp = tmp_path / "cmp.yaml"
    cmp.write_text(_comparison(n=BIG))
    p = _spawn(["compare", str(cmp), "--out", str(tmp_path / "out"), "-q", "--no-plots", "-j", "2"])
    deadline = time.monotonic() + 30
    while len(kids := _children(p.pid)) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(kids) == 2, p.stderr.read() if p.poll() is not None else kids
    time.sleep(0.3)  # the workers are simulating
    p.send_signal(sig)
    rc = p.wait(timeout=20)
    assert rc == (-9 if sig == signal.SIGKILL else 143)
    deadline = time.monotonic() + 5
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(k) for k in kids)
    if sig == signal.SIGTERM:
        assert "Traceback" not in p.stderr.read()
