"""Progress of the long commands (lab/cli/progress.py): a total, the current item, elapsed time and an ETA from
the items' weights, a line per item off a terminal; bench, calibrate and costcheck report through it."""

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from lab.cli.main import app
from lab.cli.progress import ItemProgress


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_item_lines_off_a_terminal_with_total_elapsed_and_eta_from_the_weights():
    buf, clock = io.StringIO(), FakeClock()
    with ItemProgress(Console(file=buf, width=200), "bench", 3, 100.0, tty=False, every_s=30, clock_fn=clock) as p:
        p.start("a", 10.0)
        assert p.eta_s is None  # nothing done yet
        clock.t = 20.0
        p.done("a: 20 s")
        assert p.eta_s == pytest.approx(20.0 / 10.0 * 90.0)  # elapsed / weight done x weight left
        p.start("b", 80.0)
        clock.t = 40.0
        p.update(0.25, "25 of 100 requests")  # under every_s since the last line: no line, the ETA moves
        assert p.eta_s == pytest.approx(40.0 / 30.0 * 70.0)
        clock.t = 60.0
        p.update(0.5, "50 of 100 requests")  # 40 s since the last line: a line
        p.done()
    lines = buf.getvalue().splitlines()
    assert lines == ["[1/3] a ...; elapsed 0:00, ETA ?",
                     "[1/3] a: 20 s (20.0 s); elapsed 0:20, ETA 3:00",
                     "[2/3] b ...; elapsed 0:20, ETA 3:00",
                     "[2/3] b: 50 of 100 requests; elapsed 1:00, ETA 1:00",
                     "[2/3] b (40.0 s); elapsed 1:00, ETA 0:07"]


def test_items_of_no_weight_are_shown_but_not_timed_into_the_eta():
    clock = FakeClock()
    with ItemProgress(Console(file=io.StringIO()), "calibrate", tty=False, clock_fn=clock) as p:
        p.add(1, 0.0)
        p.start("read the profiles", 0.0)
        clock.t = 100.0  # reading took 100 s
        p.add(2, 20.0)
        p.done()
        p.start("fit 1", 10.0)
        clock.t = 110.0
        p.done()
        assert (p.count, p.total) == (2, 3) and p.eta_s == pytest.approx(10.0)  # 10 s per 10 rows, not 110 s


def test_a_terminal_gets_a_bar_and_the_item_lines():
    buf = io.StringIO()
    with ItemProgress(Console(file=buf, width=120, force_terminal=True), "costcheck", 2, 2.0) as p:
        p.start("fit x", 1.0)
        p.done("fitted x")
    assert "[1/2] fitted x" in buf.getvalue()


def test_the_bench_child_reports_its_finished_requests(tmp_path):
    from lab.report.bench import _progress_writer, _run_child, read_progress

    path = str(tmp_path / "progress")
    assert read_progress(path) is None  # not written yet: the child is loading its trace
    write = _progress_writer(path, 1000)
    assert read_progress(path) == (0, 1000)
    write(3, 1000)  # under 0.5 % since the last mark: not written
    assert read_progress(path) == (0, 1000)
    write(5, 1000)
    write(1000, 1000)
    assert read_progress(path) == (1000, 1000)
    polls = []
    out, figures = _run_child(["sleep", "0.3"], poll=lambda: polls.append(1), poll_s=0.05)
    assert polls and figures.wall_s >= 0.3


def test_bench_prints_each_workload_with_the_total_elapsed_and_eta(monkeypatch):
    import lab.report.bench as bench
    from lab.report.bench import BenchResult

    def fake(name, path, data_dir=None, overrides=None, on_progress=None):
        on_progress(50, 100)
        on_progress(100, 100)
        return BenchResult(name, 100, 0.5, 0.7, 10.0, 200, 100, 50.0, "m", "g")

    monkeypatch.setattr(bench, "run_workload", fake)
    res = CliRunner().invoke(app, ["bench", "-w", "azure_conv,mooncake_conv"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "[1/2] azure_conv ...; elapsed 0:00, ETA ?" in lines
    assert any(ln.startswith("[1/2] azure_conv: 100 requests, 0.5 s simulating (") and "ETA" in ln for ln in lines)
    assert any(ln.startswith("[2/2] mooncake_conv ...; elapsed") for ln in lines)
    assert any(ln.startswith("[2/2] mooncake_conv: 100 requests") for ln in lines)
    assert "servelab benchmark" in res.output  # and then the table


def test_calibrate_shows_the_total_of_fits_and_held_out_tables(tmp_path):
    from tests.test_costmodel_cli import _synthetic_profile

    prof = tmp_path / "prof"
    _synthetic_profile(prof)
    res = CliRunner().invoke(app, ["calibrate", str(prof), "--out", str(tmp_path / "c.json"), "--report",
                                   str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("[")]
    assert lines[0] == "[1/1] read the profiles under 1 path(s) ...; elapsed 0:00, ETA ?"
    assert lines[1].startswith("[1/3] read 99 profile rows: 1 curves to fit, 1 tables to score held out (")
    assert lines[2].startswith("[2/3] fit A100-80GB-SXM4 gemm bf16 from servelab (99 rows) ...; elapsed")
    assert lines[3].startswith("[2/3] fitted A100-80GB-SXM4 gemm bf16 from servelab (99 rows) (")
    assert lines[5].startswith("[3/3] A100-80GB-SXM4 gemm bf16 [servelab] fit ") and "ETA 0:00" in lines[5]


def test_the_search_display_draws_a_bar_and_a_line_per_probe_on_a_terminal(tmp_path):
    import yaml

    from lab.cli.progress import SearchDisplay
    from lab.report.search import run_search
    from lab.report.search_spec import load_search
    from tests.test_search import BASE

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, "find": "max_rate", "low": 1, "high": 40,
                                    "tolerance": 0.3, "slo": {"ttft_s": 0.3, "percentile": 90}}))
    spec, where = load_search(path)
    buf = io.StringIO()
    with SearchDisplay(Console(file=buf, width=200, force_terminal=True), spec) as show:
        [res] = run_search(spec, where, tmp_path / "out", progress=show)
    text = buf.getvalue()
    assert text.count("base: workload.rate=") >= len(res.probes) and "p90 TTFT" in text
