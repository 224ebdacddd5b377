"""Capacity search: the largest load a deployment serves within an SLO, the fewest instances that serve a load, or
the value of a field that maximises goodput, and candidate deployments ranked by the GPUs they need
(``servelab search FILE.yaml``; docs/search.md).

A search file names a base experiment, what to find and the SLO::

    base: demo.yaml                      # an experiment file (relative to this file), or an inline mapping
    find: max_rate                       # max_rate | max_concurrency | min_instances | max_goodput
    low: 1                               # the bracket searched (the bisections)
    high: 64
    tolerance: 0.02                      # max_rate: relative width of the final bracket
    slo: {ttft_s: 0.5, tpot_s: 0.05, percentile: 90}   # p90 TTFT <= 500 ms and p90 TPOT <= 50 ms
    # or {ttft_s: 0.5, tpot_s: 0.05, attainment: 0.9}: >= 90 % of requests meet every SLO (DistServe)
    # or {itl_s: 0.1, queue_s: 2.0, percentile: 99, percentiles: {queue: 50}}: p99 ITL (TBT) <= 100 ms and median
    #    scheduling delay <= 2 s (Sarathi-Serve)
    jobs: 2                              # probes at once (--jobs)
    candidates:                          # optional: the search runs once per candidate, then ranks them
      tp2: {hardware: {tensor_parallel_size: 2}}
      tp4: {hardware: {tensor_parallel_size: 4}}

``find: max_goodput`` instead tries every value of ``field`` in ``values`` (a list or ``{range: [start, stop,
step]}``) and answers the one with the most goodput (requests per second meeting every per-request bound).

Each probe is one simulation of the base experiment with the searched field set (``workload.rate``,
``workload.concurrency`` or ``cluster.num_instances``, or ``field``). The bisections assume that the SLO, once
missed, stays missed as load grows (or as instances are removed): ``max_rate`` bisects until the bracket is within
``tolerance`` of its lower end, the integer searches exactly. A probe counts as meeting the SLO only if every
request finished (none rejected or unfinished) and, unless ``require_stable_queue: false``, its backlog was not
growing over the second half of the arrivals (lab/report/search_judge.py ``queue_growth``).

Up to ``jobs`` probes run at once on an executor (:func:`run_search`; lab/report/executors.py): the candidates'
searches side by side, a ``max_goodput`` search's values, and a bisection's next probes ahead of its current one
(both bracket ends; then the probes each outcome of the probes in flight would ask for next). The answer does not
depend on ``jobs``: the bisection takes the same path, and probes it did not need are listed as such.

A search that cannot apply to its experiment (``min_instances`` on a disaggregated deployment, ``max_rate`` on a
trace that keeps its own arrival times, a bracket end or value the experiment refuses, ...) is refused before
anything is simulated (lab/report/search_spec.py ``check_search``). Each probe is a sweep run (lab/report/sweep.py
``simulate_task``): its folder ``<out>/probes/<candidate>/<field>=<value>/`` is written atomically with ``run.json``
(the hash of the probe's configuration) last, and a re-run reuses every probe whose folder is complete and whose
hash is unchanged (``reuse_task``; ``fresh`` redoes them), judging it again from its ``requests.parquet`` and
``summary.json``. ``search.md`` and ``search.json`` replace the earlier ones as one set, in one rename of the output
folder (``replace_outputs``).

This module runs a search; the search file and its refusals are lab/report/search_spec.py, the judging of a probe
search_judge.py, the bisection and the grid search_plan.py, and search.md / search.json search_report.py.
"""


from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from lab.experiment.config import ConfigError, parse_experiment
from lab.report.compare import Run, config_hash, run_dir
from lab.report.executors import Executor, PoolExecutor, TaskOutcome
from lab.report.output_folder import OutputDirError, check_out_dir
from lab.report.search_judge import Probe, eligible, meets, probe_figures
from lab.report.search_plan import SearchPlan
from lab.report.search_report import SearchResult, value_label, write_search
from lab.report.search_spec import SearchSpec, candidate_experiments, check_search, deployment_gpus, with_field
from lab.report.sweep import SweepTask, reuse_task, simulate_task


@dataclass
class SearchState:
    """Where a search stands, handed to the progress display after every probe and at least every second.

    ``finished`` probes have a result (``simulated`` now or ``reused``); ``running`` names those in flight
    (``candidate: field=value``); ``remaining`` is the most probes the search may still need, those in flight
    included (a bisection's longest path from where it stands; every value left for ``max_goodput``), so
    ``finished + remaining`` bounds the total. ``eta_s`` bounds the time left from above: remaining x the mean
    wall time of the probes simulated so far / the probes that can run at once (None until one was simulated).
    ``last`` is the candidate and probe that just finished (None on a tick)."""

    finished: int = 0
    simulated: int = 0
    reused: int = 0
    running: list[str] = field(default_factory=list)
    remaining: int = 0
    elapsed_s: float = 0.0
    eta_s: float | None = None
    last: tuple[str, Probe] | None = None

    @property
    def total(self) -> int:
        """At most this many probes in all."""
        return self.finished + self.remaining


def _folder_value(value: Any) -> str:
    """How a value names its probe's folder: ``repr`` for numbers (``workload.rate=18.5``), the name itself for a
    name (``policy.scheduler=sarathi``)."""
    return value if isinstance(value, str) else repr(value)


def _probe_task(spec: SearchSpec, where: Path, out_dir: Path, name: str, data: dict, base_dir: Path, value: Any,
                data_dir: str | None) -> SweepTask:
    """The sweep task of one probe, its folder ``<out_dir>/probes/<name>/<field>=<value>``."""
    dotted = spec.dotted
    run = Run(group="probes", trace=name, variant=f"{dotted}={_folder_value(value)}",
              data=with_field(data, dotted, value), source=f"{where} [{name}: {dotted}={value}]",
              base_dir=str(base_dir), data_dir=data_dir)
    return SweepTask(run=run, folder=str(check_out_dir(run_dir(out_dir, run))), config_hash=config_hash(run))


def _judge(spec: SearchSpec, task: SweepTask, value: Any, reused: bool, wall_s: float | None) -> Probe:
    """A probe from its complete folder: its figures from ``requests.parquet`` and ``summary.json``, and whether
    it met the SLO (``max_goodput``: whether it is eligible)."""
    folder = Path(task.folder)
    summary = json.loads((folder / "summary.json").read_text())
    figures = probe_figures(pd.read_parquet(folder / "requests.parquet"), spec.slo, summary, spec.max_backlog_growth)
    judge = eligible if spec.find == "max_goodput" else meets
    return Probe(value, judge(figures, spec.slo, spec.require_stable_queue), figures, reused, True, wall_s)


def run_search(spec: SearchSpec, where: Path, out_dir: Path, data_dir: str | Path | None = None,
               on_probe: Callable[[str, Probe], None] | None = None, fresh: bool = False, jobs: int | None = None,
               overrides: dict | None = None, progress: Callable[[SearchState], None] | None = None,
               executor: Executor | None = None) -> list[SearchResult]:
    """Run the search for every candidate (or the base alone), write ``search.md`` and ``search.json`` into
    ``out_dir`` as one set (:func:`write_search`), and return the answers, cheapest first (fewest GPUs, then the
    larger answer for a max search, the most goodput for ``max_goodput``).

    The probes run on ``executor`` (lab/report/executors.py; default: a local process pool of ``jobs`` workers,
    else the file's ``jobs``; 1: in this process), as many at once as it has slots: each time one finishes, the
    free slots take the probes most needed over all candidates: each candidate's next probe first, then the probes
    its next decisions may ask for (:meth:`SearchPlan.ahead`). The answers do not depend on ``jobs``. ``overrides``
    (``--set``: nested experiment fields) apply to every candidate, over its own overrides.

    Every probe's folder is ``<out_dir>/probes/<candidate>/<field>=<value>/``; a probe whose folder is complete
    with an unchanged configuration is reused (``Probe.reused``) unless ``fresh``, so a search interrupted or
    re-run simulates only the probes it has not completed. ``on_probe(candidate, probe)`` is called after each,
    ``progress(state)`` after each and at least every second while probes run (:class:`SearchState`).

    Raises:
        OutputDirError: ``out_dir`` is a file or holds files no servelab command writes (before any probe).
        ConfigError: the base or a candidate is not a valid experiment, or the search cannot apply to it
            (:func:`check_search`; before any probe), or the experiment refuses a value inside the bracket.
        KeyboardInterrupt / SystemExit (SIGTERM): the workers are stopped; the probes complete by then are kept for
            a re-run; the earlier outputs are left as they were. Whatever a probe raises other than a deployment
            that cannot be built (PolicyError, WorkloadError, ...).
    """
    out_dir = check_out_dir(Path(out_dir))
    check_search(spec, where, data_dir, overrides)
    dd = str(Path(data_dir).resolve()) if data_dir is not None else None
    cands, base_dir = candidate_experiments(spec, where, overrides)
    search = _SearchRun(spec, where, out_dir, base_dir, dd, fresh, on_probe, progress)
    search.plans = [SearchPlan(spec, name, data) for name, data in cands]
    search.run(executor or PoolExecutor(max(1, jobs or spec.jobs)))
    results = sorted((_result(spec, plan, base_dir, dd) for plan in search.plans),
                     key=lambda r: _cheapest_first(spec, r))
    write_search(spec, results, out_dir)
    return results


class _SearchRun:
    """One run of a search: every candidate's plan, the probes in flight on the executor (by task id) and the
    :class:`SearchState` the progress display is handed."""

    def __init__(self, spec: SearchSpec, where: Path, out_dir: Path, base_dir: Path, data_dir: str | None,
                 fresh: bool, on_probe: Callable[[str, Probe], None] | None,
                 progress: Callable[[SearchState], None] | None) -> None:
        self.spec, self.where, self.out_dir, self.base_dir, self.data_dir = spec, where, out_dir, base_dir, data_dir
        self.fresh, self.on_probe, self.progress = fresh, on_probe, progress
        self.plans: list[SearchPlan] = []
        self.started: dict[int, tuple[SearchPlan, Any, SweepTask, float]] = {}  # task id -> the probe in flight
        self.state = SearchState()
        self.slots = 1
        self.t0 = time.perf_counter()

    def run(self, executor: Executor) -> None:
        """Probe until every plan is complete: fill the free slots, then take the outcomes as they come (the state
        shown at least every second)."""
        with executor:
            self.slots = executor.slots
            self.update(None)
            while True:
                self.start_probes(executor)
                if not self.started:
                    return
                finished = executor.finished(timeout=1.0)
                if not finished:
                    self.update(None)
                for outcome in finished:
                    self.take(outcome)

    def start_probes(self, executor: Executor) -> None:
        """Fill the free slots with the probes most needed; a probe complete in its folder from an earlier run is
        judged from it instead (unless ``fresh``)."""
        spec = self.spec
        while len(self.started) < self.slots:
            chosen = self.pick()
            if chosen is None:
                return
            plan, v = chosen
            task = _probe_task(spec, self.where, self.out_dir, plan.name, plan.data, self.base_dir, v, self.data_dir)
            plan.submitted.append(v)
            if not self.fresh and reuse_task(task) is not None:
                self.record(plan, _judge(spec, task, v, True, None))
                continue
            plan.running.add(v)
            self.started[executor.submit(simulate_task, task)] = (plan, v, task, time.perf_counter())
            self.update(None)

    def take(self, outcome: TaskOutcome) -> None:
        """Judge a finished probe, or record why it cannot run: a deployment that cannot be built is a miss for a
        grid value and ends a bisection's candidate.

        Raises:
            ConfigError, OutputDirError: the search file's or the output folder's fault. Whatever else the probe
                raised, other than a ValueError (a deployment that cannot be built).
        """
        plan, v, task, t_start = self.started.pop(outcome.index)
        plan.running.discard(v)
        try:
            outcome.result()
        except (ConfigError, OutputDirError):
            raise  # the search file's or the output folder's fault, not a deployment that cannot run
        except ValueError as e:  # the candidate cannot be built (a model that does not fit, a layout)
            why = "; ".join(line.strip() for line in str(e).splitlines())
            if plan.grid and not plan.error:  # one value that cannot run: not the answer, the rest go on
                self.record(plan, Probe(v, False, {"error": why}, False, True, time.perf_counter() - t_start))
            elif not plan.error:
                plan.error = why
                self.update(None)
            return
        if not plan.error:
            self.record(plan, _judge(self.spec, task, v, False, time.perf_counter() - t_start))

    def pick(self) -> tuple[SearchPlan, Any] | None:
        """The probe most needed over all candidates and not started: the lowest rank in its plan's
        :meth:`SearchPlan.ahead`, the earlier candidate on a tie; None when none is left to start."""
        best = None
        for i, plan in enumerate(self.plans):
            if plan.complete:
                continue
            for rank, v in enumerate(plan.ahead(self.slots)):
                if v not in plan.known and v not in plan.running:
                    if best is None or (rank, i) < best[0]:
                        best = ((rank, i), plan, v)
                    break
        return None if best is None else (best[1], best[2])

    def record(self, plan: SearchPlan, probe: Probe) -> None:
        """A probe's outcome, known now: into its plan and the counts, then shown."""
        plan.known[probe.value] = probe.ok
        plan.probes[probe.value] = probe
        self.state.finished += 1
        self.state.reused += probe.reused
        self.state.simulated += not probe.reused
        if self.on_probe is not None:
            self.on_probe(plan.name, probe)
        self.update((plan.name, probe))

    def update(self, last: tuple[str, Probe] | None) -> None:
        """Bring the state up to date (elapsed, probes in flight, the most left, the ETA) and hand it on."""
        state, spec, plans = self.state, self.spec, self.plans
        state.last = last
        state.elapsed_s = time.perf_counter() - self.t0
        state.running = [f"{plan.name}: {spec.dotted}={value_label(v, plan.probes)}"
                         for plan, v, _, _ in self.started.values()]
        state.remaining = sum(p.remaining() for p in plans)
        walls = [p.wall_s for plan in plans for p in plan.probes.values() if p.wall_s is not None]
        if walls:
            active = sum(not p.complete for p in plans)
            width = max(1, min(self.slots, state.remaining if spec.find == "max_goodput" else active))
            state.eta_s = sum(walls) / len(walls) * state.remaining / width
        if self.progress is not None:
            self.progress(state)


def _cheapest_first(spec: SearchSpec, r: SearchResult) -> tuple:
    """Sort key of the answers: an answer before none, fewer GPUs first, then the larger answer for a max search
    (the smaller for ``min_instances``), the most goodput for ``max_goodput``."""
    gpus = r.gpus if r.gpus is not None else math.inf
    if spec.rank == "per_gpu":  # DistServe: the most goodput (or rate) per GPU first
        return (r.value is None or r.per_gpu is None, -(r.per_gpu or 0.0), gpus)
    if spec.find == "max_goodput":
        return (r.value is None, gpus, -(r.goodput or 0.0))
    return (r.value is None, gpus, -(r.value or 0) if spec.find != "min_instances" else (r.value or 0))


def _result(spec: SearchSpec, plan: SearchPlan, base_dir: Path, data_dir: str | None) -> SearchResult:
    """A candidate's answer, its GPUs and its probes: the path in order, then the probes simulated ahead."""
    if plan.error:
        return SearchResult(plan.name, None, None, [plan.probes[v] for v in plan.submitted if v in plan.probes],
                            plan.error)
    path = plan.path()
    for v, p in plan.probes.items():
        p.needed = v in path or spec.find == "max_goodput"
    probes = [plan.probes[v] for v in path] + [plan.probes[v] for v in plan.submitted
                                               if v in plan.probes and v not in path]
    value = plan.answer()
    result = SearchResult(plan.name, value, None, probes)
    if value is not None:
        exp = parse_experiment(with_field(plan.data, spec.dotted, value), spec.name, base_dir, data_dir)
        result.gpus = deployment_gpus(exp)
        result.goodput = plan.probes[value].figures.get("goodput") if value in plan.probes else None
        per = result.goodput if spec.find == "max_goodput" else value
        result.per_gpu = per / result.gpus if per is not None and result.gpus else None
    return result
