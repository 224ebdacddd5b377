"""Shared types and helpers of the jump: the plan (:class:`Plan`), block-event packing, padding tables, small list helpers."""

from __future__ import annotations

from heapq import heapify
from typing import Any, Final

import numpy as np

from lab.core.batch import BatchShape, padded_size_table
from lab.core.request import Request


# Longest jump planned at once (bounds the planning work wasted when an arrival interrupts it).
MAX_JUMP_STEPS = 4096


# A planned block operation (``Plan.events``) is one int, so that sorting a jump's operations into execution order
# compares ints, not tuples: (schedule j, participant position i, kind) packed as j << 32 | i << 3 | (kind + 1),
# which orders as the tuple does (i < 2**29, kind -1..3; j < MAX_JUMP_STEPS keeps it a short int, unboxed when
# compiled). Kinds: -1 schedule 0's preemptions, 0 a new block, 1 register the block just filled, 2 admit, 3 the
# next chunk of a prompt.
EV_SCHEDULE_SHIFT: Final = 32


EV_POS_SHIFT: Final = 3


EV_POS_MASK: Final = (1 << 29) - 1


EV_KIND_MASK: Final = (1 << EV_POS_SHIFT) - 1  # (kind + 1, in the low bits)


# The heaps of a jump's coming events (completions, decode ends, crossing ends: a schedule and a participant) hold
# ints packed as schedule << 32 | participant, which order as the pairs do (schedules >= 0, participants < 2**32) and
# compare without tuples.
HEAP_SHIFT: Final = 32


HEAP_MASK: Final = (1 << 32) - 1


def float_array(values: list) -> np.ndarray:
    """A float64 array of a list of Python floats (or ints): ``np.fromiter`` with the length given, about 40 % less
    work than ``np.array``'s type discovery for the long lists a jump makes (the same values)."""
    return np.fromiter(values, np.float64, len(values))


def int_array(values: list) -> np.ndarray:
    """An int64 array of a list of Python ints (:func:`float_array`'s way)."""
    return np.fromiter(values, np.int64, len(values))


def max_of(values: list[int]) -> int:
    """``max(values)`` of a non-empty list of ints, in a typed loop (the builtin compares Python objects)."""
    top = values[0]
    for v in values:
        if v > top:
            top = v
    return top


def min_of(values: list[int]) -> int:
    """``min(values)`` of a non-empty list of ints, in a typed loop."""
    low = values[0]
    for v in values:
        if v < low:
            low = v
    return low


def remove_value(values: list[int], x: int) -> None:
    """``values.remove(x)`` for a list of ints, the search in a typed loop.

    Raises:
        ValueError: ``x`` is not in ``values``.
    """
    for k in range(len(values)):
        if values[k] == x:
            del values[k]
            return
    raise ValueError(f"{x} is not in the list")


def block_event(j: int, i: int, kind: int) -> int:
    """The packed block operation (schedule ``j``, participant ``i``, ``kind``); see ``EV_SCHEDULE_SHIFT``."""
    return (j << EV_SCHEDULE_SHIFT) | (i << EV_POS_SHIFT) | (kind + 1)


class Plan:
    """A planned stretch of decode steps.

    Schedules j = 0..num_schedules-1 are planned; request i (``reqs[i]``, with ``computed0[i]`` computed tokens and
    ``outputs0[i]`` outputs at the start) takes part in schedules j < rem[i]. Sync: schedule j executes as
    step j, in [ends[j-1], ends[j]). Async: the step already in flight (``first``) executes as step 0 and schedule j
    as step j+1, one step after it was scheduled; the last schedule is left in flight when the jump ends. Of the
    requests of that step in flight, ``new_first`` get their first token from it and ``earlier`` (positions) had
    their previous token before it started (the others at its start).

    With planned admissions (``admissions``: (schedule, position) pairs: arrivals, or with ``from_queue`` the
    waiting queue's heads) the admitted requests follow the running requests in
    ``reqs``: participant i takes part in schedules ``s0[i]`` .. ``s0[i] + rem[i] - 1`` and computes
    ``first_tokens[i]`` tokens before its decodes (its whole prompt; 1 for a running request, ``s0`` = 0, one of
    the first ``num_running``), in
    the chunks ``chunks[i]`` of its first schedules (one, or several for a prompt the budget chunks; the last
    samples its first token); its admission allocates the blocks of ``alloc0[i]`` tokens (its first chunk, or its
    whole prompt for a policy that reserves it).
    """

    # attributes set outside __init__, declared for the compiled build (mypyc's class layout)
    adm_sched: Any
    admit_after: Any
    mid_victims: Any
    preempted_at: Any
    truncated: Any
    async_: Any
    block_size: Any
    caching_unique: Any
    computed0: Any
    dts: Any
    earlier: Any
    ends_list: Any
    events: Any
    fin_sorted: Any
    finish_at: Any
    first: Any
    new_first: Any
    num_schedules: Any
    num_waiting: Any
    outputs0: Any
    rem: Any
    reqs: Any
    sizes: Any
    start: Any
    stops: Any
    __slots__ = ("reqs", "rem", "computed0", "outputs0", "num_schedules", "dts", "ends", "events", "start", "first",
                 "async_", "applied_sched", "applied_out", "num_waiting", "new_first", "earlier", "used", "finish_at",
                 "sizes", "_ev_pos", "_counts", "deferred_arrivals", "caching_unique", "block_size", "ends_list",
                 "arrivals", "admit_after", "s0", "first_tokens", "admissions", "stops", "admitted_at", "wait_rows",
                 "planned", "fin_sorted", "adm_sched", "from_queue", "chunks", "alloc0", "busy", "num_running",
                 "victims", "mid_victims", "preempted_at", "truncated")

    def __init__(self) -> None:
        self.applied_sched = 0
        self.applied_out = 0
        self.used: list[int] = []
        self._ev_pos = 0
        self._counts: Any = None
        self.deferred_arrivals = 0  # arrivals during the last planned step (they do not interrupt the jump)
        self.arrivals: list[float] = []  # times of earlier arrivals that left the blocked waiting head in place
        # planned admissions of arrivals known in advance (through_arrivals) or of the queue's heads
        # (through_queue); None / empty without
        self.s0: Any = None  # per participant, its first planned schedule (0: running at the start,
        # or a queue head schedule 0 admits)
        self.num_running = 0  # participants 0..num_running-1 were running at the start
        self.first_tokens: Any = None  # tokens it computes before its decodes (1, or its whole prompt)
        self.chunks: Any = None  # per participant, the tokens of its prompt at each of its first schedules
        self.alloc0: Any = None  # tokens whose blocks its admission allocates
        self.admissions: list[tuple[int, int]] = []  # (schedule, position) of each planned admission
        self.admitted_at: dict[int, list[tuple[int, bool]]] = {}  # executed step -> (prompt tokens, sampled) pairs
        self.wait_rows: dict[int, int] = {}  # executed step -> arrivals waiting in its row
        self.planned: set[int] = set()  # id() of the requests the jump admits
        self.from_queue = False  # they are the waiting queue's heads (through_queue), not arrivals
        self.busy: set[int] = set()  # with from_queue: schedules that admit or compute a prompt chunk
        # schedule 0's preemptions (_decode_victims), in order: (running participants before the decode that needs
        # the block, victim, reason); the victims are not participants
        self.victims: list[tuple[int, Request, str]] = []
        # the preemptions of later schedules (a walk through the queue, :func:`walk_preemptions`), in order:
        # (schedule, participant whose decode needs the block, reason, victim participant, its rem and fin before);
        # the victim's schedules end before that one (``rem``), and a later admission of it is another participant
        self.mid_victims: list[tuple[int, int, str, int, int, int]] = []
        self.preempted_at: list[int] = []  # their schedules, sorted (one entry per victim)
        self.truncated: dict[int, int] = {}  # victim participant -> the schedule that preempts it


def decode_cpu(opt, counts):
    """CPU seconds of pure-decode schedules of ``counts`` requests, an int or an int array (``Instance.step_cpu_time``
    with as many tokens as sequences and no admission; a zero coefficient's term is left out, which changes no
    sum)."""
    cpu = opt.cpu_base_s + opt.cpu_per_seq_s * counts
    if opt.cpu_per_token_s:
        cpu = cpu + opt.cpu_per_token_s * counts
    return cpu


def end_times(start: float, in_flight_dt: float | None, dts: np.ndarray) -> np.ndarray:
    """End times of consecutive steps from ``start`` (seconds): the step in flight (async) if ``in_flight_dt`` is
    given, then steps of ``dts``; added one at a time, as the event loop adds them (cumsum is sequential)."""
    head = 1 if in_flight_dt is None else 2
    t = np.empty(len(dts) + head)
    t[0] = start
    if in_flight_dt is not None:
        t[1] = in_flight_dt
    t[head:] = dts
    return t.cumsum()[1:]


# Waiting requests read at once when a jump plans admissions from the queue (more are read when it admits them all).
QUEUE_HEADS = 8


NEVER: Final = 1 << 40  # the completion step of a participant preempted during the jump (it completes in none)


def heap_remove(heap: list[int], entry: int) -> bool:
    """Remove ``entry`` from a heap of ints (kept a heap); False when it is not there."""
    for x in range(len(heap)):
        if heap[x] == entry:
            tail = heap.pop()
            if x < len(heap):
                heap[x] = tail
                heapify(heap)
            return True
    return False


def aggregate_shape(num_decodes: int, decode_sum: int, news: list[int], contexts: list[int]) -> BatchShape:
    """The shape of a step of ``num_decodes`` decodes (Σ contexts ``decode_sum``) and queries of ``news`` new tokens
    after ``contexts`` (a one-token query is a decode, as :meth:`BatchShape.from_requests` classifies it), for a
    cost model that reads decodes only through their count and Σ (``uses_decode_list`` and ``uses_decode_range``
    False): the per-decode list is left empty and the range 0."""
    prefill_new: list[int] = []
    prefill_context: list[int] = []
    prefill_tokens = 0
    for n, c in zip(news, contexts):
        if n > 1:
            prefill_new.append(n)
            prefill_context.append(c)
            prefill_tokens += n
        else:
            num_decodes += 1
            decode_sum += c
    return BatchShape(num_decodes + prefill_tokens, num_decodes + len(prefill_new), prefill_new, prefill_context,
                      [], num_decodes, decode_sum, 0, 0)


_PAD_TABLES: dict[tuple, tuple] = {}


def padding_table(sizes: tuple[int, ...], top: int) -> np.ndarray:
    """Padded token count of a pure-decode step by its batch size 0..top+1 (0 = above the largest CUDA-graph size),
    built once per (sizes, top)."""
    key = (id(sizes), top)  # the options' tuple lives as long as the run; hashing its ~35 sizes per plan costs more
    hit = _PAD_TABLES.get(key)
    if hit is None or hit[0] is not sizes:
        if len(_PAD_TABLES) >= _PAD_TABLES_KEPT:  # runs one after another in a process (a sweep) do not pile up
            _PAD_TABLES.clear()
        hit = _PAD_TABLES[key] = (sizes, padded_size_table(sizes, top + 1))
    return hit[1]


_PAD_TABLES_KEPT = 64  # (sizes, top) pairs cached at most: a cluster's instances share one, pools a few


def decode_times(cost, counts, dsum, dmax, dmin, padded, ctx_by_rem: list[int]) -> np.ndarray:
    """Times of planned pure-decode steps j = 0..k-1 (per step: decodes, Σ contexts, context range, padded tokens).
    Uses the cost model's vectorised ``decode_times`` (lab/costmodel/base.py) when it gives one; otherwise builds
    each step's shape (the participants of step j are the requests, in rem order, from the first with rem > j) and
    calls ``step_time``."""
    times = cost.decode_times(counts, dsum, dmax, dmin, padded)
    if times is not None:
        return np.asarray(times, dtype=float)
    k = len(counts)
    out = np.empty(k)
    n = len(ctx_by_rem)
    for j in range(k):
        part = [c + j for c in ctx_by_rem[n - int(counts[j]):]]
        sh = BatchShape.decode_only(part, int(dsum[j]), int(dmax[j]), int(dmin[j]))
        sh.padded_tokens = int(padded[j])
        out[j] = cost.step_time(sh)
    return out


def running_outputs(async_: bool, m: int, sched: int, n_out: int) -> tuple[int, int]:
    """(outputs, steps in flight) of a request running at the jump's start that takes part in ``m`` schedules,
    after ``sched`` of its schedules and ``n_out`` steps: async, the step in flight at the start gives it one
    output and schedule j's step (j + 1) the next; sync, schedule j's step (j) gives it one."""
    if async_:
        out = 0 if n_out == 0 else (n_out if n_out < m + 1 else m + 1)
        return out, 1 + sched - out
    out = n_out if n_out < m else m
    return out, sched - out
