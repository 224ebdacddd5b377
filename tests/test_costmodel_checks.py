"""The accuracy checks against shared measurements (docs/costmodel.md, 'Accuracy'); skipped without the data."""

import pytest

from lab.costmodel import checks
from tests.conftest import DATA_DIR, needs_data


@pytest.mark.calibration_check
@needs_data("calibration", "aiconfigurator", "perf_db", "h100_sxm")
@needs_data("calibration", "llmservingsim", "v1.0.0", "H100")
@needs_data("calibration", "vidur", "compute", "h100")
def test_cross_source_gemm_time_of_one_llama8b_step_agrees():
    df = checks.cross_source(DATA_DIR)
    g = df.pivot(index="shape", columns="family", values="gemm_ms")
    # the two vLLM-era H100 sources agree within 15 % on every step; Vidur's older kernels within 35 % (its own
    # tables jump 1.4-2.8x from m = 512 to m = 520 on most weight shapes, so its 576-token mixed step is the outlier)
    assert (g.max(axis=1) / g.min(axis=1)).max() < 1.35
    assert (g[["aiconfigurator", "llmservingsim"]].max(axis=1) / g[["aiconfigurator", "llmservingsim"]].min(axis=1)).max() < 1.15
    assert set(df["attention_source"][df["family"] == "aiconfigurator"]) == {"table"}


@pytest.mark.calibration_check
@needs_data("calibration", "splitwise_sim", "perf_model.csv")
@needs_data("calibration", "aiconfigurator", "perf_db", "h100_sxm")
@needs_data("calibration", "vidur", "compute", "a100")
def test_splitwise_prefill_and_decode_reproduced_on_held_out_configurations():
    res, params = checks.splitwise(DATA_DIR)
    held = res[res["split"] == "held-out"]
    for (hw, phase), g in held.groupby(["hardware", "phase"]):
        err = (g["predicted_ms"] / g["measured_ms"] - 1).abs().mean()
        assert err < 0.15, (hw, phase, err)
    assert all(len(p["dropped"]) == 1 for p in params.values())  # the batch-64 TP2 prefill rows below the FLOP bound
    assert held["measured_ms"].gt(0).all() and len(held) > 60
