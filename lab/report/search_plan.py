"""The search modes of one candidate: a bisection over the bracket (``max_rate``, ``max_concurrency``,
``min_instances``) or a grid of values (``max_goodput``); the probe each needs next, those it may need after the
ones in flight, and the answer (:class:`SearchPlan`)."""

from __future__ import annotations

from typing import Any, Callable

from lab.report.search_judge import Probe
from lab.report.search_spec import SearchSpec, searched_value


def bisect_boundary(ok: Callable[[float], bool], low: float, high: float, integer: bool, increasing_ok: bool,
                    tolerance: float) -> float | None:
    """The boundary value of a monotone predicate on [low, high]: the largest value that is ok when ok holds for
    small values (``increasing_ok`` False: max load), the smallest when it holds for large ones (min instances).
    None when no value in the bracket is ok."""
    good, bad = (low, high) if not increasing_ok else (high, low)
    if not ok(good):
        return None
    if ok(bad):
        return bad
    while True:
        if integer:
            if abs(good - bad) <= 1:
                return good
            mid = float(int((good + bad) // 2))
        else:
            if abs(bad - good) <= tolerance * min(good, bad):
                return good
            mid = (good + bad) / 2.0
        if ok(mid):
            good = mid
        else:
            bad = mid


class _Unknown(Exception):
    """Raised inside a replay of the search at a value whose outcome is not known (yet)."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.value = value


class SearchPlan:
    """One candidate's search: the outcomes known so far, which probe it needs next (:meth:`next_value`), the probes
    it may need after the ones in flight (:meth:`ahead`), and its answer once complete."""

    def __init__(self, spec: SearchSpec, name: str, data: dict) -> None:
        self.spec, self.name, self.data = spec, name, data
        self.known: dict[Any, bool] = {}
        self.probes: dict[Any, Probe] = {}
        self.running: set = set()
        self.submitted: list = []  # values in the order they were started
        self.error = ""

    @property
    def grid(self) -> bool:
        return self.spec.find == "max_goodput"

    def next_value(self, known: dict[Any, bool]) -> tuple[bool, Any]:
        """``(True, value)``: the probe the search asks for next, given the outcomes ``known``; ``(False,
        answer)`` once it needs none (the bisection's answer; None for a grid: :meth:`answer` picks it)."""
        if self.grid:
            for v in self.spec.values:
                if v not in known:
                    return True, v
            return False, None
        spec = self.spec

        def ok(v: float) -> bool:
            v = searched_value(spec, v)
            if v not in known:
                raise _Unknown(v)
            return known[v]

        try:
            found = bisect_boundary(ok, spec.low, spec.high, spec.find != "max_rate", spec.find == "min_instances",
                            spec.tolerance)
        except _Unknown as u:
            return True, u.value
        return False, found

    @property
    def complete(self) -> bool:
        return bool(self.error) or not self.next_value(self.known)[0]

    def ahead(self, limit: int) -> list[Any]:
        """Up to ``limit`` values the search needs now or may need next, in order of need: the one it needs now
        first, then (breadth first over the outcomes of the probes not known yet, a hit before a miss) those the
        next decisions would ask for. A grid: its values not known, in order."""
        if self.grid:
            return [v for v in self.spec.values if v not in self.known][:limit]
        out: list = []
        queue = [dict(self.known)]
        looked = 0
        while queue and len(out) < limit and looked < 4 * limit + 8:
            hyp = queue.pop(0)
            looked += 1
            more, v = self.next_value(hyp)
            if not more:
                continue
            if v not in out:
                out.append(v)
            queue += [{**hyp, v: True}, {**hyp, v: False}]
        return out

    def remaining(self) -> int:
        """The most probes the search may still need, those in flight included: a grid's values not known; a
        bisection's path from here when every outcome not known is a miss except at the bracket's easy end (the
        longest for max_rate, whose tolerance is relative to the lower end)."""
        if self.error:
            return 0
        if self.grid:
            return sum(v not in self.known for v in self.spec.values)
        spec = self.spec
        easy = searched_value(spec, spec.high if spec.find == "min_instances" else spec.low)
        hyp = dict(self.known)
        n = 0
        while True:
            more, v = self.next_value(hyp)
            if not more:
                return n
            hyp[v] = v == easy
            n += 1

    def path(self) -> list[Any]:
        """The values the search asked for, in order, given the outcomes known (its probes that were needed)."""
        hyp: dict = {}
        out = []
        while True:
            more, v = self.next_value(hyp)
            if not more or v not in self.known:
                return out
            out.append(v)
            hyp[v] = self.known[v]

    def answer(self) -> Any:
        """The answer: the bisection's boundary value, or the grid's value with the most goodput among the eligible
        probes (the earliest listed on a tie); None when none qualifies."""
        more, found = self.next_value(self.known)
        if not self.grid:
            return None if found is None else searched_value(self.spec, found)
        best = None
        for v in self.spec.values:
            p = self.probes.get(v)
            if p is not None and p.ok and (best is None or p.figures["goodput"] > self.probes[best].figures["goodput"]):
                best = v
        return best
