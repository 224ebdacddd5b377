"""The flagship comparison experiments/deepseek_v3_pd_mtp_wide_ep.yaml: it parses, and one tiny variant of its PD
layout (2 TP8 prefill instances, a DP16 + EP16 decode group in lock-step, MTP k = 3) simulates to the end."""

from pathlib import Path

from lab.core.request import RequestStatus
from lab.experiment.config import parse_experiment
from lab.experiment.simulation import simulate
from lab.report.compare import load_comparison
from tests.conftest import needs_data

REPO = Path(__file__).resolve().parent.parent
FILE = REPO / "experiments" / "deepseek_v3_pd_mtp_wide_ep.yaml"

needs_h200 = needs_data("calibration", "aiconfigurator", "perf_db", "h200_sxm")


@needs_h200
def test_the_flagship_comparison_parses_with_its_layouts_at_equal_gpu_count():
    spec, runs = load_comparison(FILE)
    assert spec.note and (FILE.parent / spec.note).is_file()
    by = {r.variant: r for r in runs}
    assert len(by) == len(runs)
    pd = by["pd_k3_r16"].data
    decode = pd["deployment"]["decode"]
    assert pd["deployment"]["prefill"]["count"] * 8 + decode["count"] == 32  # 2 TP8 nodes + 16 ranks
    assert decode["hardware"] == {"tensor_parallel_size": 1, "data_parallel_size": 16, "expert_parallel_size": 16}
    assert pd["speculative"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert by["tp8_k1_r16"].data["cluster"]["num_instances"] * 8 == 32
    dp_ep = by["dp_ep_k1_r16"].data
    assert dp_ep["cluster"]["num_instances"] == 32 and dp_ep["hardware"]["data_parallel_size"] == 8
    assert by["pd_off_r16"].data["speculative"] is None
    pair = [by["pd_k1_r16_drafter_kv"].data, by["pd_k1_r16_no_drafter_kv"].data]
    assert [d["deployment"]["transfer"]["transfer_drafter_kv"] for d in pair] == [True, False]
    # every rate has 25 s of arrivals
    assert all(r.data["workload"]["num_requests"] == 25 * r.data["workload"]["rate"] for r in runs)
    assert {k for r in runs if r.group == "pd" for k in [r.curve_series]} == {None, 1, 2, 3}


@needs_h200
def test_a_tiny_pd_variant_with_the_wide_ep_decode_group_runs_every_request_to_the_end():
    _, runs = load_comparison(FILE, groups=["pd"])
    run = next(r for r in runs if r.variant == "pd_k3_r16")
    data = dict(run.data)
    data["workload"] = {**data["workload"], "num_requests": 6, "rate": 50.0,
                        "prompt_tokens": {"kind": "constant", "value": 600, "max": 600},
                        "output_tokens": {"kind": "constant", "value": 12, "max": 12}}
    # the operator model without the H200 tables (fitted curves and roofline): the tables take ~6 s to index per
    # cost model, and a PD run with MTP builds four (P and D, target and drafter); the deployment, the lock-step
    # group and MTP are the file's own
    data["cost_model"] = {"kind": "operator"}
    exp = parse_experiment(data, run.source, Path(run.base_dir), run.data_dir)
    res = simulate(exp)
    assert [r.status for r in res.requests] == [RequestStatus.FINISHED] * 6
    assert all(r.num_output_tokens == 12 for r in res.requests)
    assert len(res.groups) == 1 and len(res.groups[0].ranks) == 16  # D: one lock-step group of 16 ranks
    assert all(r.num_drafts > 0 for r in res.requests)  # D verifies MTP drafts
    prefill = {r.remote.source.instance_id for r in res.requests}
    decode = {r.remote.d_instance for r in res.requests}
    assert prefill <= {0, 1} and decode <= set(range(2, 18))
    # every request's KV went P -> D: 600 tokens x (61 x 576 x 2 B latent + 1,152 B MTP layer)
    assert res.cluster.bytes_transferred == 6 * 600 * (70_272 + 1_152)
    assert res.cluster.drafter_bytes_transferred == 6 * 600 * 1_152
