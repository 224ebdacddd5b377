"""The ``servelab`` command line (typer)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="servelab: trace-driven simulator and policy lab for LLM inference serving.")
console = Console()
err_console = Console(stderr=True)

EXPERIMENT_ARG = typer.Argument(..., help="experiment YAML file", exists=False)
OUT_OPT = typer.Option(None, "--out", "-o", help="output folder (default reports/<experiment name>/)")
DATA_OPT = typer.Option(None, "--data-dir", help="shared data folder (default $SERVELAB_DATA_DIR or ../shared/data)")
SET_OPT = typer.Option(None, "--set", help="override a field, e.g. --set engine.max_num_seqs=64 (repeatable)")


def _fail(msg: str) -> None:
    err_console.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(2)


def _load(path: Path, data_dir: Optional[Path], sets: Optional[list[str]]):
    from lab.config import ConfigError, load_experiment, parse_set_option

    try:
        return load_experiment(path, data_dir, parse_set_option(sets or []))
    except ConfigError as e:
        _fail(str(e))


def _simulate(exp, show_progress: bool = True):
    from lab.simulation import build_requests, simulate
    from lab.workload.loaders import WorkloadError
    from policies import PolicyError

    try:
        reqs = build_requests(exp)
    except (WorkloadError, ValueError) as e:
        _fail(str(e))
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
    except (PolicyError, FileNotFoundError, ValueError) as e:
        _fail(str(e))


def _out_dir(exp, out: Optional[Path]) -> Path:
    if out is not None:
        return out
    if exp.output.dir:
        return exp.path(exp.output.dir, "output.dir")
    return Path("reports") / exp.name


def _print_summary(summary: dict, out_dir: Path) -> None:
    t = Table(title=f"{summary['experiment']}: {summary['num_finished']}/{summary['num_requests']} finished, "
                    f"{summary['num_rejected']} rejected, {summary['num_unfinished']} unfinished")
    for c in ("metric (ms)", "mean", "median", "p90", "p99"):
        t.add_column(c, justify="right")
    for m in ("ttft", "tpot", "itl", "e2el"):
        s = summary[m]
        t.add_row(m.upper(), *("–" if s[k] is None else f"{s[k] * 1000:.1f}" for k in ("mean", "median", "p90", "p99")))
    console.print(t)
    console.print(f"throughput {summary['request_throughput']:.2f} req/s, "
                  f"{summary['output_token_throughput']:.0f} output tok/s over {summary['duration_s']:.1f} s; "
                  f"{summary['num_preemptions']} preemptions; simulated in "
                  f"{summary['simulation']['wall_time_s']:.2f} s wall")
    console.print(f"wrote {out_dir}/ (report.md, summary.json, requests.parquet/.csv, steps.parquet)")


@app.command()
def run(experiment: Path = EXPERIMENT_ARG, out: Optional[Path] = OUT_OPT, data_dir: Optional[Path] = DATA_OPT,
        set_: Optional[list[str]] = SET_OPT, no_plots: bool = typer.Option(False, "--no-plots"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar")) -> None:
    """Run an experiment and write its report."""
    from lab.report import write_report

    exp = _load(experiment, data_dir, set_)
    result = _simulate(exp, not quiet)
    out_dir = _out_dir(exp, out)
    summary = write_report(result, out_dir, plots=exp.output.plots and not no_plots)
    _print_summary(summary, out_dir)


@app.command()
def validate(experiment: Path = EXPERIMENT_ARG, out: Optional[Path] = OUT_OPT, data_dir: Optional[Path] = DATA_OPT,
             set_: Optional[list[str]] = SET_OPT, no_plots: bool = typer.Option(False, "--no-plots"),
             quiet: bool = typer.Option(False, "--quiet", "-q")) -> None:
    """Run an experiment and compare it with the measured per-request timings it names (validation.measured)."""
    from lab.report import write_report
    from lab.validate import ValidationError, compare, load_measured, write_validation

    exp = _load(experiment, data_dir, set_)
    if exp.validation is None:
        _fail(f"{experiment}: no 'validation' section (validation.measured names the measured requests file)")
    try:
        measured = load_measured(exp.path(exp.validation.measured, "validation.measured"), exp.validation.format)
    except ValidationError as e:
        _fail(str(e))
    result = _simulate(exp, not quiet)
    out_dir = _out_dir(exp, out)
    summary = write_report(result, out_dir, plots=exp.output.plots and not no_plots)
    from lab.metrics import requests_frame

    report = compare(measured, requests_frame(result.requests))
    write_validation(report, out_dir)
    t = Table(title=f"{exp.name}: simulated vs measured ({report['num_compared']} requests)")
    for c in ("metric", "measured", "simulated", "error %"):
        t.add_column(c, justify="right")
    for m in ("ttft", "tpot", "e2el"):
        for stat in ("mean", "p50", "p90", "p99"):
            row = report["metrics"][m][stat]
            t.add_row(f"{m.upper()} {stat}", f"{row['measured'] * 1000:.1f} ms", f"{row['simulated'] * 1000:.1f} ms",
                      f"{row['error_pct']:+.1f}")
    console.print(t)
    console.print(f"wrote {out_dir}/validation.json")
    _ = summary


@app.command()
def catalog() -> None:
    """List the models and GPUs the catalogs know."""
    from lab.costmodel.hardware import hardware_names, load_hardware
    from lab.costmodel.model_arch import load_model, model_names

    t = Table(title="models")
    for c in ("name", "layers", "hidden", "heads/kv", "params (B)", "active (B)", "KV B/token (bf16)"):
        t.add_column(c)
    for n in model_names():
        m = load_model(n)
        t.add_row(n, str(m.num_layers), str(m.hidden_size), f"{m.num_heads}/{m.num_kv_heads}",
                  f"{m.params_total() / 1e9:.2f}", f"{m.params_active() / 1e9:.2f}", f"{m.kv_bytes_per_token():,}")
    console.print(t)
    t = Table(title="GPUs")
    for c in ("name", "BF16 TFLOPS", "FP8 TFLOPS", "memory (GB)", "bandwidth (TB/s)", "link (GB/s)"):
        t.add_column(c)
    for n in hardware_names():
        h = load_hardware(n)
        t.add_row(n, f"{h.bf16_flops / 1e12:.0f}", f"{h.fp8_flops / 1e12:.0f}" if h.fp8_flops else "–",
                  f"{h.memory_bytes / 1e9:.1f}", f"{h.memory_bandwidth / 1e12:.2f}", f"{h.link_bandwidth / 1e9:.0f}")
    console.print(t)


@app.command()
def policies() -> None:
    """List the registered scheduling policies."""
    from policies import describe, describe_routers

    for title, items in (("schedulers", describe()), ("routers", describe_routers())):
        t = Table(title=title)
        t.add_column("name")
        t.add_column("description")
        for n, d in items.items():
            t.add_row(n, d)
        console.print(t)


from lab.cli_costmodel import register as _register_costmodel  # noqa: E402

_register_costmodel(app)

if __name__ == "__main__":
    app()
