"""The cost-model commands (cost, calibrate, profile) and the new experiments, end to end."""

import builtins
import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from lab.cli.main import app
from lab.experiment.config import ConfigError, load_experiment, parse_experiment
from lab.costmodel.features import work
from lab.costmodel.hardware import load_hardware
from lab.costmodel.operator import load_curves
from lab.costmodel.profiles import Observations, read_profiles, write_servelab
from tests.conftest import needs_data

runner = CliRunner()
REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_cost_prints_every_operator_with_its_source():
    res = runner.invoke(app, ["cost", "--model", "Llama-3.1-8B", "--gpu", "H100", "--prefill", "512:1024",
                              "--decode", "8:2000", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["tokens"] == 520 and d["sequences"] == 9
    ops = {r["op"]: r for r in d["operators"]}
    assert {"qkv_proj", "attention_prefill", "attention_decode", "lm_head", "overhead"} <= set(ops)
    assert sum(r["time_s"] for r in d["operators"]) == pytest.approx(d["step_time_s"])
    assert ops["qkv_proj"]["source"].startswith("fit:H100-SXM5-80GB/gemm/bf16")
    res = runner.invoke(app, ["cost", "--model", "Llama-3.1-8B", "--gpu", "H100"])
    assert res.exit_code == 2 and "--prefill" in res.output
    res = runner.invoke(app, ["cost", "--model", "Llama-3.1-8B", "--gpu", "H100", "--decode", "x"])
    assert res.exit_code == 2 and "COUNT:KV_LENGTH" in res.output


def _synthetic_profile(folder):
    """A servelab-format GEMM profile generated from a known roofline with efficiencies 0.6 / 0.8."""
    hw = load_hardware("A100")
    grid = [(m, n, k) for m in (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
            for n in (2048, 4096, 8192) for k in (2048, 4096, 8192)]
    df = pd.DataFrame(grid, columns=["m", "n", "k"]).assign(gpu=hw.name, source="synthetic", dtype="bf16")
    F, B, _ = work("gemm", df)
    df["time_s"] = np.maximum(F / (hw.bf16_flops * 0.6), B / (hw.memory_bandwidth * 0.8)) + 4e-6
    obs = Observations()
    obs.add("gemm", df)
    write_servelab(obs, folder, {"gpu": "A100"})


def test_calibrate_writes_a_coefficients_file_with_its_note_and_a_heldout_report(tmp_path):
    prof = tmp_path / "prof"
    _synthetic_profile(prof)
    out = tmp_path / "coef.json"
    res = runner.invoke(app, ["calibrate", str(prof), "--out", str(out), "--report", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    note = data["note"]
    assert note["command"].startswith("servelab calibrate") and note["fit_method"] and note["date"]
    assert note["sources"][0]["sha256"] and note["sources"][0]["path"].endswith("gemm.csv")
    cs = load_curves(out)
    assert cs.get("A100-80GB-SXM4", "gemm", "bf16") is not None
    rep = pd.read_csv(tmp_path / "rep" / "heldout.csv")
    assert rep.loc[0, "fit_mape_pct"] < 5 and rep.loc[0, "table_mape_pct"] < 10
    assert "| A100-80GB-SXM4 | gemm |" in (tmp_path / "rep" / "heldout.md").read_text()
    res = runner.invoke(app, ["calibrate", str(tmp_path / "nothing-here")])
    assert res.exit_code == 2


def test_unknown_profile_folder_is_a_clear_error(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    res = runner.invoke(app, ["calibrate", str(tmp_path), "--out", str(tmp_path / "c.json")])
    out = " ".join(res.output.split())  # rich wraps at the terminal width, which depends on the path's length
    assert res.exit_code == 2 and "no profile found" in out and "expected a servelab profile" in out


def test_profile_without_torch_says_how_to_install_it(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_torch(name, *a, **kw):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    res = runner.invoke(app, ["profile", "--out", str(tmp_path / "p"), "--device", "cpu", "--quick"])
    assert res.exit_code == 2
    assert "servelab[profile]" in res.output


def test_profile_smoke_on_cpu_writes_a_readable_profile(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "p"
    res = runner.invoke(app, ["profile", "--out", str(out), "--device", "cpu", "--quick", "--repeats", "2",
                              "--gpu", "H100"])
    assert res.exit_code == 0, res.output
    obs = read_profiles([out])
    s = obs.summary().set_index("class")["rows"]
    assert s["gemm"] == 6 and s["attn_prefill"] == 4 and s["attn_decode"] == 4 and s["elementwise"] == 12
    assert set(obs.gpus()) == {"H100-SXM5-80GB"}


def test_parallelism_fields_are_validated(tmp_path):
    base = {"name": "x", "model": {"name": "DeepSeek-V3", "dtype": "fp8"}, "cost_model": {"kind": "operator"}}
    with pytest.raises(ConfigError, match="expert_parallel_size"):
        parse_experiment({**base, "hardware": {"tensor_parallel_size": 1, "expert_parallel_size": 8}})
    with pytest.raises(ConfigError, match="num_instances"):
        parse_experiment({**base, "hardware": {"expert_parallel_size": 8, "data_parallel_size": 8}})
    with pytest.raises(ConfigError, match="operator"):
        parse_experiment({"name": "x", "hardware": {"tensor_parallel_size": 2, "data_parallel_size": 1,
                                                    "expert_parallel_size": 2}})
    parse_experiment({"name": "x", "hardware": {"pipeline_parallel_size": 2}})  # PP: any cost model (split by layers)
    with pytest.raises(ConfigError, match="moe_imbalance"):
        parse_experiment({**base, "cost_model": {"kind": "operator", "moe_imbalance": 0.5}})


@pytest.mark.parametrize("name", ["deepseek_v3_h200_tp8", "deepseek_v3_h200_dp8_ep8", "qwen3_32b_h100_tp2",
                                  "qwen3_32b_h100_tp4"])
def test_new_experiments_run_end_to_end(tmp_path, name):
    marker = needs_data("calibration", "aiconfigurator", "perf_db")
    if marker.args[0]:
        pytest.skip("shared data not found")
    res = runner.invoke(app, ["run", str(REPO / "experiments" / f"{name}.yaml"), "--out", str(tmp_path), "-q",
                              "--no-plots", "--set", "workload.num_requests=40"])
    assert res.exit_code == 0, res.output
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["num_finished"] == 40
    d = s["deployment"]
    if name.startswith("deepseek"):
        assert d["kv_capacity"]["bytes_per_block"] == 70_272 * 16
    else:
        tp = int(name[-1])
        assert d["kv_capacity"]["bytes_per_block"] == 16 * 64 * 2 * (8 // tp) * 128 * 2
    exp = load_experiment(REPO / "experiments" / f"{name}.yaml")
    assert exp.cost_model.kind == "operator"
