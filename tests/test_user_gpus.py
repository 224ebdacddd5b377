"""GPUs a user describes: inline in an experiment (hardware.gpu as a mapping) or in a GPU catalog file
(hardware.gpu_catalog), checked as the packaged entries are, and listed by servelab catalog --gpu-catalog."""

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lab.cli.main import app
from lab.costmodel import hardware
from lab.experiment.config import ConfigError, parse_experiment

REPO = Path(__file__).resolve().parent.parent
L40S_FILE = REPO / "experiments" / "user_gpus" / "l40s.yaml"
# The L40S's figures (NVIDIA L40S datasheet; experiments/user_gpus/l40s.yaml)
L40S = {"bf16_tflops": 362.05, "fp8_tflops": 733, "memory_bytes": 48305799168, "memory_bandwidth_tbps": 0.864,
        "link_gbps": 32, "pcie_gbps": 32, "link": "pcie4_p2p", "num_sms": 142}
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_user_gpus():
    hardware.forget_user_gpus()
    yield
    hardware.forget_user_gpus()


def _experiment(tmp_path: Path, hw: dict, name: str = "gpu_test", **extra) -> Path:
    path = tmp_path / f"{name}.yaml"
    data = {"name": name, "workload": {"num_requests": 24, "rate": 6.0}, "hardware": hw, **extra}
    path.write_text(yaml.safe_dump(data))
    return path


def _run(path: Path, out: Path) -> dict:
    res = runner.invoke(app, ["run", str(path), "--out", str(out), "-q", "--no-plots"], terminal_width=300)
    assert res.exit_code == 0, res.output
    return json.loads((out / "summary.json").read_text())


def test_an_inline_gpu_runs_with_its_own_figures(tmp_path):
    slow = _run(_experiment(tmp_path, {"gpu": {"name": "L40S-a", **L40S}}, "slow"), tmp_path / "slow")
    fast = _run(_experiment(tmp_path, {"gpu": {"name": "L40S-b", **L40S, "memory_bandwidth_tbps": 1.728}}, "fast"),
                tmp_path / "fast")
    assert slow["deployment"]["gpu"] == "L40S-a" and slow["num_finished"] == 24
    # vLLM's batch defaults for a GPU under 70 GiB, and a KV cache sized from its 48 GB
    assert slow["deployment"]["max_num_seqs"] == 256 and slow["deployment"]["max_num_batched_tokens"] == 2048
    h100 = _run(_experiment(tmp_path, {"gpu": "H100-SXM5-80GB"}, "h100"), tmp_path / "h100")
    assert slow["deployment"]["num_gpu_blocks"] < h100["deployment"]["num_gpu_blocks"]
    # decode is bandwidth-bound: twice the bandwidth, shorter TPOT
    assert fast["tpot"]["mean"] < 0.75 * slow["tpot"]["mean"]


def test_a_gpu_from_a_catalog_file_runs_as_the_same_gpu_inline(tmp_path):
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "mine.yaml").write_text(L40S_FILE.read_text())
    from_file = _run(_experiment(tmp_path, {"gpu": "L40S", "gpu_catalog": "gpus/mine.yaml"}, "from_file"),
                     tmp_path / "a")  # relative to the experiment file
    inline = _run(_experiment(tmp_path, {"gpu": {"name": "L40S-inline", **L40S, "gpus_per_node": 8}}, "inline"),
                  tmp_path / "b")
    assert from_file["deployment"]["gpu"] == "L40S"
    for m in ("ttft", "tpot", "e2el"):
        assert from_file[m] == inline[m]


def test_the_shipped_l40s_runs_tensor_parallel_over_pcie(tmp_path):
    s = _run(_experiment(tmp_path, {"gpu": "l40s", "gpu_catalog": str(L40S_FILE), "tensor_parallel_size": 2}),
             tmp_path / "tp2")  # by alias; TP2 prices its all-reduces on the catalog's pcie4_p2p link
    assert s["deployment"]["gpu"] == "L40S" and s["deployment"]["tensor_parallel_size"] == 2


@pytest.mark.parametrize("change, field, message", [
    ({"memory_bandwidth_tbps": 0}, "memory_bandwidth_tbps",
     "must be a positive number (peak HBM/GDDR bandwidth, TB/s), got 0"),
    ({"num_sms": None}, "num_sms", "missing"),
    ({"num_sms": 141.5}, "num_sms", "must be a positive integer"),
    ({"bf16_tflop": 362}, "bf16_tflop", "unknown GPU field"),
    ({"link": "nvlink9"}, "link", "'nvlink9' is not a known link type"),
    ({"fp8_tflops": "733"}, "fp8_tflops", "must be a positive number"),
])
def test_a_bad_field_fails_in_one_line_naming_file_and_field(tmp_path, change, field, message):
    fields = {k: v for k, v in {**L40S, **change}.items() if v is not None}
    inline = _experiment(tmp_path, {"gpu": {"name": "X1", **fields}}, "inline")
    res = runner.invoke(app, ["run", str(inline), "--out", str(tmp_path / "o1"), "-q"], terminal_width=300)
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line and f"{inline}: hardware.gpu: {field}: {message}" in line, line

    catalog = tmp_path / "gpus.yaml"
    catalog.write_text(yaml.safe_dump({"X2": fields}))
    from_file = _experiment(tmp_path, {"gpu": "X2", "gpu_catalog": "gpus.yaml"}, "from_file")
    res = runner.invoke(app, ["run", str(from_file), "--out", str(tmp_path / "o2"), "-q"], terminal_width=300)
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line and f"hardware.gpu_catalog: {catalog}: X2.{field}: {message}" in line, line
    assert line.startswith(f"error: {from_file}: ")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()  # refused before simulating


def test_a_catalog_file_that_is_missing_or_not_a_mapping_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"hardware\.gpu_catalog: .*nope\.yaml: GPU catalog file does not exist"):
        parse_experiment({"name": "t", "hardware": {"gpu": "X", "gpu_catalog": "nope.yaml"}}, "t.yaml", tmp_path)
    (tmp_path / "list.yaml").write_text("- L40S\n")
    with pytest.raises(ConfigError, match="expected a mapping of GPU name -> fields"):
        parse_experiment({"name": "t", "hardware": {"gpu": "X", "gpu_catalog": "list.yaml"}}, "t.yaml", tmp_path)


def test_an_unknown_gpu_name_says_how_to_describe_one(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_experiment({"name": "t", "hardware": {"gpu": "L40S"}}, "t.yaml", tmp_path)
    assert "hardware.gpu" in str(e.value) and "hardware.gpu_catalog" in str(e.value)


def test_a_user_gpu_may_not_take_a_packaged_name_nor_redefine_its_own(tmp_path):
    with pytest.raises(ConfigError, match=r"'H100' is a packaged GPU .* give yours another name"):
        parse_experiment({"name": "t", "hardware": {"gpu": {"name": "H100", **L40S}}}, "t.yaml", tmp_path)
    parse_experiment({"name": "t", "hardware": {"gpu": {"name": "Mine", **L40S}}}, "a.yaml", tmp_path)
    parse_experiment({"name": "t", "hardware": {"gpu": {"name": "Mine", **L40S}}}, "b.yaml", tmp_path)  # same: fine
    with pytest.raises(ConfigError, match=r"'Mine' is already described with other figures by a\.yaml"):
        parse_experiment({"name": "t", "hardware": {"gpu": {"name": "Mine", **L40S, "num_sms": 100}}}, "c.yaml",
                         tmp_path)


def test_every_packaged_gpu_passes_the_same_check():
    for name in hardware.hardware_names():
        hardware.check_gpu_entry(name, hardware._catalog()[name], f"lab/catalog/hardware.yaml: {name}")


def test_catalog_lists_a_user_catalog_and_refuses_a_bad_one(tmp_path):
    res = runner.invoke(app, ["catalog", "--gpu-catalog", str(L40S_FILE)], terminal_width=300)
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if "L40S" in line)
    assert "362" in row and "733" in row and "48.3" in row and str(L40S_FILE) in row
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"B": {**L40S, "pcie_gbps": -1}}))
    res = runner.invoke(app, ["catalog", "--gpu-catalog", str(bad)], terminal_width=300)
    assert res.exit_code == 2 and f"{bad}: B.pcie_gbps: must be a positive number" in res.output
