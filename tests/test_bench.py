"""The speed benchmark's Vidur side: the command it runs and the equivalent servelab experiment."""

import json
import stat
import sys

import pytest

from lab.report.bench import run_vidur, vidur_equivalent
from lab.experiment.config import parse_experiment
from lab.experiment.simulation import build_deployment


def test_vidur_command_names_model_tp_trace_and_attention_profile(tmp_path):
    record = tmp_path / "argv.json"
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    wall, peak = run_vidur(str(tmp_path), str(fake), "trace.csv", "meta-llama/Llama-2-70b-hf", 2, "/x/attention.csv")
    argv = json.loads(record.read_text())
    opts = dict(zip(argv[2::2], argv[3::2]))  # after "-m vidur.main"
    assert argv[:2] == ["-m", "vidur.main"] and wall > 0 and peak > 0
    assert opts["--replica_config_model_name"] == "meta-llama/Llama-2-70b-hf"
    assert opts["--replica_config_tensor_parallel_size"] == "2"
    assert opts["--trace_request_generator_config_trace_file"] == "trace.csv"
    assert opts["--replica_scheduler_config_type"] == "vllm"
    assert argv[-2:] == ["--random_forrest_execution_time_predictor_config_attention_input_file", "/x/attention.csv"]


def test_vidur_failure_is_an_error_with_its_output(tmp_path):
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('no attention.csv')\nsys.exit(3)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="no attention.csv"):
        run_vidur(str(tmp_path), str(fake), "trace.csv")


def test_servelab_side_runs_what_vidur_runs():
    dep = build_deployment(parse_experiment({"name": "v", **vidur_equivalent("meta-llama/Llama-2-70b-hf", 2)}))
    assert (dep.model.name, dep.hardware.name) == ("Llama-2-70B", "A100-80GB-SXM4")
    assert (dep.scheduler_config.max_num_seqs, dep.scheduler_config.max_num_batched_tokens) == (128, 4096)
    with pytest.raises(ValueError, match="--vidur-model"):
        vidur_equivalent("Qwen/Qwen-72B", 1)


def test_vidur_trace_becomes_the_same_requests_for_servelab(tmp_path):
    from lab.report.bench import vidur_trace_as_csv
    from lab.workload.loaders import load_csv

    src = tmp_path / "vidur.csv"
    src.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.5,4090,100\n5.0,0,0\n")
    assert vidur_trace_as_csv(str(src), str(tmp_path / "t.csv"), time_scale=2.0) == 3
    reqs = load_csv(tmp_path / "t.csv")
    # Vidur keeps prompt + output <= 4096 by shortening the prompt, and at least one token of each
    assert [(r.arrival_time, r.prompt_len, r.max_tokens) for r in reqs] == [(0.0, 374, 44), (9.0, 3996, 100),
                                                                             (10.0, 1, 1)]
    with pytest.raises(ValueError, match="expected Vidur trace columns"):
        vidur_trace_as_csv(str(tmp_path / "t.csv"), str(tmp_path / "u.csv"))
