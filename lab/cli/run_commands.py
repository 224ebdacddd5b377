"""``servelab run`` and ``servelab validate``: one experiment simulated, its report written (and, for validate,
compared with the measured run it names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lab.cli.common import (DATA_OPT, EXPERIMENT_ARG, NO_PLOTS_OPT, OUT_OPT, RUN_QUIET_OPT, SET_OPT, console,
                            err_console, fail, load_checked_experiment, suffixed_name)


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

    exp = load_checked_experiment(experiment, data_dir, set_)
    _apply_percentile_options(exp, experiment, percentile_metrics, metric_percentiles)
    if save_detailed:  # what is reported, not what runs: the report folder stays
        exp.output = exp.output.model_copy(update={"save_detailed": True})
    out_dir = _checked_out_dir(exp, out, set_)  # before simulating: --out at a file fails at once
    result = _simulate(exp, not quiet)
    try:
        written = write_outputs(result, out_dir, plots=exp.output.plots and not no_plots)
    except OutputDirError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{out_dir}: cannot write the outputs: {e}")
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
        fail(f"{path}: --{str(err['loc'][0]).replace('_', '-')}: {err['msg'].removeprefix('Value error, ')}")


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
        fail(f"{path}: holds the report of {other}, another file with the experiment name {exp.name!r}; this run "
              f"({Path(exp.source).resolve()}) would replace it: pass --out DIR, rename this experiment (name:), "
              "or delete that folder")
    try:
        return check_out_dir(path)
    except OutputDirError as e:
        fail(str(e))


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


def _out_dir(exp, out: Optional[Path], set_: Optional[list[str]] = None) -> Path:
    """``--out``, else ``output.dir``, else ``reports/<name>``; with ``--set`` overrides and no explicit folder the
    default gets their values as a suffix, so an override never replaces the base experiment's report."""
    if out is not None:
        return out
    if exp.output.dir:
        return exp.path(exp.output.dir, "output.dir")
    return Path("reports") / suffixed_name(exp.name, set_)


def _simulate(exp, show_progress: bool = True):
    from lab.cluster.cluster import RouterError
    from lab.core.sched_api import SchedulerContractError
    from lab.experiment.simulation import build_requests, simulate
    from lab.workload.loaders import WorkloadError
    from policies import PolicyError

    try:
        reqs = build_requests(exp)
    except (WorkloadError, ValueError) as e:
        fail(f"{exp.source}: {e}")
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
        fail(f"{exp.source}: {e}")


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


def validate(experiment: Path = EXPERIMENT_ARG, out: Optional[Path] = OUT_OPT, data_dir: Optional[Path] = DATA_OPT,
             set_: Optional[list[str]] = SET_OPT, no_plots: bool = NO_PLOTS_OPT,
             quiet: bool = RUN_QUIET_OPT) -> None:
    """Run an experiment and compare it with the measured run it names (validation.measured): latency errors,
    per-request error distributions, queue/KV time series and where the simulated time goes."""
    from lab.report.output_folder import OutputDirError
    from lab.report.validate import ValidationError, run_validation
    from lab.workload.loaders import WorkloadError

    exp = load_checked_experiment(experiment, data_dir, set_)
    if exp.validation is None:
        fail(f"{experiment}: no 'validation' section (validation.measured names the measured requests file)")
    out_dir = _checked_out_dir(exp, out, set_)
    made = []  # the run's result, cleaned up (spill folder) once its outputs are written

    def simulate_fn(e):
        made.append(_simulate_with_breakdown(e, not quiet))
        return made[-1]

    try:
        report = run_validation(exp, out_dir, simulate_fn, plots=exp.output.plots and not no_plots)
    except (ValidationError, OutputDirError) as e:
        fail(str(e))
    except (WorkloadError, ValueError) as e:  # a bad trace or profile table: one line, as `run` prints it
        fail(f"{exp.source}: {e}")
    finally:
        for r in made:
            r.cleanup()
    if quiet:
        _print_wrote(out_dir)
        return
    _print_validation(exp.name, report, out_dir, plotted=exp.output.plots and not no_plots)


def _print_validation(name: str, report: dict, out_dir: Path, plotted: bool) -> None:
    """The validation's table (measured vs simulated latencies, the run's figures), its KV capacity line and the
    line naming the files written."""
    from lab.report.validate import kv_capacity_line, run_rows

    t = Table(title=f"{name}: simulated vs measured ({report['num_compared']} requests)")
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
    written = [f for f in ("validation.md", "validation.json", "validation_requests.csv", "validation_timeseries.csv")
               if (out_dir / f).is_file()]
    console.print(f"wrote {out_dir}/{', '.join(written)}{' and PNG plots' if plotted else ''}", highlight=False)


def _simulate_with_breakdown(exp, show_progress: bool):
    from lab.experiment.simulation import build_requests, simulate

    if not show_progress:
        return simulate(exp, build_requests(exp), record_breakdown=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        reqs = build_requests(exp)
        task = bar.add_task(f"simulating {exp.name}", total=len(reqs))
        return simulate(exp, reqs, lambda d, t: bar.update(task, completed=d), record_breakdown=True)


def register(app: typer.Typer) -> None:
    """Add ``servelab run`` and ``validate`` to the main app, in the order ``--help`` lists them."""
    app.command()(run)
    app.command()(validate)
