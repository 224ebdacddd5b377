"""The step log's memory bound (rows held, not run length), its summarized mode (no rows, identical results), the
order-independent totals behind the summary's engine statistics, and the bench's refusal of unlike references."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab.core.step_log import ROW_BUDGET, RUN_ROW_BUDGET, ExactSum, StepLog, StepLogSummarized, StepTotals

REPO = Path(__file__).resolve().parent.parent


def _fill(log: StepLog, rows: int, rng: np.random.Generator, held: list[int]) -> None:
    """Append ``rows`` steps the way the engine does (maybe_spill before each real step, bulk fast-forward rows),
    recording how many rows the log holds after each call."""
    t = 0.0
    while rows > 0:
        if rng.random() < 0.7:
            d = float(rng.uniform(1e-3, 5e-2))
            log.maybe_spill()
            log.append(t, d, int(rng.integers(1, 8192)), 0, 3, int(rng.integers(1, 256)), int(rng.integers(0, 900)),
                       int(rng.integers(0, 256)), int(rng.integers(0, 50)), 0, 3, 0.0, d)
            t += d
            rows -= 1
        else:
            n = min(rows, int(rng.integers(1, 40)))
            ds = rng.uniform(1e-3, 5e-2, n).tolist()
            starts = (t + np.cumsum([0.0] + ds[:-1])).tolist()
            log.extend(starts, ds, [5.0] * n, rng.integers(0, 900, n).astype(float).tolist(), 5, 2)
            log.add_waiting(1)
            t = starts[-1] + ds[-1]
            rows -= n
        held.append(len(log.cols["start"]))


def test_row_budget_bounds_the_rows_held_and_keeps_every_row(tmp_path):
    budget = 100
    spilled, unbounded = (StepLog(3, 1000, str(tmp_path / "s" / "steps.parquet"), budget),
                          StepLog(3, 1000))  # same rows, all in memory
    held: list[int] = []
    _fill(spilled, 5000, np.random.default_rng(1), held)
    _fill(unbounded, 5000, np.random.default_rng(1), [])
    assert len(spilled) == len(unbounded) == 5000
    assert max(held) < budget + 40  # the budget plus at most one fast-forward jump's rows
    assert spilled.spilled_rows > 4000
    a = pd.concat(list(spilled.frames()), ignore_index=True)
    b = pd.concat(list(unbounded.frames()), ignore_index=True)
    pd.testing.assert_frame_equal(a, b)
    assert spilled.totals().engine_stats() == unbounded.totals().engine_stats()


def test_a_summarized_log_keeps_no_rows_and_the_same_totals():
    summary, full = StepLog(0, 1000, summary=True), StepLog(0, 1000)
    held: list[int] = []
    _fill(summary, 20_000, np.random.default_rng(2), held)
    _fill(full, 20_000, np.random.default_rng(2), [])
    assert len(summary) == 20_000 and max(held) <= 4096 + 40
    assert summary.totals().engine_stats() == full.totals().engine_stats()
    with pytest.raises(StepLogSummarized, match="output.step_log"):
        next(summary.frames())


def test_exact_sum_does_not_depend_on_order_or_grouping():
    rng = np.random.default_rng(3)
    v = rng.lognormal(-4, 2, 50_001) * rng.choice([-1.0, 1.0], 50_001)
    whole = ExactSum()
    whole.add(v)
    parts = ExactSum()
    perm = rng.permutation(v)
    for chunk in np.array_split(perm, 7):
        piece = ExactSum()
        piece.add(chunk)
        parts.merge(piece)
    assert whole.value() == parts.value() == math.fsum(v.tolist())
    assert StepTotals().engine_stats() is None


def _run(tmp_path, name: str, step_log: str, monkeypatch=None):
    from lab.experiment.config import load_experiment
    from lab.experiment.simulation import simulate
    from lab.report.run_report import write_report

    exp = load_experiment(REPO / "experiments" / "demo.yaml", None, {
        "workload": {"num_requests": 150}, "cluster": {"num_instances": 2}, "output": {"step_log": step_log}})
    with simulate(exp) as res:
        write_report(res, tmp_path / name, plots=False)
    return tmp_path / name


def test_full_and_summarized_runs_write_identical_results(tmp_path, monkeypatch):
    import lab.core.step_log as step_log

    monkeypatch.setattr(step_log, "SUMMARY_ROWS", 64)  # fold often: many partial totals
    full, summ = _run(tmp_path, "full", "full"), _run(tmp_path, "summary", "summary")
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, summ))
    for s in (a, b):
        s["simulation"].pop("wall_time_s")
    assert a["engine"]["num_steps"] > 500 and a == b
    pd.testing.assert_frame_equal(pd.read_parquet(full / "requests.parquet"), pd.read_parquet(summ / "requests.parquet"))
    assert (full / "bench_result.json").read_text() == (summ / "bench_result.json").read_text()
    assert (full / "steps.parquet").is_file() and not (summ / "steps.parquet").exists()


def test_the_run_row_budget_is_shared_by_its_instances(monkeypatch):
    """One instance holds the whole run's budget; many hold at least ROW_BUDGET each; a run that fits writes no
    spill file (nor loads pyarrow for one)."""
    from lab.core.step_log import rows_per_log
    from lab.experiment.config import load_experiment
    from lab.experiment.simulation import simulate

    assert rows_per_log(1) == RUN_ROW_BUDGET and rows_per_log(4) == RUN_ROW_BUDGET // 4
    assert rows_per_log(64) == ROW_BUDGET
    import lab.core.step_log as step_log

    monkeypatch.setattr(step_log, "RUN_ROW_BUDGET", 600)
    monkeypatch.setattr(step_log, "ROW_BUDGET", 200)
    exp = load_experiment(REPO / "experiments" / "demo.yaml", None, {
        "workload": {"num_requests": 150}, "cluster": {"num_instances": 2}})
    with simulate(exp) as res:
        logs = [i.steps for i in res.instances]
        assert [log.chunk_rows for log in logs] == [300, 300]
        assert all(len(log) > 300 for log in logs) and all(log.spilled_rows for log in logs)
        assert all(Path(log.spill_path).is_file() for log in logs)
    monkeypatch.setattr(step_log, "RUN_ROW_BUDGET", 1 << 20)
    with simulate(exp) as res:
        assert not any(i.steps.spilled_rows for i in res.instances)
        assert all(i.steps.spill_path is None for i in res.instances)  # (its folder is not even made)
        assert res.spill_folder is not None and res.spill_folder.made is None


def test_bench_json_is_what_json_dumps_writes():
    import io

    from lab.report.table_files import write_bench_json

    d = {"a": 1, "itls": [[0.25, 0.25], [], [1 / 3] * 3], "b": [0.1, None]}
    f = io.StringIO()
    write_bench_json(d, f)
    assert f.getvalue() == json.dumps(d)


def test_bench_ratio_refuses_a_reference_for_another_model_or_gpu():
    from lab.report.bench import VIDUR_REFERENCE, BenchResult, Reference, UnlikeReference, speed_ratio

    ours = BenchResult("azure_conv", 19366, 3.0, 4.0, 3500.0, 400_000, 380_000, 200.0, "Llama-3.1-8B",
                       "H100-SXM5-80GB")
    with pytest.raises(UnlikeReference, match="Llama-2-7B / A100"):
        speed_ratio(ours, VIDUR_REFERENCE)
    with pytest.raises(UnlikeReference):
        speed_ratio(ours, Reference("vidur", "azure_conv", "Llama-3.1-8B", "H100-SXM5-80GB", 58098, 9.0, 1.0, "x"))
    same = Reference("vidur", "azure_conv", "Llama-3.1-8B", "H100-SXM5-80GB", 19366, 40.0, 1000.0, "x")
    assert speed_ratio(ours, same) == (10.0, 5.0)
