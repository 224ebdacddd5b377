"""Kernel back-ends as a cost-model dimension (lab/costmodel/backends.py, attention.py, moe_backends.py): vLLM's
defaults per GPU, model and version, its refusals as one-line errors, how a verify query runs in each attention
back-end's tiles, the MLA core of each back-end, MoE back-ends with DeepGEMM's per-expert padding and vLLM's
fallback to Triton, and the A100 prefill curve scaled from the head configuration it was fitted on."""

import math

import pytest

from lab.core.batch import BatchShape
from lab.costmodel import backends
from lab.costmodel.attention import TRITON_MLA_SLOWDOWN, tile_ratio
from lab.costmodel.hardware import load_hardware
from lab.costmodel.model_arch import load_model
from lab.costmodel.moe_backends import DEEPGEMM_ALIGN, GroupedGemmMoE, deepgemm_compute_eff
from lab.costmodel.operator import OperatorCostModel, load_curves
from lab.costmodel.parallel import Parallelism
from lab.experiment.config import ConfigError, parse_experiment
from lab.experiment.simulation import build_cost_model

H100, H200, A100 = (load_hardware(n) for n in ("H100-SXM5-80GB", "H200-SXM-141GB", "A100-80GB-SXM4"))
B200, MI300X = load_hardware("B200-HGX"), load_hardware("MI300X")
DSV3, LLAMA8B = load_model("DeepSeek-V3"), load_model("Llama-3.1-8B")


def test_defaults_are_what_vllm_picks_for_the_gpu_model_and_version():
    assert backends.default_attention_backend(False, H100) == "FLASH_ATTN"
    assert backends.default_attention_backend(False, B200) == "FLASHINFER"
    assert backends.default_attention_backend(False, MI300X) == "TRITON_ATTN"
    assert backends.default_attention_backend(True, H200, "0.33") == "FLASH_ATTN_MLA"
    assert backends.default_attention_backend(True, H200, "0.11") == "FLASHMLA"
    assert backends.default_attention_backend(True, B200, "0.19") == "FLASHINFER_MLA"
    assert backends.default_attention_backend(True, A100) == "TRITON_MLA"
    assert backends.default_moe_backend("fp8_block", H200, "0.33") == "deep_gemm"
    assert backends.default_moe_backend("fp8_block", H200, "0.11") == "triton"
    assert backends.default_moe_backend("bf16", H200, "0.33") == "triton"
    assert backends.default_moe_backend("fp8_block", A100, "0.33") == "triton"


@pytest.mark.parametrize("call, message", [
    (lambda: backends.check_attention_backend("FLASHMLA", False, H100, "Llama-3.1-8B"),
     "engine.attention_backend FLASHMLA: an MLA back-end, but Llama-3.1-8B does not use MLA"),
    (lambda: backends.check_attention_backend("FLASH_ATTN", True, H100, "DeepSeek-V3"),
     "engine.attention_backend FLASH_ATTN: a standard-attention back-end, but DeepSeek-V3 uses MLA"),
    (lambda: backends.check_attention_backend("CUTLASS_MLA", True, H200, "DeepSeek-V3"),
     "engine.attention_backend CUTLASS_MLA: needs compute capability 10.x; H200-SXM-141GB is 9.0"),
    (lambda: backends.check_attention_backend("FLASH_ATTN", False, MI300X, "Llama-3.1-8B"),
     "engine.attention_backend FLASH_ATTN: not available on MI300X (ROCm); use TRITON_ATTN"),
    (lambda: backends.check_moe_backend("deep_gemm", "bf16", H100),
     "engine.moe_backend deep_gemm: takes block-scaled fp8 weights; this model runs bf16 weights"),
    (lambda: backends.check_moe_backend("flashinfer_trtllm", "fp8_block", H200),
     "engine.moe_backend flashinfer_trtllm: needs compute capability 10.x; H200-SXM-141GB is 9.0"),
])
def test_backends_vllm_refuses_are_one_line_errors(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def _exp(**kw):
    base = {"name": "b", "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
            "cost_model": {"kind": "operator"}}
    for k, v in kw.items():
        base[k] = {**base.get(k, {}), **v}
    return parse_experiment(base)


def test_config_fields_take_vllms_names_and_refuse_others_in_one_line():
    with pytest.raises(ConfigError) as e:
        _exp(engine={"attention_backend": "FLASH_ATTENTION"})
    [line] = str(e.value).splitlines()
    assert line.startswith("<experiment>: engine.attention_backend:") and "'FLASH_ATTN'" in line
    with pytest.raises(ConfigError) as e:
        _exp(engine={"moe_backend": "deepgemm"})
    [line] = str(e.value).splitlines()
    assert line.startswith("<experiment>: engine.moe_backend:") and "'deep_gemm'" in line
    with pytest.raises(ValueError, match="engine.attention_backend: kernel back-ends are priced by cost_model.kind "
                                         "operator only"):
        build_cost_model(_exp(engine={"attention_backend": "TRITON_ATTN"}, cost_model={"kind": "roofline"}),
                         LLAMA8B, H100)
    with pytest.raises(ValueError, match="an MLA back-end, but Llama-3.1-8B does not use MLA"):
        build_cost_model(_exp(engine={"attention_backend": "FLASHMLA"}), LLAMA8B, H100)
    cm = build_cost_model(_exp(engine={"attention_backend": "TRITON_ATTN"}), LLAMA8B, H100)
    assert cm.attention_backend == "TRITON_ATTN"
    assert build_cost_model(_exp(), LLAMA8B, H100).attention_backend == "FLASH_ATTN"


def test_a_verify_query_takes_more_tiles_only_when_its_rows_overflow_the_kernels_tile():
    fa, fmla, tri = (backends.ATTENTION_BACKENDS[n] for n in ("FLASH_ATTN", "FLASHMLA", "TRITON_MLA"))
    assert tile_ratio(fa, 4, 4) == 1          # Llama-3.1-8B: 4 query heads per KV head, 16 rows in a 64-row tile
    assert tile_ratio(fmla, 4, 16) == 1       # DeepSeek-V3 TP8: 16 heads x 4 tokens fill one 64-row tile
    assert tile_ratio(fmla, 5, 16) == 2
    assert tile_ratio(fmla, 4, 128) == 4      # attention DP: 128 heads, 2 tiles per decode, 8 per verify
    assert tile_ratio(tri, 4, 16) == 4        # Triton MLA's 16-row blocks


def _verify_and_decode(cm, q, ctx=2000):
    v = BatchShape.from_requests([q], [ctx], [q - 1])
    d = BatchShape.from_requests([1], [ctx + q - 1])
    return cm._attention_layer(v)[1], cm._attention_layer(d)[1]


def test_mla_verify_under_attention_dp_pays_the_extra_tiles_and_tp8_does_not():
    tp8 = OperatorCostModel(DSV3, H200, Parallelism(8), weight_dtype="fp8")
    verify, decode = _verify_and_decode(tp8, 4)
    assert verify == pytest.approx(decode)  # one tile either way
    dp = OperatorCostModel(DSV3, H200, Parallelism(1, 1, 8, 8), weight_dtype="fp8")
    verify, decode = _verify_and_decode(dp, 4)
    assert verify == pytest.approx(decode + 3 * dp.attn.core(1, 2003))  # 8 tiles where a decode runs 2


def test_mla_backends_differ_by_their_latent_attention_core():
    kw = dict(parallel=Parallelism(8), weight_dtype="fp8")
    flashmla = OperatorCostModel(DSV3, H200, attention_backend="FLASHMLA", **kw)
    triton = OperatorCostModel(DSV3, H200, attention_backend="TRITON_MLA", **kw)
    shape = BatchShape.from_requests([1] * 64, [4000] * 64)
    d_f, d_t = flashmla._attention_layer(shape)[1], triton._attention_layer(shape)[1]
    core_f = flashmla.attn.core(64, 64 * 4000)
    # the decode of one layer: projections + core; Triton's core is FlashMLA's published efficiency / 3.93
    assert d_t - d_f == pytest.approx(triton.attn.core(64, 64 * 4000) - core_f)
    assert triton.attn.core(64, 64 * 4000) == pytest.approx(core_f * TRITON_MLA_SLOWDOWN, rel=0.05)


def test_deep_gemm_runs_triton_where_vllm_falls_back_and_pads_experts_to_128_rows_elsewhere():
    tp8 = OperatorCostModel(DSV3, H200, Parallelism(8), weight_dtype="fp8", moe_backend="deep_gemm")
    assert tp8.moe.uses_fallback(4096)  # the TP8 intermediate shard is 256 <= 512: vLLM runs Triton
    ep = OperatorCostModel(DSV3, H200, Parallelism(1, 1, 8, 8), weight_dtype="fp8", moe_backend="deep_gemm")
    triton = OperatorCostModel(DSV3, H200, Parallelism(1, 1, 8, 8), weight_dtype="fp8", moe_backend="triton")
    assert ep.moe.uses_fallback(127) and not ep.moe.uses_fallback(128)  # M >= 128 (_valid_deep_gemm)
    assert ep.moe.time(64) == triton.moe.time(64)
    # 256 tokens x 8 experts / 8 GPUs = 256 rows over 32 local experts: 8 rows each, computed as 128
    R, touched = ep.moe.rows(256)
    assert (R, touched) == (256, 32)
    cutlass = GroupedGemmMoE(ep, "cutlass")
    h, i = DSV3.hidden_size, DSV3.moe_intermediate_size
    flops_padded = 2.0 * 32 * DEEPGEMM_ALIGN * 3 * h * i
    assert ep.moe.time(256) > flops_padded / (H200.peak_flops("fp8") * deepgemm_compute_eff(DEEPGEMM_ALIGN))
    assert cutlass.time(256) < ep.moe.time(256)  # CUTLASS computes the 8 rows, DeepGEMM 128 of them
    # with 128 rows per expert or more there is no padding to waste: DeepGEMM beats CUTLASS
    assert ep.moe.time(8192) < cutlass.time(8192)


def test_a_curve_fitted_on_one_head_configuration_scales_to_more_heads_by_flops():
    curves = load_curves()
    c = curves.get("A100-80GB-SXM4", "attn_prefill", "bf16")
    assert tuple(c.heads) == (32, 4, 128)  # Vidur's A100 table: Llama-2-70B at TP2
    mha = load_model("Llama-2-7B")  # 32 heads, 32 KV heads: the same query heads, no scaling
    gqa = OperatorCostModel(load_model("Llama-3.1-70B"), A100, Parallelism(1), curves=curves)  # 64 heads
    m = OperatorCostModel(mha, A100, Parallelism(1), curves=curves)
    q = [1536]
    t64 = gqa.attn.prefill(q, [0])
    fitted = gqa.attn._prefill_curve(c, q, [0], 32, 4, 128, 128, 2 * 4 * 128 * 2.0)
    assert t64 == pytest.approx(2 * fitted)  # twice the fitted configuration's heads: twice its time
    assert m.attn.prefill(q, [0]) == m.attn._prefill_curve(c, q, [0], 32, 32, 128, 128, 2 * 32 * 128 * 2.0)
    assert math.isfinite(t64)


def test_servelab_cost_prints_two_attention_and_two_moe_backends_side_by_side(capsys):
    from lab.cli.costmodel import _compare_backends

    shape = BatchShape.from_requests([1] * 32, [2000] * 32)
    args = (None, "DeepSeek-V3", None, "H200", 1, 1, 8, 8, "fp8", "bf16", None, None, None)
    _compare_backends(shape, args, ["FLASHMLA", "TRITON_MLA"], ["triton", "cutlass"], "0.33", True, None)
    import json

    out = json.loads(capsys.readouterr().out)
    names = [b["backends"] for b in out["backends"]]
    assert names == ["FLASHMLA / triton", "FLASHMLA / cutlass", "TRITON_MLA / triton", "TRITON_MLA / cutlass"]
    t = {b["backends"]: b["step_time_s"] for b in out["backends"]}
    assert t["TRITON_MLA / triton"] > t["FLASHMLA / triton"]
    assert t["FLASHMLA / cutlass"] != t["FLASHMLA / triton"]


@pytest.mark.parametrize("name, runs", [("deepseek_v3_backends_h200", 6), ("spec_decode_load", 24)])
def test_the_backend_and_speculation_experiments_parse(name, runs):
    from pathlib import Path

    from lab.report.compare import load_comparison

    _, loaded = load_comparison(Path(__file__).resolve().parent.parent / "experiments" / f"{name}.yaml")
    assert len(loaded) == runs
