"""The scheduler-knob experiments of issue 41 load, carry their readings, and one small variant of each runs: partial
prefills (experiments/partial_prefills_v0.yaml), priority with a full max_num_seqs (priority_full_batch.yaml),
SGLang prefill-first decode gaps (sglang_prefill_first_gaps.yaml) and DistServe's chatbot placement search
(distserve_chatbot_placement.yaml, and _tight.yaml with the SLOs scaled by 0.4). The smoke runs use the operator
model without the H100 tables (indexing them takes seconds) and a few requests."""

from pathlib import Path

import pytest

from lab.core.request import RequestStatus
from lab.experiment.config import parse_experiment
from lab.experiment.simulation import simulate
from lab.report.compare import load_comparison
from lab.report.search_spec import candidate_experiments, check_search, load_search

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = REPO / "experiments"


def _runs(name: str) -> dict:
    spec, runs = load_comparison(EXPERIMENTS / name)
    assert spec.note and (EXPERIMENTS / spec.note).is_file()
    return {(r.trace, r.variant): r for r in runs}


def _smoke(run, **workload):
    data = dict(run.data)
    data["workload"] = {**data["workload"], **workload}
    data["cost_model"] = {"kind": "operator"}
    res = simulate(parse_experiment(data, run.source, Path(run.base_dir), run.data_dir))
    assert res.requests and all(r.status == RequestStatus.FINISHED for r in res.requests)
    return res


def test_partial_prefills_experiment_varies_the_v0_limits():
    runs = _runs("partial_prefills_v0.yaml")
    assert {v for _, v in runs} == {"single", "p2_l1", "p4_l1", "p4_l4"}
    exp = parse_experiment(runs["long_mix", "p4_l1"].data, runs["long_mix", "p4_l1"].source)
    assert exp.engine.vllm_version == "0.6" and exp.engine.enable_chunked_prefill
    assert (exp.engine.max_num_partial_prefills, exp.engine.max_long_partial_prefills) == (4, 1)
    _smoke(runs["long_mix", "p4_l1"], num_requests=8, rate=20.0)


def test_priority_experiment_varies_the_preemption_rule():
    runs = _runs("priority_full_batch.yaml")
    rules = {v: parse_experiment(r.data, r.source, Path(r.base_dir)).engine.priority_preemption
             for (_, v), r in runs.items() if v != "fcfs"}
    assert rules == {"none": "none", "max_num_seqs": "max_num_seqs", "v0": "v0", "v0_nopreempt": "none"}
    res = _smoke(runs["priority_mix", "max_num_seqs"], max_requests=12)
    assert {r.priority for r in res.requests} > {0}


def test_sglang_gaps_experiment_compares_the_step_rules():
    runs = _runs("sglang_prefill_first_gaps.yaml")
    schedulers = {v: r.data["policy"]["scheduler"] for (t, v), r in runs.items() if t == "prefill_heavy_r8"}
    assert schedulers == {"sglang": "sglang", "sglang_pdi2": "sglang", "sglang_mixed": "sglang", "vllm": "vllm_v1"}
    assert "num_gpu_blocks" not in runs["prefill_heavy_r8", "sglang"].data["engine"]  # the KV pool as derived
    _smoke(runs["prefill_heavy_r14", "sglang_pdi2"], num_requests=6)


def test_distserve_placement_search_checks_and_names_its_candidates():
    spec, where = load_search(EXPERIMENTS / "distserve_chatbot_placement.yaml")
    assert (EXPERIMENTS / "distserve_chatbot_placement.md").is_file()
    check_search(spec, where)
    names = [n for n, _ in candidate_experiments(spec, where)[0]]
    assert {"colocated_v1_tp1", "colocated_v0_tp1", "p1tp1-d1tp1", "p1tp1-d1tp2", "p2tp2-d1tp2"} <= set(names)
    assert spec.rank == "per_gpu" and spec.slo.attainment == pytest.approx(0.9)
    tight, where = load_search(EXPERIMENTS / "distserve_chatbot_placement_tight.yaml")
    check_search(tight, where)
    assert (tight.slo.ttft_s, tight.slo.tpot_s) == pytest.approx((0.4 * spec.slo.ttft_s, 0.4 * spec.slo.tpot_s))
    assert [n for n, _ in candidate_experiments(tight, where)[0]] == [
        "colocated_v0_tp1", "colocated_v0_tp2", "colocated_v1_tp1", "p1tp1-d1tp1", "p1tp1-d1tp2"]
