"""KV blocks in a jump: how far the running requests can go before the free blocks run out or the waiting head may be admitted (:func:`plan_bound`), and the ordered block operations the jump replays (:func:`block_events`)."""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from lab.core.kv_cache import unique_content
from lab.core.request import Request
from lab.engine.jump.base import EV_POS_SHIFT, EV_SCHEDULE_SHIFT, Plan, block_event
from lab.engine.jump import decisions


# Batch size from which plan_bound counts new blocks with numpy rather than a Python loop (measured crossover ~45).
VECTOR_BOUND_FROM = 48


def last_victims(needs_block: list[bool], blocks: list[int], free: int) -> list[tuple[int, int]] | None:
    """vLLM V1's ``last`` victim rule in a schedule that only decodes (``policies.common.allocate_or_preempt``):
    the running requests, in order, each take a block if ``needs_block``; one that finds none of the ``free``
    blocks left preempts the last running request (``blocks``: what each holds, freed), again until its block fits
    or it is preempted itself. Returns (position of the decode that needed the block, position of the victim) in
    preemption order; None without any preemption."""
    last = len(needs_block) - 1  # the last request not preempted
    victims: list[tuple[int, int]] = []
    for x in range(len(needs_block)):
        if x > last:
            break
        if needs_block[x]:
            while free < 1 and x <= last:
                victims.append((x, last))
                free += blocks[last]
                last -= 1
            if x > last:  # it preempted itself
                break
            free -= 1
    return victims or None


def plan_bound(inst, head, running: list[Request], computed0: list[int], rem: list[int], fin: list[int], k: int, bs: int,
           free: int, async_: bool, check_head: bool = False) -> tuple[int, int | None]:
    """How many of schedules 0..k-1 the jump may make: ``(k', f)``, where ``f`` is the completion step after which
    the next schedule may admit the waiting ``head`` (the jump then ends with that step, ``k' = f + 1``), or None.

    KV: request i takes a block at schedules j0, j0 + bs, ... below rem_i (j0 = -C_i mod bs), and a request
    completing at the output of step f_i frees all its blocks for schedule f_i + 1 on; schedule j preempts when
    the blocks taken by schedules 0..j exceed ``free`` plus those freed by then, so the jump stops before it.
    Between completions the blocks taken only grow, so the first such schedule is found by binary search.

    Admission: with requests waiting behind ``head`` (shown blocked by the last real schedule), a schedule between
    completions cannot admit it (free blocks only shrink, the budget and ``max_num_seqs`` slots do not grow); at a
    completion the scheduler's decision (:func:`~lab.engine.jump.decisions.head_decision`) says, from the
    running count, the decodes of the next schedule and its free blocks after their allocations, whether the
    jump goes on. The completion ending the jump is also ``f`` when the jump's length cut it (the next schedule
    has not been checked). With ``check_head``, schedule 0 is checked the same way first (something changed since
    the last schedule that showed the head blocked): ``(0, -1)`` when it may admit the head (a jump can then start
    with that admission, :func:`through_queue` from ``after`` = -1)."""
    j0s = [(-c) % bs for c in computed0]

    if len(rem) < VECTOR_BOUND_FROM:
        def new_blocks(m: int) -> int:  # blocks taken by schedules 0..m-1
            total = 0
            for j0, r in zip(j0s, rem):
                top = r if r < m else m
                if top > j0:
                    total += (top - j0 + bs - 1) // bs
            return total
    else:  # the same integer sum with numpy (a large batch: called ~log k times per stretch between completions)
        rem_a = np.array(rem, dtype=np.int64)
        lead_a = bs - 1 - np.array(j0s, dtype=np.int64)

        def new_blocks(m: int) -> int:
            return int(np.maximum((np.minimum(rem_a, m) + lead_a) // bs, 0).sum())

    def first_overflow(a: int, b: int, avail: int) -> int | None:  # first j in a..b with new_blocks(j+1) > avail
        if new_blocks(b + 1) <= avail:
            return None
        lo, hi = a - 1, b
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if new_blocks(mid + 1) > avail:
                hi = mid
            else:
                lo = mid
        return hi

    if head is None and new_blocks(k) <= free:
        return k, None  # the common case without requests waiting: everything fits, frees aside
    n = len(rem)
    if check_head and head is not None:
        avail = free - new_blocks(1)
        num_decodes = sum(1 for r in rem if r > 0)
        if avail >= 0 and not decisions.head_stays_blocked(inst, head, n, num_decodes, avail):
            return 0, -1  # schedule 0 may admit it (avail < 0: schedule 0 preempts, found below)
    caching = inst.kv.enable_prefix_caching
    ref_cnt = inst.kv.pool.ref_cnt
    ref_left: dict[int, int] = {}  # holders left of shared blocks whose holders complete during the jump
    fin_sorted = sorted(fin)
    order = sorted(range(n), key=fin.__getitem__)
    freed = 0
    a = 0
    pos = 0
    while True:
        f = fin_sorted[pos] if pos < n else k
        j = first_overflow(a, min(f, k - 1), free + freed) if min(f, k - 1) >= a else None
        if j is not None:
            return j, None
        if async_ and head is not None and a < f < k:
            # schedule f runs without the requests whose last token is in flight: one more token of budget each
            num_decodes = n - bisect_right(fin_sorted, f)
            avail = free + freed - new_blocks(f + 1)
            if avail >= 0 and not decisions.head_stays_blocked(inst, head, n - pos, num_decodes, avail):
                return f, f - 1
        if f + 1 >= k:
            return k, (f if f < k and head is not None else None)
        while pos < n and fin_sorted[pos] == f:  # completions at the output of step f free their blocks
            i = order[pos]
            j0, r = j0s[i], rem[i]
            freed += _blocks_freed(running[i], ref_cnt, ref_left, caching) + ((r - j0 + bs - 1) // bs if r > j0 else 0)
            pos += 1
        a = f + 1
        if head is not None:
            num_decodes = n - (bisect_right(fin_sorted, f + 1) if async_ else pos)
            avail = free + freed - new_blocks(f + 2)
            if avail < 0:
                continue  # schedule f + 1 preempts before admitting: the next segment stops there
            if not decisions.head_stays_blocked(inst, head, n - pos, num_decodes, avail):
                return f + 1, f


def _blocks_freed(request: Request, ref_cnt: list[int], ref_left: dict[int, int], caching: bool) -> int:
    """Blocks a completing request's held blocks free (those the jump allocates are its own): all of them unless
    prefix caching may share them, then those it is the last holder of (``ref_cnt``: the pool's counts;
    ``ref_left``: holders left of the blocks of requests already completed in the jump, updated)."""
    if not caching or unique_content(request):
        return len(request.blocks)
    freed = 0
    for b in request.blocks:
        left = ref_left.get(b)
        left = (ref_cnt[b] if left is None else left) - 1
        ref_left[b] = left
        if not left:
            freed += 1
    return freed


def admission_events(p: Plan, n_run: int, k: int, bs: int) -> None:
    """Add the block operations of the planned admissions to ``p.events`` (kind 2: admit the request, allocating
    its prompt's (first chunk's) blocks, after the decodes of that schedule; kind 3: the blocks of a chunked
    prompt's next chunk, at each next schedule of its prompt, after the decodes before it; then kind 0 as its
    decodes cross block boundaries)."""
    ev: list[int] = p.events  # (typed locals: native appends and indexing when compiled)
    s0: list[int] = p.s0
    rem: list[int] = p.rem
    first_tokens: list[int] = p.first_tokens
    chunks: list[list[int]] = p.chunks
    admissions: list[tuple[int, int]] = p.admissions
    shift = EV_SCHEDULE_SHIFT
    for j, i in admissions:
        ev.append(block_event(j, i, 2))
        prompt_schedules = len(chunks[i])
        for t in range(1, prompt_schedules):
            ev.append(block_event(j + t, i, 3))
        top = min(s0[i] + rem[i], k)
        new_block = block_event(0, i, 0)
        for jd in range(j + prompt_schedules + (-first_tokens[i]) % bs, top, bs):
            ev.append((jd << shift) | new_block)
    ev.sort()


def admission_rows(p: Plan) -> None:
    """For each planned admission at schedule j: the row of step j - 1 (the last before schedule j) counts the
    arrival as waiting (a queue head is counted in ``num_waiting`` already, and leaves it from row j on: see
    :func:`write_rows`), and the row of each step that computes its prompt (j, async j + 1, and the next ones for a
    chunked prompt) has its tokens and whether it samples (``admitted_at``: row -> (tokens, samples) pairs)."""
    off = 1 if p.async_ else 0
    chunks = p.chunks
    admitted_at: dict[int, list[tuple[int, bool]]] = p.admitted_at
    for j, i in p.admissions:
        if not p.from_queue:
            p.wait_rows[j - 1] = p.wait_rows.get(j - 1, 0) + 1
        q = j + off
        last = len(chunks[i]) - 1
        for t, tokens in enumerate(chunks[i]):
            if q + t < p.num_schedules:
                row = admitted_at.get(q + t)
                if row is None:
                    row = admitted_at[q + t] = []
                row.append((tokens, t == last))


def block_events(computed0: list[int], rem: list[int], k: int, bs: int, async_: bool, caching: bool,
                  unique: list[bool]) -> list[int]:
    """The decodes' block operations (:func:`block_event`: schedule j, request position, kind) in execution order; kind
    0 = take a new block, 1 = register the block that just filled. Within one request's allocation the new block
    comes first (vLLM ``allocate_slots``)."""
    if not caching or all(unique):
        return _new_block_events(computed0, rem, k, bs)
    ev: list[int] = []
    shift = EV_SCHEDULE_SHIFT
    for i, c in enumerate(computed0):
        top = min(rem[i], k)
        new_block = block_event(0, i, 0)
        for j in range((-c) % bs, top, bs):
            ev.append((j << shift) | new_block)
        if caching and not unique[i]:
            # sync: a block fills when computed0 + j + 1 is a multiple of bs; async (one token behind): when computed0 + j is
            register = block_event(0, i, 1)
            for j in range(((-c) % bs) if async_ else ((-c - 1) % bs), top, bs):
                ev.append((j << shift) | register)
    ev.sort()
    return ev


def _new_block_events(computed0: list[int], rem: list[int], k: int, bs: int) -> list[int]:
    """:func:`block_events` when no block is registered (kind 0 only), made in order without a sort: request i
    takes a new block at the schedules j = (-computed0[i]) mod bs, + bs, ... below min(rem[i], k), so the requests
    are grouped by that residue, and each schedule j reads the group of j mod bs (in position order), dropping
    the requests past their last schedule."""
    tops = [m if m < k else k for m in rem]
    groups: list[list[int]] = [[] for _ in range(bs)]
    for i, c in enumerate(computed0):
        groups[(-c) % bs].append(i)
    ev: list[int] = []
    shift = EV_SCHEDULE_SHIFT
    for j in range(max(tops, default=0)):
        members = groups[j % bs]
        if not members:
            continue
        if any(tops[i] <= j for i in members):
            members = groups[j % bs] = [i for i in members if tops[i] > j]
        base = j << shift
        for i in members:
            ev.append(base | (i << EV_POS_SHIFT) | 1)  # (block_event(j, i, 0))
    return ev
