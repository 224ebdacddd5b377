"""Sweeps: one base experiment run over axes of field values, with replications, into one results table
(``servelab sweep FILE.yaml``; docs/sweeps.md).

A sweep file::

    name: demo_rates
    base: demo.yaml                    # an experiment file (relative to this file) or an inline mapping
    axes:                              # field path -> values: a list, or {range: [start, stop, step]} (stop included)
      workload.rate: [4, 8, 12, 16]
      engine.max_num_seqs: {range: [64, 256, 64]}
    mode: cross                        # cross (every combination) or zip (the i-th value of every axis together)
    replications: 3                    # runs per point, seeds base seed + 0, 1, 2
    jobs: 2                            # worker processes

Each run is a :class:`SweepTask` computed by an executor (lab/report/executors.py): a local process pool (the
default, ``--jobs``) or Ray (``--executor ray``); the same task function either way, so the results are the same.
A run writes only what the sweep row and a resume need (``requests.parquet``, ``summary.json``, then ``run.json``
with the hash of its configuration) into its folder ``<out>/sweep/base/p<point>_r<replication>/``, atomically; with
``--plots`` it writes the full run report with PNG plots. A re-run resumes: every run whose folder is complete and
whose hash is unchanged is read back instead of simulated (``--fresh`` redoes them). A failed run does not stop the
sweep; it is recorded with status ``failed`` and its one-line error. The sweep writes ``sweep.csv`` /
``sweep.parquet`` (one row per run: point, replication, seed, the axes, status, error, the :data:`METRICS`:
throughputs and goodput in req/s or tok/s, mean / p50 / p90 / p95 / p99 of TTFT, TPOT, ITL, E2EL and queue time in
ms, SLO attainment in %, each column's unit at the end of its name) and ``sweep_summary.csv`` (one row per point:
each metric's mean over the successful replications under the same name and its 95 % confidence half-width,
Student's t, as ``<metric>_ci95``), and ``sweep.html``: the four replace the earlier ones as one set, in one rename
of the output folder (:func:`replace_outputs`, which ``servelab search`` shares).
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lab.experiment.config import ConfigError, deep_merge, format_errors, parse_experiment, read_yaml
from lab.experiment.simulation import simulate
from lab.report.compare import RUN_META, ComparisonSpec, Run, comparison_runs, config_hash, run_dir
from lab.report.executors import Executor, PoolExecutor
from lab.report.html import write_sweep_html
from lab.report.output_folder import atomic_dir, check_out_dir, remove_stale_temps
from lab.report.run_report import write_report
from lab.report.run_summary import collect
from lab.report.table_files import json_default

# The statistics of each latency in the tables (summary.json's; p50 is the median).
LATENCY_STATS = ("mean", "p50", "p90", "p95", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2el", "queue_time")

# column -> (where in a run's summary.json, factor to the column's unit). Column names carry their unit, as
# bench_result.json's keys do: ``ttft_p99_ms`` is bench_result.json's ``p99_ttft_ms`` (summary.json: seconds).
_COLUMNS: dict[str, tuple[tuple[str, ...], float]] = {
    "request_throughput_req_s": (("request_throughput",), 1.0),
    "output_throughput_tok_s": (("output_token_throughput",), 1.0),
    "total_token_throughput_tok_s": (("total_token_throughput",), 1.0),
    "request_goodput_req_s": (("goodput",), 1.0),
    "slo_attainment_pct": (("slo_attainment",), 100.0),
    **{f"{m}_{s}_ms": ((m, "median" if s == "p50" else s), 1e3) for m in LATENCIES for s in LATENCY_STATS},
    "num_preemptions": (("num_preemptions",), 1.0),
    "num_finished": (("num_finished",), 1.0),
}
METRICS = list(_COLUMNS)
# the metrics sweep.html charts (its table of points has every one)
CHART_METRICS = ["request_throughput_req_s", "output_throughput_tok_s", "request_goodput_req_s", "slo_attainment_pct",
                 "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "e2el_p99_ms",
                 "queue_time_p99_ms", "num_preemptions"]

# Student's t quantiles for a two-sided 95 % interval, by degrees of freedom (1..30; beyond, the normal's 1.96)
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def expand_values(path: str, vals: list[Any] | dict[str, list[float]]) -> list[Any]:
    """An axis's values: a list as it is, or ``{range: [start, stop, step]}`` expanded (stop included; integers when
    all three are). Also a search's ``values`` (lab/report/search_spec.py).

    Raises:
        ValueError: a mapping other than ``{range: [start, stop, step]}``, a step <= 0, stop < start, or no values
            (the message starts with ``path``).
    """
    if isinstance(vals, dict):
        if set(vals) != {"range"} or len(vals["range"]) != 3:
            raise ValueError(f"{path}: expected a list of values or {{range: [start, stop, step]}}")
        start, stop, step = vals["range"]
        if not step > 0 or stop < start:
            raise ValueError(f"{path}: range needs step > 0 and stop >= start, got {vals['range']}")
        n = int(math.floor((stop - start) / step + 1e-9)) + 1
        vals = [start + i * step for i in range(n)]
        if all(isinstance(x, int) for x in (start, stop, step)):
            vals = [int(v) for v in vals]
    if not vals:
        raise ValueError(f"{path}: no values")
    return list(vals)


class SweepSpec(BaseModel):
    """A sweep file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    base: str | dict[str, Any]
    axes: dict[str, list[Any] | dict[str, list[float]]] = Field(min_length=1)
    mode: Literal["cross", "zip"] = "cross"
    replications: int = Field(1, ge=1)
    jobs: int = Field(1, ge=1)

    @field_validator("axes")
    @classmethod
    def _expand(cls, axes: dict) -> dict:
        return {path: expand_values(path, vals) for path, vals in axes.items()}

    @model_validator(mode="after")
    def _zip_lengths(self) -> "SweepSpec":
        if self.mode == "zip" and len({len(v) for v in self.axes.values()}) > 1:
            sizes = ", ".join(f"{k}: {len(v)}" for k, v in self.axes.items())
            raise ValueError(f"mode zip needs every axis to have as many values, got {sizes}")
        return self

    def points(self) -> list[dict[str, Any]]:
        """The axis values of every point, in order."""
        names = list(self.axes)
        combos = zip(*self.axes.values()) if self.mode == "zip" else itertools.product(*self.axes.values())
        return [dict(zip(names, c)) for c in combos]


def _nested(path: str, value: Any) -> dict:
    node: dict = {}
    top = node
    *head, last = path.split(".")
    for part in head:
        node = node.setdefault(part, {})
    node[last] = value
    return top


def load_sweep(path: str | Path, data_dir: str | Path | None = None) -> tuple[SweepSpec, ComparisonSpec, list[Run]]:
    """Read a sweep file and build every run (validated now, so a bad point fails before anything runs).

    Raises:
        ConfigError: a bad sweep file, base experiment or point (the message names the file and the run).
    """
    p = Path(path)
    raw = read_yaml(p, "sweep file")
    try:
        spec = SweepSpec.model_validate(raw or {})
    except ValidationError as e:
        raise ConfigError(format_errors(str(p), e, SweepSpec).replace("invalid experiment", "invalid sweep file")) \
            from None
    if isinstance(spec.base, dict):
        base = dict(spec.base)
    else:
        base_path = (p.resolve().parent / spec.base).resolve()
        base = read_yaml(base_path, "base experiment")
        if not isinstance(base, dict):
            raise ConfigError(f"{base_path}: expected a YAML mapping")
    seed = int(base.get("seed", 0))
    variants = {}
    for i, point in enumerate(spec.points()):
        _check_point(p, i, point, base)
        for k in range(spec.replications):
            over: dict = {"seed": seed + k}
            for field, value in point.items():
                over = deep_merge(over, _nested(field, value))
            variants[f"p{i:04d}_r{k}"] = over
    cmp = ComparisonSpec.model_validate({"name": spec.name, "jobs": spec.jobs, "plots": False, "base": base,
                                         "traces": {"base": {}},
                                         "groups": {"sweep": {"traces": ["base"], "variants": variants}}})
    dd = Path(data_dir).resolve() if data_dir is not None else None  # absolute: workers may run elsewhere
    return spec, cmp, comparison_runs(cmp, p, dd)


def _check_point(path: Path, index: int, point: dict[str, Any], base: dict) -> None:
    """Validate one point's axis values on the base experiment, so a bad axis is reported in the sweep's terms:
    ``sweep.yaml [point 0: engine.max_num_seq=32]: engine.max_num_seq: unknown field; did you mean ...``.

    Raises:
        ConfigError: the point is not a valid experiment.
    """
    over: dict = {}
    for field, value in point.items():
        over = deep_merge(over, _nested(field, value))
    where = ", ".join(f"{k}={v}" for k, v in point.items())
    parse_experiment(deep_merge(base, over), f"{path} [point {index}: {where}]", path.resolve().parent)


@dataclass(frozen=True)
class SweepTask:
    """One run as it crosses to a worker: the run, its folder (absolute), the hash of its configuration (computed
    here, so a worker's environment cannot change it) and whether it writes the full report with PNG plots."""

    run: Run
    folder: str
    config_hash: str
    plots: bool = False


@dataclass
class SweepState:
    """Where a sweep stands, handed to the progress display after every change (and at least every second).

    Counts are runs: ``reused`` (complete before this sweep started), ``done`` (simulated now), ``failed``,
    ``running`` (submitted and not finished, at most the executor's slots). ``elapsed_s`` since the first run was
    submitted; ``eta_s`` = elapsed / runs finished now x runs left (None until one finished). ``last`` is the
    variant that just finished (None on a tick) with its ``last_error``."""

    total: int
    reused: int = 0
    done: int = 0
    failed: int = 0
    running: int = 0
    elapsed_s: float = 0.0
    eta_s: float | None = None
    last: str | None = None
    last_error: str | None = None
    last_wall_s: float | None = None

    @property
    def finished(self) -> int:
        """Runs with an outcome: reused, done or failed."""
        return self.reused + self.done + self.failed


def simulate_task(task: SweepTask) -> dict:
    """Worker (any executor): simulate one run and write its folder atomically (lab/report/output_folder.py
    ``atomic_dir``): ``requests.parquet``, ``summary.json`` and, last, ``run.json`` (config hash, wall time in s,
    plots); with ``task.plots`` the full run report (also ``steps.parquet``, ``report.md``, PNG plots).

    Returns:
        ``{"summary": ..., "wall_s": ...}``, the summary as ``summary.json`` reads back (what a resumed run reads).

    Raises:
        whatever the simulation raises (the run's folder is then left as it was).
    """
    run = task.run
    exp = parse_experiment(run.data, run.source, Path(run.base_dir), run.data_dir)
    t0 = time.perf_counter()
    with simulate(exp) as result:
        with atomic_dir(Path(task.folder)) as tmp:
            if task.plots:
                write_report(result, tmp, plots=True, atomic=False)
            else:
                req, summary = collect(result)
                req.to_parquet(tmp / "requests.parquet", index=False)
                (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=json_default))
            wall = time.perf_counter() - t0
            (tmp / RUN_META).write_text(json.dumps({"config_hash": task.config_hash, "wall_s": wall,
                                                    "plots": task.plots}))
    del result
    _collect_cycles()
    return {"summary": json.loads((Path(task.folder) / "summary.json").read_text()), "wall_s": wall}


_heap_frozen = False


def _collect_cycles() -> None:
    """Free the run just finished. A run's objects form reference cycles, which the generational collector frees
    too late: without this a worker grew by ~7 MB per run (experiments/sweep_200.yaml). A full collection scans every
    live object (~90 ms here), so the first call also freezes what survives (modules, caches: gc.freeze) and later
    calls scan only what the runs since created (under 1 ms)."""
    global _heap_frozen
    gc.collect()
    if not _heap_frozen:
        gc.freeze()
        _heap_frozen = True


def reuse_task(task: SweepTask) -> dict | None:
    """The result of a run whose folder is complete (``run.json`` written last, ``summary.json``) with the same
    configuration hash, and with plots if the task wants them; None otherwise. Raises nothing."""
    d = Path(task.folder)
    try:
        meta = json.loads((d / RUN_META).read_text())
        if not isinstance(meta, dict) or meta.get("config_hash") != task.config_hash:
            return None
        if task.plots and not meta.get("plots", False):
            return None
        return {"summary": json.loads((d / "summary.json").read_text()), "wall_s": float(meta.get("wall_s", 0.0))}
    except (OSError, ValueError, TypeError):
        return None


def _metric(summary: dict, name: str) -> Any:
    """One METRICS column from a run's summary (``summary.json``) in the column's unit: ``ttft_p99_ms`` is
    ``summary["ttft"]["p99"]`` x 1000, ``slo_attainment_pct`` is ``summary["slo_attainment"]`` x 100; None where
    the summary has no value (no SLO: no goodput; no finished request: no latency)."""
    path, factor = _COLUMNS[name]
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return None if value is None else value * factor


def sweep_tables(spec: SweepSpec, runs: list[Run], results: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per run: point, replication, seed, the axes as columns, status ``ok``/``failed``, the one-line
    error, the :data:`METRICS` columns; one row per point: each metric's mean over the point's successful
    replications under the metric's own name and its 95 % confidence half-width as ``<metric>_ci95``, in the
    metric's unit). ``results[i]`` belongs to ``runs[i]``: ``{"summary"}`` or ``{"error"}``."""
    points = spec.points()
    rows = []
    for run, res in zip(runs, results):
        i, k = run.variant[1:].split("_r")
        summary = res.get("summary")
        row = {"point": int(i), "replication": int(k), "seed": run.data.get("seed"), **points[int(i)],
               "status": "ok" if summary is not None else "failed", "error": res.get("error")}
        row.update({m: _metric(summary, m) if summary is not None else None for m in METRICS})
        rows.append(row)
    per_run = pd.DataFrame(rows).sort_values(["point", "replication"]).reset_index(drop=True)
    agg = []
    for i, grp in per_run.groupby("point", sort=True):
        ok = grp[grp["status"] == "ok"]
        row = {"point": i, **points[int(i)], "replications": len(ok), "failed": len(grp) - len(ok)}
        for m in METRICS:
            vals = pd.to_numeric(ok[m], errors="coerce").dropna()
            row[m] = float(vals.mean()) if len(vals) else None
            row[f"{m}_ci95"] = (_T95[min(len(vals) - 2, 29)] * float(vals.std(ddof=1)) / math.sqrt(len(vals))
                                if len(vals) > 1 else None)
        agg.append(row)
    return per_run, pd.DataFrame(agg)


def sweep_tasks(runs: list[Run], out_dir: Path, plots: bool = False) -> list[SweepTask]:
    """A task per run, its folder ``<out_dir>/sweep/base/<variant>`` made absolute.

    Raises:
        OutputDirError: ``out_dir`` is a file or a folder holding files no sweep writes, or a run folder holds files
            no servelab run writes (checked here, before anything runs).
    """
    out_dir = check_out_dir(Path(out_dir))
    tasks = []
    for r in runs:
        folder = check_out_dir(run_dir(out_dir, r))
        remove_stale_temps(folder)
        tasks.append(SweepTask(run=r, folder=str(folder), config_hash=config_hash(r), plots=plots))
    return tasks


def run_sweep(spec: SweepSpec, cmp: ComparisonSpec, runs: list[Run], out_dir: Path, jobs: int | None = None,
              fresh: bool = False, progress: Callable[[SweepState], None] | None = None,
              executor: Executor | None = None, plots: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run (or resume) the sweep and write ``sweep.csv``, ``sweep.parquet``, ``sweep_summary.csv`` and
    ``sweep.html`` as one set (:func:`replace_outputs`: the earlier set or the new one, never a mix).

    Every run whose folder is complete with an unchanged configuration is reused (``fresh``: none); the others go
    to ``executor`` (default: a local process pool of ``jobs`` workers, else the file's ``jobs``). A failed run
    does not stop the others: it gets status ``failed`` and its one-line error in the table
    (``per_run.attrs["failed"]``: ``[(variant, error)]``; ``per_run.attrs["reused"]``: runs read back).

    Raises:
        OutputDirError: a bad ``out_dir`` (before anything runs). ExecutorError: the executor cannot start or broke
            down. OSError: a table cannot be written (the earlier set is then left as it was).
        KeyboardInterrupt / SystemExit (SIGTERM): the workers are stopped first; complete runs stay for a resume.
    """
    tasks = sweep_tasks(runs, out_dir, plots)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    results: list[dict | None] = [None if fresh else reuse_task(t) for t in tasks]
    todo = [i for i, res in enumerate(results) if res is None]
    state = SweepState(total=len(tasks), reused=len(tasks) - len(todo))
    if progress:
        progress(state)
    if todo:
        _execute(executor or PoolExecutor(jobs or spec.jobs), [tasks[i] for i in todo], todo, results, state,
                 progress)
    per_run, summary = sweep_tables(spec, runs, results)

    def write(folder: Path) -> None:
        per_run.to_csv(folder / "sweep.csv", index=False)
        per_run.to_parquet(folder / "sweep.parquet", index=False)
        summary.to_csv(folder / "sweep_summary.csv", index=False)
        write_sweep_html(folder, spec.name, spec.axes, summary, CHART_METRICS, cmp.base.get("slo"), len(runs),
                         table_metrics=METRICS)

    replace_outputs(Path(out_dir), write, keep=("sweep",))
    per_run.attrs["reused"] = state.reused
    per_run.attrs["failed"] = [(runs[i].variant, res["error"]) for i, res in enumerate(results) if "error" in res]
    return per_run, summary


def _execute(executor: Executor, tasks: list[SweepTask], ids: list[int], results: list, state: SweepState,
             progress: Callable[[SweepState], None] | None) -> None:
    """Run ``tasks`` on ``executor``, filling ``results[ids[j]]`` and ``state`` as each finishes."""
    t0 = time.perf_counter()
    with executor:
        slots = executor.slots
        state.running = min(slots, len(tasks))
        for batch in executor.map_unordered(simulate_task, tasks):
            state.last = state.last_error = state.last_wall_s = None
            for out in batch:
                task = tasks[out.index]
                err = out.error or _folder_missing(task)
                results[ids[out.index]] = {"error": err} if err else out.value
                state.failed += err is not None
                state.done += err is None
                state.last, state.last_error = task.run.variant, err
                state.last_wall_s = None if err else out.value["wall_s"]
            left = len(tasks) - state.done - state.failed
            state.running = min(slots, left)
            state.elapsed_s = time.perf_counter() - t0
            finished = state.done + state.failed
            state.eta_s = state.elapsed_s / finished * left if finished else None
            if progress:
                progress(state)


def _folder_missing(task: SweepTask) -> str | None:
    """An error when a run reported success but its folder is not on this machine (a Ray node writing to a folder
    this machine does not share), else None."""
    if (Path(task.folder) / RUN_META).is_file():
        return None
    return (f"the run finished but {task.folder} is not on this machine: the output folder must be on a file "
            "system every worker shares")


def replace_outputs(out_dir: Path, write: Callable[[Path], None], keep: Sequence[str] = ()) -> None:
    """Replace the output folder ``out_dir`` by what ``write(folder)`` writes into a new folder, as one set: one
    rename (lab/report/output_folder.py ``atomic_dir``, as ``servelab run`` writes its folder), so that a failure or a
    kill, even ``kill -9``, leaves the earlier folder whole or the new one, never a mix of old and new files.

    The subfolders named in ``keep`` (the run records a re-run resumes from: a sweep's ``sweep``, a search's
    ``probes``) are carried into the new folder before the rename, their files as hard links (copies where the
    file system has none, or files on another device), so that the earlier folder holds them until the rename and
    the new one from it on; temporary folders of killed runs in them are left behind. Anything else of the earlier
    folder is gone after the rename.

    Raises:
        OutputDirError: ``out_dir`` is a file, or a folder holding files that no servelab command writes.
        OSError: a file cannot be written or linked; whatever ``write`` raises. ``out_dir`` is then left as it was.
    """
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        write(tmp)
        for name in keep:
            if (out_dir / name).is_dir():
                shutil.copytree(out_dir / name, tmp / name, symlinks=True, copy_function=_link_or_copy,
                                ignore=shutil.ignore_patterns(".*.tmp-*", ".*.old-*"))


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` at ``dst``, or copy it (with its times) where a link cannot be made. Raises OSError."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
