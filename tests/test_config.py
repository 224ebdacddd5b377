"""Experiment files: validation errors name the file and field; overrides; path expansion."""

import pytest

from lab.experiment.config import ConfigError, load_experiment, parse_set_option


def write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_minimal_experiment_gets_defaults(tmp_path):
    exp = load_experiment(write(tmp_path, "name: x\n"))
    assert exp.engine.max_num_batched_tokens is None and exp.policy.scheduler == "vllm_v1"
    assert exp.workload.source == "synthetic"


@pytest.mark.parametrize("gpu,mbt,seqs", [("H100", 8192, 1024), ("H200", 8192, 1024), ("B200", 16384, 1024),
                                          ("A100", 2048, 256), ("RTX4090", 2048, 256)])
def test_batch_limits_default_to_vllms_for_the_gpu(gpu, mbt, seqs):
    from lab.experiment.config import parse_experiment
    from lab.experiment.simulation import build_deployment

    dep = build_deployment(parse_experiment({"name": "x", "hardware": {"gpu": gpu}}))
    assert (dep.scheduler_config.max_num_batched_tokens, dep.scheduler_config.max_num_seqs) == (mbt, seqs)
    dep = build_deployment(parse_experiment({"name": "x", "hardware": {"gpu": gpu},
                                             "engine": {"max_num_batched_tokens": 1000, "max_num_seqs": 7}}))
    assert (dep.scheduler_config.max_num_batched_tokens, dep.scheduler_config.max_num_seqs) == (1000, 7)


def test_bad_field_value_names_file_field_and_value(tmp_path):
    p = write(tmp_path, "name: x\nengine:\n  max_num_seqs: -3\n")
    with pytest.raises(ConfigError) as e:
        load_experiment(p)
    msg = str(e.value)
    assert "exp.yaml" in msg and "engine.max_num_seqs" in msg and "-3" in msg


def test_unknown_field_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="engine.max_num_seq"):
        load_experiment(write(tmp_path, "name: x\nengine:\n  max_num_seq: 3\n"))


def test_unknown_model_or_gpu_names_the_file_and_field(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_experiment(write(tmp_path, "name: x\nmodel: {name: Llama-9-999B}\nhardware: {gpu: H900}\n"))
    msg = str(e.value)
    assert "exp.yaml" in msg and "model 'Llama-9-999B' is not in the catalog" in msg
    assert "hardware.gpu" in msg and "'H900' is not in the catalog" in msg


def test_trace_source_needs_a_path(tmp_path):
    with pytest.raises(ConfigError, match="needs 'path'"):
        load_experiment(write(tmp_path, "name: x\nworkload:\n  source: azure\n"))


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_experiment(write(tmp_path, "name: [x\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment(tmp_path / "missing.yaml")


def test_set_overrides_parse_yaml_scalars(tmp_path):
    over = parse_set_option(["engine.max_num_seqs=64", "engine.enable_chunked_prefill=false", "name=y"])
    exp = load_experiment(write(tmp_path, "name: x\n"), overrides=over)
    assert exp.engine.max_num_seqs == 64 and exp.engine.enable_chunked_prefill is False and exp.name == "y"
    with pytest.raises(ConfigError, match="FIELD.PATH=VALUE"):
        parse_set_option(["oops"])


def test_paths_expand_data_dir_and_resolve_relative_to_the_file(tmp_path):
    (tmp_path / "data").mkdir()
    exp = load_experiment(write(tmp_path, "name: x\n"), data_dir=tmp_path / "data")
    assert exp.path("{data_dir}/a.csv", "f") == tmp_path / "data" / "a.csv"
    assert exp.path("b.csv", "f") == tmp_path / "b.csv"
    exp = load_experiment(write(tmp_path, "name: x\n"), data_dir=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="SERVELAB_DATA_DIR"):
        exp.path("{data_dir}/a.csv", "workload.path")
