"""Speed benchmark: time servelab on fixed workloads (bench/*.yaml), optionally beside Vidur.

Each workload runs in its own process so its peak memory (maximum resident set size, from ``wait4``) is its own.
Wall time is the simulation itself (``simulate``), after the trace is loaded and before any report is written;
the process's total wall time is shown too. Vidur, when ``--vidur PATH`` names a checkout of microsoft/vidur with
its profiling data and its dependencies importable by ``--vidur-python``, is run on the same Azure conversation
trace with its vLLM scheduler and a Llama-2-7B / A100 replica, and servelab runs the same model, GPU and trace for
the ratio. Speed ratios are printed only against a reference measured for the same model, GPU, workload and
request count (:func:`speed_ratio` refuses any other); references for other setups are kept, with their setup, in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab.experiment.config import load_experiment
from lab.experiment.simulation import build_requests, simulate

WORKLOADS = {
    "azure_conv": "bench/azure_conv.yaml",
    "million_16x": "bench/million_16x.yaml",
    "mooncake_conv": "bench/mooncake_conv.yaml",
}

@dataclass(frozen=True)
class Reference:
    """A speed figure measured for one setup: the simulator, the workload (a WORKLOADS name, or a name for a trace
    made for the comparison), the model and GPU (this project's catalog names), the request count, whole-process
    wall seconds and peak resident memory (MB), and where it comes from (a command, a document)."""

    simulator: str
    workload: str
    model: str
    gpu: str
    requests: int
    wall_s: float
    peak_mb: float
    source: str


# Vidur (microsoft/vidur, vLLM scheduler, predictors already trained), 2-core machine: Azure 2023 conversation
# trace, 19,366 requests, 103 s wall, 1.9 GB (the trace three times, 58,098 requests: 289 s, 3.0 GB). Its model and
# GPU differ from azure_conv's (Llama-3.1-8B / H100), so speed_ratio refuses it against that workload: it is kept
# for the record (docs/performance.md), not for a printed ratio.
VIDUR_REFERENCE = Reference("vidur", "azure_conv", "Llama-2-7B", "A100-80GB-SXM4", 19366, 103.0, 1900.0,
                            "docs/performance.md (Vidur's Llama-2-7B / A100 run of the Azure conversation trace)")


class UnlikeReference(ValueError):
    """A reference measured for another model, GPU, workload or request count than the run it is compared with."""


@dataclass
class BenchResult:
    name: str
    requests: int
    sim_wall_s: float
    total_wall_s: float
    sim_end_s: float
    steps: int
    jumped_steps: int
    peak_mb: float
    model: str = ""
    gpu: str = ""

    @property
    def sim_per_wall(self) -> float:
        return self.sim_end_s / self.sim_wall_s if self.sim_wall_s else float("nan")

    @property
    def req_per_wall(self) -> float:
        return self.requests / self.sim_wall_s if self.sim_wall_s else float("nan")

    @property
    def steps_per_wall(self) -> float:
        return self.steps / self.sim_wall_s if self.sim_wall_s else float("nan")


def speed_ratio(ours: BenchResult, ref: Reference) -> tuple[float, float]:
    """(reference wall / our whole-process wall, reference peak MB / our peak MB): how many times faster and
    leaner servelab ran the same setup.

    Raises:
        UnlikeReference: ``ref`` was measured for another workload, model, GPU or request count (a ratio between
            different setups says nothing about the simulators).
    """
    ours_setup = (ours.name, ours.model, ours.gpu, ours.requests)
    ref_setup = (ref.workload, ref.model, ref.gpu, ref.requests)
    if ours_setup != ref_setup:
        raise UnlikeReference(f"{ref.simulator} reference ({ref.source}) is for workload {ref.workload!r}, "
                              f"{ref.model} / {ref.gpu}, {ref.requests:,} requests; this run is {ours.name!r}, "
                              f"{ours.model} / {ours.gpu}, {ours.requests:,} requests: no ratio")
    return ref.wall_s / ours.total_wall_s, ref.peak_mb / ours.peak_mb


def worker(experiment: str, data_dir: str | None, overrides: str | None) -> None:
    """Run one workload and print one JSON line of figures (called in a child process)."""
    t0 = time.perf_counter()
    over = json.loads(overrides) if overrides else None
    exp = load_experiment(experiment, data_dir, over)
    reqs = build_requests(exp)
    t1 = time.perf_counter()
    res = simulate(exp, reqs)
    t2 = time.perf_counter()
    print(json.dumps({
        "requests": len(reqs), "sim_wall_s": t2 - t1, "load_s": t1 - t0, "sim_end_s": res.sim_end,
        "steps": sum(len(i.steps) for i in res.instances), "jumped_steps": sum(i.jumped_steps for i in res.instances),
        "finished": sum(1 for r in reqs if r.finish_time is not None),
        "model": res.deployment.model.name, "gpu": res.deployment.hardware.name,
    }))


def _run_child(args: list[str], cwd: str | None = None) -> tuple[str, float, float]:
    """Run a child process; return (stdout, wall seconds, peak RSS in MB)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    out, err = "", ""
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    out = p.stdout.read() if p.stdout else ""
    err = p.stderr.read() if p.stderr else ""
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:6])} ... failed ({p.returncode}):\n{err[-3000:]}")
    peak_mb = usage.ru_maxrss / 1024.0  # Linux reports KiB
    return out, wall, peak_mb


def run_workload(name: str, path: str, data_dir: str | None = None, overrides: dict | None = None) -> BenchResult:
    args = [sys.executable, "-m", "lab.report.bench", path]
    if data_dir:
        args += ["--data-dir", data_dir]
    if overrides:
        args += ["--overrides", json.dumps(overrides)]
    out, wall, peak = _run_child(args)
    d = json.loads(out.strip().splitlines()[-1])
    return BenchResult(name, d["requests"], d["sim_wall_s"], wall, d["sim_end_s"], d["steps"], d["jumped_steps"], peak,
                       d["model"], d["gpu"])


# Vidur model names -> this project's catalog names (the models Vidur profiled on the A100 that the catalog has).
VIDUR_MODELS = {"meta-llama/Llama-2-7b-hf": "Llama-2-7B", "meta-llama/Llama-2-70b-hf": "Llama-2-70B",
                "meta-llama/Meta-Llama-3-8B": "Llama-3.1-8B"}
# Vidur's vLLM scheduler defaults (vidur/config/config.py): batch_size_cap 128, max_tokens_in_batch 4096, block 16.
VIDUR_VLLM_LIMITS = {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "block_size": 16}


def vidur_trace_as_csv(vidur_trace: str, out_csv: str, max_tokens: int = 4096, time_scale: float = 1.0) -> int:
    """Write the requests Vidur's ``trace_replay`` generator makes of a trace (columns ``arrived_at,
    num_prefill_tokens, num_decode_tokens``) as a servelab CSV trace, so both simulators run the same requests:
    token counts at least 1, the prompt shortened so prompt + output <= ``max_tokens`` (Vidur's default 4096),
    arrival times multiplied by ``time_scale`` (vidur/request_generator/trace_replay_request_generator.py).
    Returns the number of requests.

    Raises:
        ValueError: the file lacks those columns.
    """
    df = pd.read_csv(vidur_trace)
    need = {"arrived_at", "num_prefill_tokens", "num_decode_tokens"}
    if not need <= set(df.columns):
        raise ValueError(f"{vidur_trace}: expected Vidur trace columns {sorted(need)}, found {list(df.columns)}")
    prompt = df["num_prefill_tokens"].astype(int).clip(lower=1)
    output = df["num_decode_tokens"].astype(int).clip(lower=1)
    prompt = prompt - (prompt + output - max_tokens).clip(lower=0)
    pd.DataFrame({"arrival_time_s": df["arrived_at"] * time_scale, "prompt_tokens": prompt,
                  "output_tokens": output}).to_csv(out_csv, index=False)
    return len(df)


def vidur_equivalent(model: str, tp: int) -> dict:
    """Overrides that make a servelab experiment run what Vidur runs: its model on A100s at ``tp``, its vLLM
    scheduler's limits.

    Raises:
        ValueError: a Vidur model this catalog lacks.
    """
    if model not in VIDUR_MODELS:
        raise ValueError(f"--vidur-model {model!r}: expected one of {sorted(VIDUR_MODELS)}")
    return {"model": {"name": VIDUR_MODELS[model]},
            "hardware": {"gpu": "A100-80GB-SXM4", "tensor_parallel_size": tp},
            "engine": dict(VIDUR_VLLM_LIMITS)}


def run_vidur(vidur_dir: str, python: str, trace: str, model: str = "meta-llama/Llama-2-7b-hf", tp: int = 1,
              attention_file: str | None = None, time_scale: float = 1.0) -> tuple[float, float]:
    """Run Vidur on a trace (its vLLM scheduler, one A100 replica of ``model`` at ``tp``, metrics not written);
    return (whole-process wall s, peak MB). ``attention_file`` replaces the attention profile Vidur looks for under
    its data/profiling (for a checkout that lacks it).

    Raises:
        RuntimeError: Vidur failed (the message ends with its stderr).
    """
    out_dir = tempfile.mkdtemp(prefix="vidur_bench_")
    args = [python, "-m", "vidur.main",
            "--replica_config_device", "a100",
            "--replica_config_model_name", model,
            "--cluster_config_num_replicas", "1",
            "--replica_config_tensor_parallel_size", str(tp),
            "--replica_config_num_pipeline_stages", "1",
            "--request_generator_config_type", "trace_replay",
            "--trace_request_generator_config_trace_file", trace,
            "--replica_scheduler_config_type", "vllm",
            "--metrics_config_output_dir", out_dir,
            "--no-metrics_config_write_metrics"]
    if time_scale != 1.0:
        args += ["--trace_request_generator_config_time_scale_factor", str(time_scale)]
    if attention_file:
        args += ["--random_forrest_execution_time_predictor_config_attention_input_file", attention_file]
    _, wall, peak = _run_child(args, cwd=vidur_dir)
    return wall, peak


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="servelab benchmark worker: run one workload, print figures as JSON")
    ap.add_argument("experiment")
    ap.add_argument("--data-dir")
    ap.add_argument("--overrides")
    a = ap.parse_args()
    worker(a.experiment, a.data_dir, a.overrides)
