"""The sweep's progress display (``servelab sweep``): a rich progress bar on a terminal, plain lines elsewhere.

Both show runs done / running / failed / reused out of the total, the elapsed time and the ETA of
lab/report/sweep.py ``SweepState``. On a terminal the bar redraws in place; on a non-terminal (CI logs, pipes) a
line is printed when a run fails, every ``every_n`` finished runs (default: a tenth of the sweep) and at least every
``every_s`` seconds while the sweep runs, plus a last line at the end.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from lab.report.sweep import SweepState


def clock(seconds: float | None) -> str:
    """``h:mm:ss`` (``m:ss`` under an hour); ``?`` for None."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def counts(state: SweepState) -> str:
    """``"12/200 runs: 8 done, 3 reused, 1 failed, 2 running; elapsed 0:14, ETA 3:02"``."""
    return (f"{state.finished}/{state.total} runs: {state.done} done, {state.reused} reused, {state.failed} failed, "
            f"{state.running} running; elapsed {clock(state.elapsed_s)}, ETA {clock(state.eta_s)}")


class SweepDisplay:
    """Callable progress sink for ``run_sweep(progress=...)``; a context manager (the bar lives inside the block).

    ``tty`` None: the console's own answer (``Console.is_terminal``)."""

    def __init__(self, console: Console, tty: bool | None = None, every_s: float = 5.0,
                 every_n: int | None = None) -> None:
        self.console = console
        self.tty = console.is_terminal if tty is None else tty
        self.every_s = every_s
        self.every_n = every_n
        self._bar: Progress | None = None
        self._task = None
        self._last_print = 0.0
        self._last_count = 0
        self._state: SweepState | None = None

    def __enter__(self) -> "SweepDisplay":
        if self.tty:
            self._bar = Progress(TextColumn("[bold]sweep"), BarColumn(), TextColumn("{task.fields[counts]}"),
                                 console=self.console, transient=False)
            self._bar.__enter__()
        self._last_print = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        elif self._state is not None and self._last_count != self._state.finished:
            self._line(self._state)

    def __call__(self, state: SweepState) -> None:
        self._state = state
        if self._bar is not None:
            self._draw(state)
            if state.last_error:
                self._bar.console.print(f"failed: {state.last}: {state.last_error}", highlight=False, markup=False,
                                       soft_wrap=True)
            return
        if state.last_error:
            self.console.print(f"failed: {state.last}: {state.last_error}", highlight=False, markup=False,
                               soft_wrap=True)
        every_n = self.every_n or max(1, state.total // 10)
        now = time.monotonic()
        if state.finished - self._last_count >= every_n or now - self._last_print >= self.every_s:
            self._line(state)

    def _draw(self, state: SweepState) -> None:
        if self._task is None:
            self._task = self._bar.add_task("sweep", total=state.total, counts="")
        self._bar.update(self._task, completed=state.finished, counts=counts(state))

    def _line(self, state: SweepState) -> None:
        self.console.print(f"sweep: {counts(state)}", highlight=False, markup=False, soft_wrap=True)
        self._last_print = time.monotonic()
        self._last_count = state.finished
