"""``servelab bench``: the simulator timed on fixed workloads, and beside Vidur on the same requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.table import Table

from lab.cli.common import DATA_OPT, console, err_console, fail


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
    from lab.core.native import core_description
    from lab.report.bench import EXPECTED_WALL_S, VIDUR_REFERENCE, WORKLOADS, VidurCase

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        fail(f"--workloads: unknown {bad}; expected some of {sorted(WORKLOADS)}")
    if not names and vidur is None:
        fail("--workloads: empty; name at least one workload, or give --vidur")
    try:  # check the Vidur options before running anything
        case = VidurCase(vidur_model, vidur_tp, vidur_trace, vidur_scheduler, vidur_chunk_size, vidur_time_scale,
                         str(vidur_attention_file.resolve()) if vidur_attention_file else None)
    except ValueError as e:
        fail(str(e))
    dd = str(data_dir) if data_dir else None
    over = {"simulation": {"fast_forward": False}} if no_fast_forward else None
    err_console.print(f"hot core: {core_description()}")  # (the children import what this process imports)
    # progress: one item per workload (and Vidur, then servelab on its requests), weighted by its expected seconds
    vidur_items = {"vidur": VIDUR_REFERENCE.wall_s, "servelab": EXPECTED_WALL_S["azure_conv"]} if vidur else {}
    show = ItemProgress(err_console, "bench", len(names) + len(vidur_items),
                        sum(EXPECTED_WALL_S[n] for n in names) + sum(vidur_items.values()))

    def requests_done(done: int, total: int) -> None:  # the workload's child reports its finished requests
        show.update(done / total if total else 0.0, f"{done:,} of {total:,} requests")

    with show:
        table, results = _run_workloads(names, dd, over, show, requests_done) if names else (None, [])
        if vidur is not None:
            labels = {"vidur": f"Vidur ({case.label}; {vidur_model}, TP{vidur_tp})",
                      "servelab": "servelab on Vidur's requests"}
            cmp = _run_vidur(vidur, vidur_python, case, dd, over, show, labels, vidur_items, requests_done)
    if names:
        console.print(table)
    if vidur is not None:
        _print_vidur_comparison(cmp, f"{case.label}; {vidur_model}, TP{vidur_tp}", vidur_json)
    elif "azure_conv" in names:
        _print_reference_ratio(next(r for r in results if r.name == "azure_conv"))


def _run_workloads(names: list[str], data_dir: str | None, over: dict | None, show,
                   requests_done: Callable[[int, int], None]) -> tuple[Table, list]:
    """Run each workload in a child process (lab/report/bench.py ``run_workload``), one progress item each; return
    the table of their figures and the results."""
    from lab.experiment.paths import PROJECT_ROOT
    from lab.report.bench import EXPECTED_WALL_S, WORKLOADS, run_workload

    t = Table(title="servelab benchmark")
    for c in ("workload", "requests", "wall (s)", "total wall (s)", "sim s / wall s", "req / wall s",
              "steps / wall s", "steps jumped", "peak MB"):
        t.add_column(c, justify="right")
    results = []
    for n in names:
        show.start(n, EXPECTED_WALL_S[n])
        r = run_workload(n, str(PROJECT_ROOT / WORKLOADS[n]), data_dir, over, requests_done)
        show.done(f"{n}: {r.requests:,} requests, {r.sim_wall_s:.1f} s simulating")
        results.append(r)
        t.add_row(n, f"{r.requests:,}", f"{r.sim_wall_s:.2f}", f"{r.total_wall_s:.2f}",
                  f"{r.sim_per_wall:,.0f}", f"{r.req_per_wall:,.0f}", f"{r.steps_per_wall:,.0f}",
                  f"{r.jumped_share:.0%}", f"{r.peak_mb:,.0f}")
    return t, results


def _run_vidur(vidur: Path, vidur_python: str, case, data_dir: str | None, over: dict | None, show,
               labels: dict[str, str], items: dict[str, float], requests_done: Callable[[int, int], None]):
    """Run Vidur from its checkout, then servelab on the same requests (lab/report/bench.py ``compare_with_vidur``),
    a progress item each; a failure is a one-line error (exit 2)."""
    import os

    from lab.experiment.paths import PROJECT_ROOT
    from lab.report.bench import WORKLOADS, UnlikeReference, compare_with_vidur

    def stage(name: str) -> None:
        if show.current is not None:
            show.done()
        show.start(labels[name], items[name])

    try:
        python = os.path.abspath(vidur_python) if os.sep in vidur_python else vidur_python  # runs in --vidur
        cmp = compare_with_vidur(str(vidur.resolve()), python, case, str(PROJECT_ROOT / WORKLOADS["azure_conv"]),
                                 data_dir, over, stage, requests_done)
    except (FileNotFoundError, RuntimeError, UnlikeReference) as e:
        fail(str(e))
    show.done()
    return cmp


def _print_vidur_comparison(cmp, setup: str, vidur_json: Optional[Path]) -> None:
    """Vidur's and servelab's whole-process times and memory on the same requests, and the ratios; with
    ``vidur_json`` the figures appended to it as one JSON line."""
    v, s = cmp.vidur, cmp.servelab
    console.print(f"Vidur ({setup}, A100): {v.wall_s:.1f} s wall (whole "
                  f"process, {v.user_cpu_s:.1f} s user CPU), {v.peak_mb:,.0f} MB peak; servelab on the same "
                  f"{s.requests:,} requests, model, GPUs and limits: {s.total_wall_s:.2f} s whole process "
                  f"({s.sim_wall_s:.2f} s simulation, {s.user_cpu_s:.2f} s user CPU, {s.jumped_share:.0%} of "
                  f"{s.steps:,} steps jumped), {s.peak_mb:,.0f} MB -> {cmp.faster:.1f}x faster, "
                  f"{cmp.leaner:.1f}x less memory (other processes kept {v.others_cores:.1f} / "
                  f"{s.others_cores:.1f} cores busy)", highlight=False, soft_wrap=True)
    if vidur_json is not None:
        with open(vidur_json, "a") as f:
            f.write(json.dumps(cmp.as_record()) + "\n")


def _print_reference_ratio(ours) -> None:
    """The azure_conv run against the recorded Vidur run (docs/performance.md), or why there is no ratio (the
    recorded run is for another model and GPU)."""
    from lab.report.bench import VIDUR_REFERENCE, UnlikeReference, speed_ratio

    ref = VIDUR_REFERENCE
    try:
        faster, leaner = speed_ratio(ours, ref)
        console.print(f"{ref.simulator} reference ({ref.source}): {ref.wall_s:.1f} s, {ref.peak_mb:,.0f} MB "
                      f"-> {faster:.1f}x faster, {leaner:.1f}x less memory", highlight=False)
    except UnlikeReference as e:  # the recorded Vidur run is for another model and GPU: no ratio
        console.print(f"{e}; run with --vidur PATH for a like-for-like comparison "
                      "(docs/performance.md keeps the recorded figures with their setup)", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``servelab bench`` to the main app."""
    app.command()(bench)
