"""The commands that list what servelab knows: ``servelab catalog`` (models and GPUs), ``servelab policies``
(schedulers and routers) and ``servelab support`` (which features compose)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from lab.cli.common import DATA_OPT, console, err_console, fail, load_checked_experiment


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
            fail(str(e))

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


def support(experiment: Optional[Path] = typer.Argument(None, help="an experiment file to check (optional)"),
            data_dir: Optional[Path] = DATA_OPT) -> None:
    """Print the support matrix (which features compose, which schedulers support which feature) as Markdown, or
    check one experiment against it (exit 2 with the reason when a combination is refused)."""
    from lab.experiment.support import markdown_tables, refusals
    from policies import scheduler_class, scheduler_names

    if experiment is None:
        print(markdown_tables({n: scheduler_class(n) for n in scheduler_names()}), end="")
        return
    exp = load_checked_experiment(experiment, data_dir, None)
    found = refusals(exp)
    for line in found:
        err_console.print(f"{exp.source}: {line}", highlight=False)
    if found:
        raise typer.Exit(2)
    console.print(f"{exp.source}: every feature combination it uses is supported", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``servelab catalog``, ``policies`` and ``support`` to the main app, in the order ``--help`` lists
    them."""
    app.command()(catalog)
    app.command()(policies)
    app.command()(support)
