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
