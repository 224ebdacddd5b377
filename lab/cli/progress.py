"""Progress displays of the long commands: a rich progress bar on a terminal, plain lines elsewhere (CI logs, pipes).

* :class:`ItemProgress` (``servelab bench``, ``costcheck``, ``calibrate``): a list of items of known (estimated)
  weights, one at a time. It shows the total, the current item, the elapsed time and an ETA: elapsed / the weight
  done so far x the weight left, where an item under way counts with the share of it done (when the caller can
  tell, :meth:`ItemProgress.update`). Weights are the caller's estimate of each item's cost (expected seconds,
  rows to fit); the ETA scales them by the speed measured so far, so a slower machine moves the ETA, not the
  weights. An item of weight 0 (reading the inputs) is shown but its time is left out of that speed. Off a
  terminal a line is printed when an item starts and when it ends, and at most every ``every_s`` seconds
  (default 30) while one runs and reports its share.
* :class:`SearchDisplay` (``servelab search``): a line per probe (its value and outcome, each bound as judged), and
  on a terminal a bar with the probes done out of the most the search may need, those in flight, elapsed and an
  ETA that bounds the time left (lab/report/search.py ``SearchState``).

Both write to the console they are given (``servelab`` passes stderr, so stdout keeps the results).
"""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from lab.cli.sweep_display import clock


class ItemProgress:
    """Progress over ``total`` items of a long command; a context manager (the bar lives inside the block).

    Call :meth:`add` for items whose number is known only later (a phase that plans its own items), :meth:`start`
    as each item starts (with its weight), :meth:`update` with the share of it done where the caller can tell, and
    :meth:`done` when it ends (with a note for its line). :meth:`line` prints any other line (above the bar on a
    terminal). ``tty`` None: the console's own answer (``Console.is_terminal``)."""

    def __init__(self, console: Console, title: str, total: int = 0, weight: float = 0.0, tty: bool | None = None,
                 every_s: float = 30.0, clock_fn: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.title = title
        self.tty = console.is_terminal if tty is None else tty
        self.every_s = every_s
        self.total = total
        self.total_weight = weight
        self.count = 0  # items done
        self.weight_done = 0.0
        self.current: str | None = None
        self.current_weight = 0.0
        self.current_share = 0.0
        self._now = clock_fn
        self._unweighted_s = 0.0  # time spent in items of weight 0: not part of the speed the ETA uses
        self._t0 = clock_fn()
        self._item_t0 = self._t0
        self._last_line = self._t0
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> "ItemProgress":
        if self.tty:
            self._bar = Progress(TextColumn(f"[bold]{self.title}"), BarColumn(), TextColumn("{task.fields[text]}"),
                                 console=self.console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=1.0, text="")
        self._t0 = self._item_t0 = self._last_line = self._now()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    # -- the caller's side

    def add(self, items: int, weight: float) -> None:
        """``items`` more items of ``weight`` in all."""
        self.total += items
        self.total_weight += weight
        self._draw()

    def start(self, label: str, weight: float = 1.0) -> None:
        """Item ``label`` starts; ``weight`` is its share of the total weight."""
        self.current, self.current_weight, self.current_share = label, weight, 0.0
        self._item_t0 = self._now()
        if not self.tty:
            self._print(f"[{self.count + 1}/{self.total}] {label} ...; {self._times()}")
        self._draw()

    def update(self, share: float, note: str = "") -> None:
        """The current item is ``share`` (0..1) done; off a terminal a line at most every ``every_s`` seconds."""
        self.current_share = min(max(share, 0.0), 1.0)
        if not self.tty and self._now() - self._last_line >= self.every_s:
            what = f"{note}; " if note else f"{self.current_share:.0%}; "
            self._print(f"[{self.count + 1}/{self.total}] {self.current}: {what}{self._times()}")
        self._draw(note)

    def done(self, note: str = "") -> float:
        """The current item ended; its line says ``note`` (default: its label) and its wall time. Returns the item's
        wall seconds."""
        wall = self._now() - self._item_t0
        self.count += 1
        self.weight_done += self.current_weight
        if self.current_weight <= 0:
            self._unweighted_s += wall
        label, self.current, self.current_weight, self.current_share = self.current, None, 0.0, 0.0
        self._print(f"[{self.count}/{self.total}] {note or label} ({clock_or_s(wall)}); {self._times()}")
        self._draw()
        return wall

    def line(self, text: str) -> None:
        """Print a line (above the bar on a terminal)."""
        self._print(text)

    # -- figures

    @property
    def elapsed_s(self) -> float:
        return self._now() - self._t0

    @property
    def eta_s(self) -> float | None:
        """elapsed / weight done x weight left (the current item counted by its share; the time of items of weight
        0 left out); None before any weight is done."""
        done = self.weight_done + self.current_weight * self.current_share
        if done <= 0 or self.total_weight <= 0:
            return None
        busy = self.elapsed_s - self._unweighted_s
        if self.current is not None and self.current_weight <= 0:
            busy -= self._now() - self._item_t0
        return max(busy, 0.0) / done * max(self.total_weight - done, 0.0)

    def _times(self) -> str:
        return f"elapsed {clock(self.elapsed_s)}, ETA {clock(self.eta_s)}"

    def _print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)
        self._last_line = self._now()

    def _draw(self, note: str = "") -> None:
        if self._bar is None:
            return
        done = self.weight_done + self.current_weight * self.current_share
        current = f"{self.current}{f' ({note})' if note else ''}: " if self.current else ""
        self._bar.update(self._task, completed=done / self.total_weight if self.total_weight else 0.0,
                         text=f"{min(self.count + 1, self.total)}/{self.total} {current}{self._times()}")


def clock_or_s(seconds: float) -> str:
    """Under a minute ``12.3 s``, else ``h:mm:ss`` / ``m:ss``."""
    return f"{seconds:.1f} s" if seconds < 60 else clock(seconds)


class SearchDisplay:
    """Callable progress sink for ``run_search(progress=...)``; a context manager (the bar lives in the block).

    Every probe gets a line, ``candidate: field=value -> met: p90 TTFT 412 ms <= 500 ms, ...`` (reused probes say
    so); on a terminal a bar shows the probes done out of the most the search may need, those in flight, the
    elapsed time and an ETA that bounds the time left; off a terminal each probe line ends with the same counts,
    and a line of counts is printed at least every ``every_s`` seconds while probes run."""

    def __init__(self, console: Console, spec, tty: bool | None = None, every_s: float = 30.0) -> None:
        self.console = console
        self.spec = spec
        self.tty = console.is_terminal if tty is None else tty
        self.every_s = every_s
        self._bar: Progress | None = None
        self._task = None
        self._last_line = time.monotonic()
        self._values: dict[str, list] = {}

    def __enter__(self) -> "SearchDisplay":
        if self.tty:
            self._bar = Progress(TextColumn("[bold]search"), BarColumn(), TextColumn("{task.fields[text]}"),
                                 console=self.console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task("search", total=1, text="")
        self._last_line = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def __call__(self, state) -> None:
        from lab.report.search_report import probe_text, value_label

        if state.last is not None:
            name, probe = state.last
            seen = self._values.setdefault(name, [])
            seen.append(probe.value)
            how = " (reused)" if probe.reused else ""
            text = (f"{name}: {self.spec.dotted}={value_label(probe.value, seen)} -> "
                    f"{probe_text(self.spec, probe)}{how}")
            self._print(text if self.tty else f"{text}; {counts(state)}")
        elif not self.tty and time.monotonic() - self._last_line >= self.every_s and state.running:
            self._print(f"search: {counts(state)}; running {', '.join(state.running)}")
        if self._bar is not None:
            self._bar.update(self._task, total=max(state.total, 1), completed=state.finished,
                             text=counts(state) + (f"; running {', '.join(state.running)}" if state.running else ""))

    def _print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)
        self._last_line = time.monotonic()


def counts(state) -> str:
    """``"4 of at most 11 probes (1 reused); elapsed 0:12, ETA <= 0:20"``: the probes finished out of the most the
    search may need, and a bound on the time left."""
    reused = f" ({state.reused} reused)" if state.reused else ""
    eta = "?" if state.eta_s is None else f"<= {clock(state.eta_s)}"
    return f"{state.finished} of at most {state.total} probes{reused}; elapsed {clock(state.elapsed_s)}, ETA {eta}"
