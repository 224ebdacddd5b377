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


def test_set_overrides_that_cannot_be_parsed_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"--set 'workload.max_requests=\[': the value is not valid YAML") as e:
        parse_set_option(["workload.max_requests=["])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="workload was set to a value by an earlier --set, so it has no fields"):
        parse_set_option(["workload=5", "workload.num_requests=3"])
    assert parse_set_option(["workload.num_requests=3", "workload=5"]) == {"workload": 5}  # the later one wins


def test_a_directory_given_as_the_experiment_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not an experiment file"):
        load_experiment(tmp_path)


def test_paths_expand_data_dir_and_resolve_relative_to_the_file(tmp_path):
    (tmp_path / "data").mkdir()
    exp = load_experiment(write(tmp_path, "name: x\n"), data_dir=tmp_path / "data")
    assert exp.path("{data_dir}/a.csv", "f") == tmp_path / "data" / "a.csv"
    assert exp.path("b.csv", "f") == tmp_path / "b.csv"
    exp = load_experiment(write(tmp_path, "name: x\n"), data_dir=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="SERVELAB_DATA_DIR"):
        exp.path("{data_dir}/a.csv", "workload.path")


def test_num_requests_on_a_trace_is_refused_not_ignored(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0.0,10,5\n")
    text = f"name: x\nworkload: {{source: csv, path: {trace}, num_requests: 2000}}\n"
    with pytest.raises(ConfigError, match="num_requests is for generated workloads.*use max_requests"):
        load_experiment(write(tmp_path, text))
    load_experiment(write(tmp_path, text.replace("num_requests", "max_requests")))  # the field for traces


@pytest.mark.parametrize("key,command", [("axes", "sweep"), ("find", "search"), ("groups", "compare")])
def test_a_sweep_search_or_comparison_file_given_as_an_experiment_names_its_command(tmp_path, key, command):
    p = write(tmp_path, f"name: x\nbase: exp.yaml\n{key}: {{}}\n")
    with pytest.raises(ConfigError, match=f"not one experiment: run it with servelab {command} "):
        load_experiment(p)
