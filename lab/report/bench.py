"""Speed benchmark: time servelab on fixed workloads (bench/*.yaml), optionally beside Vidur.

Each workload runs in its own process so its peak memory (maximum resident set size, from ``wait4``) is its own.
Wall time is the simulation itself (``simulate``), after the trace is loaded and before any report is written;
the process's total wall time is shown too. Vidur, when ``--vidur PATH`` names a checkout of microsoft/vidur with
its profiling data and its dependencies importable by ``--vidur-python``, is run on its copy of an Azure 2023 trace
(conversation or code) with its vLLM or Sarathi scheduler on an A100 replica (:class:`VidurCase`), and servelab
runs the same requests, model, GPUs and limits for the ratio (:func:`compare_with_vidur`). Speed ratios are
printed only against a reference measured for the same model, GPU, workload and request count (:func:`speed_ratio`
refuses any other); references for other setups are kept, with their setup, in docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from lab.experiment.config import load_experiment
from lab.experiment.simulation import build_requests, simulate

WORKLOADS = {
    "azure_conv": "bench/azure_conv.yaml",
    "million_16x": "bench/million_16x.yaml",
    "mooncake_conv": "bench/mooncake_conv.yaml",
}
# Whole-process wall seconds each workload took on the 2-core reference machine (docs/performance.md, `servelab
# bench`): the weights of the progress display's ETA, which scales them by the speed measured so far.
EXPECTED_WALL_S = {"azure_conv": 4.0, "million_16x": 225.0, "mooncake_conv": 15.0}

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
    """Figures of one servelab benchmark process: requests, the simulation's wall seconds (trace loaded, no report)
    and the whole process's, simulated seconds, engine steps and those the fast-forward jumped, peak resident MB,
    the model and GPU it ran, and the :class:`ProcessFigures` noise indicators (user CPU s, others' cores, load)."""

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
    user_cpu_s: float = 0.0
    others_cores: float = float("nan")
    load_avg_1m: float = float("nan")

    @property
    def jumped_share(self) -> float:
        """Share of engine steps advanced by the decode fast-forward (0..1)."""
        return self.jumped_steps / self.steps if self.steps else 0.0

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


def worker(experiment: str, data_dir: str | None, overrides: str | None, progress_file: str | None = None) -> None:
    """Run one workload and print one JSON line of figures (called in a child process). With ``progress_file``,
    write ``"<finished> <total>"`` requests into it (replacing its content) each time another 0.5 % of the requests
    finished: a check per finished request and a write per mark, some 0.1 s of the million-request run's ~220 s."""
    t0 = time.perf_counter()
    over = json.loads(overrides) if overrides else None
    exp = load_experiment(experiment, data_dir, over)
    reqs = build_requests(exp)
    t1 = time.perf_counter()
    res = simulate(exp, reqs, _progress_writer(progress_file, len(reqs)) if progress_file else None)
    t2 = time.perf_counter()
    print(json.dumps({
        "requests": len(reqs), "sim_wall_s": t2 - t1, "load_s": t1 - t0, "sim_end_s": res.sim_end,
        "steps": sum(len(i.steps) for i in res.instances),
        "jumped_steps": sum(i.jump.jumped_steps for i in res.instances),
        "finished": sum(1 for r in reqs if r.finish_time is not None),
        "model": res.deployment.model.name, "gpu": res.deployment.hardware.name,
    }))


def _progress_writer(path: str, total: int):
    """A ``simulate`` progress callback that writes ``"<done> <total>"`` into ``path`` every 0.5 % of ``total``."""
    step = max(1, total // 200)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    mark = [step]

    def write(done: int) -> None:
        os.pwrite(fd, f"{done} {total}\n".ljust(32).encode(), 0)

    def progress(done: int, _total: int) -> None:
        if done >= mark[0] or done == total:
            mark[0] = done + step
            write(done)

    write(0)
    return progress


def read_progress(path: str) -> tuple[int, int] | None:
    """``(finished, total)`` requests from a progress file :func:`_progress_writer` writes; None before the child
    wrote one (still loading its trace) or when it cannot be read."""
    try:
        with open(path) as f:
            done, total = f.read().split()[:2]
        return int(done), int(total)
    except (OSError, ValueError):
        return None


class ProcessFigures(NamedTuple):
    """Whole-process figures of one child process: wall seconds, peak resident memory (MB, ``wait4``'s
    ru_maxrss), user CPU seconds (ru_utime: unlike wall time, barely moved by other processes on a shared
    machine), the CPU cores other processes kept busy on average while it ran (see :func:`_busy_cpu_s`), and the
    machine's 1-minute load average when it ended."""

    wall_s: float
    peak_mb: float
    user_cpu_s: float
    others_cores: float
    load_avg_1m: float


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores: user, nice, system, irq, softirq and
    steal jiffies of /proc/stat's ``cpu`` line, proc(5)), or NaN where /proc/stat is unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _run_child(args: list[str], cwd: str | None = None, poll=None,
               poll_s: float = 0.5) -> tuple[str, ProcessFigures]:
    """Run a child process; return its stdout and :class:`ProcessFigures`. ``poll()``, when given, is called every
    ``poll_s`` seconds while the child runs (for a progress display; the child's figures are its own either way).

    Raises:
        RuntimeError: the child exited non-zero (the message ends with its stderr).
    """
    import subprocess  # noqa: PLC0415 - the parent's only: the worker process (start-up counted) needs neither
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # never a full pipe
        busy0, t0 = _busy_cpu_s(), time.perf_counter()
        p = subprocess.Popen(args, stdout=out, stderr=err, text=True, cwd=cwd)
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG if poll is not None else 0)
            if pid:
                break
            time.sleep(poll_s)
            poll()
        wall = time.perf_counter() - t0
        busy = _busy_cpu_s() - busy0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:6])} ... failed ({p.returncode}):\n{stderr[-3000:]}")
    own_cpu = usage.ru_utime + usage.ru_stime
    others = max(busy - own_cpu, 0.0) / wall if wall > 0 else float("nan")
    peak_mb = usage.ru_maxrss / 1024.0  # Linux reports KiB
    return stdout, ProcessFigures(wall, peak_mb, usage.ru_utime, others, os.getloadavg()[0])


def run_workload(name: str, path: str, data_dir: str | None = None, overrides: dict | None = None,
                 on_progress=None) -> BenchResult:
    """Run one experiment file (with ``overrides`` merged over it) in a child process and return its figures.
    ``on_progress(finished, total)`` (requests), when given, is called about every half second while the child
    simulates (the child writes its count into a temporary file every 0.5 % of the requests).

    Raises:
        RuntimeError: the child failed (the message ends with its stderr).
    """
    import tempfile  # noqa: PLC0415 - as _run_child's

    args = [sys.executable, "-m", "lab.report.bench", path]
    if data_dir:
        args += ["--data-dir", data_dir]
    if overrides:
        args += ["--overrides", json.dumps(overrides)]
    if on_progress is None:
        out, proc = _run_child(args)
    else:
        with tempfile.TemporaryDirectory(prefix="servelab_bench_") as tmp:
            progress_file = os.path.join(tmp, "progress")

            def poll() -> None:
                got = read_progress(progress_file)
                if got is not None:
                    on_progress(*got)

            out, proc = _run_child(args + ["--progress", progress_file], poll=poll)
    d = json.loads(out.strip().splitlines()[-1])
    return BenchResult(name, d["requests"], d["sim_wall_s"], proc.wall_s, d["sim_end_s"], d["steps"], d["jumped_steps"],
                       proc.peak_mb, d["model"], d["gpu"], proc.user_cpu_s, proc.others_cores, proc.load_avg_1m)


# Vidur model names -> this project's catalog names (the models Vidur profiled on the A100 that the catalog has).
VIDUR_MODELS = {"meta-llama/Llama-2-7b-hf": "Llama-2-7B", "meta-llama/Llama-2-70b-hf": "Llama-2-70B",
                "meta-llama/Meta-Llama-3-8B": "Llama-3.1-8B"}
# Vidur's vLLM scheduler defaults (vidur/config/config.py): batch_size_cap 128, max_tokens_in_batch 4096, block 16.
VIDUR_VLLM_LIMITS = {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "block_size": 16}
# Vidur's copies of the Azure LLM inference 2023 traces (its data/processed_traces, columns arrived_at,
# num_prefill_tokens, num_decode_tokens): conversation 19,366 requests, code 8,819.
VIDUR_TRACES = {"conv": "data/processed_traces/splitwise_conv.csv", "code": "data/processed_traces/splitwise_code.csv"}
# Vidur replica scheduler -> servelab policy; Vidur's SarathiSchedulerConfig has only chunk_size (default 512) on top
# of the shared batch_size_cap 128 and block_size 16 (vidur/config/config.py).
VIDUR_SCHEDULERS = {"vllm": "vllm_v1", "sarathi": "sarathi"}


@dataclass(frozen=True)
class VidurCase:
    """One setup both simulators run: Vidur's model name and tensor-parallel size on A100s, which of its traces
    (a VIDUR_TRACES key), its replica scheduler (a VIDUR_SCHEDULERS key; ``chunk_size`` tokens per step for
    Sarathi), the factor arrival times are multiplied by, and an attention profile (CSV path) replacing the one
    Vidur looks for under its data/profiling (for a checkout that lacks it)."""

    model: str = "meta-llama/Llama-2-7b-hf"
    tp: int = 1
    trace: str = "conv"
    scheduler: str = "vllm"
    chunk_size: int = 512
    time_scale: float = 1.0
    attention_file: str | None = None

    def __post_init__(self) -> None:
        """Raises ValueError naming the option for a model, trace or scheduler outside the tables above."""
        for option, value, known in (("--vidur-model", self.model, VIDUR_MODELS), ("--vidur-trace", self.trace,
                                     VIDUR_TRACES), ("--vidur-scheduler", self.scheduler, VIDUR_SCHEDULERS)):
            if value not in known:
                raise ValueError(f"{option} {value!r}: expected one of {sorted(known)}")

    @property
    def workload(self) -> str:
        """Name of servelab's run of this case (the trace as Vidur makes it)."""
        return f"azure_{self.trace}_as_vidur"

    @property
    def label(self) -> str:
        """Short description, e.g. ``conv, sarathi chunk 512, arrivals x8``."""
        sched = f"sarathi chunk {self.chunk_size}" if self.scheduler == "sarathi" else self.scheduler
        return f"{self.trace}, {sched}" + (f", arrivals x{self.time_scale:g}" if self.time_scale != 1.0 else "")


def vidur_trace_as_csv(vidur_trace: str, out_csv: str, max_tokens: int = 4096, time_scale: float = 1.0) -> int:
    """Write the requests Vidur's ``trace_replay`` generator makes of a trace (columns ``arrived_at,
    num_prefill_tokens, num_decode_tokens``) as a servelab CSV trace, so both simulators run the same requests:
    token counts at least 1, the prompt shortened so prompt + output <= ``max_tokens`` (Vidur's default 4096),
    arrival times multiplied by ``time_scale`` (vidur/request_generator/trace_replay_request_generator.py).
    Returns the number of requests.

    Raises:
        ValueError: the file lacks those columns.
    """
    import pandas as pd  # noqa: PLC0415 - the benchmark worker, which imports this module, does not need it

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


def vidur_equivalent(model: str, tp: int, scheduler: str = "vllm", chunk_size: int = 512) -> dict:
    """Overrides that make a servelab experiment run what Vidur runs: its model on A100s at ``tp``, its
    scheduler's limits (128 sequences, 4,096 tokens a step for vLLM) and, for ``scheduler="sarathi"``, servelab's
    Sarathi policy with the same ``chunk_size`` (tokens per step).

    Raises:
        ValueError: a Vidur model this catalog lacks, or a scheduler outside VIDUR_SCHEDULERS.
    """
    VidurCase(model, tp, scheduler=scheduler, chunk_size=chunk_size)  # validates
    policy: dict = {"scheduler": VIDUR_SCHEDULERS[scheduler]}
    if scheduler == "sarathi":
        policy["options"] = {"chunk_size": chunk_size}
    return {"model": {"name": VIDUR_MODELS[model]},
            "hardware": {"gpu": "A100-80GB-SXM4", "tensor_parallel_size": tp},
            "engine": dict(VIDUR_VLLM_LIMITS), "policy": policy}


def vidur_args(trace: str, case: VidurCase, out_dir: str) -> list[str]:
    """Vidur's command-line options (after ``python -m vidur.main``) for ``case`` on the trace file ``trace``: one
    A100 replica, no pipeline stages, metrics not written (flag names from vidur/config/config.py, flattened by
    vidur/config/flat_dataclass.py as ``<config class in snake case>_<field>``)."""
    args = ["--replica_config_device", "a100",
            "--replica_config_model_name", case.model,
            "--cluster_config_num_replicas", "1",
            "--replica_config_tensor_parallel_size", str(case.tp),
            "--replica_config_num_pipeline_stages", "1",
            "--request_generator_config_type", "trace_replay",
            "--trace_request_generator_config_trace_file", trace,
            "--replica_scheduler_config_type", case.scheduler,
            "--metrics_config_output_dir", out_dir,
            "--no-metrics_config_write_metrics"]
    if case.scheduler == "sarathi":
        args += ["--sarathi_scheduler_config_chunk_size", str(case.chunk_size)]
    if case.time_scale != 1.0:
        args += ["--trace_request_generator_config_time_scale_factor", str(case.time_scale)]
    if case.attention_file:
        args += ["--random_forrest_execution_time_predictor_config_attention_input_file", case.attention_file]
    return args


def run_vidur(vidur_dir: str, python: str, trace: str, case: VidurCase = VidurCase()) -> ProcessFigures:
    """Run Vidur (``python -m vidur.main`` in ``vidur_dir``) on a trace file for ``case``; return its
    whole-process figures.

    Raises:
        RuntimeError: Vidur failed (the message ends with its stderr).
    """
    import tempfile  # noqa: PLC0415 - as _run_child's

    out_dir = tempfile.mkdtemp(prefix="vidur_bench_")
    _, proc = _run_child([python, "-m", "vidur.main", *vidur_args(trace, case, out_dir)], cwd=vidur_dir)
    return proc


@dataclass
class VidurComparison:
    """One paired run: Vidur's whole process and servelab's on the same requests, model, GPUs and limits."""

    case: VidurCase
    vidur: ProcessFigures
    servelab: BenchResult
    faster: float  # Vidur whole-process wall / servelab whole-process wall
    leaner: float  # Vidur peak MB / servelab peak MB

    def as_record(self) -> dict:
        """A flat dict for one JSON line: case fields, then ``vidur_*`` and ``servelab_*`` figures (seconds, MB,
        cores), the ratios and servelab's jumped-step share."""
        s = self.servelab
        return {**asdict(self.case), "label": self.case.label, "requests": s.requests,
                **{f"vidur_{k}": v for k, v in self.vidur._asdict().items()},
                "servelab_wall_s": s.total_wall_s, "servelab_sim_wall_s": s.sim_wall_s, "servelab_peak_mb": s.peak_mb,
                "servelab_user_cpu_s": s.user_cpu_s, "servelab_others_cores": s.others_cores,
                "servelab_load_avg_1m": s.load_avg_1m,
                "servelab_steps": s.steps, "servelab_jumped_share": s.jumped_share,
                "ratio": self.faster, "memory_ratio": self.leaner}


def compare_with_vidur(vidur_dir: str, python: str, case: VidurCase, experiment: str, data_dir: str | None = None,
                       overrides: dict | None = None, on_stage=None, on_progress=None) -> VidurComparison:
    """Run Vidur on its copy of the trace, then servelab (``experiment`` with :func:`vidur_equivalent`'s overrides,
    then ``overrides``) on exactly the requests Vidur made of it; the ratio is whole process against whole process.
    ``on_stage(name)`` is called as each starts (``"vidur"``, ``"servelab"``), ``on_progress(finished, total)``
    while servelab runs (:func:`run_workload`).

    Raises:
        FileNotFoundError: ``vidur_dir`` lacks the trace (not a microsoft/vidur checkout).
        RuntimeError: either simulator failed.
        UnlikeReference: servelab ran another model, GPU or request count than Vidur (a broken override).
    """
    trace = Path(vidur_dir) / VIDUR_TRACES[case.trace]
    if not trace.is_file():
        raise FileNotFoundError(f"--vidur {vidur_dir}: {trace} not found (expected a microsoft/vidur checkout)")
    if on_stage is not None:
        on_stage("vidur")
    v = run_vidur(vidur_dir, python, str(trace), case)
    if on_stage is not None:
        on_stage("servelab")
    import tempfile  # noqa: PLC0415 - as _run_child's

    same_trace = Path(tempfile.mkdtemp(prefix="servelab_vidur_")) / "trace.csv"
    n = vidur_trace_as_csv(str(trace), str(same_trace), time_scale=case.time_scale)
    equivalent = vidur_equivalent(case.model, case.tp, case.scheduler, case.chunk_size)
    ours = run_workload(case.workload, experiment, data_dir,
                        {**equivalent, "workload": {"source": "csv", "path": str(same_trace)}, **(overrides or {})},
                        on_progress)
    ref = Reference("vidur", case.workload, VIDUR_MODELS[case.model], equivalent["hardware"]["gpu"], n, v.wall_s,
                    v.peak_mb, f"this run ({case.label}, TP{case.tp})")
    faster, leaner = speed_ratio(ours, ref)
    return VidurComparison(case, v, ours, faster, leaner)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="servelab benchmark worker: run one workload, print figures as JSON")
    ap.add_argument("experiment")
    ap.add_argument("--data-dir")
    ap.add_argument("--overrides")
    ap.add_argument("--progress", help="file to write '<finished> <total>' requests into as the run goes")
    a = ap.parse_args()
    worker(a.experiment, a.data_dir, a.overrides, a.progress)
    # The figures are printed: end the process without tearing the finished run down object by object (~0.2 s of a
    # 3 s run of the Azure trace), as multiprocessing's workers end (os._exit) — unless a profiler or tracer runs
    # (cProfile, pyinstrument, coverage write their results at exit).
    if sys.getprofile() is None and sys.gettrace() is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    gc.freeze()  # as the servelab command does at its end (lab/cli/main.py main): no last traversal at exit
