"""Step times of a planned stretch of decodes: the participants' contexts by schedule (:class:`Stretch`, :class:`DecodeEnds`) and the cost model's times, with CUDA-graph padding and CPU work."""

from __future__ import annotations

from bisect import insort
from itertools import accumulate
from typing import Any, Final

import numpy as np

from lab.engine.jump.base import decode_cpu, decode_times, end_times, float_array, int_array, max_of, min_of


# A plan's first pricing of up to this many schedules is done in plain floats when the cost model has a steady form
# (:func:`priced_in_floats`): a few numpy calls on a handful of values cost more than the values.
FLOAT_PRICED: Final = 64


def priced_in_floats(stretch: "Stretch", cost, kk: int, pad_table: np.ndarray, opt, cpu_terms, async_: bool,
                      start: float, in_flight_dt: float | None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """:func:`plan`'s pricing of the pure-decode schedules 0..kk-1 of ``stretch``, computed in plain ints and
    floats, the same values as :func:`priced_with_numpy` (the same float operations, one step at a time):
    (decodes, step seconds with CPU work under sync, end times (under async the step in flight's first), the first
    schedule whose CPU work would show under async or -1); None when the cost model has no steady form."""
    runs = stretch.steady_times(cost, kk, pad_table)
    if runs is None:
        return None
    counts: list[int] = []
    dts: list[float] = []
    cpus: list[float] = []
    for b, times in runs:
        counts += [b] * len(times)
        if cpu_terms:
            cpu: float = decode_cpu(opt, b)
            if async_:
                cpus += [cpu] * len(times)
            else:
                times = [d + cpu for d in times]
        dts += times
    end = start
    ends: list[float] = []
    if in_flight_dt is not None:
        end += in_flight_dt
        ends.append(end)
    for d in dts:
        end += d
        ends.append(end)
    shown = -1
    made = start  # async: schedule j is made at the end of executed step j - 1 and must be done by that of step j
    for j, cpu in enumerate(cpus):
        if not made + cpu <= ends[j]:
            shown = j
            break
        made = ends[j]
    return int_array(counts), float_array(dts), float_array(ends), shown


def priced_with_numpy(stretch: "Stretch", cost, kk: int, pad_table: np.ndarray, opt, cpu_terms, async_: bool,
                       start: float, in_flight_dt: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """:func:`priced_in_floats` through numpy, for any cost model (``Stretch.times``)."""
    counts, dts = stretch.times(cost, kk, pad_table)
    if cpu_terms:
        cpu = decode_cpu(opt, counts)
        if not async_:
            dts = dts + cpu
    # End times added one step at a time, as the event loop adds them (cumsum is sequential).
    ends = end_times(start, in_flight_dt, dts)
    if async_ and cpu_terms:
        # schedule j's CPU work runs from the boundary it is made at (the start, then the end of executed step
        # j-1) and is hidden only if done by the end of executed step j; the jump stops before the first not
        hidden = np.concatenate(([start], ends[:kk - 1])) + cpu <= ends[:kk]
        if not hidden.all():
            return counts, dts, ends, int(np.argmin(hidden))
    return counts, dts, ends, -1


class Stretch:
    """Step shapes of a stretch of pure decodes: participant i (context ``ctx[i]`` at the stretch's first
    schedule) decodes in its first ``rem[i]`` schedules. Sorted by rem, the participants of schedule t are a
    suffix, so counts, Σ contexts and the context range follow from suffix sums. Schedules before the first
    completion have every participant: their shapes follow from Σ and the range of ``ctx`` alone, and the sorted
    sums are built only when a stretch is priced past it (a jump through arrivals prices ~25 steps between
    arrivals, rarely reaching a completion)."""

    __slots__ = ("n", "ctx", "rem", "min_rem", "by_rem", "suffix", "rem_sorted", "ranged")

    def __init__(self, ctx: list[int], rem: list[int], ranged: bool = True) -> None:
        self.n = len(ctx)
        self.ctx = ctx
        self.rem = rem
        self.min_rem = min_of(rem)
        self.ranged = ranged  # the cost model reads the context range (CostModel.uses_decode_range)
        self.by_rem: Any = None

    def _sort(self) -> None:
        ctx, rem = self.ctx, self.rem
        order = sorted(range(len(rem)), key=rem.__getitem__)
        by_rem = [ctx[i] for i in order]
        rev = by_rem[::-1]
        self.by_rem = by_rem
        sums = list(accumulate(rev))[::-1] + [0]
        if self.ranged:
            self.suffix = np.array([sums, list(accumulate(rev, max))[::-1] + [0],
                                    list(accumulate(rev, min))[::-1] + [0]], dtype=np.int64)
        else:
            self.suffix = np.array([sums], dtype=np.int64)
        self.rem_sorted = np.array([rem[i] for i in order])

    def steady_times(self, cost, kk: int, pad_table: np.ndarray, t_from: int = 0) -> list[tuple[int, list[float]]] | None:
        """Schedules t_from..kk-1 as runs of one unchanged batch (it changes only at completions): per run, its
        decodes and its step seconds (plain floats) from the cost model's ``steady_decode_times``, each step's from
        its own sums (so a stretch priced in parts has the same times). None when the cost model has no steady
        form."""
        ctx, rem = self.ctx, self.rem
        n = self.n
        if kk <= self.min_rem:  # the common case: no completion among them
            total = 0
            for c in ctx:
                total += c
            times = cost.steady_decode_times(n, total + n * t_from, max_of(ctx) + t_from, min_of(ctx) + t_from,
                                             int(pad_table[n]), kk - t_from)
            return None if times is None else [(n, times)]
        by_rem = sorted(zip(rem, ctx))
        runs = []
        first = 0  # by_rem[first:] take part in schedule t0 (rem > t0)
        t0 = t_from
        while t0 < kk:
            while by_rem[first][0] <= t0:
                first += 1
            t1 = min(kk, by_rem[first][0])
            part = [c for _, c in by_rem[first:]]
            b = n - first
            times = cost.steady_decode_times(b, sum(part) + t0 * b, max(part) + t0, min(part) + t0,
                                             int(pad_table[b]), t1 - t0)
            if times is None:
                return None
            runs.append((b, times))
            t0 = t1
        return runs

    def times(self, cost, kk: int, pad_table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(decodes, step seconds) of the stretch's schedules 0..kk-1, cost model's times without CPU work."""
        dmax: Any
        dmin: Any
        js = np.arange(kk, dtype=np.int64)
        if kk <= self.min_rem:  # no completion among them: every participant decodes in each
            n = self.n
            counts = np.full(kk, n, dtype=np.int64)
            dsum = sum(self.ctx) + n * js
            if self.ranged:
                dmax = max(self.ctx) + js
                dmin = min(self.ctx) + js
            else:
                dmax = dmin = None
            return counts, decode_times(cost, counts, dsum, dmax, dmin, pad_table[counts], self.ctx)
        if self.by_rem is None:
            self._sort()
        idx = self.rem_sorted.searchsorted(js, side="right")  # first participant in rem order
        counts = self.n - idx
        suffix = self.suffix
        dsum = suffix[0, idx] + counts * js
        if self.ranged:
            dmax = suffix[1, idx] + js
            dmin = suffix[2, idx] + js
        else:
            dmax = dmin = None
        return counts, decode_times(cost, counts, dsum, dmax, dmin, pad_table[counts], self.by_rem)


class DecodeEnds:
    """The decoding batch of a jump through arrivals, for a cost model that reads decodes only through their count
    and Σ contexts (:func:`through_arrivals` with ``aggregates``): participants by the schedule of their last
    decode + 1 (``s0 + rem``: their end), with each one's context base (its context at schedule j is base + j).
    Entries before ``lo`` have ended; ``base_sum`` is Σ base of the rest. A schedule's decodes and a stretch's
    runs of one batch then cost what changes, not the batch size."""

    __slots__ = ("by_end", "lo", "base_sum")

    def __init__(self, ends: list[int], bases: list[int]) -> None:
        self.by_end = sorted(zip(ends, bases))
        self.lo = 0
        self.base_sum = sum(bases)

    def advance(self, j: int) -> int:
        """Drop the participants whose decodes end before schedule j; return how many decode in it."""
        by_end, lo = self.by_end, self.lo
        while lo < len(by_end) and by_end[lo][0] <= j:
            self.base_sum -= by_end[lo][1]
            lo += 1
        self.lo = lo
        return len(by_end) - lo

    def add(self, end: int, base: int) -> None:
        """A participant that decodes from the next schedule until ``end`` (exclusive)."""
        insort(self.by_end, (end, base), lo=self.lo)
        self.base_sum += base

    def last_end(self) -> int:
        """The largest end among those left (0 if none)."""
        return self.by_end[-1][0] if self.lo < len(self.by_end) else 0

    def stretch(self, j_lo: int) -> "_EndsStretch":
        """The decodes from schedule ``j_lo`` on (after :meth:`advance` to it) as a stretch to price."""
        return _EndsStretch(self, j_lo)


class _EndsStretch:
    """:class:`Stretch`'s pricing (``steady_times``; ``times`` through a :class:`Stretch` built on demand) of the
    decodes left in a :class:`DecodeEnds` from schedule ``j_lo`` on: the same runs, the same integer sums."""

    __slots__ = ("ends", "j_lo")

    def __init__(self, ends: DecodeEnds, j_lo: int) -> None:
        self.ends = ends
        self.j_lo = j_lo

    def steady_times(self, cost, kk: int, pad_table: np.ndarray, t_from: int = 0) -> list[tuple[int, list[float]]] | None:
        """As :meth:`Stretch.steady_times` for a cost model that reads no context range (0 passed for it)."""
        ends, j_lo = self.ends, self.j_lo
        by_end = ends.by_end
        k = ends.lo
        b = len(by_end) - k
        base_sum = ends.base_sum
        while k < len(by_end) and by_end[k][0] - j_lo <= t_from:  # (the decodes ended before schedule t_from)
            base_sum -= by_end[k][1]
            b -= 1
            k += 1
        runs = []
        t0 = t_from
        while t0 < kk:
            t1 = by_end[k][0] - j_lo
            if t1 > kk:
                t1 = kk
            times = cost.steady_decode_times(b, base_sum + b * (j_lo + t0), 0, 0, int(pad_table[b]), t1 - t0)
            if times is None:
                return None
            runs.append((b, times))
            while k < len(by_end) and by_end[k][0] - j_lo <= t1:  # the decodes ending there leave the batch
                base_sum -= by_end[k][1]
                b -= 1
                k += 1
            t0 = t1
        return runs

    def times(self, cost, kk: int, pad_table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`Stretch.times` of the same decodes."""
        left = self.ends.by_end[self.ends.lo:]
        j_lo = self.j_lo
        return Stretch([base + j_lo for _, base in left], [end - j_lo for end, _ in left],
                        cost.uses_decode_range).times(cost, kk, pad_table)
