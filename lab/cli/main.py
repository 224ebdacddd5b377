"""The ``servelab`` command line (typer).

Commands import the simulator (numpy, pandas, the cost model, the policies) inside their own bodies, on purpose:
``servelab --help``, ``servelab catalog`` and a one-line config error then answer in a fraction of a second
instead of paying every command's imports.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="servelab: trace-driven simulator and policy lab for LLM inference serving.")
# Piped or captured output is not wrapped at Rich's 80-column fallback: names in tables stay whole.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

EXPERIMENT_ARG = typer.Argument(..., help="experiment YAML file", exists=False)
OUT_OPT = typer.Option(None, "--out", "-o", help="output folder (default reports/<experiment name>/)")
NAMED_OUT_OPT = typer.Option(None, "--out", "-o", help="output folder (default reports/<name>/, the file's name field)")
DATA_OPT = typer.Option(None, "--data-dir", help="shared data folder (default $SERVELAB_DATA_DIR or ../shared/data)")
NO_PLOTS_OPT = typer.Option(False, "--no-plots", help="write tables only, no PNG plots")
QUIET_OPT = typer.Option(False, "--quiet", "-q", help="no progress bar")
RUN_QUIET_OPT = typer.Option(False, "--quiet", "-q", help="print only the line naming the output folder (no "
                             "progress bar, no tables); errors and notes still go to stderr")
SET_OPT = typer.Option(None, "--set", help="override a field, e.g. --set engine.max_num_seqs=64 (repeatable)")


def _print_version(value: bool) -> None:
    """``--version``: print the installed package's version (pyproject.toml's, from its metadata) and exit 0."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("servelab")
    except PackageNotFoundError:
        v = "unknown (the servelab package is not installed)"
    console.print(f"servelab {v}", highlight=False, markup=False)
    raise typer.Exit()


@app.callback()
def _app_options(show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                                   help="print the version and exit")) -> None:
    """servelab: trace-driven simulator and policy lab for LLM inference serving."""


def _fail(msg: str) -> None:
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)  # one greppable line
    raise typer.Exit(2)


def _load(path: Path, data_dir: Optional[Path], sets: Optional[list[str]]):
    from lab.experiment.config import ConfigError, load_experiment, parse_set_option

    try:
        overrides = parse_set_option(sets or [])
        exp = load_experiment(path, data_dir, overrides)
    except ConfigError as e:
        _fail(str(e))
    if "gpu" in (overrides.get("hardware") or {}):
        _note_pinned_limits(exp, overrides)
    _note_slo_units(exp.slo)
    return exp


def _note_slo_units(slo) -> None:
    """A note on stderr for SLO bounds that look like milliseconds in a seconds field (the run goes on)."""
    from lab.experiment.config import implausible_slo_bounds

    for note in implausible_slo_bounds(slo):
        err_console.print(f"note: {note}", highlight=False)


def _note_pinned_limits(exp, overrides: dict) -> None:
    """``--set hardware.gpu=...`` keeps engine limits the file pins for another GPU: say so, with vLLM's defaults
    for the new GPU (lab/experiment/simulation.py ``batch_defaults``)."""
    from lab.costmodel.hardware import load_hardware
    from lab.experiment.simulation import batch_defaults

    set_engine = overrides.get("engine") or {}
    mbt, seqs = batch_defaults(load_hardware(exp.hardware.gpu))
    for field, default in (("max_num_batched_tokens", mbt), ("max_num_seqs", seqs)):
        value = getattr(exp.engine, field)
        if value is not None and field not in set_engine and value != default:
            err_console.print(f"note: engine.{field} stays {value} as the file sets it; vLLM's default for "
                              f"{exp.hardware.gpu} is {default} (--set engine.{field}=... to change it)",
                              highlight=False)


def _simulate(exp, show_progress: bool = True):
    from lab.cluster.cluster import RouterError
    from lab.core.sched_api import SchedulerContractError
    from lab.experiment.simulation import build_requests, simulate
    from lab.workload.loaders import WorkloadError
    from policies import PolicyError

    try:
        reqs = build_requests(exp)
    except (WorkloadError, ValueError) as e:
        _fail(f"{exp.source}: {e}")
    try:
        if show_progress and exp.simulation.progress:
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=err_console, transient=True) as bar:
                task = bar.add_task(f"simulating {exp.name}", total=len(reqs))
                step = max(1, len(reqs) // 200)

                def progress(done: int, total: int) -> None:
                    if done % step == 0 or done == total:
                        bar.update(task, completed=done)

                return simulate(exp, reqs, progress)
        return simulate(exp, reqs)
    except (PolicyError, FileNotFoundError, ValueError, SchedulerContractError, RouterError) as e:
        _fail(f"{exp.source}: {e}")


def _out_dir(exp, out: Optional[Path], set_: Optional[list[str]] = None) -> Path:
    """``--out``, else ``output.dir``, else ``reports/<name>``; with ``--set`` overrides and no explicit folder the
    default gets their values as a suffix, so an override never replaces the base experiment's report."""
    if out is not None:
        return out
    if exp.output.dir:
        return exp.path(exp.output.dir, "output.dir")
    if set_:
        import re

        suffix = re.sub(r"[^A-Za-z0-9_.=-]+", "_", "+".join(set_))[:120]
        return Path("reports") / f"{exp.name}+{suffix}"
    return Path("reports") / exp.name


def _print_summary(summary: dict, out_dir: Path) -> None:
    """The run's latency table, the offered and achieved load (over the arrival window and over the whole
    duration, lab/report/run_markdown.py ``achieved_words``) and the line naming the output folder."""
    from lab.report.run_markdown import achieved_words

    t = Table(title=f"{summary['experiment']}: {summary['num_finished']}/{summary['num_requests']} finished, "
                    f"{summary['num_rejected']} rejected, {summary['num_unfinished']} unfinished")
    for c in ("metric (ms)", "mean", "median", "p90", "p99"):
        t.add_column(c, justify="right")
    for m in ("ttft", "tpot", "itl", "e2el"):
        s = summary[m]
        t.add_row(m.upper(), *("–" if s[k] is None else f"{s[k] * 1000:.1f}" for k in ("mean", "median", "p90", "p99")))
    console.print(t)
    console.print(f"offered: {summary.get('offered_load', '')}." + achieved_words(summary, " ")
                  + f" Output {summary['output_token_throughput']:.0f} tok/s over {summary['duration_s']:.1f} s; "
                  f"{summary['num_preemptions']} preemptions; simulated in "
                  f"{summary['simulation']['wall_time_s']:.2f} s wall", highlight=False, soft_wrap=True)
    _print_wrote(out_dir)


def _print_wrote(out_dir: Path) -> None:
    """The one line naming the output folder and the files in it (all ``-q`` prints)."""
    files = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    console.print(f"wrote {out_dir}/ ({', '.join(files)})", highlight=False, markup=False, soft_wrap=True)


@app.command()
def run(experiment: Path = EXPERIMENT_ARG, out: Optional[Path] = OUT_OPT, data_dir: Optional[Path] = DATA_OPT,
        set_: Optional[list[str]] = SET_OPT, no_plots: bool = NO_PLOTS_OPT,
        quiet: bool = RUN_QUIET_OPT,
        save_detailed: bool = typer.Option(
            False, "--save-detailed", help="as vllm bench serve: bench_result.json with the per-request lists "
            "(ttfts, itls: each request's token gaps, ...; default: the file's output.save_detailed, else the "
            "aggregates only)"),
        percentile_metrics: Optional[str] = typer.Option(
            None, "--percentile-metrics", help="as vllm bench serve: metrics given percentiles, e.g. ttft,tpot,itl "
            "(default: the file's output.percentile_metrics)"),
        metric_percentiles: Optional[str] = typer.Option(
            None, "--metric-percentiles", help="as vllm bench serve: percentiles, e.g. 90,99 "
            "(default: the file's output.metric_percentiles)")) -> None:
    """Run an experiment and write its report (into a temporary folder that replaces the output folder at the end)."""
    from lab.report.output_folder import OutputDirError
    from lab.report.run_report import write_outputs

    exp = _load(experiment, data_dir, set_)
    _apply_percentile_options(exp, experiment, percentile_metrics, metric_percentiles)
    if save_detailed:  # what is reported, not what runs: the report folder stays
        exp.output = exp.output.model_copy(update={"save_detailed": True})
    out_dir = _checked_out_dir(exp, out, set_)  # before simulating: --out at a file fails at once
    result = _simulate(exp, not quiet)
    try:
        written = write_outputs(result, out_dir, plots=exp.output.plots and not no_plots)
    except OutputDirError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"{out_dir}: cannot write the outputs: {e}")
    finally:
        result.cleanup()  # the step log's spill folder
    if quiet:
        _print_wrote(out_dir)
        return
    _print_summary(written.summary, out_dir)
    _print_vllm_block(exp, written.bench)


def _apply_percentile_options(exp, path: Path, metrics: Optional[str], percentiles: Optional[str]) -> None:
    """``--percentile-metrics`` / ``--metric-percentiles`` replace the experiment's output fields (checked as the
    file's fields are; a bad value is a one-line error). They change what is reported, not the run, so unlike
    ``--set`` they keep the report folder."""
    from pydantic import ValidationError

    from lab.experiment.config import OutputConfig

    if metrics is None and percentiles is None:
        return
    fields = exp.output.model_dump()
    fields.update({k: v for k, v in (("percentile_metrics", metrics), ("metric_percentiles", percentiles))
                   if v is not None})
    try:
        exp.output = OutputConfig.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        _fail(f"{path}: --{str(err['loc'][0]).replace('_', '-')}: {err['msg'].removeprefix('Value error, ')}")


def _print_vllm_block(exp, bench: dict) -> None:
    """The ``vllm bench serve`` summary block of the run, from bench_result.json's mapping as the run wrote it
    (kept in memory: the file is not read back)."""
    from lab.report.vllm_format import serving_result_block

    block = serving_result_block(bench, exp.output.metrics(), exp.output.percentiles())
    console.print(block, highlight=False, markup=False)


def _checked_out_dir(exp, out: Optional[Path], set_: Optional[list[str]] = None) -> Path:
    """The output folder, absolute (``--out .`` is replaced too), checked to be absent, empty or an earlier output
    folder (else a one-line error, exit 2); a default folder (no ``--out``, no ``output.dir``) that holds the report
    of another experiment file of the same name is refused too (:func:`_other_experiment_file`)."""
    from lab.report.output_folder import OutputDirError, check_out_dir

    path = _out_dir(exp, out, set_)
    other = _other_experiment_file(exp, path) if out is None and not exp.output.dir else None
    if other is not None:
        _fail(f"{path}: holds the report of {other}, another file with the experiment name {exp.name!r}; this run "
              f"({Path(exp.source).resolve()}) would replace it: pass --out DIR, rename this experiment (name:), "
              "or delete that folder")
    try:
        return check_out_dir(path)
    except OutputDirError as e:
        _fail(str(e))


def _other_experiment_file(exp, folder: Path) -> Optional[str]:
    """The experiment file an existing report ``folder`` was written from (its summary.json's ``experiment_file``)
    when that is not ``exp``'s own file, else None (no folder, no such record, or the same file). Raises nothing."""
    try:
        recorded = json.loads((folder / "summary.json").read_text()).get("experiment_file")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(recorded, str) or not recorded:
        return None
    try:
        same = Path(recorded).resolve() == Path(exp.source).resolve()
    except OSError:
        return None
    return None if same else recorded


@app.command()
def validate(experiment: Path = EXPERIMENT_ARG, out: Optional[Path] = OUT_OPT, data_dir: Optional[Path] = DATA_OPT,
             set_: Optional[list[str]] = SET_OPT, no_plots: bool = NO_PLOTS_OPT,
             quiet: bool = RUN_QUIET_OPT) -> None:
    """Run an experiment and compare it with the measured run it names (validation.measured): latency errors,
    per-request error distributions, queue/KV time series and where the simulated time goes."""
    from lab.report.output_folder import OutputDirError
    from lab.report.validate import ValidationError, run_validation
    from lab.workload.loaders import WorkloadError

    exp = _load(experiment, data_dir, set_)
    if exp.validation is None:
        _fail(f"{experiment}: no 'validation' section (validation.measured names the measured requests file)")
    out_dir = _checked_out_dir(exp, out, set_)
    made = []  # the run's result, cleaned up (spill folder) once its outputs are written

    def simulate_fn(e):
        made.append(_simulate_with_breakdown(e, not quiet))
        return made[-1]

    try:
        report = run_validation(exp, out_dir, simulate_fn, plots=exp.output.plots and not no_plots)
    except (ValidationError, OutputDirError) as e:
        _fail(str(e))
    except (WorkloadError, ValueError) as e:  # a bad trace or profile table: one line, as `run` prints it
        _fail(f"{exp.source}: {e}")
    finally:
        for r in made:
            r.cleanup()
    if quiet:
        _print_wrote(out_dir)
        return
    from lab.report.validate import kv_capacity_line, run_rows

    t = Table(title=f"{exp.name}: simulated vs measured ({report['num_compared']} requests)")
    for c in ("metric", "measured", "simulated", "error %"):
        t.add_column(c, justify="right")
    for m in ("ttft", "tpot", "e2el"):
        for stat in ("mean", "p50", "p90", "p99"):
            row = report["metrics"][m][stat]
            t.add_row(f"{m.upper()} {stat}", f"{row['measured'] * 1000:.1f} ms", f"{row['simulated'] * 1000:.1f} ms",
                      f"{row['error_pct']:+.1f}")
    for label, measured, simulated, error in run_rows(report):
        t.add_row(label, measured, simulated, error)
    console.print(t)
    console.print(kv_capacity_line(report.get("kv_capacity") or {}), highlight=False)
    plotted = " and PNG plots" if exp.output.plots and not no_plots else ""
    written = [f for f in ("validation.md", "validation.json", "validation_requests.csv", "validation_timeseries.csv")
               if (out_dir / f).is_file()]
    console.print(f"wrote {out_dir}/{', '.join(written)}{plotted}", highlight=False)


def _simulate_with_breakdown(exp, show_progress: bool):
    from lab.experiment.simulation import build_requests, simulate

    if not show_progress:
        return simulate(exp, build_requests(exp), record_breakdown=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        reqs = build_requests(exp)
        task = bar.add_task(f"simulating {exp.name}", total=len(reqs))
        return simulate(exp, reqs, lambda d, t: bar.update(task, completed=d), record_breakdown=True)


@app.command()
def bench(workloads: str = typer.Option("azure_conv,million_16x,mooncake_conv", "--workloads", "-w",
                                        show_default=False,
                                        help="comma-separated: azure_conv, million_16x, mooncake_conv (default: "
                                        "all three; '' with --vidur: only the Vidur comparison)"),
          data_dir: Optional[Path] = DATA_OPT,
          vidur: Optional[Path] = typer.Option(None, "--vidur", help="a microsoft/vidur checkout to run beside us"),
          vidur_python: str = typer.Option(sys.executable, "--vidur-python", show_default=False,
                                           help="the Python that has Vidur's dependencies (default: the one running "
                                           "servelab)"),
          vidur_model: str = typer.Option("meta-llama/Llama-2-7b-hf", "--vidur-model",
                                          help="the model both simulators run (Vidur's name)"),
          vidur_tp: int = typer.Option(1, "--vidur-tp", min=1, help="tensor parallel size of that replica"),
          vidur_trace: str = typer.Option("conv", "--vidur-trace",
                                          help="Vidur's copy of the Azure 2023 trace: conv or code"),
          vidur_scheduler: str = typer.Option("vllm", "--vidur-scheduler",
                                              help="vllm (servelab: vllm_v1) or sarathi (both: --vidur-chunk-size)"),
          vidur_chunk_size: int = typer.Option(512, "--vidur-chunk-size", min=1,
                                               help="Sarathi's token budget per step"),
          vidur_time_scale: float = typer.Option(1.0, "--vidur-time-scale", min=0.01,
                                                 help="stretch the trace's arrival times (both simulators)"),
          vidur_attention_file: Optional[Path] = typer.Option(
              None, "--vidur-attention-file", help="attention profile for Vidur, if its checkout lacks data/profiling/.../attention.csv"),
          vidur_json: Optional[Path] = typer.Option(None, "--vidur-json",
                                                    help="append the comparison's figures to this file, one JSON line"),
          no_fast_forward: bool = typer.Option(False, "--no-fast-forward",
                                               help="step by step, without jumping over predictable decode stretches "
                                               "(the jump is exact; this times the simulator without it)")) -> None:
    """Time the simulator on fixed workloads and print a table (wall time, simulated s per wall s, requests and
    steps per wall s, peak memory); with --vidur, Vidur's time for the same model, GPU, scheduler and trace, and the
    ratio of whole-process wall times."""
    from lab.cli.progress import ItemProgress
    from lab.report.bench import (EXPECTED_WALL_S, VIDUR_REFERENCE, WORKLOADS, UnlikeReference, VidurCase,
                                  compare_with_vidur, run_workload, speed_ratio)
    from lab.experiment.paths import PROJECT_ROOT

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        _fail(f"--workloads: unknown {bad}; expected some of {sorted(WORKLOADS)}")
    if not names and vidur is None:
        _fail("--workloads: empty; name at least one workload, or give --vidur")
    try:  # check the Vidur options before running anything
        case = VidurCase(vidur_model, vidur_tp, vidur_trace, vidur_scheduler, vidur_chunk_size, vidur_time_scale,
                         str(vidur_attention_file.resolve()) if vidur_attention_file else None)
    except ValueError as e:
        _fail(str(e))
    dd = str(data_dir) if data_dir else None
    over = {"simulation": {"fast_forward": False}} if no_fast_forward else None
    results = []
    from lab.core.native import core_description

    err_console.print(f"hot core: {core_description()}")  # (the children import what this process imports)
    # progress: one item per workload (and Vidur, then servelab on its requests), weighted by its expected seconds
    vidur_items = {"vidur": VIDUR_REFERENCE.wall_s, "servelab": EXPECTED_WALL_S["azure_conv"]} if vidur else {}
    show = ItemProgress(err_console, "bench", len(names) + len(vidur_items),
                        sum(EXPECTED_WALL_S[n] for n in names) + sum(vidur_items.values()))

    def requests_done(done: int, total: int) -> None:  # the workload's child reports its finished requests
        show.update(done / total if total else 0.0, f"{done:,} of {total:,} requests")

    with show:
        if names:
            t = Table(title="servelab benchmark")
            for c in ("workload", "requests", "wall (s)", "total wall (s)", "sim s / wall s", "req / wall s",
                      "steps / wall s", "steps jumped", "peak MB"):
                t.add_column(c, justify="right")
            for n in names:
                show.start(n, EXPECTED_WALL_S[n])
                r = run_workload(n, str(PROJECT_ROOT / WORKLOADS[n]), dd, over, requests_done)
                show.done(f"{n}: {r.requests:,} requests, {r.sim_wall_s:.1f} s simulating")
                results.append(r)
                t.add_row(n, f"{r.requests:,}", f"{r.sim_wall_s:.2f}", f"{r.total_wall_s:.2f}",
                          f"{r.sim_per_wall:,.0f}", f"{r.req_per_wall:,.0f}", f"{r.steps_per_wall:,.0f}",
                          f"{r.jumped_share:.0%}", f"{r.peak_mb:,.0f}")
        if vidur is not None:
            labels = {"vidur": f"Vidur ({case.label}; {vidur_model}, TP{vidur_tp})",
                      "servelab": "servelab on Vidur's requests"}

            def stage(name: str) -> None:
                if show.current is not None:
                    show.done()
                show.start(labels[name], vidur_items[name])

            try:
                import os

                python = os.path.abspath(vidur_python) if os.sep in vidur_python else vidur_python  # runs in --vidur
                cmp = compare_with_vidur(str(vidur.resolve()), python, case,
                                         str(PROJECT_ROOT / WORKLOADS["azure_conv"]), dd, over, stage,
                                         requests_done)
            except (FileNotFoundError, RuntimeError, UnlikeReference) as e:
                _fail(str(e))
            show.done()
    if names:
        console.print(t)
    if vidur is not None:
        v, s = cmp.vidur, cmp.servelab
        console.print(f"Vidur ({case.label}; {vidur_model}, TP{vidur_tp}, A100): {v.wall_s:.1f} s wall (whole "
                      f"process, {v.user_cpu_s:.1f} s user CPU), {v.peak_mb:,.0f} MB peak; servelab on the same "
                      f"{s.requests:,} requests, model, GPUs and limits: {s.total_wall_s:.2f} s whole process "
                      f"({s.sim_wall_s:.2f} s simulation, {s.user_cpu_s:.2f} s user CPU, {s.jumped_share:.0%} of "
                      f"{s.steps:,} steps jumped), {s.peak_mb:,.0f} MB -> {cmp.faster:.1f}x faster, "
                      f"{cmp.leaner:.1f}x less memory (other processes kept {v.others_cores:.1f} / "
                      f"{s.others_cores:.1f} cores busy)", highlight=False, soft_wrap=True)
        if vidur_json is not None:
            with open(vidur_json, "a") as f:
                f.write(json.dumps(cmp.as_record()) + "\n")
    elif "azure_conv" in names:
        ours = next(r for r in results if r.name == "azure_conv")
        ref = VIDUR_REFERENCE
        try:
            faster, leaner = speed_ratio(ours, ref)
            console.print(f"{ref.simulator} reference ({ref.source}): {ref.wall_s:.1f} s, {ref.peak_mb:,.0f} MB "
                          f"-> {faster:.1f}x faster, {leaner:.1f}x less memory", highlight=False)
        except UnlikeReference as e:  # the recorded Vidur run is for another model and GPU: no ratio
            console.print(f"{e}; run with --vidur PATH for a like-for-like comparison "
                          "(docs/performance.md keeps the recorded figures with their setup)", highlight=False)


@app.command()
def sweep(spec: Path = typer.Argument(..., help="sweep YAML file (docs/sweeps.md)"), out: Optional[Path] = NAMED_OUT_OPT,
          data_dir: Optional[Path] = DATA_OPT,
          jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="worker processes (default: the file's jobs); "
                                             "with --executor ray and no --address, the local Ray instance's CPUs"),
          executor: str = typer.Option("pool", "--executor", help="pool (local processes) or ray"),
          address: Optional[str] = typer.Option(None, "--address", help="Ray cluster to join: auto or host:port "
                                                "(default: start a local Ray instance)"),
          plots: bool = typer.Option(False, "--plots", help="every run also writes its full report with PNG plots"),
          fresh: bool = typer.Option(False, "--fresh", help="redo every run, also those already complete"),
          quiet: bool = QUIET_OPT) -> None:
    """Run a base experiment over axes of field values with replications; writes sweep.csv (one row per run) and
    sweep_summary.csv (per point: mean and 95 % confidence half-width), replaced with sweep.parquet and sweep.html
    as one set. A re-run resumes from complete runs. Exits 1 when a run failed (the others still run; the failures
    are listed and in sweep.csv's status column)."""
    from lab.cli.sweep_display import SweepDisplay
    from lab.experiment.config import ConfigError
    from lab.report.executors import ExecutorError, make_executor
    from lab.report.output_folder import OutputDirError
    from lab.report.sweep import load_sweep, run_sweep

    try:
        sweep_spec, cmp, runs = load_sweep(spec, data_dir)
    except ConfigError as e:
        _fail(str(e))
    out_dir = out or Path("reports") / sweep_spec.name
    try:
        pool_or_ray = make_executor(executor, jobs or sweep_spec.jobs, address)
    except (ExecutorError, ValueError) as e:
        _fail(str(e))
    try:
        if quiet:
            per_run, _ = run_sweep(sweep_spec, cmp, runs, out_dir, fresh=fresh, executor=pool_or_ray, plots=plots)
        else:
            with SweepDisplay(err_console) as display:
                per_run, _ = run_sweep(sweep_spec, cmp, runs, out_dir, fresh=fresh, progress=display,
                                       executor=pool_or_ray, plots=plots)
    except (ExecutorError, OutputDirError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        err_console.print(f"interrupted: the runs already complete in {out_dir} are kept; run the same command "
                          "again to resume (--fresh redoes them)", highlight=False)
        raise typer.Exit(130)
    reused, failed = per_run.attrs.get("reused", 0), per_run.attrs.get("failed", [])
    if failed:
        err_console.print(f"{len(failed)} run(s) failed:", highlight=False)
    for variant, err in failed:
        err_console.print(f"  {variant}: {err}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"{len(runs)} runs ({reused} reused, {len(runs) - reused - len(failed)} simulated, {len(failed)} "
                  f"failed) on {pool_or_ray.name}; wrote {out_dir}/sweep.csv, sweep.parquet, sweep_summary.csv and "
                  "sweep.html",
                  highlight=False)
    if failed:
        raise typer.Exit(1)


@app.command()
def search(spec: Path = typer.Argument(..., help="search YAML file (docs/search.md)"), out: Optional[Path] = NAMED_OUT_OPT,
           data_dir: Optional[Path] = DATA_OPT,
           jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="probes simulated at once (default: "
                                              "the file's jobs, else 1); the answer does not depend on it"),
           set_: Optional[list[str]] = typer.Option(None, "--set", help="override a field of the base experiment "
                                                    "for every candidate, e.g. --set engine.max_num_seqs=64 "
                                                    "(repeatable)"),
           fresh: bool = typer.Option(False, "--fresh", help="redo every probe, also those already complete in the "
                                                              "output folder with an unchanged configuration"),
           quiet: bool = QUIET_OPT) -> None:
    """Find the highest load within an SLO, the fewest instances for a load, or the value of a field with the most
    goodput, over simulations, and rank candidate deployments by the GPUs they need; writes search.md and
    search.json (replaced as one set). A re-run into the same folder reuses every probe already complete with an
    unchanged configuration (--fresh: none)."""
    from lab.cli.progress import SearchDisplay
    from lab.core.sched_api import SchedulerContractError
    from lab.experiment.config import ConfigError, parse_set_option
    from lab.report.executors import ExecutorError
    from lab.report.output_folder import OutputDirError
    from lab.report.search import run_search
    from lab.report.search_report import search_markdown
    from lab.report.search_spec import load_search
    from lab.workload.loaders import WorkloadError
    from policies import PolicyError

    try:
        search_spec, where = load_search(spec)
        overrides = parse_set_option(set_ or [])
    except ConfigError as e:
        _fail(str(e))
    _note_slo_units(search_spec.slo)
    out_dir = out or Path("reports") / _suffixed(search_spec.name, set_)
    n_jobs = jobs or search_spec.jobs
    try:
        if quiet:
            results = run_search(search_spec, where, out_dir, data_dir, fresh=fresh, jobs=n_jobs, overrides=overrides)
        else:
            with SearchDisplay(err_console, search_spec) as display:
                results = run_search(search_spec, where, out_dir, data_dir, fresh=fresh, jobs=n_jobs,
                                     overrides=overrides, progress=display)
    except (ConfigError, OutputDirError, PolicyError, WorkloadError, SchedulerContractError, FileNotFoundError,
            ExecutorError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        err_console.print(f"interrupted: the probes already complete in {out_dir}/probes are kept; run the same "
                          "command again to resume (--fresh redoes them)", highlight=False)
        raise typer.Exit(130)
    text = search_markdown(search_spec, results)
    console.print(text.split("\n\nProbes")[0], highlight=False, markup=False)
    probes = [p for r in results for p in r.probes]
    reused = sum(p.reused for p in probes)
    ahead = sum(not p.needed for p in probes)
    console.print(f"{len(probes)} probes ({reused} reused, {len(probes) - reused} simulated"
                  + (f", {ahead} simulated ahead and not needed" if ahead else "")
                  + f"; {n_jobs} at a time); wrote {out_dir}/search.md and search.json", highlight=False)


def _suffixed(name: str, set_: Optional[list[str]]) -> str:
    """``name``, with ``--set`` overrides their values as a suffix (as ``servelab run`` names its default folder), so
    an override never replaces the report of the file as it is."""
    if not set_:
        return name
    import re

    return f"{name}+" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", "+".join(set_))[:120]


@app.command()
def compare(spec: Path = typer.Argument(..., help="comparison YAML file"), out: Optional[Path] = NAMED_OUT_OPT,
            data_dir: Optional[Path] = DATA_OPT,
            jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="worker processes (default: the file's jobs)"),
            group: Optional[list[str]] = typer.Option(None, "--group", "-g", help="run only this group (repeatable)"),
            no_plots: bool = NO_PLOTS_OPT,
            fresh: bool = typer.Option(False, "--fresh", help="redo every run, also those already complete in the "
                                                               "output folder with an unchanged configuration"),
            quiet: bool = QUIET_OPT) -> None:
    """Run several policies on several traces (a comparison file) and write one side-by-side report. A re-run into
    the same folder reuses every run whose folder is complete and whose configuration is unchanged (--fresh: none)."""
    from lab.report.compare import load_comparison, run_comparison
    from lab.experiment.config import ConfigError
    from lab.report.executors import ExecutorError
    from lab.workload.loaders import WorkloadError
    from policies import PolicyError

    try:
        cmp_spec, runs = load_comparison(spec, data_dir, group)
    except ConfigError as e:
        _fail(str(e))
    out_dir = out or Path("reports") / cmp_spec.name
    done, reused = [0], [0]

    def progress(res: dict) -> None:
        done[0] += 1
        reused[0] += bool(res.get("reused"))
        if not quiet:
            s = res["summary"]
            how = "reused, configuration unchanged" if res.get("reused") else f"{res['wall_s']:.1f} s wall"
            err_console.print(f"[{done[0]}/{len(runs)}] {res['group']}/{res['trace']}/{res['variant']}: "
                              f"TTFT p99 {(s['ttft']['p99'] or 0) * 1000:.0f} ms, TPOT p99 "
                              f"{(s['tpot']['p99'] or 0) * 1000:.1f} ms, {s['request_throughput']:.2f} req/s "
                              f"({how})", highlight=False)

    try:
        run_comparison(cmp_spec, runs, out_dir, jobs=jobs, plots=False if no_plots else None, progress=progress,
                       note_base=spec.resolve().parent, fresh=fresh)
    except (PolicyError, WorkloadError, FileNotFoundError, ValueError, ExecutorError) as e:
        _fail(str(e))
    console.print(f"{len(runs)} runs ({reused[0]} runs reused, {len(runs) - reused[0]} simulated); wrote "
                  f"{out_dir}/comparison.md, comparison.csv and every run's report", highlight=False)


@app.command()
def catalog(gpu_catalog: Optional[list[Path]] = typer.Option(
        None, "--gpu-catalog", metavar="FILE", help="also list the GPUs of this user GPU catalog (the YAML file an "
        "experiment names in hardware.gpu_catalog), after checking them; repeatable")) -> None:
    """List the models and GPUs the catalogs know (with --gpu-catalog, a user's GPUs too)."""
    from lab.costmodel.hardware import GPUCatalogError, hardware_names, load_gpu_catalog, load_hardware
    from lab.costmodel.model_arch import load_model, model_names

    user = []
    for path in gpu_catalog or []:
        try:
            user += [(n, str(path)) for n in load_gpu_catalog(path)]
        except GPUCatalogError as e:
            _fail(str(e))

    t = Table(title="models")
    for c in ("name", "layers", "hidden", "heads/kv", "params (B)", "active (B)", "KV B/token (bf16)"):
        t.add_column(c)
    for n in model_names():
        m = load_model(n)
        t.add_row(n, str(m.num_layers), str(m.hidden_size), f"{m.num_heads}/{m.num_kv_heads}",
                  f"{m.params_total() / 1e9:.2f}", f"{m.params_active() / 1e9:.2f}", f"{m.kv_bytes_per_token():,}")
    console.print(t)
    t = Table(title="GPUs")
    for c in ("name", "BF16 TFLOPS", "FP8 TFLOPS", "memory (GB)", "bandwidth (TB/s)", "link (GB/s)", "from"):
        t.add_column(c)
    for n, where in [(n, "packaged") for n in hardware_names()] + user:
        h = load_hardware(n)
        t.add_row(n, f"{h.bf16_flops / 1e12:.0f}", f"{h.fp8_flops / 1e12:.0f}" if h.fp8_flops else "–",
                  f"{h.memory_bytes / 1e9:.1f}", f"{h.memory_bandwidth / 1e12:.2f}", f"{h.link_bandwidth / 1e9:.0f}",
                  where)
    console.print(t)


@app.command()
def policies() -> None:
    """List the registered schedulers and routers with their options (docs/policies.md has the details)."""
    from policies import describe, describe_routers, options_of, router_class, scheduler_class

    for title, items, get in (("schedulers (policy.scheduler, policy.options)", describe(), scheduler_class),
                              ("routers (cluster.router, cluster.router_options)", describe_routers(), router_class)):
        t = Table(title=title)
        t.add_column("name")
        t.add_column("description")
        t.add_column("options (default)")
        for n, d in items.items():
            opts = options_of(get(n))
            t.add_row(n, d, ", ".join(f"{k}={v[0]!r}" for k, v in opts.items()) or "–")
        console.print(t)
    console.print("A user policy: policy.scheduler (or cluster.router) = path/to/file.py:ClassName")


@app.command()
def support(experiment: Optional[Path] = typer.Argument(None, help="an experiment file to check (optional)"),
            data_dir: Optional[Path] = DATA_OPT) -> None:
    """Print the support matrix (which features compose, which schedulers support which feature) as Markdown, or
    check one experiment against it (exit 2 with the reason when a combination is refused)."""
    from lab.experiment.support import markdown_tables, refusals
    from policies import scheduler_class, scheduler_names

    if experiment is None:
        print(markdown_tables({n: scheduler_class(n) for n in scheduler_names()}), end="")
        return
    exp = _load(experiment, data_dir, None)
    found = refusals(exp)
    for line in found:
        err_console.print(f"{exp.source}: {line}", highlight=False)
    if found:
        raise typer.Exit(2)
    console.print(f"{exp.source}: every feature combination it uses is supported", highlight=False)


from lab.cli.costmodel import register as _register_costmodel  # noqa: E402
from lab.cli.kvcache import register as _register_kv  # noqa: E402

_register_costmodel(app)
_register_kv(app)

# --- servelab traces: the trace catalog (traces/manifest.yaml; lab/workload/catalog.py) -------------------------
traces_app = typer.Typer(no_args_is_help=True, help="The public trace catalog (traces/manifest.yaml): list, verify, "
                                                    "fetch.")
app.add_typer(traces_app, name="traces")
MANIFEST_OPT = typer.Option(None, "--manifest", help="trace manifest (default traces/manifest.yaml)")


def _traces_manifest(manifest: Optional[Path]):
    from lab.workload.catalog import CatalogError, load_manifest

    try:
        return load_manifest(manifest)
    except CatalogError as e:
        _fail(str(e))


@traces_app.command("list")
def traces_list(data_dir: Optional[Path] = DATA_OPT, manifest: Optional[Path] = MANIFEST_OPT) -> None:
    """List the catalog's traces and whether each is present under the data directory (not hashed: see verify)."""
    from lab.experiment.paths import default_data_dir

    m = _traces_manifest(manifest)
    dd = data_dir or default_data_dir()
    t = Table(title=f"traces ({m.source}; data dir {dd})")
    for c in ("name", "format", "requests", "size", "licence", "local"):
        t.add_column(c, justify="right" if c in ("requests", "size") else "left")
    t.add_column("path (under the data dir)", overflow="fold")
    for e in m.traces:
        t.add_row(e.name, e.format, f"{e.num_requests:,}", f"{e.size / 1e6:.2f} MB", e.licence.split(" (")[0],
                  "present" if e.local_path(dd).is_file() else "missing", e.path)
    console.print(t)


@traces_app.command("verify")
def traces_verify(name: Optional[str] = typer.Argument(None, help="one trace (default: all)"),
                  data_dir: Optional[Path] = DATA_OPT, manifest: Optional[Path] = MANIFEST_OPT) -> None:
    """Check the sha256 of local trace files against the manifest (exit status 2 if any is missing or differs)."""
    from lab.experiment.paths import default_data_dir
    from rich.markup import escape

    from lab.workload.catalog import CatalogError, verify

    m = _traces_manifest(manifest)
    dd = data_dir or default_data_dir()
    if name:
        try:
            m.get(name)
        except CatalogError as e:
            _fail(str(e))
    names = [name] if name else m.names()
    t = Table(title=f"trace checksums (data dir {dd})")
    t.add_column("name")
    t.add_column("status")
    t.add_column("detail", overflow="fold")
    failed = 0
    for n in names:
        try:
            p = verify(n, dd, m)
            t.add_row(n, "[green]ok[/]", str(p))
        except CatalogError as e:
            failed += 1
            t.add_row(n, "[red]FAILED[/]", escape(str(e)))
    console.print(t)
    if failed:
        _fail(f"{failed} of {len(names)} trace(s) missing or mismatched")


@traces_app.command("fetch")
def traces_fetch(name: str = typer.Argument(..., help="trace name (servelab traces list)"),
                 data_dir: Optional[Path] = DATA_OPT, manifest: Optional[Path] = MANIFEST_OPT,
                 force: bool = typer.Option(False, "--force", help="download even if a verified copy exists"),
                 timeout: float = typer.Option(60.0, "--timeout", help="network timeout, seconds")) -> None:
    """Download one trace from its public URL into the data directory, refusing it unless its sha256 matches."""
    from lab.experiment.paths import default_data_dir
    from lab.workload.catalog import CatalogError, fetch, verify

    m = _traces_manifest(manifest)
    dd = data_dir or default_data_dir()
    try:
        entry = m.get(name)
        if not force and entry.local_path(dd).is_file():
            try:
                console.print(f"{name}: {verify(name, dd, m)} already present (sha256 verified)", highlight=False)
                return
            except CatalogError:
                pass  # replaced below once the download verifies
        err_console.print(f"fetching {name} from {entry.url} ...", highlight=False)
        p = fetch(name, dd, m, timeout=timeout, force=True)
    except CatalogError as e:
        _fail(str(e))
    console.print(f"{name}: {p} (sha256 verified)", highlight=False)


def _tidy_help(*apps: typer.Typer) -> None:
    """Make ``--help`` read as prose the terminal wraps.

    typer's Rich help keeps a docstring's single line breaks (the command list and the text after a command's first
    line showed the source's 120-column wrapping as ragged lines at 80 columns): each command's help becomes its
    docstring with the lines of every paragraph joined. And typer 0.2x prints a value type after every option,
    ``<bool>`` after a flag (``--quiet <bool>``, even ``--help <bool>``) as if it took a value, and
    ``<list[str]>`` after a repeatable option: a flag shows none, a repeatable option its element (``<str>``; its
    help says it repeats), a bounded number its type and bounds (``<int> [x>=1]``, not ``<int range> [x>=1]``).
    Only the help's rendering changes, never parsing.
    """
    import inspect
    import re

    for a in apps:
        for info in a.registered_commands:
            text = info.help if info.help is not None else inspect.getdoc(info.callback) or ""
            info.help = "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))
    from typer import core

    for cls in (getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)):
        shown = getattr(cls, "display_type_rich", None)
        if shown is None or getattr(shown, "_servelab_tidy", False):
            continue

        def display_type_rich(self, ctx, _shown=shown):
            if self.metavar is None and getattr(self, "is_flag", False):
                return None
            label = _shown(self, ctx)
            if isinstance(label, str) and self.metavar is None:
                label = re.sub(r"^<list\[(\w+)\]>(\.\.\.)?$", lambda m: f"<{m.group(1).lower()}>{m.group(2) or ''}",
                               label)
                label = re.sub(r"^<(\w+) range>$", r"<\1>", label)  # the range itself follows: <int> [x>=1]
            return label

        display_type_rich._servelab_tidy = True  # type: ignore[attr-defined]
        cls.display_type_rich = display_type_rich


_tidy_help(app, traces_app)


def main(prog_name: str | None = None) -> None:
    """The ``servelab`` console script: the typer app; then, as the process ends, every object still alive is put
    out of the cyclic garbage collector's sight (``gc.freeze``). The interpreter's last collection at exit would
    otherwise traverse a finished run's millions of objects (the million-request setup at 100,000 requests: 0.78 s
    from the end of the work to the end of the process, 0.11 s frozen); reference counting still frees them."""
    try:
        app(prog_name=prog_name)
    finally:
        gc.freeze()


if __name__ == "__main__":
    main()
