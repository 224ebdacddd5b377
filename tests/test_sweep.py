"""Sweeps: axes expand (cross, zip, ranges), replications get their own seeds, the tables have the axes and
confidence intervals, and a re-run reuses complete runs."""

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
    vals = per_run[per_run["point"] == 3]["ttft_mean"]
    assert row["ttft_mean_mean"] == pytest.approx(vals.mean())
    assert row["ttft_mean_ci95"] == pytest.approx(12.706 * vals.std(ddof=1) / 2 ** 0.5)
    assert pd.read_csv(out / "sweep.csv").shape[0] == 8
    again, _ = run_sweep(spec, cmp, runs, out, jobs=1)
    assert again.attrs["reused"] == 8 and again.equals(per_run)


def test_bad_sweep_files(tmp_path):
    with pytest.raises(ConfigError, match="zip needs"):
        load_sweep(_write(tmp_path, mode="zip", axes={"workload.rate": [1, 2, 3], "seed": [0, 1]}))
    with pytest.raises(ConfigError, match="range"):
        load_sweep(_write(tmp_path, axes={"workload.rate": {"range": [5, 1, 1]}}))
    with pytest.raises(ConfigError, match="workload.rate"):
        load_sweep(_write(tmp_path, axes={"workload.rate": [-1]}))
