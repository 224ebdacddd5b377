"""The commands that run many simulations into one output folder, each run's folder reused by a re-run: ``servelab
sweep``, ``servelab search`` and ``servelab compare`` (their runs go to lab/report/executors.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lab.cli.common import (DATA_OPT, NAMED_OUT_OPT, NO_PLOTS_OPT, QUIET_OPT, console, err_console, fail,
                            note_slo_units, suffixed_name)


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
        fail(str(e))
    out_dir = out or Path("reports") / sweep_spec.name
    try:
        pool_or_ray = make_executor(executor, jobs or sweep_spec.jobs, address)
    except (ExecutorError, ValueError) as e:
        fail(str(e))
    try:
        if quiet:
            per_run, _ = run_sweep(sweep_spec, cmp, runs, out_dir, fresh=fresh, executor=pool_or_ray, plots=plots)
        else:
            with SweepDisplay(err_console) as display:
                per_run, _ = run_sweep(sweep_spec, cmp, runs, out_dir, fresh=fresh, progress=display,
                                       executor=pool_or_ray, plots=plots)
    except (ExecutorError, OutputDirError) as e:
        fail(str(e))
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
        fail(str(e))
    note_slo_units(search_spec.slo)
    out_dir = out or Path("reports") / suffixed_name(search_spec.name, set_)
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
        fail(str(e))
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
        fail(str(e))
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
        fail(str(e))
    console.print(f"{len(runs)} runs ({reused[0]} runs reused, {len(runs) - reused[0]} simulated); wrote "
                  f"{out_dir}/comparison.md, comparison.csv and every run's report", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``servelab sweep``, ``search`` and ``compare`` to the main app, in the order ``--help`` lists them."""
    app.command()(sweep)
    app.command()(search)
    app.command()(compare)
