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
    if spec["find"] != "max_rate" and "tolerance" not in over:
        spec.pop("tolerance")  # for max_rate only: refused elsewhere
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_search(path)


def test_max_rate_meets_the_slo_just_below_the_answer_and_misses_just_above(tmp_path):
    spec, path = _spec(tmp_path)
    [res] = run_search(spec, path, path.parent / "out")
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
    results = run_search(spec, path, path.parent / "out")
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
    [res] = run_search(spec, path, path.parent / "out")
    assert res.value is None and all(p.figures["queue_growing"] for p in res.probes)
    spec, path = _spec(tmp_path, require_stable_queue=False, **over)
    [res] = run_search(spec, path, path.parent / "out")
    assert res.value == 200  # the latency bound alone is met by a 120-request burst


def test_a_typo_in_a_search_file_stops_the_search_naming_the_field(tmp_path):
    from lab.experiment.config import UnknownFieldError

    spec, path = _spec(tmp_path, field="workload.rat")
    with pytest.raises(UnknownFieldError, match=r"workload\.rat: unknown field; did you mean 'rate'"):
        run_search(spec, path, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before any probe


# Resume and atomic outputs: a probe is a sweep run (lab/report/sweep.py), reused when its folder is complete and its
# configuration unchanged; search.md and search.json are replaced as one set.

def _counting(monkeypatch) -> list:
    """Patch the simulation entry point that probes call (lab/report/sweep.py simulate_task); the list it returns
    gets each simulated probe's workload.rate."""
    import lab.report.sweep as sweep_mod
    from lab.experiment.simulation import simulate as real

    calls = []

    def counted(exp):
        calls.append(exp.workload.rate)
        return real(exp)

    monkeypatch.setattr(sweep_mod, "simulate", counted)
    return calls


def _outputs(out):
    return (out / "search.md").read_bytes(), (out / "search.json").read_bytes()


def test_a_rerun_reuses_every_probe_and_fresh_redoes_them(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    spec, path = _spec(tmp_path, tolerance=0.2)
    out = tmp_path / "out"
    [first] = run_search(spec, path, out)
    n = len(first.probes)
    assert n >= 4 and len(calls) == n and not any(p.reused for p in first.probes)
    assert sorted(calls) == sorted(p.value for p in first.probes)
    outputs = _outputs(out)
    assert len(list((out / "probes" / "base").glob("*/run.json"))) == n  # one complete folder per probe
    [again] = run_search(spec, path, out)
    assert len(calls) == n  # nothing simulated again
    assert all(p.reused for p in again.probes) and _outputs(out) == outputs
    assert [(p.value, p.ok, p.figures) for p in again.probes] == [(p.value, p.ok, p.figures) for p in first.probes]
    run_search(spec, path, out, fresh=True)
    assert len(calls) == 2 * n and _outputs(out) == outputs


def test_an_interrupted_search_keeps_the_earlier_outputs_and_resumes_its_probes(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    spec_a, path = _spec(tmp_path, tolerance=0.3)
    out = tmp_path / "out"
    [a] = run_search(spec_a, path, out)
    earlier = _outputs(out)
    spec_b, path = _spec(tmp_path, tolerance=0.05)  # a narrower bracket: A's probes, then more
    [ref] = run_search(spec_b, path, tmp_path / "ref")
    new_values = [p.value for p in ref.probes if p.value not in {q.value for q in a.probes}]
    assert len(new_values) >= 2
    calls.clear()

    import lab.report.sweep as sweep_mod
    from lab.experiment.simulation import simulate as real

    def killed_at_the_second_new_probe(exp):
        if len(calls) == 1:
            raise KeyboardInterrupt
        calls.append(exp.workload.rate)
        return real(exp)

    monkeypatch.setattr(sweep_mod, "simulate", killed_at_the_second_new_probe)
    with pytest.raises(KeyboardInterrupt):
        run_search(spec_b, path, out)
    assert calls == new_values[:1]
    assert _outputs(out) == earlier  # the earlier pair, whole
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary folder left

    calls = _counting(monkeypatch)
    [b] = run_search(spec_b, path, out)
    assert calls == new_values[1:]  # each probe simulated once over the interrupted run and this one
    assert [p.reused for p in b.probes] == [p.value not in new_values[1:] for p in b.probes]
    assert _outputs(out) == _outputs(tmp_path / "ref")


def test_a_failure_while_writing_leaves_the_earlier_pair(tmp_path, monkeypatch):
    import lab.report.search as search_mod

    spec, path = _spec(tmp_path, tolerance=0.3)
    out = tmp_path / "out"
    run_search(spec, path, out)
    earlier = _outputs(out)
    spec, path = _spec(tmp_path, tolerance=0.3, slo={"ttft_s": 0.05, "percentile": 90})  # another answer

    def fail(results):
        raise OSError("disk full")

    monkeypatch.setattr(search_mod, "search_json", fail)  # search.md is written, search.json is not
    with pytest.raises(OSError, match="disk full"):
        run_search(spec, path, out)
    assert _outputs(out) == earlier
    monkeypatch.undo()
    run_search(spec, path, out)
    md, js = _outputs(out)
    assert md != earlier[0] and js != earlier[1] and b"TTFT <= 50 ms" in md


def _refused(tmp_path, **over) -> str:
    spec, path = _spec(tmp_path, **over)
    with pytest.raises(ConfigError) as e:
        run_search(spec, path, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # before any probe
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path))
    return msg


def test_a_search_that_cannot_apply_to_its_experiment_is_refused_before_any_probe(tmp_path):
    pd_base = {**BASE, "deployment": {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}}
    msg = _refused(tmp_path, base=pd_base, find="min_instances", low=1, high=4)
    assert "cluster.num_instances" in msg and "disaggregated" in msg and "deployment.decode.count" in msg
    msg = _refused(tmp_path, find="min_instances", low=1, high=4, candidates={
        "colo": {}, "pd": {"deployment": pd_base["deployment"]}})
    assert "candidate pd: " in msg
    pools = {**BASE, "pools": [{"name": "a"}, {"name": "b"}]}
    assert "pools" in _refused(tmp_path, base=pools, find="min_instances", low=1, high=4)
    dp = {**BASE, "hardware": {**BASE["hardware"], "data_parallel_size": 2}}
    assert "multiples of 2" in _refused(tmp_path, base=dp, find="min_instances", low=2, high=8)
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0.0,64,8\n")
    csv = {**BASE, "workload": {"source": "csv", "path": str(trace)}}
    assert "source 'csv' does not use" in _refused(tmp_path, base=csv)
    arrivals = {**BASE, "workload": {**BASE["workload"], "arrival_times": {"path": str(trace),
                                                                            "column": "arrival_time_s"}}}
    assert "workload.arrival_times" in _refused(tmp_path, base=arrivals)
    sessions = {**BASE, "workload": {"source": "sessions", "num_requests": 10}}
    assert "concurrency" in _refused(tmp_path, base=sessions, find="max_concurrency", low=1, high=8)
    with pytest.raises(ConfigError, match=r"tolerance does not apply to find min_instances"):
        _spec(tmp_path, find="min_instances", low=1, high=4, tolerance=0.1)
    with pytest.raises(ConfigError, match=r"candidate name 'tp 2'"):
        _spec(tmp_path, candidates={"tp 2": {}})


def test_the_command_refuses_min_instances_on_a_disaggregated_experiment_with_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    # experiments/pd_llama8b_h100.yaml is a comparison file: its 1p1d variant as an experiment file
    comparison = yaml.safe_load((repo / "experiments" / "pd_llama8b_h100.yaml").read_text())
    base = {**comparison["base"], **comparison["traces"]["chat_2000_250"], "name": "pd",
            "deployment": comparison["groups"]["two_gpus"]["variants"]["1p1d_r10"]["deployment"]}
    (tmp_path / "pd.yaml").write_text(yaml.safe_dump(base))
    spec = {"name": "pd", "base": "pd.yaml", "find": "min_instances", "low": 1, "high": 4,
            "slo": {"ttft_s": 1.0, "percentile": 90}}
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(spec))
    res = subprocess.run([sys.executable, "-m", "lab", "search", str(path), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120, cwd=repo)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert str(path) in lines[0] and "cluster.num_instances" in lines[0] and "disaggregated" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_command_refuses_an_out_folder_that_is_not_an_output(tmp_path):
    from typer.testing import CliRunner

    from lab.cli.main import app

    spec, path = _spec(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    res = CliRunner().invoke(app, ["search", str(path), "--out", str(tmp_path / "mine"), "-q"])
    assert res.exit_code == 2 and "not servelab outputs" in res.output
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
