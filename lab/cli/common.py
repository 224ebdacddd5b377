"""What the ``servelab`` commands share: the consoles (results on stdout, progress and errors on stderr), the
options several commands take, the one-line error exit, and loading an experiment with its notes."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

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


def fail(msg: str) -> None:
    """Print ``msg`` as one greppable ``error:`` line on stderr and exit with status 2."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)  # one greppable line
    raise typer.Exit(2)


def load_checked_experiment(path: Path, data_dir: Optional[Path], sets: Optional[list[str]]):
    """The experiment file at ``path`` with its ``--set`` overrides, validated (a bad file or override: one-line
    error, exit 2), with notes on stderr for engine limits a ``--set hardware.gpu`` keeps and SLO bounds that look
    like milliseconds."""
    from lab.experiment.config import ConfigError, load_experiment, parse_set_option

    try:
        overrides = parse_set_option(sets or [])
        exp = load_experiment(path, data_dir, overrides)
    except ConfigError as e:
        fail(str(e))
    if "gpu" in (overrides.get("hardware") or {}):
        _note_pinned_limits(exp, overrides)
    note_slo_units(exp.slo)
    return exp


def note_slo_units(slo) -> None:
    """A note on stderr for SLO bounds that look like milliseconds in a seconds field (the run goes on)."""
    from lab.experiment.config import implausible_slo_bounds

    for note in implausible_slo_bounds(slo):
        err_console.print(f"note: {note}", highlight=False)


def _note_pinned_limits(exp, overrides: dict) -> None:
    """``--set hardware.gpu=...`` keeps engine limits the file pins for another GPU: say so, with vLLM's defaults
    for the new GPU (lab/experiment/resolve.py ``batch_defaults``)."""
    from lab.costmodel.hardware import load_hardware
    from lab.experiment.resolve import batch_defaults

    set_engine = overrides.get("engine") or {}
    mbt, seqs = batch_defaults(load_hardware(exp.hardware.gpu))
    for field, default in (("max_num_batched_tokens", mbt), ("max_num_seqs", seqs)):
        value = getattr(exp.engine, field)
        if value is not None and field not in set_engine and value != default:
            err_console.print(f"note: engine.{field} stays {value} as the file sets it; vLLM's default for "
                              f"{exp.hardware.gpu} is {default} (--set engine.{field}=... to change it)",
                              highlight=False)


def suffixed_name(name: str, set_: Optional[list[str]]) -> str:
    """``name``, with ``--set`` overrides their values as a suffix (as ``servelab run`` names its default folder), so
    an override never replaces the report of the file as it is."""
    if not set_:
        return name
    return f"{name}+" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", "+".join(set_))[:120]
