"""``servelab kv``: the KV cache vLLM would configure for an experiment (or a model on a GPU set) — its KV cache
groups, block size, block count, per-request blocks — and the start-up lines vLLM of that version prints
("GPU KV cache size", "Maximum concurrency"). Registered on the main typer app by :func:`register`
(lab/cli/main.py). See docs/hybrid_models.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from lab.cli.common import DATA_OPT

console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _fail(msg: str) -> None:
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def kv_report(dep) -> list[str]:
    """The lines ``servelab kv`` prints for a built deployment (lab/experiment/build.py ``Deployment``): the
    layout, the per-request block need and vLLM's start-up lines."""
    from lab.costmodel.hybrid_kv import kv_layout

    sched = dep.scheduler_config
    mml, mbt = sched.max_model_len, sched.max_num_batched_tokens
    layout = dep.kv_layout
    if layout is None:  # full attention: one group of every layer
        layout = kv_layout(dep.model, max_model_len=mml, block_size=dep.block_size)
    cap = dep.kv_capacity or dep.derived_kv_capacity
    blocks = dep.num_gpu_blocks
    per_req = layout.blocks_per_request(mml, mbt)
    out = [f"model {dep.model.name} on {dep.hardware.name}; vLLM {layout.version}; max_model_len {mml:,}, "
           f"max_num_batched_tokens {mbt:,}",
           f"KV cache groups ({len(layout.groups)}, {layout.group_size} layers each with padding; hybrid manager "
           f"{'on' if layout.hybrid_manager else 'off'}; Mamba cache mode {layout.mamba_mode}):"]
    for g, n in zip(layout.groups, per_req):
        win = f", window {g.window:,}" if g.window else ""
        out.append(f"  {g.kind:8s} {g.num_layers:3d} {g.layer_kind} layers{win}, {g.block_tokens:,} tokens a block, "
                   f"{n:,} blocks per {mml:,}-token request")
    bpb = cap.bytes_per_block if cap is not None and cap.layout is not None else layout.bytes_per_block
    source = "engine.num_gpu_blocks" if dep.kv_capacity is None else "derived"
    out.append(f"block size {layout.block_size} tokens (configured {layout.configured_block_size}); a block is "
               f"{bpb:,} bytes per GPU; {blocks:,} blocks ({source}); {sum(per_req):,} blocks per request")
    out.append("vLLM prints:")
    out += [f"  {line}" for line in layout.startup_lines(blocks, mml, mbt)]
    return out


def kv(experiment: Optional[Path] = typer.Argument(None, help="an experiment file (or give --model)"),
       model: Optional[str] = typer.Option(None, "--model", help="a catalog model, instead of an experiment"),
       gpu: str = typer.Option("H100-SXM5-80GB", "--gpu", help="with --model: the GPU"),
       tp: int = typer.Option(1, "--tp", help="with --model: tensor-parallel size"),
       max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="with --model"),
       version: str = typer.Option("0.33", "--vllm-version", help="with --model: 0.33, 0.19 or 0.11"),
       sets: Optional[list[str]] = typer.Option(None, "--set", help="FIELD.PATH=VALUE override (repeatable)"),
       data_dir: Optional[Path] = DATA_OPT) -> None:
    """The KV cache vLLM configures for an experiment or a model: KV cache groups (full attention, sliding window,
    chunked, Mamba / linear attention), block size, blocks per request, and the "GPU KV cache size" / "Maximum
    concurrency" lines vLLM of that version prints (docs/hybrid_models.md)."""
    from lab.experiment.config import ConfigError, load_experiment, parse_experiment, parse_set_option
    from lab.experiment.build import build_deployment

    try:
        overrides = parse_set_option(sets or [])
        if experiment is not None:
            exp = load_experiment(experiment, data_dir, overrides)
        elif model is not None:
            data: dict = {"name": "kv", "model": {"name": model},
                          "hardware": {"gpu": gpu, "tensor_parallel_size": tp},
                          "engine": {"vllm_version": version}}
            if max_model_len:
                data["engine"]["max_model_len"] = max_model_len
            for section, fields in overrides.items():
                data.setdefault(section, {}).update(fields) if isinstance(fields, dict) else data.update(
                    {section: fields})
            exp = parse_experiment(data, base_dir=Path.cwd())
        else:
            _fail("give an experiment file or --model")
        dep = build_deployment(exp)
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    for line in kv_report(dep):
        console.print(line, highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``servelab kv`` to the main app."""
    app.command("kv")(kv)
