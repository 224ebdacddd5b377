"""The operator cost model: source order (table > fitted curve > roofline), interpolation, fitting, parallelism
terms, eager mode, and the shipped coefficients; the measured-data checks skip without shared data."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from lab.costmodel import ops
from lab.core.batch import BatchShape
from lab.costmodel.families import drop_impossible
from lab.costmodel.features import gemm_features, work
from lab.costmodel.fit import TILE_FEATURES, CurveSet, fit_curve, mape
from lab.costmodel.hardware import load_hardware
from lab.costmodel.model_arch import load_model
from lab.costmodel.operator import OperatorCostModel, load_curves
from lab.costmodel.parallel import Parallelism
from lab.costmodel.profiles import Observations, read_profiles, write_servelab
from lab.costmodel.roofline import Efficiency
from lab.costmodel.tables import Curve1D, TableSet, load_tables
from tests.conftest import DATA_DIR, needs_data

H100 = "H100-SXM5-80GB"
AIC_H100 = ("calibration", "aiconfigurator", "perf_db", "h100_sxm")


def llama(**kw) -> OperatorCostModel:
    return OperatorCostModel(load_model("Llama-3.1-8B"), load_hardware(H100), curves=CurveSet(), **kw)


def test_plain_roofline_when_nothing_is_measured():
    cm = llama()
    shape = BatchShape.from_requests([1] * 8, [512] * 8)
    rows = {r.op: r for r in cm.explain(shape)}
    assert {r.source for r in rows.values() if r.op in ("qkv_proj", "attention_decode")} == {"roofline"}
    F, B = ops.gemm(8, 6144, 4096)
    hw, e = load_hardware(H100), Efficiency()
    expect = max(F / (hw.bf16_flops * e.gemm_compute), B / (hw.memory_bandwidth * e.gemm_memory)) + e.kernel_launch_s
    assert rows["qkv_proj"].time_s == pytest.approx(32 * expect)
    assert sum(cm.breakdown(shape).values()) == pytest.approx(cm.step_time(shape))
    assert sum(r.time_s for r in cm.explain(shape)) == pytest.approx(cm.step_time(shape))


def _gemm_profile(tmp_path, gpu="H100", n=6144, k=4096):
    ms = [1, 16, 64, 256, 1024]
    obs = Observations()
    obs.add("gemm", pd.DataFrame({"gpu": H100, "source": "x", "dtype": "bf16", "m": ms, "n": n, "k": k,
                                  "time_s": [10e-6, 10e-6, 20e-6, 80e-6, 320e-6]}))
    write_servelab(obs, tmp_path, {"gpu": gpu})
    return tmp_path


def test_measured_table_wins_and_is_interpolated_log_log(tmp_path):
    ts = TableSet(read_profiles([_gemm_profile(tmp_path)]), H100)
    cm = llama(tables=ts)
    src = {r.op: r.source for r in cm.explain(BatchShape.from_requests([128], [0]))}
    assert src["qkv_proj"].startswith("table:") and src["o_proj"] == "roofline"
    f, _ = ts.gemm("bf16", 6144, 4096)
    assert f(64) == pytest.approx(20e-6)
    assert f(128) == pytest.approx(math.sqrt(20e-6 * 80e-6))  # halfway in log m between 64 and 256
    assert f(1) == f(0.5) == pytest.approx(10e-6)  # clamped below the grid
    assert f(4096) == pytest.approx(320e-6 * 4)  # linear in m above it


def test_curve1d_and_aligned_gemm_tables():
    c = Curve1D([1, 10, 100], [1.0, 10.0, 100.0])
    assert c(31.6227766) == pytest.approx(31.6227766)
    q = Curve1D([64, 128, 256], [1.0, 4.0, 16.0], max_slope=2.0)
    assert q(512) == pytest.approx(64.0)  # quadratic continuation for attention over sequence length


def test_fit_recovers_a_known_efficiency_curve():
    hw = load_hardware(H100)
    rng = np.random.default_rng(1)
    m = rng.choice([1, 4, 16, 64, 256, 1024, 4096], 400)
    n = rng.choice([1024, 4096, 8192], 400)
    k = rng.choice([1024, 4096, 8192], 400)
    df = pd.DataFrame({"gpu": H100, "source": "synthetic", "dtype": "bf16", "m": m, "n": n, "k": k})
    F, B, _ = work("gemm", df)
    truth = np.maximum(F / (hw.bf16_flops * 0.7), B / (hw.memory_bandwidth * 0.85)) + 5e-6
    df["time_s"] = truth
    c = fit_curve("gemm", "bf16", df, hw)
    F, B, feats = work("gemm", df)
    pred = c.predict(F, B, feats)
    assert mape(pred, truth) < 5
    i = 7
    scalar = c.time(F[i], B[i], {f: v[i] for f, v in feats.items()})
    assert scalar == pytest.approx(pred[i], rel=1e-9)  # the hot-path evaluation equals the vectorised one
    # round trip through the coefficients JSON
    cs = CurveSet({"what": "test"})
    cs.add(H100, c)
    back = CurveSet.from_json(json.loads(json.dumps(cs.to_json())))
    assert back.get(H100, "gemm", "bf16").time(F[i], B[i], {f: v[i] for f, v in feats.items()}) == pytest.approx(scalar, rel=1e-4)


def test_gemm_tile_and_wave_features_by_hand():
    f = gemm_features(17, 4096, 4096, 0.0, 132)
    # 17 rows use 17/128 of one m tile; 4096 = 32 full n tiles; 32 tiles fill 32/132 of the only wave
    assert (f["align"], f["mtile"], f["ntile"], f["wave"]) == (1.0, 17 / 128, 1.0, 32 / 132)
    f = gemm_features(256, 17024, 4096, 0.0, 132)
    # 2 x 133 = 266 tiles on 132 SMs: three waves, the last with 2 tiles
    assert (f["align"], f["mtile"], f["ntile"], f["wave"]) == (2.0, 1.0, 1.0, 266 / 396)
    v = gemm_features(np.array([17.0, 256.0]), np.array([4096.0, 17024.0]), 4096.0, 0.0, np.array([132.0, 132.0]))
    assert v["wave"].tolist() == [32 / 132, 266 / 396] and v["align"].tolist() == [1.0, 2.0]


def test_tile_features_are_fitted_only_from_a_grid_of_many_weight_shapes():
    hw = load_hardware(H100)
    rng = np.random.default_rng(2)

    def frame(ns, ks):
        m = rng.choice([1, 17, 100, 129, 300, 1000, 4096], 300)
        df = pd.DataFrame({"gpu": H100, "source": "synthetic", "dtype": "bf16", "m": m, "n": rng.choice(ns, 300),
                           "k": rng.choice(ks, 300)})
        F, B, _ = work("gemm", df)
        df["time_s"] = np.maximum(F / (hw.bf16_flops * 0.7), B / (hw.memory_bandwidth * 0.85)) + 5e-6
        return df

    few = fit_curve("gemm", "bf16", frame([1024, 4096, 8192], [1024, 4096, 8192]), hw)  # 9 (n, k) shapes
    assert all(few.knots[f] == [0.0, 1.0] for f in TILE_FEATURES)
    many = fit_curve("gemm", "bf16", frame([130, 2048, 3000, 8192, 9000], [1024, 2000, 4096, 8192]), hw)  # 20
    assert all(many.knots[f] != [0.0, 1.0] for f in TILE_FEATURES)


def test_fitted_curve_is_second_and_proxies_borrow_it():
    cs = load_curves()
    assert cs.get(H100, "gemm", "bf16") is not None, "the shipped coefficients lack the H100 GEMM curve"
    cm = OperatorCostModel(load_model("Llama-3.1-8B"), load_hardware(H100), curves=cs)
    src = {r.op: r.source for r in cm.explain(BatchShape.from_requests([256], [0]))}
    assert src["qkv_proj"] == f"fit:{H100}/gemm/bf16"
    h800 = OperatorCostModel(load_model("Llama-3.1-8B"), load_hardware("H800"), curves=cs)
    src = {r.op: r.source for r in h800.explain(BatchShape.from_requests([256], [0]))}
    assert "proxy for H800-SXM5-80GB" in src["qkv_proj"]
    b200 = OperatorCostModel(load_model("Llama-3.1-8B"), load_hardware("B200"), curves=cs)
    assert {r.source for r in b200.explain(BatchShape.from_requests([256], [0])) if r.op == "qkv_proj"} == {"roofline"}


def test_stale_coefficients_file_is_a_clear_error(tmp_path):
    data = json.loads(json.dumps(load_curves().to_json()))
    data["curves"][H100]["gemm"]["bf16"]["knots"].pop("align")
    p = tmp_path / "c.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="rerun `servelab calibrate`"):
        load_curves(p)
    with pytest.raises(FileNotFoundError, match="cost_model.coefficients"):
        load_curves(tmp_path / "missing.json")


def test_decode_cost_depends_on_the_spread_not_only_the_mean():
    # with the fitted H100 decode-attention curve one 32k sequence alone runs slower than four 8k ones (less
    # parallelism), so a batch whose KV is concentrated in one sequence costs more than an even one
    cm = OperatorCostModel(load_model("Llama-3.1-8B"), load_hardware(H100), curves=load_curves())
    even = BatchShape.from_requests([1] * 4, [8000] * 4)
    skew = BatchShape.from_requests([1] * 4, [31997, 1, 1, 1])  # same total KV, one long sequence
    assert skew.decode_sum == even.decode_sum
    assert cm.step_time(skew) > cm.step_time(even)


def test_tp_ep_pp_terms():
    ds = load_model("DeepSeek-V3")
    h200 = load_hardware("H200")
    tp8 = OperatorCostModel(ds, h200, Parallelism(tp=8), weight_dtype="fp8", curves=CurveSet())
    ep8 = OperatorCostModel(ds, h200, Parallelism(tp=1, ep=8, dp=8), weight_dtype="fp8", curves=CurveSet())
    shape = BatchShape.from_requests([1] * 32, [1000] * 32)
    b_tp, b_ep = tp8.breakdown(shape), ep8.breakdown(shape)
    assert b_tp["allreduce"] > 0 and "ep_alltoall" not in b_tp
    assert b_ep["ep_alltoall"] > 0 and "allreduce" not in b_ep
    assert tp8.mla_mode == "decomposed" and "FlashMLA" in tp8.dec_src
    pp = OperatorCostModel(load_model("Llama-3.1-70B"), load_hardware(H100), Parallelism(tp=4, pp=2),
                           curves=CurveSet())
    rows = {r.op: r for r in pp.explain(shape)}
    assert rows["pp_sendrecv"].calls == 1 and rows["pp_sendrecv"].time_s > 0
    assert OperatorCostModel(ds, h200, Parallelism(tp=8), weight_dtype="fp8", curves=CurveSet(),
                             moe_imbalance=1.5).breakdown(shape)["moe_experts"] == pytest.approx(1.5 * b_tp["moe_experts"])


def test_eager_mode_waits_for_the_host():
    shape = BatchShape.from_requests([1], [100])
    graphs = llama()
    eager = llama(enforce_eager=True, cpu_launch_s=50e-6)
    b = eager.breakdown(shape)
    assert b["host_launch_bound"] > 0
    assert eager.step_time(shape) > graphs.step_time(shape)
    assert sum(b.values()) == pytest.approx(eager.step_time(shape))
    n_kernels = sum(op.kernels * op.calls for op in eager.tok_ops) + eager.attn_calls
    assert eager.step_time(shape) >= n_kernels * 50e-6


def test_drop_impossible_removes_tables_faster_than_the_roofline():
    hw = load_hardware(H100)
    m = np.array([4096] * 20)
    good = pd.DataFrame({"gpu": H100, "source": "good.csv", "dtype": "bf16", "m": m, "n": 8192, "k": 8192})
    F, _, _ = work("gemm", good)
    good["time_s"] = F / (hw.bf16_flops * 0.7)
    bad = good.assign(source="bad.csv", time_s=good["time_s"] / 10)
    obs = Observations()
    obs.add("gemm", pd.concat([good, bad]))
    kept = drop_impossible(obs)
    assert set(kept.get("gemm")["source"]) == {"good.csv"}
    assert any("bad.csv" in n for n in kept.notes)


@needs_data(*AIC_H100)
def test_aiconfigurator_tables_reproduce_grid_points_and_mla_moe_are_covered():
    obs = load_tables([DATA_DIR.joinpath(*AIC_H100)])
    ts = TableSet(obs, H100)
    f, src = ts.gemm("bf16", 4096, 4096)
    assert f(4096) == pytest.approx(0.174135e-3, rel=1e-4) and "gemm_perf.parquet" in src
    cm = OperatorCostModel(load_model("DeepSeek-V3"), load_hardware(H100), Parallelism(tp=8), weight_dtype="fp8",
                           tables=ts, curves=load_curves())
    assert cm.mla_mode == "module-table"
    rows = {r.op: r.source for r in cm.explain(BatchShape.from_requests([512] + [1] * 16, [0] + [2000] * 16))}
    assert rows["moe_experts"].startswith("table:") and rows["mla_module_decode"].startswith("table:")
    # decode attention of Llama-3.1-8B, 32 x 1k: between the measured (32, 1023) and (32, 2047) grid points
    cm8 = OperatorCostModel(load_model("Llama-3.1-8B"), load_hardware(H100), tables=ts, curves=load_curves())
    t = cm8._decode(32, 32 * 1500, 1500)
    assert 0.0567e-3 < t < 0.0992e-3


def test_mtp_drafter_pass_costs_about_one_moe_layer():
    from lab.costmodel.speculative import SpeculativeCostModel, make_drafter

    ds_arch, h200 = load_model("DeepSeek-V3"), load_hardware("H200")
    ds = OperatorCostModel(ds_arch, h200, Parallelism(tp=8), weight_dtype="fp8", curves=load_curves())
    drafter = make_drafter("mtp", ds_arch, "bf16", "fp8", 8)
    mtp = OperatorCostModel(drafter.arch, h200, Parallelism(tp=8), weight_dtype="fp8", curves=load_curves())
    shape = BatchShape.from_requests([1] * 64, [2000] * 64)
    per_layer = (ds.step_time(shape) - ds.eff.step_overhead_s) / ds.L
    one = SpeculativeCostModel(ds, mtp, 1, drafter.projections, h200, "fp8")
    assert 0.8 * per_layer < one.drafter_time(shape) < 3 * per_layer  # one MoE layer + eh_proj + LM head
    three = SpeculativeCostModel(ds, mtp, 3, drafter.projections, h200, "fp8")
    assert three.drafter_time(shape) == pytest.approx(3 * one.drafter_time(shape), rel=0.1)  # reused 3 times
    assert three.step_time(shape) == pytest.approx(ds.step_time(shape) + three.drafter_time(shape))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("eager", [False, True])
def test_stage_times_place_each_operator_on_its_stage_and_sum_to_the_step(pp, eager):
    m = load_model("Llama-3.1-8B")  # 32 layers: equal stages
    cm = OperatorCostModel(m, load_hardware(H100), Parallelism(tp=2, pp=pp), curves=load_curves(),
                           enforce_eager=eager)
    stages = Parallelism(pp=pp).stage_layers(m.num_layers)
    for shape in (BatchShape.from_requests([1] * 32, [1000] * 32),
                  BatchShape.from_requests([512, 1, 1, 1], [0, 300, 5000, 20]),
                  BatchShape.from_requests([2048], [0])):
        st = cm.stage_times(shape, stages)
        assert len(st) == pp and all(t > 0 for t in st)
        assert sum(st) == pytest.approx(cm.step_time(shape), rel=1e-12)
        if eager:
            continue
        rows = {r.op: r.time_s for r in cm.explain(shape)}
        send = rows["pp_sendrecv"] / (pp - 1)  # one call per boundary, on the sending stage
        head = rows["final_norm"] + rows["lm_head"] + rows["logits_gather"] + rows["sampler"]
        per_stage = (sum(rows.values()) - rows["embedding"] - head - rows["pp_sendrecv"] - rows["overhead"]) / pp
        assert st[0] == pytest.approx(per_stage + rows["embedding"] + send + rows["overhead"], rel=1e-12)
        assert st[-1] == pytest.approx(per_stage + head, rel=1e-12)
        for t in st[1:-1]:
            assert t == pytest.approx(per_stage + send, rel=1e-12)


def test_stage_times_put_the_first_dense_layers_on_the_first_stage():
    ds = load_model("DeepSeek-V3")  # 61 layers, the first 3 with a dense MLP
    cm = OperatorCostModel(ds, load_hardware("H200"), Parallelism(tp=8, pp=4), weight_dtype="fp8",
                           curves=load_curves())
    stages = Parallelism(pp=4).stage_layers(ds.num_layers)  # [16, 15, 15, 15]
    shape = BatchShape.from_requests([1] * 64, [2000] * 64)
    st = cm.stage_times(shape, stages)
    assert sum(st) == pytest.approx(cm.step_time(shape), rel=1e-12)
    assert st[1] == st[2]  # 15 MoE layers each, one send
    b = cm.breakdown(shape)
    dense = b["gate_up_proj"] + b["act"] + b["down_proj"]  # all on stage 0, with 13 of the 58 MoE layers
    moe = sum(v for k, v in b.items() if k in ("router", "moe_experts", "shared_gate_up", "shared_act", "shared_down"))
    layer = sum(v for k, v in b.items() if k in ("norms", "qkv_a_proj", "q_b_proj", "q_kv_a_norms", "o_proj", "rope",
                                                 "attention_prefill", "attention_decode")) / ds.num_layers
    ar = b["allreduce"] / (ds.num_layers + 3 + 58)
    expect0 = dense + moe * 13 / 58 + 16 * layer + (16 + 16) * ar + b["embedding"] + b["pp_sendrecv"] / 3 + b["overhead"]
    assert st[0] == pytest.approx(expect0, rel=1e-9)


def test_stage_times_reject_a_split_of_other_layers_or_stages():
    cm = OperatorCostModel(load_model("Llama-3.1-8B"), load_hardware(H100), Parallelism(pp=2), curves=CurveSet())
    shape = BatchShape.from_requests([1] * 4, [100] * 4)
    assert cm.stage_times(shape, [32]) == [cm.step_time(shape)]
    assert cm.stage_times(BatchShape(), [16, 16]) == [cm.eff.step_overhead_s, 0.0]
    for bad in ([10, 10], [8, 8, 8, 8]):
        with pytest.raises(ValueError, match="stage layers"):
            cm.stage_times(shape, bad)
