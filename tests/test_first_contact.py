"""First-contact rough edges of the command line: help text, the default output folder of a same-named experiment
from another file, validate's whole-run figures, and the shared conventions of report figures."""

import json
import re
from pathlib import Path

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from lab.cli.main import app
from lab.experiment.config import SLOConfig
from lab.report import plots
from lab.report.validate import NOT_MEASURED, kv_capacity_line, load_measured

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent


def _command_paths(command, path=()):
    subs = getattr(command, "commands", None)
    yield path
    for name, sub in (subs or {}).items():
        yield from _command_paths(sub, path + (name,))


def test_help_shows_no_type_after_a_flag_and_reads_as_prose():
    paths = list(_command_paths(typer.main.get_command(app)))
    assert ("run",) in paths and ("traces", "fetch") in paths
    for path in paths:
        res = runner.invoke(app, [*path, "--help"], terminal_width=100)
        assert res.exit_code == 0, (path, res.output)
        assert "<bool>" not in res.output and "<list[" not in res.output, (path, res.output)
        assert "range>" not in res.output, (path, res.output)
    top = runner.invoke(app, ["--help"]).output
    # a docstring's source line breaks are joined: the command list wraps at the terminal's width (80 columns
    # here), not after "latency errors," where the docstring's source line ends
    assert "latency errors, per-request error" in top
    run = runner.invoke(app, ["run", "--help"], terminal_width=100).output
    flags = [line for line in run.splitlines() if re.search(r"--(quiet|no-plots|help)\b", line)]
    assert len(flags) == 3 and not any("<" in line for line in flags), flags  # a flag takes no value
    assert re.search(r"--set\s+<str>", run)  # a repeatable option: its element's type


def _demo_named(tmp_path: Path, file: str) -> Path:
    data = yaml.safe_load((REPO / "experiments" / "demo.yaml").read_text())
    data["workload"]["num_requests"] = 12
    path = tmp_path / file
    path.write_text(yaml.safe_dump(data))
    return path


def _earlier_report(tmp_path: Path, experiment_file: str) -> Path:
    folder = tmp_path / "reports" / "demo"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"experiment": "demo", "experiment_file": experiment_file}))
    return folder


def test_the_default_folder_of_another_file_with_the_same_name_is_not_replaced(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = _demo_named(tmp_path, "copy_of_demo.yaml")
    folder = _earlier_report(tmp_path, str(REPO / "experiments" / "demo.yaml"))
    res = runner.invoke(app, ["run", str(mine), "-q", "--no-plots"], terminal_width=400)
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line and str(REPO / "experiments" / "demo.yaml") in line and "--out" in line, line
    assert json.loads((folder / "summary.json").read_text())["experiment_file"].endswith("experiments/demo.yaml")
    # an explicit --out is the user's choice: it goes ahead
    res = runner.invoke(app, ["run", str(mine), "-q", "--no-plots", "--out", "reports/demo"], terminal_width=400)
    assert res.exit_code == 0, res.output


def test_the_same_file_replaces_its_own_default_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = _demo_named(tmp_path, "demo.yaml")
    _earlier_report(tmp_path, "demo.yaml")  # recorded relative to this folder: the same file
    res = runner.invoke(app, ["run", "demo.yaml", "-q", "--no-plots"], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert mine.is_file()


def test_a_second_file_with_the_same_name_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = _demo_named(tmp_path, "a.yaml"), _demo_named(tmp_path, "b.yaml")
    assert runner.invoke(app, ["run", str(first), "-q", "--no-plots"]).exit_code == 0
    summary = json.loads((tmp_path / "reports" / "demo" / "summary.json").read_text())
    if "experiment_file" not in summary:
        pytest.skip("summary.json does not record experiment_file yet (lab/report/run_summary.py collect)")
    res = runner.invoke(app, ["run", str(second), "-q", "--no-plots"], terminal_width=400)
    assert res.exit_code == 2 and str(first) in res.output


def _bench_file(path: Path, **extra) -> Path:
    n = 10
    d = {"request_rate": 2.0, "burstiness": 1.0, "input_lens": [200 + 10 * i for i in range(n)],
         "output_lens": [50] * n, "ttfts": [0.05] * n, "itls": [[0.01] * 49 for _ in range(n)], **extra}
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("recorded", [True, False])
def test_validate_compares_duration_and_throughput_and_never_prints_none(tmp_path, recorded):
    extra = {"duration": 6.0, "completed": 10, "total_output_tokens": 500} if recorded else {}
    _bench_file(tmp_path / "measured.json", **extra)
    exp = tmp_path / "val.yaml"
    exp.write_text(yaml.safe_dump({"name": "val", "workload": {"source": "vllm_bench", "path": "measured.json"},
                                   "validation": {"measured": "measured.json", "format": "vllm_bench"}}))
    res = runner.invoke(app, ["validate", str(exp), "--out", str(tmp_path / "out"), "--no-plots"],
                        terminal_width=200)  # (not -q: the printed table is checked too)
    assert res.exit_code == 0, res.output
    md = (tmp_path / "out" / "validation.md").read_text()
    run = json.loads((tmp_path / "out" / "validation.json").read_text())["run"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert run["duration_s"]["simulated"] == pytest.approx(summary["duration_s"])
    assert "None" not in md and "None" not in res.output
    assert "| duration |" in md and "| request throughput |" in md and "| output throughput |" in md
    if recorded:
        assert run["duration_s"]["measured"] == 6.0 and run["request_throughput"]["measured"] == pytest.approx(10 / 6)
        assert run["output_throughput"]["measured"] == pytest.approx(500 / 6)
        err = (summary["duration_s"] - 6.0) / 6.0 * 100
        assert run["duration_s"]["error_pct"] == pytest.approx(err)
        assert f"| duration | 6.0 s | {summary['duration_s']:.1f} s |" in md
    else:
        assert run["duration_s"]["measured"] is None and run["duration_s"]["error_pct"] is None
        assert f"| duration | {NOT_MEASURED} |" in md and NOT_MEASURED in res.output
    assert "measured not recorded" in md  # no meta.json beside a vllm_bench file: said, not "None"


def test_an_llmservingsim_file_gives_the_runs_duration_and_throughput(tmp_path):
    rows = [{"request_id": f"bench-{i}", "input_toks": 100, "output_toks": 10, "queued_ts": 100.0 + i,
             "first_token_ts": 100.5 + i, "last_token_ts": 101.0 + i} for i in range(4)]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    run = load_measured(path).attrs["run"]
    assert run["duration_s"] == pytest.approx(4.0)  # first queue entry (100) to the last token (104)
    assert run["request_throughput"] == pytest.approx(1.0) and run["output_throughput"] == pytest.approx(10.0)


def test_kv_capacity_line_says_what_is_unknown():
    line = kv_capacity_line({"used": 100, "derived": None, "measured": None})
    assert "None" not in line and "not derived" in line and "not recorded" in line


def test_series_colours_are_distinct_and_slo_lines_are_drawn():
    colours = [plots.series_style(k)["color"] for k in range(10)]
    assert len(set(colours)) == 10
    assert plots.series_style(10)["color"] == colours[0] and plots.series_style(10)["ls"] != "-"
    slo = SLOConfig(ttft_s=0.5, tpot_s=0.05)
    assert plots.slo_bound(slo, "TTFT") == 0.5 and plots.slo_bound(slo, "itl") == 0.05
    assert plots.slo_bound({"e2el_s": 9.0}, "e2el") == 9.0 and plots.slo_bound(slo, "e2el") is None
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 2)
    axes[0].plot([1, 2], [0, 1], label="a", **plots.series_style(0))
    assert plots.draw_slo(axes[0], slo, "ttft") == 0.5 and plots.draw_slo(axes[1], slo, "e2el") is None
    line = axes[0].get_lines()[-1]
    assert list(line.get_xdata()) == [500.0, 500.0] and line.get_label() == "TTFT SLO 500 ms"
    assert len(axes[1].get_lines()) == 0
    plots.shared_legend(fig, axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "TTFT SLO 500 ms"]
    plt.close(fig)
