"""The speed benchmark's Vidur side: the command it runs and the equivalent servelab experiment."""

import json
import stat
import sys

import pytest

from lab.report.bench import VidurCase, compare_with_vidur, run_vidur, vidur_args, vidur_equivalent
from lab.experiment.config import parse_experiment
from lab.experiment.simulation import build_deployment


def test_vidur_command_names_model_tp_trace_and_attention_profile(tmp_path):
    record = tmp_path / "argv.json"
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    case = VidurCase("meta-llama/Llama-2-70b-hf", 2, attention_file="/x/attention.csv")
    proc = run_vidur(str(tmp_path), str(fake), "trace.csv", case)
    argv = json.loads(record.read_text())
    opts = dict(zip(argv[2::2], argv[3::2]))  # after "-m vidur.main"
    assert argv[:2] == ["-m", "vidur.main"] and proc.wall_s > 0 and proc.peak_mb > 0 and proc.user_cpu_s >= 0
    assert "--sarathi_scheduler_config_chunk_size" not in opts
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


def test_sarathi_case_runs_sarathi_with_the_same_chunk_in_both():
    case = VidurCase("meta-llama/Llama-2-70b-hf", 2, scheduler="sarathi", chunk_size=256, time_scale=8.0)
    argv = vidur_args("t.csv", case, "/tmp/o")
    opts = {a: b for a, b in zip(argv, argv[1:] + [""]) if a.startswith("--") and not b.startswith("--")}
    assert opts["--replica_scheduler_config_type"] == "sarathi"
    assert opts["--sarathi_scheduler_config_chunk_size"] == "256"
    assert opts["--trace_request_generator_config_time_scale_factor"] == "8.0"
    exp = parse_experiment({"name": "v", **vidur_equivalent(case.model, case.tp, case.scheduler, case.chunk_size)})
    assert (exp.policy.scheduler, exp.policy.options) == ("sarathi", {"chunk_size": 256})
    assert build_deployment(exp).scheduler_config.max_num_seqs == 128  # Vidur's batch_size_cap
    assert vidur_equivalent(case.model, 2)["policy"] == {"scheduler": "vllm_v1"}


@pytest.mark.parametrize("field, value, option", [("trace", "arxiv", "--vidur-trace"),
                                                  ("scheduler", "orca", "--vidur-scheduler"),
                                                  ("model", "Qwen/Qwen-72B", "--vidur-model")])
def test_unknown_vidur_case_names_the_option(field, value, option):
    with pytest.raises(ValueError, match=option):
        VidurCase(**{field: value})


def test_comparison_runs_servelab_on_the_code_trace_vidur_ran(tmp_path):
    (tmp_path / "data/processed_traces").mkdir(parents=True)
    (tmp_path / "data/processed_traces/splitwise_code.csv").write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,300,5\n0.5,5000,3\n1.0,20,4\n")
    fake = tmp_path / "fake_python"  # stands in for Vidur: checks it was given the code trace, then sleeps
    fake.write_text(f"#!{sys.executable}\nimport sys, time\n"
                    "assert sys.argv[sys.argv.index('--trace_request_generator_config_trace_file') + 1]"
                    ".endswith('splitwise_code.csv')\ntime.sleep(0.3)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    case = VidurCase("meta-llama/Llama-2-70b-hf", 2, trace="code", scheduler="sarathi")
    cmp = compare_with_vidur(str(tmp_path), str(fake), case, "bench/azure_conv.yaml")
    rec = cmp.as_record()
    assert (cmp.servelab.name, cmp.servelab.requests, cmp.servelab.model) == ("azure_code_as_vidur", 3, "Llama-2-70B")
    assert rec["vidur_wall_s"] >= 0.3 and rec["ratio"] == pytest.approx(rec["vidur_wall_s"] / rec["servelab_wall_s"])
    assert (rec["trace"], rec["scheduler"], rec["label"]) == ("code", "sarathi", "code, sarathi chunk 512")
    with pytest.raises(FileNotFoundError, match="splitwise_conv.csv not found"):
        compare_with_vidur(str(tmp_path), str(fake), VidurCase(), "bench/azure_conv.yaml")


@pytest.mark.parametrize("args, message", [(["--vidur-scheduler", "orca"], "--vidur-scheduler 'orca'"),
                                           (["--vidur-trace", "arxiv"], "--vidur-trace 'arxiv'")])
def test_bench_rejects_a_bad_vidur_case_before_running_anything(args, message):
    from typer.testing import CliRunner

    from lab.cli.main import app

    res = CliRunner().invoke(app, ["bench", "-w", "", "--vidur", "/nonexistent", *args])
    assert res.exit_code == 2 and message in res.output, res.output
