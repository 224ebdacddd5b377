"""A model given by model.hf_config is named from its config, wherever a model name is shown (report.md,
summary.json, bench_result.json model_id, servelab cost), not by the catalog default."""

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lab.cli.main import app
from lab.costmodel.model_arch import hf_model_name, load_model
from lab.experiment.config import parse_experiment

runner = CliRunner()
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
           "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000}


@pytest.mark.parametrize("file, name_or_path, expected", [
    ("Mistral-7B-v0.1/config.json", None, "Mistral-7B-v0.1"),          # the hub layout: the folder
    ("Mistral-7B-v0.1/config.json", "", "Mistral-7B-v0.1"),            # an empty _name_or_path is no name
    ("configs/mistral_7b.json", None, "mistral_7b"),                   # another file name: its stem
    ("x/config.json", "mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1"),  # a hub id, as written
    ("x/config.json", "/models/Mistral-7B-v0.1/", "Mistral-7B-v0.1"),  # a local path: its last folder
])
def test_the_name_comes_from_the_config(tmp_path, file, name_or_path, expected):
    path = tmp_path / file
    path.parent.mkdir(parents=True)
    cfg = dict(MISTRAL, **({} if name_or_path is None else {"_name_or_path": name_or_path}))
    path.write_text(json.dumps(cfg))
    assert hf_model_name(path, cfg) == expected
    assert load_model(hf_config=path).name == expected


def test_a_bare_config_json_in_the_current_folder_is_named_by_that_folder(tmp_path, monkeypatch):
    folder = tmp_path / "Mistral-7B-v0.1"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MISTRAL))
    monkeypatch.chdir(folder)
    assert load_model(hf_config="config.json").name == "Mistral-7B-v0.1"
    res = runner.invoke(app, ["cost", "--hf-config", "config.json", "--gpu", "H100", "--decode", "4:500"],
                        terminal_width=300)
    assert res.exit_code == 0, res.output
    assert "Mistral-7B-v0.1 on H100-SXM5-80GB" in res.output


def test_the_default_model_stays_the_catalog_default_without_hf_config():
    exp = parse_experiment({"name": "t"}, "t.yaml")
    assert exp.model.name == "Llama-3.1-8B"


@pytest.mark.parametrize("label, shown", [(None, "Mistral-7B-v0.1"), ("my-mistral", "my-mistral")])
def test_a_run_of_an_hf_config_model_shows_its_name_everywhere(tmp_path, label, shown):
    (tmp_path / "Mistral-7B-v0.1").mkdir()
    (tmp_path / "Mistral-7B-v0.1" / "config.json").write_text(json.dumps(MISTRAL))
    model = {"hf_config": "Mistral-7B-v0.1/config.json", **({"name": label} if label else {})}
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({"name": "hf", "workload": {"num_requests": 12, "rate": 4.0}, "model": model}))
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(exp), "--out", str(out), "-q", "--no-plots"], terminal_width=300)
    assert res.exit_code == 0, res.output
    assert json.loads((out / "summary.json").read_text())["deployment"]["model"] == shown
    assert json.loads((out / "bench_result.json").read_text())["model_id"] == shown
    report = (out / "report.md").read_text()
    assert f"{shown} on H100-SXM5-80GB" in report and "Llama-3.1-8B" not in report
