"""The free queue's order during a walk through the waiting queue (:class:`FreeOrder`): which blocks a decode or an admission takes, so a resumed request's prefix hit on its own freed blocks is exact."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from lab.core.kv_cache import KVCacheManager, unique_content
from lab.core.request import Request, RequestStatus
from lab.engine.jump.base import QUEUE_HEADS, running_outputs
from lab.engine.jump.admitting import ExtendedJump
from lab.engine.jump import decisions


def free_order(inst, a: ExtendedJump, victims: list, j: int, short: bool = False) -> FreeOrder | None:
    """The free queue's order (:class:`FreeOrder`) at the walk's first check point ``j`` (schedule ``j``'s decodes'
    blocks taken): the runs of the waiting heads preempted before, found in the queue now, then schedule 0's takes
    and its preemptions ``victims`` in running order, and up to schedule ``j`` each step's completions and each
    schedule's takes (the decodes of the running requests only: the walk starts before any admission; ``short``:
    schedule ``j`` runs out of blocks, its takes are left to its preemptions). None when there is no head to
    follow."""
    kv: KVCacheManager = inst.kv
    bs = kv.block_size
    fq = kv.pool.free_queue
    order = FreeOrder(fq.n, kv.pool.prepend_unhashed)
    heads = [h for h in inst.waiting.first(QUEUE_HEADS) if h.prev_blocks is not None and unique_content(h)]
    if heads:
        _track_runs(order, kv, heads)
    if not victims and not order.runs and not _preempts_in_walks(inst):
        return None
    n_run: int = a.n_run
    dfirst: list[int] = a.dfirst
    rem: list[int] = a.rem
    fin: list[int] = a.fin
    taken = 0  # schedule 0's takes so far, in running order; each group of victims is freed before its decode's
    v_at = 0  # (victims come in running order: _decode_victims)
    for i in range(n_run):
        while v_at < len(victims) and victims[v_at][0] == i:
            v = victims[v_at][1]
            order.take(taken)
            taken = 0
            order.free(len(v.blocks) - v.num_cached_blocks, v.num_cached_blocks, v)
            v_at += 1
        if dfirst[i] == 0 and rem[i] > 0:
            taken += 1
    order.take(taken)
    for before, v, _ in victims:
        if before == n_run:  # (the last decode preempted itself)
            order.free(len(v.blocks) - v.num_cached_blocks, v.num_cached_blocks, v)
    async_ = inst.async_scheduling
    completing: dict[int, list[int]] = {}  # step -> participants completing at its output, before schedule j
    for i in range(n_run):
        if fin[i] < j:
            completing.setdefault(fin[i], []).append(i)
    done = 0  # schedules whose takes are counted
    for f in sorted(completing):
        order.take(_crossings(a, done + 1, f, bs))  # schedules up to the one before this completion's free
        done = f
        for i in completing[f]:
            full = full_blocks_at_end(a, i, bs, async_)
            order.free(blocks_at_end(a, i, bs) - full, full)
    order.take(_crossings(a, done + 1, j - 1 if short else j, bs))  # (short: schedule j preempts, _QueueWalk.preempt)
    return order


def _preempts_in_walks(inst) -> bool:
    """Whether a walk through the queue may plan preemptions (:func:`walk_preemptions`), whose victims' hits it
    then follows in the free order: the scheduler declares its decode preemptions (asked about the first running
    request)."""
    running = inst.running
    return (inst.kv_offload is None and bool(running)
            and decisions.decode_preemption_reason(inst, running[0]) is not None)


def _crossings(a: ExtendedJump, lo: int, hi: int, bs: int) -> int:
    """Blocks the running participants' decodes take in schedules lo..hi: participant i at schedules dfirst_i,
    dfirst_i + bs, ... below its rem_i."""
    total = 0
    dfirst: list[int] = a.dfirst
    rem: list[int] = a.rem
    for i in range(a.n_run):
        d = dfirst[i]
        m = rem[i]
        first = d if d >= lo else d + (lo - d + bs - 1) // bs * bs
        last = hi if hi < m - 1 else m - 1
        if last >= first:
            total += (last - first) // bs + 1
    return total


def _track_runs(order: FreeOrder, kv, heads: list[Request]) -> None:
    """Find the live own blocks of ``heads`` (preempted, content unique to them) in the free queue, head first; a
    head whose blocks are not one run of consecutive entries, last block first, or lie deep in the queue, is not
    tracked (its hit is then not planned)."""
    fq = kv.pool.free_queue
    fs = kv.pool.free_seq
    rc = kv.pool.ref_cnt
    want: dict[int, tuple[Request, int]] = {}  # block -> (head, index in its blocks)
    live: dict[int, int] = {}
    for h in heads:
        prev: Any = h.prev_blocks
        blocks, seqs = prev
        n = 0
        while n < len(seqs) and not rc[blocks[n]] and fs[blocks[n]] == seqs[n]:
            want[blocks[n]] = (h, n)
            n += 1
        live[id(h)] = n
    found: dict[int, list[int]] = {}  # id(head) -> positions of its blocks 0..n-1
    ids, seqs_q = fq.ids, fq.seqs
    pos = 0
    left = len(want)
    for q in range(fq.head, min(len(ids), fq.head + _RUN_SCAN)):
        if not left:
            break
        b = ids[q]
        if fs[b] != seqs_q[q]:
            continue  # a stale entry
        hit = want.get(b)
        if hit is not None:
            key = id(hit[0])
            where = found.get(key)
            if where is None:
                where = found[key] = [-1] * live[key]
            where[hit[1]] = pos
            left -= 1
        pos += 1
    for h in heads:
        n = live[id(h)]
        where = found.get(id(h))
        if not n or where is None or where != list(range(where[0], where[0] - n, -1)):
            continue
        order.track(h, where[-1], n)


_RUN_SCAN = 4096  # free-queue entries _track_runs reads at most


def blocks_at_end(a: ExtendedJump, i: int, bs: int) -> int:
    """The blocks participant i holds when it completes (those it held, its admission's, its decodes' crossings)."""
    s0: list[int] = a.s0
    rem: list[int] = a.rem
    return blocks_before(a, i, s0[i] + rem[i], bs)


def full_blocks_at_end(a: ExtendedJump, i: int, bs: int, async_: bool, m: int = -1) -> int:
    """Participant i's registered full blocks when it completes: computed tokens // block_size (under async its
    output registers them, lab/core/outputs.py ``cache_computed_blocks``, as the last schedule did not; a
    completing request is not scheduled after its last output's step); with ``m`` >= 0, after its first ``m``
    schedules instead (``num_cached_blocks`` as :func:`_sync_counters` sets it: one token less under async for a
    request past its prompt)."""
    if m < 0:
        m = a.rem[i]
        if i < a.n_run:
            return (a.c0[i] + m) // bs
        k = len(a.chunks[i])
        return (a.c0[i] + a.first_tokens[i] + m - k) // bs
    if i < a.n_run:
        c = a.c0[i] + m
        return (c - 1) // bs if async_ else c // bs
    k = len(a.chunks[i])
    c = a.c0[i] + a.first_tokens[i] + m - k
    return c // bs if m <= k or not async_ else (c - 1) // bs


@contextmanager
def as_preempted(victims: list):
    """While the walk through the queue asks the scheduler's admission rules about schedule 0's victims (not
    preempted yet: the jump's apply preempts them), give them the state ``Instance.preempt`` leaves (recompute):
    waiting, nothing computed or in flight, no blocks held, their own freed blocks remembered (a rule reads only
    that there are some); restored afterwards. The waiting queue itself does not hold them meanwhile: the walk
    passes the rules its length with them (``num_waiting``) and does not ask a rule that could read it short."""
    saved = [as_preempted_now(r, r.num_output_tokens) for r in victims]
    try:
        yield
    finally:
        restore_states(saved)


def blocks_before(a: ExtendedJump, i: int, s: int, bs: int) -> int:
    """The blocks participant i holds before schedule ``s`` allocates (its admission's, its decodes' crossings in
    the schedules before ``s``)."""
    dfirst: list[int] = a.dfirst
    held: list[int] = a.held
    base: list[int] = a.base
    first = dfirst[i]
    return held[i] + base[i] + ((s - first + bs - 1) // bs if s > first else 0)


def outputs_before(a: ExtendedJump, i: int, s: int, async_: bool) -> int:
    """The outputs participant i has gained in the jump when schedule ``s`` is made (``s`` steps completed), as
    :func:`_sync_admitted_counters` counts them for its schedules before ``s``."""
    m = s - a.s0[i]
    if i < a.n_run:
        return running_outputs(async_, m, m, s)[0]
    k = len(a.chunks[i])
    first_out = a.s0[i] + k - 1 + (1 if async_ else 0)
    out = s - first_out
    return 0 if out < 0 else (out if out < m - k + 1 else m - k + 1)


def as_preempted_now(r: Request, outputs: int) -> tuple:
    """Give request ``r`` the state ``Instance.preempt`` leaves (recompute), with ``outputs`` output tokens, for the
    admission rules the walk asks about it; returns what :func:`restore_states` puts back."""
    saved = (r, r.status, r.num_computed_tokens, r.num_output_placeholders, r.blocks, r.num_cached_blocks,
             r.prev_blocks, r.num_output_tokens)
    if unique_content(r):
        r.prev_blocks = (r.blocks, [])
    r.status, r.num_computed_tokens, r.num_output_placeholders = RequestStatus.PREEMPTED, 0, 0
    r.blocks, r.num_cached_blocks, r.num_output_tokens = [], 0, outputs
    return saved


def restore_states(saved: list) -> None:
    """Undo :func:`as_preempted_now`, the last first."""
    for x in range(len(saved) - 1, -1, -1):
        state: tuple = saved[x]
        r: Request = state[0]
        r.status = state[1]
        r.num_computed_tokens = state[2]
        r.num_output_placeholders = state[3]
        r.blocks = state[4]
        r.num_cached_blocks = state[5]
        r.prev_blocks = state[6]
        r.num_output_tokens = state[7]
    saved.clear()


class FreeOrder:
    """The free queue's order as a jump through the queue changes it, for the prefix hits of heads preempted under
    prefix caching (their own freed full blocks, content unique to them). The queue is a stack of blocks freed to
    its head (partial blocks, ``prepend_unhashed``: taken first) on top of the main sequence: the blocks free at the
    jump's start (positions 0..L-1, head first), then the runs freed to the tail since. A take pops the stack, else
    the next main position not touched; a preempted head's own full blocks are one run of positions, its last
    block first, so its hit when admitted is the part of the run not taken yet (its first blocks), at most
    ``(num_tokens - 1) // block_size`` blocks. Only runs known exactly are tracked (:meth:`hit` gives None
    otherwise)."""

    __slots__ = ("consumed", "stack", "end", "runs", "touched", "prepend")

    def __init__(self, num_free: int, prepend: bool) -> None:
        self.consumed = 0  # main positions taken (touched ones skipped)
        self.stack = 0
        self.end = num_free  # the main sequence's length
        self.runs: dict[int, tuple[int, int]] = {}  # id(request) -> its run's [start, end)
        self.touched: list[tuple[int, int]] = []  # [start, end) of runs taken out by a hit
        self.prepend = prepend

    def take(self, n: int) -> None:
        """``n`` blocks taken from the queue's head."""
        if self.stack:
            d = n if n < self.stack else self.stack
            self.stack -= d
            n -= d
        c = self.consumed + n
        for lo, hi in self.touched:  # (few: one per resumption the jump plans)
            if lo < c and hi > self.consumed:
                c += hi - lo
        self.consumed = c

    def free(self, num_partial: int, num_full: int, owner=None) -> None:
        """A request's blocks freed (``BlockPool.free_unique``): the partial ones to the head (or the tail), then
        the full ones to the tail, as ``owner``'s run when it is a request that may hit them later."""
        if self.prepend:
            self.stack += num_partial
        else:
            self.end += num_partial
        if owner is not None:
            self.runs[id(owner)] = (self.end, self.end + num_full)
        self.end += num_full

    def track(self, request: Request, start: int, length: int) -> None:
        """``request``'s live own blocks are main positions start..start+length-1 (free at the jump's start)."""
        self.runs[id(request)] = (start, start + length)

    def hit(self, request: Request, bs: int, drop_last: bool) -> int | None:
        """The prefix-hit tokens ``request`` would get now, or None when its run is not tracked."""
        run = self.runs.get(id(request))
        if run is None:
            return None
        start, end = run
        n = end - max(start, self.consumed)
        n = max(0, min(n, (request.num_tokens - 1) // bs))
        if n and drop_last:
            n -= 1
        return n * bs

    def touch(self, request: Request, hit_blocks: int) -> None:
        """``request`` admitted with ``hit_blocks`` of its run as its hit: they leave the queue (the run's end)."""
        end = self.runs.pop(id(request))[1]
        if hit_blocks:  # (its first blocks: the run's last entries)
            self.touched.append((end - hit_blocks, end))
            self.touched.sort()
