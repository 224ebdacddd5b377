"""Capacity search: bisection on a monotone SLO predicate, candidates ranked by GPUs, refusals."""

import pytest
import yaml

from lab.experiment.config import ConfigError
from lab.report.search import _bisect, load_search, run_search

BASE = {"name": "b", "seed": 0,
        "workload": {"source": "synthetic", "num_requests": 120, "rate": 5.0,
                     "prompt_tokens": {"kind": "constant", "value": 512},
                     "output_tokens": {"kind": "constant", "value": 64}},
        "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
        "simulation": {"progress": False, "record_events": False}}


def test_bisection_finds_the_boundary_within_tolerance_and_exactly_for_integers():
    calls = []

    def ok(x):
        calls.append(x)
        return x <= 37.3

    assert 37.3 * 0.98 <= _bisect(ok, 1, 100, False, False, 0.02) <= 37.3
    assert _bisect(lambda n: n >= 5, 1, 8, True, True, 0) == 5
    assert _bisect(lambda n: n <= 3, 1, 8, True, False, 0) == 3
    assert _bisect(lambda x: False, 1, 8, False, False, 0.1) is None
    assert _bisect(lambda x: True, 1, 8, False, False, 0.1) == 8


def _spec(tmp_path, **over):
    spec = {"name": "s", "base": BASE, "find": "max_rate", "low": 1, "high": 200, "tolerance": 0.05,
            "slo": {"ttft_s": 0.3, "tpot_s": 0.05, "percentile": 90}, **over}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_search(path)


def test_max_rate_meets_the_slo_just_below_the_answer_and_misses_just_above(tmp_path):
    spec, path = _spec(tmp_path)
    [res] = run_search(spec, path)
    assert res.value is not None and res.gpus == 1
    met = [p.value for p in res.probes if p.ok]
    missed = [p.value for p in res.probes if not p.ok]
    assert max(met) == res.value and min(missed) > res.value
    assert (min(missed) - res.value) <= 0.05 * res.value
    assert all(p.figures["p_ttft"] <= 0.3 and p.figures["p_tpot"] <= 0.05 for p in res.probes if p.ok)


def test_candidates_are_ranked_by_gpus_and_one_that_cannot_run_says_why(tmp_path):
    spec, path = _spec(tmp_path, find="min_instances", low=1, high=4,
                       base={**BASE, "workload": {**BASE["workload"], "rate": 40.0}},
                       candidates={"tp1": {"hardware": {"tensor_parallel_size": 1}},
                                   "tp3": {"hardware": {"tensor_parallel_size": 3}}})
    results = run_search(spec, path)
    assert [r.candidate for r in results] == ["tp1", "tp3"]
    assert results[0].value is not None and results[0].gpus == results[0].value
    assert "must divide" in results[1].error


def test_bad_search_files(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of 'percentile'"):
        _spec(tmp_path, slo={"ttft_s": 0.3})
    with pytest.raises(ConfigError, match="low"):
        _spec(tmp_path, low=10, high=5)
    with pytest.raises(ConfigError, match="integers"):
        _spec(tmp_path, find="min_instances", low=1.5, high=4)


def test_the_search_command_writes_its_answer(tmp_path):
    from typer.testing import CliRunner

    from lab.cli.main import app

    spec = {"name": "s", "base": BASE, "find": "max_rate", "low": 1, "high": 50, "tolerance": 0.1,
            "slo": {"ttft_s": 0.3, "tpot_s": 0.05, "attainment": 0.9}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(app, ["search", str(path), "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    assert "| base |" in (tmp_path / "out" / "search.md").read_text()
    bad = CliRunner().invoke(app, ["search", str(tmp_path / "missing.yaml")])
    assert bad.exit_code == 2


def test_a_backlog_that_still_grows_at_the_last_arrival_is_flagged_and_a_bounded_one_is_not():
    import numpy as np
    import pandas as pd

    from lab.report.search import queue_growth

    arrivals = np.arange(100, dtype=float)  # one request per second for 100 s
    bounded = pd.DataFrame({"arrival_time": arrivals, "finish_time": arrivals + 5.0})  # Little: ~5 in the system
    growing = pd.DataFrame({"arrival_time": arrivals, "finish_time": arrivals * 2.0 + 1.0})  # served at half rate
    assert queue_growth(bounded)["queue_growing"] is False
    g = queue_growth(growing)
    # at t = 99: arrived 100, finished those with 2a + 1 <= 99 (a <= 49) -> 50 in the system; at t = 49.5: 25
    assert (g["in_system_at_last_arrival"], g["in_system_at_mid_arrivals"], g["queue_growing"]) == (50, 25, True)


def test_a_short_trace_at_a_rate_it_cannot_sustain_misses_unless_told_otherwise(tmp_path):
    over = {"base": {**BASE, "workload": {**BASE["workload"], "rate": 200.0}}, "find": "max_rate", "low": 150,
            "high": 200, "slo": {"ttft_s": 60.0, "percentile": 90}}
    spec, path = _spec(tmp_path, **over)
    [res] = run_search(spec, path)
    assert res.value is None and all(p.figures["queue_growing"] for p in res.probes)
    spec, path = _spec(tmp_path, require_stable_queue=False, **over)
    [res] = run_search(spec, path)
    assert res.value == 200  # the latency bound alone is met by a 120-request burst


def test_a_typo_in_a_search_file_stops_the_search_naming_the_field(tmp_path):
    from lab.experiment.config import UnknownFieldError

    spec, path = _spec(tmp_path, field="workload.rat")
    with pytest.raises(UnknownFieldError, match=r"workload\.rat: unknown field; did you mean 'rate'"):
        run_search(spec, path)
