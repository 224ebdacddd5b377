"""servelab compare: one file, several policies and traces, one side-by-side report."""

from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from lab.cli.main import app
from lab.report.compare import load_comparison
from lab.experiment.config import ConfigError
from tests.conftest import needs_data

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()

SMALL = """
name: small
description: two schedulers on two generated workloads, two routers on a 2-instance cluster
note: note.md
base:
  engine: {max_num_batched_tokens: 2048}
  workload: {source: synthetic, rate: 20, prompt_tokens: {kind: constant, value: 900, max: 900},
             output_tokens: {kind: constant, value: 40, max: 40}}
traces:
  few: {workload: {num_requests: 40}}
  more: {workload: {num_requests: 60, rate: 25}}
groups:
  schedulers:
    traces: [few, more]
    variants:
      vllm_v1: {}
      sarathi: {policy: {scheduler: sarathi}}
  routers:
    traces: [few]
    base: {cluster: {num_instances: 2}}
    variants:
      rr: {cluster: {router: round_robin}}
      lr: {cluster: {router: least_requests}}
"""


def test_compare_runs_every_variant_and_writes_one_report(tmp_path):
    (tmp_path / "cmp.yaml").write_text(SMALL)
    (tmp_path / "note.md").write_text("## Reading\n\nSarathi trades TTFT for TPOT.\n")
    out = tmp_path / "out"
    res = runner.invoke(app, ["compare", str(tmp_path / "cmp.yaml"), "--out", str(out), "-q", "--jobs", "1"])
    assert res.exit_code == 0, res.output
    table = pd.read_csv(out / "comparison.csv")
    assert len(table) == 6 and set(table["variant"]) == {"vllm_v1", "sarathi", "rr", "lr"}
    assert (table["num_finished"] == table["num_requests"]).all()
    md = (out / "comparison.md").read_text()
    assert "Sarathi trades TTFT for TPOT." in md and "### few" in md and "### more" in md
    assert "req/instance" in md and (out / "schedulers_cdf.png").is_file()
    for g, t, v in (("schedulers", "more", "sarathi"), ("routers", "few", "lr")):
        assert (out / g / t / v / "summary.json").is_file() and (out / g / t / v / "events.parquet").is_file()
        bench = __import__("json").loads((out / g / t / v / "bench_result.json").read_text())
        assert "completed" in bench and not {"ttfts", "itls", "input_lens"} & set(bench)  # no per-request detail
    s = table.set_index(["group", "trace", "variant"])
    # Sarathi's 512-token budget: lower TPOT tail, higher TTFT than vLLM's 2048-token budget
    assert s.loc[("schedulers", "more", "sarathi"), "tpot_p99"] < s.loc[("schedulers", "more", "vllm_v1"), "tpot_p99"]
    assert s.loc[("schedulers", "more", "sarathi"), "ttft_mean"] > s.loc[("schedulers", "more", "vllm_v1"), "ttft_mean"]


def test_a_bad_run_fails_before_anything_runs_naming_the_run(tmp_path):
    p = tmp_path / "cmp.yaml"
    p.write_text(SMALL.replace("rate: 25", "rte: 25"))
    with pytest.raises(ConfigError, match=r"(?s)\[group schedulers, trace more, variant vllm_v1\].*workload.rte"):
        load_comparison(p)
    p.write_text(SMALL.replace("traces: [few]", "traces: [fewer]"))
    with pytest.raises(ConfigError, match="unknown trace 'fewer'"):
        load_comparison(p)
    p.write_text(SMALL.replace("scheduler: sarathi", "scheduler: sarathy"))
    res = runner.invoke(app, ["compare", str(p), "-q"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "unknown scheduler 'sarathy'" in res.output and "variant sarathi" in res.output


@needs_data("traces", "mooncake", "conversation_trace.jsonl")
def test_the_shipped_comparison_file_is_valid():
    spec, runs = load_comparison(REPO / "experiments" / "policy_comparison.yaml")
    assert {r.trace for r in runs} >= {"azure_code", "azure_conv", "mooncake_conv"}
    assert any(r.data["policy"]["scheduler"].endswith("ShortestPromptFirst") for r in runs)


CURVE = """
name: curve
description: max_num_seqs sweep at TP1 and TP2 on a saturated generated workload
base:
  cost_model: {kind: roofline}
  workload: {source: synthetic, num_requests: 8, rate: 1000, prompt_tokens: {kind: constant, value: 128, max: 128},
             output_tokens: {kind: constant, value: 16, max: 16}}
traces:
  sat: {}
groups:
  sweep:
    traces: [sat]
    curve: {x: engine.max_num_seqs, series: hardware.tensor_parallel_size}
    variants:
      tp1_c1: {engine: {max_num_seqs: 1}}
      tp1_c2: {engine: {max_num_seqs: 2}}
      tp1_c4: {engine: {max_num_seqs: 4}}
      tp2_c1: {engine: {max_num_seqs: 1}, hardware: {tensor_parallel_size: 2}}
      tp2_c4: {engine: {max_num_seqs: 4}, hardware: {tensor_parallel_size: 2}}
"""


def test_a_curve_group_writes_its_figure_and_table(tmp_path):
    (tmp_path / "cmp.yaml").write_text(CURVE)
    out = tmp_path / "out"
    res = runner.invoke(app, ["compare", str(tmp_path / "cmp.yaml"), "--out", str(out), "-q", "--jobs", "1"])
    assert res.exit_code == 0, res.output
    png = out / "sweep_sat_curve.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = pd.read_csv(out / "comparison.csv").set_index("variant")
    # the TP1 variants never set tensor_parallel_size: the series value is the validated default, 1
    assert table.loc["tp1_c2", "curve_x"] == 2 and table.loc["tp1_c2", "curve_series"] == 1
    assert table.loc["tp2_c4", "curve_series"] == 2
    md = (out / "comparison.md").read_text()
    assert "![sweep / sat: throughput, TTFT and TPOT vs engine.max_num_seqs](sweep_sat_curve.png)" in md
    head = ("| engine.max_num_seqs | hardware.tensor_parallel_size | variant | out tok/s | TTFT mean (ms) | "
            "TPOT mean (ms) | queue mean (ms) |")
    assert head in md
    body = md.split(head)[1].split("\n\n")[0].strip().splitlines()[1:]  # after the separator row
    assert [r.split("|")[3].strip() for r in body] == ["tp1_c1", "tp2_c1", "tp1_c2", "tp1_c4", "tp2_c4"]
    tput = table["output_token_throughput"]
    assert tput["tp1_c1"] < tput["tp1_c2"] < tput["tp1_c4"] and tput["tp2_c1"] > tput["tp1_c1"]


def test_a_curve_without_plots_still_writes_the_table(tmp_path):
    # no series: one line; the TP2 variants go, or they would share x with the TP1 ones
    text = CURVE.replace(", series: hardware.tensor_parallel_size", "")
    p = tmp_path / "cmp.yaml"
    p.write_text("\n".join(line for line in text.splitlines() if "tp2_c" not in line) + "\n")
    out = tmp_path / "out"
    res = runner.invoke(app, ["compare", str(p), "--out", str(out), "-q", "--no-plots"])
    assert res.exit_code == 0, res.output
    md = (out / "comparison.md").read_text()
    assert "| engine.max_num_seqs | variant | out tok/s |" in md and not (out / "sweep_sat_curve.png").exists()


def test_a_bad_curve_path_is_one_line_naming_the_file_group_and_path(tmp_path):
    p = tmp_path / "cmp.yaml"
    p.write_text(CURVE.replace("x: engine.max_num_seqs", "x: engine.max_num_seq"))
    with pytest.raises(ConfigError) as e:
        load_comparison(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg and "group 'sweep'" in msg and "'engine.max_num_seq'" in msg
    res = runner.invoke(app, ["compare", str(p), "-q"], env={"COLUMNS": "400"})
    assert res.exit_code == 2 and "curve path 'engine.max_num_seq' does not exist" in res.output
    p.write_text(CURVE.replace("series: hardware.tensor_parallel_size", "series: hardware.tensor_paralel_size"))
    with pytest.raises(ConfigError, match=r"group 'sweep': curve path 'hardware.tensor_paralel_size' does not exist"):
        load_comparison(p)
    p.write_text(CURVE.replace("x: engine.max_num_seqs", "x: policy.scheduler"))  # not a number
    with pytest.raises(ConfigError, match=r"group 'sweep': curve x 'policy.scheduler' is 'vllm_v1'.*expected a number"):
        load_comparison(p)
    p.write_text(CURVE.replace("tp2_c4: {engine: {max_num_seqs: 4}", "tp2_c4: {engine: {max_num_seqs: 1}"))
    with pytest.raises(ConfigError, match=r"variants 'tp2_c1' and 'tp2_c4' are the same curve point"):
        load_comparison(p)
    p.write_text(CURVE.replace("curve: {x: engine.max_num_seqs", "curve: {x: 'engine..max'"))
    with pytest.raises(ConfigError, match=r"groups.sweep.curve.x"):
        load_comparison(p)


@needs_data("calibration", "aiconfigurator", "perf_db", "h100_sxm")
@needs_data("calibration", "aiconfigurator", "perf_db", "h200_sxm")
def test_the_shipped_parallelism_comparisons_are_valid():
    _, runs = load_comparison(REPO / "experiments" / "tp2_vs_pp2.yaml")
    points = {(r.group, r.curve_series, r.curve_x) for r in runs}
    assert len(runs) == len(points) == 28
    assert {x for _, _, x in points} == {1, 2, 4, 8, 16, 32, 64} and {s for _, s, _ in points} == {1, 2}
    _, runs = load_comparison(REPO / "experiments" / "deepseek_v3_dp_ep_lockstep.yaml")
    lock = {(r.trace, r.variant): r.data["hardware"]["data_parallel_lock_step"] for r in runs}
    assert lock[("rate8", "lock_step")] is True and lock[("rate8", "independent")] is False and len(lock) == 6
