"""Extension: a jump goes on through arrivals known in advance (``Instance.jump.known_arrivals``) when the scheduler's admission rule says each is admitted whole (:func:`through_arrivals`)."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np

from lab.core.kv_cache import unique_content
from lab.core.request import Request
from lab.engine.jump.base import Plan
from lab.engine.jump.pricing import DecodeEnds
from lab.engine.jump.admitting import ExtendedJump, decode_stretch, start_extension
from lab.engine.jump import decisions


# An arrival this close to a step boundary (seconds) is not planned: SimPy's clock may differ from the trace's
# arrival time by an ulp, and the order of the two would then be a coin toss.
_ARRIVAL_MARGIN_S = 1e-7


class KnownArrivals:
    """The requests an open-loop stream delivers to one instance, in delivery order, each at exactly its
    ``arrival_time`` (lab/experiment/simulation.py sets it only then); ``next`` is the position of the first not yet
    delivered (``Instance.add_request`` advances it)."""

    __slots__ = ("requests", "next")

    def __init__(self, requests: list) -> None:
        self.requests = requests
        self.next = 0

    def peek(self, offset: int = 0):
        """The request ``offset`` places after the next one to arrive, or None past the end."""
        i = self.next + offset
        requests = self.requests
        return requests[i] if i < len(requests) else None


def planned_arrival(plan: Plan, request: Request) -> bool:
    """Whether the jump ``plan`` admits ``request`` (an arrival it planned: it only joins the waiting queue)."""
    return id(request) in plan.planned


def arrivals_allowed(inst, running: list[Request], caching: bool) -> bool:
    """Whether a jump may plan admissions on this instance now: one pipeline stage, no CPU KV tier, no swap copy
    pending, and (with prefix caching) no running request whose blocks others may share (their frees are then
    exact block counts)."""
    if len(inst.options.stage_layers) > 1 or inst.kv_offload is not None or inst.swap.pending_s:
        return False
    return not caching or inst.jump.all_content_unique or all(map(unique_content, running))


def through_arrivals(inst, known: KnownArrivals, start: float, async_: bool, running: list[Request], computed0: list[int],
                      rem: list[int], fin: list[int], dts: np.ndarray, counts: np.ndarray, ends: list[float],
                      cap: int, stop_time: float, pad_table: np.ndarray) -> ExtendedJump:
    """Extend a planned stretch of decodes (``dts``, ``counts``, ``ends``: schedules from ``start``) through the
    admissions of the next arrivals, while each is certain.

    The next request R arrives at its known time t; the first schedule made after t (j, at the end of the step
    under way) is the one that sees it, with every other request arriving before it (:func:`seen_together`: in
    a burst, several arrive during one step). The jump admits them there when the scheduler's declared rule
    (``decisions.admits_whole``) says that schedule admits each, in queue order, with its whole prompt, given
    the running count, the decodes it schedules first, the prompts admitted before it and the free blocks after
    their allocations (:func:`_admits_all`). Schedule j then computes the decodes and their prompts, priced by the
    cost model as the engine prices it (``Instance.price_step``: CUDA-graph padding, CPU work), and from j + 1 on
    they decode with the others until their ``stop_at``. The next stretch of decodes is planned up to the next
    arrival, and so on. The extension stops at the first arrival that is not certain
    (it then sizes the jump as the expected next arrival does), at ``cap`` schedules and before ``stop_time``;
    under async scheduling also before a schedule whose CPU work would show. :meth:`ExtendedJump.bound` then cuts the
    whole at the first schedule that would run out of KV blocks."""
    a, ad = start_extension(inst, running, computed0, rem, fin, dts, counts, ends)
    ends = a.ends
    eps = _ARRIVAL_MARGIN_S
    cost = inst.cost_model
    aggregates = not cost.uses_decode_range and not cost.uses_decode_list
    dbase = ad.dbase
    # (aggregates: the decoding batch kept by decode end, so that a schedule and a stretch cost what changes)
    ends_of = DecodeEnds(list(rem), list(computed0)) if aggregates else None
    m = 0
    while True:
        r = known.peek(m)
        if r is None:
            a.hint = float("inf")
            return a
        t = a.hint = r.arrival_time
        e = bisect_right(ends, t)
        j = e + 1  # the first schedule made after t (schedule j is made when executed step j - 1 ends)
        if j >= len(a.dts) or j >= cap:
            return a
        at = ends[e]
        if t - (start if e == 0 else ends[e - 1]) <= eps or at >= stop_time:
            return a
        group = seen_together(inst, known, m, at, eps)
        if group is None:
            return a
        decoders: Any
        if ends_of is not None:  # the decodes' count and Σ contexts are all the cost model reads
            avail = ad.free_at(a, j)
            num_decodes = ends_of.advance(j)
            decoders = num_decodes, ends_of.base_sum + num_decodes * j
        else:
            decoders, avail = ad.at_schedule(a, j)
            num_decodes = len(decoders)
        if not _admits_all(inst, group, len(ad.alive), num_decodes, avail):
            return a
        if not ad.admit(a, group, j, at, decoders):
            return a
        if ends_of is not None:
            for i in range(len(a.c0) - len(group), len(a.c0)):
                ends_of.add(a.s0[i] + a.rem[i], dbase[i])
        m += len(group)
        nxt = known.peek(m)
        a.hint = nxt.arrival_time if nxt is not None else float("inf")
        if not decode_stretch(inst, a, ad.alive, ad.dbase, j + 1, cap, stop_time, async_, pad_table, ad.cpu_on,
                               ends_of):
            return a


def seen_together(inst, known: KnownArrivals, m: int, at: float, eps: float) -> list | None:
    """The arrivals from ``known.peek(m)`` on that the schedule made at ``at`` (seconds) sees first, in the
    order the waiting queue serves them: those arriving more than ``eps`` before ``at`` (the first is known to
    arrive after the schedule before it), when the next arrives more than ``eps`` after ``at``. None when that is
    not certain (an arrival within ``eps`` of ``at``; several, and the queue does not serve arrivals in arrival
    order, ``WaitingQueue.arrivals_join_back``) or one of them holds computed state, blocks, or is rejected."""
    group = [known.peek(m)]
    if at - group[0].arrival_time <= eps:
        return None
    after = known.peek(m + 1)
    while after is not None and after.arrival_time <= at + eps:
        if (after.arrival_time >= at - eps or after.arrival_time < group[-1].arrival_time
                or not inst.waiting.arrivals_join_back):
            return None
        group.append(after)
        after = known.peek(m + len(group))
    for r in group:
        if r.num_computed_tokens or r.blocks or inst.rejection_reason(r):
            return None
    return group


def _admits_all(inst, group: list, num_running: int, num_decodes: int, num_free_blocks: int) -> bool:
    """Whether a schedule of ``num_decodes`` decodes (``num_free_blocks`` free blocks after their allocations;
    negative: it preempts) admits every request of ``group`` (arrivals, in service order) with its whole prompt,
    by the scheduler's declared rule (``decisions.admits_whole``), each after those before it, as
    :func:`_heads_admitted` applies it to a queue's heads."""
    num_scheduled_tokens = num_decodes
    left = len(group)
    for r in group:
        if num_free_blocks < 0:
            return False
        kind, _, blocks = decisions.head_decision(inst, r, num_running, num_scheduled_tokens, num_free_blocks, left)
        if kind != decisions.WHOLE:
            return False
        left -= 1
        if left:
            num_free_blocks -= blocks
            num_running += 1
            num_scheduled_tokens += r.num_tokens
    return True
