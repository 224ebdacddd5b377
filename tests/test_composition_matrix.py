"""The support matrix (lab/experiment/support.py): refused combinations stop before anything is simulated with one
line naming the fields and whose rule it is; docs/composition.md holds the current tables; and the reproducers of
../shared/repro/compose run clean or are refused up front."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.core.request import RequestStatus
from lab.core.sched_api import EngineStall
from lab.experiment.config import ConfigError, load_experiment, parse_experiment
from lab.experiment.simulation import simulate
from lab.experiment.support import REFUSALS, markdown_tables, refusals
from policies import scheduler_class, scheduler_names
from tests.conftest import DATA_DIR

REPO = Path(__file__).resolve().parent.parent
COMPOSE = DATA_DIR.parent / "repro" / "compose"
needs_compose = pytest.mark.skipif(not COMPOSE.is_dir(), reason=f"reproducers not found: {COMPOSE}")


def _exp(**sections) -> dict:
    base = {"name": "m", "workload": {"num_requests": 2, "prompt_tokens": {"kind": "constant", "value": 40},
                                      "output_tokens": {"kind": "constant", "value": 4}},
            "simulation": {"progress": False}}
    base.update(sections)
    return base


REFUSED = [
    (dict(engine={"async_scheduling": True}, speculative={"method": "ngram", "num_speculative_tokens": 2}),
     "async_scheduling: true with speculative.method ngram", "vLLM 0.33"),
    (dict(engine={"kv_offloading_size": 1.0}, policy={"preemption": {"mode": "swap"}}),
     "kv_offloading_size with policy.preemption.mode swap", "vLLM 0.33"),
    (dict(engine={"kv_offloading_size": 1.0},
          deployment={"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}),
     "kv_offloading_size with deployment.mode disaggregated", "[servelab]"),
    (dict(policy="orca", speculative={"method": "eagle", "num_speculative_tokens": 2}),
     "scheduler 'orca' does not support speculative decoding", "schedulers that do: "),
    (dict(policy="sarathi", engine={"kv_offloading_size": 1.0}),
     "scheduler 'sarathi' does not support CPU tier", "supports_kv_offload"),
    (dict(policy="static", engine={"async_scheduling": True}),
     "scheduler 'static' does not support async scheduling", "supports_async"),
    (dict(cluster={"num_instances": 2, "router": "session_affinity"}),
     "router session_affinity with workload.source synthetic", "servelab"),
]


@pytest.mark.parametrize("sections,fragment,rule", REFUSED, ids=[f"refused{i}" for i in range(len(REFUSED))])
def test_a_refused_combination_stops_before_any_step_with_one_line(sections, fragment, rule):
    exp = parse_experiment(_exp(**sections), source="x.yaml")
    with pytest.raises(ConfigError) as e:
        simulate(exp)
    msg = str(e.value)
    assert msg.startswith("x.yaml: ") and fragment in msg and rule in msg and "\n" not in msg


def test_a_refusal_inside_a_pool_names_the_pool():
    exp = parse_experiment(_exp(pools=[{"name": "a", "hand_off": {"to": "b"}},
                                       {"name": "b", "policy": {"scheduler": "orca"}}],
                                speculative={"method": "eagle", "num_speculative_tokens": 1}), source="p.yaml")
    assert refusals(exp) == [refusals(exp)[0]] and refusals(exp)[0].startswith("pools[1] b: speculative:")


def test_a_combination_the_matrix_allows_runs():
    exp = parse_experiment(_exp(speculative={"method": "eagle", "num_speculative_tokens": 2},
                                hardware={"pipeline_parallel_size": 2},
                                policy={"preemption": {"mode": "swap"}}))
    assert refusals(exp) == []
    res = simulate(exp)
    assert all(r.status == RequestStatus.FINISHED for r in res.requests)


def test_the_docs_hold_the_matrix_the_code_gives():
    page = (REPO / "docs" / "composition.md").read_text()
    start = page.index("<!-- support-matrix:begin")
    body = page[page.index("\n", start) + 1:page.index("<!-- support-matrix:end -->")]
    assert body == markdown_tables({n: scheduler_class(n) for n in scheduler_names()}), \
        "docs/composition.md is stale: paste the output of `servelab support` between the markers"
    assert all(r.reason in page for r in REFUSALS)


def test_servelab_support_checks_one_experiment(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nengine: {kv_offloading_size: 1.0}\npolicy: {preemption: {mode: swap}}\n")
    p = subprocess.run([sys.executable, "-m", "lab", "support", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2 and "policy.preemption.mode swap" in p.stderr
    good = tmp_path / "good.yaml"
    good.write_text("name: good\n")
    p = subprocess.run([sys.executable, "-m", "lab", "support", str(good)], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0 and "supported" in p.stdout


def _runs_clean(exp):
    res = simulate(exp)
    for r in res.requests:
        assert r.status == RequestStatus.FINISHED or (r.status == RequestStatus.REJECTED and r.reason), r
        if r.status == RequestStatus.FINISHED:
            assert r.num_output_tokens == r.max_tokens
    for inst in res.instances:
        assert inst.kv.num_free_blocks == inst.kv.pool.num_gpu_blocks - 1 and inst.num_pinned_blocks == 0
    return res


@needs_compose
def test_pp3_and_deeper_async_pipelines_run_one_request():
    for pp in (3, 4, 8):
        exp = load_experiment(COMPOSE / "pp3_async_one_request_contract_error.yaml",
                              overrides={"hardware": {"pipeline_parallel_size": pp}})
        res = _runs_clean(exp)
        assert all(r.status == RequestStatus.FINISHED for r in res.requests)


@needs_compose
def test_hand_off_with_drafts_keeps_the_counters_whole():
    res = _runs_clean(load_experiment(COMPOSE / "pools_handoff_spec_negative_tokens.yaml"))
    assert [r.served_by for r in res.requests] == [[0, 1]]
    chain = parse_experiment({"name": "chain", "workload": {"num_requests": 3},
                              "pools": [{"name": "p0", "hand_off": {"to": "p1", "after_output_tokens": 1}},
                                        {"name": "p1", "hand_off": {"to": "p2", "after_output_tokens": 3}},
                                        {"name": "p2"}],
                              "speculative": {"method": "eagle", "num_speculative_tokens": 3}})
    res = _runs_clean(chain)
    assert all(r.served_by == [0, 1, 2] for r in res.requests)


@needs_compose
def test_a_pool_that_rejects_a_hand_off_leaves_both_pools_blocks_whole():
    res = _runs_clean(load_experiment(COMPOSE / "pools_handoff_reject_indexerror.yaml"))
    (r,) = res.requests
    assert r.status == RequestStatus.REJECTED and "KV blocks" in r.reason and r.served_by == [0, 1]


@needs_compose
def test_a_dp_lock_step_group_serves_as_the_decode_role():
    res = _runs_clean(load_experiment(COMPOSE / "pd_decode_dp_lockstep_never_runs.yaml"))
    assert all(r.status == RequestStatus.FINISHED and r.served_by[-1] in (1, 2) for r in res.requests)
    assert res.groups and res.groups[0].num_steps > 0


@needs_compose
def test_a_request_that_cannot_fit_its_lookahead_slots_is_rejected_not_livelocked():
    res = _runs_clean(load_experiment(COMPOSE / "spec_lookahead_self_preemption_livelock.yaml"))
    (r,) = res.requests
    assert r.status == RequestStatus.REJECTED and "draft and lookahead slots" in r.reason
    assert sum(i.num_preemptions for i in res.instances) == 0


@needs_compose
def test_sglang_pd_pp_mtp_runs_clean_with_and_without_the_overlap_scheduler():
    # sglang schedules with a step in flight since issue 41 (SGLang's overlap scheduler: supports_async)
    path = COMPOSE / "pd_sglang_mtp_pp2_kv_short.yaml"
    for overlap in (True, False):
        res = _runs_clean(load_experiment(path, overrides={"engine": {"async_scheduling": overlap}}))
        assert sum(r.status == RequestStatus.FINISHED for r in res.requests) > 0


def test_a_run_that_runs_out_of_events_with_requests_left_is_an_error(monkeypatch):
    from lab.engine.instance import Instance

    monkeypatch.setattr(Instance, "add_request", lambda self, request: None)  # arrivals vanish
    with pytest.raises(EngineStall, match="ran out of events .* 2 request"):
        simulate(parse_experiment(_exp()))


def test_the_example_user_policy_serves_a_decode_instance_and_one_without_kv_holding_is_refused(tmp_path):
    pd = {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}
    example = str(REPO / "experiments" / "user_policies" / "shortest_prompt_first.py") + ":ShortestPromptFirst"
    res = _runs_clean(parse_experiment(_exp(policy=example, deployment=pd,
                                            workload={"num_requests": 60, "rate": 50},
                                            engine={"num_gpu_blocks": 300})))
    assert sum(r.status == RequestStatus.FINISHED for r in res.requests) > 50
    plain = tmp_path / "plain.py"
    plain.write_text((REPO / "experiments" / "user_policies" / "shortest_prompt_first.py").read_text()
                     .replace("    admits_kv_holding = True", "    pass"))
    exp = parse_experiment(_exp(policy=f"{plain}:ShortestPromptFirst", deployment=pd), source="u.yaml")
    with pytest.raises(ConfigError, match="does not support prefill/decode disaggregation .*admits_kv_holding"):
        simulate(exp)


def test_a_trace_file_replays_through_pd_and_pools(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0.0,100,10\n0.1,200,20\n0.2,50,5\n")
    for layout in ({"deployment": {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}},
                   {"pools": [{"name": "a", "hand_off": {"to": "b", "after_output_tokens": 3}}, {"name": "b"}]}):
        exp = parse_experiment({"name": "t", "workload": {"source": "csv", "path": str(trace)}, **layout})
        res = _runs_clean(exp)
        assert [r.num_output_tokens for r in res.requests] == [10, 20, 5]


def test_sglang_on_a_sliding_window_hybrid_counts_every_kv_group_and_does_not_livelock():
    # make composition (seed 4, draw 238): SGLang + gpt-oss-20b + EAGLE in a 19-block pool; SGLang's token
    # arithmetic read the shared pool's free blocks as tokens of one group, admitted two requests whose blocks in both
    # groups did not fit, and retracted and re-admitted them 10,000 times (the no-progress guard's error)
    from tests import composition as comp

    outcome = comp.run_draw(comp.draw_from_seed(4, 238), timeout_s=120)
    assert outcome.kind == "ok", outcome.message
