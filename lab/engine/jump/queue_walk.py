"""Extension: with a long queue behind a blocked head, a jump goes on through the heads' admissions and the preemptions of its later schedules (:func:`through_queue`, :class:`QueueWalk`)."""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Any

import numpy as np

from lab.core.kv_cache import KVCacheManager, unique_content
from lab.core.request import Request
from lab.engine.jump.base import HEAP_MASK, HEAP_SHIFT, NEVER, QUEUE_HEADS, decode_cpu, heap_remove, remove_value
from lab.engine.jump.blocks import last_victims
from lab.engine.jump.admitting import Admitting, ExtendedJump, start_extension
from lab.engine.jump.arrivals import arrivals_allowed
from lab.engine.jump.free_order import (FreeOrder, as_preempted, as_preempted_now, blocks_at_end, blocks_before,
    free_order, full_blocks_at_end, outputs_before, restore_states)
from lab.engine.jump import decisions


def resumed_hit(inst, head: Request, num_taken: int) -> int | None:
    """The prefix-hit tokens of the waiting ``head``, preempted before (recompute) under prefix caching, at
    schedule 0 once its decodes have taken ``num_taken`` blocks from the free queue (its own freed blocks still
    free then: ``KVCacheManager.own_hit_after``); None for any other head (its hit is none, or not its own)."""
    kv: KVCacheManager = inst.kv
    if head.prev_blocks is None or not kv.enable_prefix_caching or head.num_computed_tokens:
        return None
    return kv.own_hit_after(head, num_taken)


def walks_queue(inst, running: list[Request]) -> bool:
    """Whether a jump may go on through admissions of the waiting queue's heads (:func:`through_queue`): no
    completion triggers an arrival or leaves for another pool, arrivals join the back of the queue, and
    :func:`arrivals_allowed`."""
    return (not inst.jump.finish_triggers_arrival and not inst.jump.hands_off and inst.waiting.arrivals_join_back
            and arrivals_allowed(inst, running, inst.kv.enable_prefix_caching))


def through_queue(inst, running: list[Request], computed0: list[int], rem: list[int], fin: list[int], dts: np.ndarray,
                   counts: np.ndarray, ends: list[float], cap: int, stop_time: float, pad_table: np.ndarray,
                   after: Any, victims: list | None = None) -> ExtendedJump:
    """Extend a planned stretch of decodes that ends with the completion at step ``after`` (``dts``, ``counts``,
    ``ends``: schedules 0..after; ``after`` = -1: none, schedule 0 is the first checked, when something changed
    since the last schedule that showed the head blocked) through admissions of the waiting queue's heads, while
    each is certain: the
    overloaded regime, where a long queue waits behind a head blocked by KV or ``max_num_seqs`` and each
    completion may let heads in.

    At the schedule j after a completion, the scheduler's declared rules decide (:func:`_heads_admitted`), from the
    running count, the tokens it schedules first and the free blocks after their allocations: if the head stays
    blocked (``decisions.head_decision``) the decodes go on to the next completion; if it takes heads with
    their whole prompts (``decisions.WHOLE``) before one it leaves blocked, schedule j admits them as
    :func:`through_arrivals` admits an arrival, and the schedule after it (with the whole budget again) is
    checked the same way. The extension ends at the first schedule whose decision is not certain (``admit_after``
    of the result: the jump ends with the step before it, and that schedule is a real one), before a schedule that
    would run out of KV blocks (a preemption), at ``cap`` schedules and past ``stop_time``. The walk keeps the
    free blocks, the decoding batch and its Σ contexts up to date event by event (block crossings, decode ends,
    completions), so a schedule costs what changes in it, not the batch size; it prices stretches of decodes with
    the cost model's steady form (a cost model without one leaves them to real schedules) and adds CPU work as
    ``Instance.price_step`` does (under async, a schedule whose CPU work would show ends the walk). Arrivals
    during the jump queue behind heads it does not admit (:func:`absorb_arrival`). ``victims``: schedule 0's
    preemptions (:func:`_decode_victims`; ``running`` is then the requests it keeps): their blocks are free from
    schedule 0 on and they wait at the queue's head, the last preempted first."""
    freed = sum(len(v.blocks) for _, v, _ in victims) if victims else 0
    a, ad = start_extension(inst, running, computed0, rem, fin, dts, counts, ends, freed)
    a.hint = float("inf")  # arrivals join the back of the queue: they do not size the jump
    a.admit_after = after
    j = after + 1
    decoders, avail = ad.at_schedule(a, j)
    walk = _QueueWalk(inst, a, ad, j, decoders, avail, pad_table)
    if inst.kv.enable_prefix_caching:
        walk.order = free_order(inst, a, victims or [], j, walk.avail < 0)  # (None: no head to follow)
    front = [v for _, v, _ in reversed(victims or ())]
    with as_preempted(front):
        try:
            _walk_queue(inst, a, ad, walk, j, cap, stop_time, front)
        finally:
            restore_states(walk.saved)
    walk.close()
    return a


def _walk_queue(inst, a: ExtendedJump, ad: Admitting, walk: "_QueueWalk", j: int, cap: int, stop_time: float,
                front: list) -> None:
    """:func:`through_queue`'s walk from check point ``j`` (the schedule after a completion, an admission or a
    preemption) until the first schedule that is not certain; it sets ``a.admit_after``. ``front``: requests queued
    ahead of the waiting queue by the jump's schedule 0 (its victims). A schedule whose decodes run out of KV
    blocks preempts as the scheduler declares (:func:`walk_preemptions`); its victims then head the queue."""
    waiting = inst.waiting
    num_waiting = len(waiting) + len(front)  # with the heads admitted before heads[m] (num_waiting - m wait)
    if front and len(ad.alive) + len(waiting) <= 1:
        return  # a rule may read the queue's length, which does not hold the victims yet (it does not decide then)
    heads = front + waiting.first(QUEUE_HEADS)
    in_heads = len(heads) - len(front)  # the waiting queue's first requests that heads holds
    m = 0  # heads admitted
    after: int | None
    while True:
        # check point j; the walk's state is schedule j's (its decodes' blocks taken)
        if j >= cap or a.made_at(j) >= stop_time:
            return
        if walk.avail < 0:  # schedule j runs out of KV blocks: it preempts, then only decodes
            found = walk_preemptions(inst, a, ad, walk, j)
            if found is None:
                return
            victims, needs_block = found
            if not walk.preempt(j, victims, needs_block):
                return
            moved: list[Request] = []  # (the last preempted first)
            for x in range(len(victims) - 1, -1, -1):
                moved.append(a.req(victims[x][1]))
            heads[m:m] = moved
            num_waiting += len(moved)
            a.admit_after = j
            j += 1
            walk.advance(j)
            continue
        if len(ad.alive) + num_waiting - m <= 1 or (a.mid_victims and len(ad.alive) < 2):
            # whether anything else runs or waits (arrivals may join) can change the admission rule (and a rule
            # reads the waiting queue's length, which does not hold the walk's victims)
            return
        if m + QUEUE_HEADS // 2 >= len(heads):
            # (four times as many as read so far: a long walk reads the queue's front O(its length) times in all)
            more = waiting.first(max(4 * in_heads, in_heads + QUEUE_HEADS))[in_heads:]
            heads += more
            in_heads += len(more)
        rest = walk.rest(j)  # a chunk of a prompt part-way done, in the running phase
        if rest is False:
            return
        scheduled = walk.num_decodes + (rest[1] if rest else 0)
        free = walk.avail - (walk.chunk_blocks(rest[1]) if rest else 0)
        if free < 0:
            return  # that chunk's blocks would preempt
        # schedule 0's first head, preempted before: its own blocks still free after the decodes' are its hit
        if j == 0 and m == 0:
            first_hit = resumed_hit(inst, heads[0], ad.free - walk.avail)
        elif walk.order is not None and not rest and m < len(heads) and heads[m].prev_blocks is not None:
            # (not after a prompt's next chunk: its blocks are taken before the head's hit is looked up)
            first_hit = walk.order.hit(heads[m], inst.kv.block_size, inst.kv.drop_last_hit_block)
        else:
            first_hit = None
        got = _heads_admitted(inst, heads, m, len(ad.alive), scheduled, free, num_waiting - m, first_hit)
        if got is None:
            return
        taken, last_chunk = got
        if last_chunk is not None and rest and rest[1] < a.first_tokens[rest[0]] - rest[2]:
            return  # two prompts part-way done
        if taken or rest:
            first = len(a.c0)
            if not ad.admit(a, heads[m:m + taken], j, a.made_at(j), walk.decoders(j), last_chunk, rest or None,  # type: ignore[arg-type]
                            first_hit if taken else None):
                return
            if rest:
                walk.chunk_done(rest[1])
            walk.joined(range(first, len(a.c0)))
            m += taken
            after = j  # the next schedule has the whole budget again: it is checked as one after a completion
        else:
            after = ad.next_completion()
            sit_out = walk.next_decode_end()
            if after is not None and ad.async_ and sit_out is not None and j < sit_out <= min(after, cap - 1):
                # async: requests whose last token is in flight sit this schedule out, so it has more budget:
                # it is checked as a schedule after a completion is
                after = sit_out - 1
            if after is None:
                a.admit_after = None  # the jump ends inside a stretch whose head was checked
                return
            if not walk.decodes(j, min(after, cap - 1)):
                short = len(a.dts)
                if walk.avail < 0 and walk.cross_done == short and j < short:
                    # schedules j..short-1 planned; schedule short runs out of blocks: a check point that preempts
                    walk.stop_until(short)
                    a.admit_after = short - 1
                    j = short
                    continue
                a.admit_after = None
                return
            if len(a.dts) != after + 1:
                a.admit_after = None  # the jump ends inside a stretch whose head was checked
                return
        a.admit_after = after
        j = after + 1
        walk.advance(j)


def walk_preemptions(inst, a: ExtendedJump, ad: Admitting, walk: "_QueueWalk", s: int) -> tuple[list, list[bool]] | None:
    """The preemptions of schedule ``s`` of a walk through the queue, whose decodes run out of KV blocks, as the
    scheduler declares them (``SchedulerBase.decode_preemption_reason``: vLLM V1's ``last`` victim rule,
    recompute), as :func:`_decode_victims` makes schedule 0's: the decodes take their blocks in running order
    (participants alive, by position); one that finds none free preempts the last running participant until it
    fits or is preempted itself. Returns the victims, (participant whose decode needs the block, victim, reason,
    blocks it holds, whether it takes a block in schedule ``s``), in preemption order, and for each running
    participant (``ad.alive``, in order) whether its decode takes a block in ``s``; None when the walk must end
    there: the policy preempts otherwise, a prompt is part-way done,
    a victim is not decoding in schedule ``s`` (under async, its last token in flight) or holds content others may
    share, or nothing would be left to decode."""
    if s < 1 or walk.pending is not None or inst.kv_offload is not None:
        return None
    bs: int = walk.bs
    alive: list[int] = ad.alive
    s0: list[int] = a.s0
    rem: list[int] = a.rem
    dfirst: list[int] = a.dfirst
    d0: list[int] = ad.d0
    needs_block: list[bool] = []
    held: list[int] = []
    num_crossing = 0
    for i in alive:
        c = dfirst[i] <= s < s0[i] + rem[i] and (s - dfirst[i]) % bs == 0
        needs_block.append(c)
        held.append(blocks_before(a, i, s, bs))
        if c:
            num_crossing += 1
    # (before schedule s's decodes take their blocks)
    preempted = last_victims(needs_block, held, walk.avail + num_crossing)
    if preempted is None or len(preempted) >= len(alive):
        return None
    victims: list[tuple[int, int, str, int, bool]] = []
    for x, y in preempted:
        v = alive[y]
        reason = decisions.decode_preemption_reason(inst, a.req(alive[x]))
        if reason is None or not d0[v] <= s < s0[v] + rem[v] or not unique_content(a.req(v)):
            return None
        victims.append((alive[x], v, reason, held[y], needs_block[y]))
    for x in range(len(alive) - len(preempted)):
        i = alive[x]
        if d0[i] <= s < s0[i] + rem[i]:
            return victims, needs_block
    return None  # nothing left to decode


class _QueueWalk:
    """The state of :func:`through_queue` at its current schedule: free blocks after that schedule's decode
    allocations (``avail``), the requests decoding in it (``num_decodes``, their context base sum ``dbase_sum``:
    Σ contexts at schedule s = ``dbase_sum`` + ``num_decodes`` · s), and heaps of the coming events: block
    crossings, decode ends (first schedule without a decode) and completions (the jump's ``Admitting`` heap).

    A decoding participant's context crosses a block boundary every ``block_size`` schedules, so crossings are kept
    as counts by schedule modulo ``block_size`` (``cross_count``; participant i's residue ``cross_residue[i]``),
    with a heap of the schedules at which each participant's crossings end (``cross_ends``: its last decode's
    schedule + 1): taking a schedule's crossings costs one lookup, not a heap pop and push per crossing.
    ``cross_done``: the last schedule whose crossings are taken."""

    __slots__ = ("inst", "a", "ad", "avail", "num_decodes", "dbase_sum", "cross_count", "cross_residue",
                 "cross_ends", "cross_done", "stops", "pad_table", "bs", "ranged", "decoding", "blocks", "pending",
                 "pending_done", "aggregates", "order", "saved")

    def __init__(self, inst, a: ExtendedJump, ad: Admitting, j: int, decoders: list[int], avail: int,
                 pad_table: np.ndarray) -> None:
        self.inst, self.a, self.ad = inst, a, ad
        self.avail = avail
        self.pad_table = pad_table
        bs = self.bs = inst.kv.block_size
        self.ranged = inst.cost_model.uses_decode_range
        self.aggregates = not self.ranged and not inst.cost_model.uses_decode_list
        self.decoding = set(decoders)  # kept only for a cost model that reads the context range
        dbase: list[int] = ad.dbase
        self.num_decodes = len(decoders)
        dbase_sum = 0
        for i in decoders:
            dbase_sum += dbase[i]
        self.dbase_sum = dbase_sum
        n = len(a.c0)  # participants so far (the lists below grow as more join)
        self.blocks: list[int] = [0] * n  # by participant: the blocks it frees at its completion (once tracked)
        self.pending: Any = None  # a participant part-way through its prompt (a chunk of it in the last schedule)
        self.pending_done = 0  # the tokens of its prompt its chunks so far compute (the sum of its chunks)
        self.order: FreeOrder | None = None  # the free queue's order, when resumed heads' hits are followed
        self.saved: list = []  # the state of the requests the walk preempted (:func:`as_preempted_now`)
        self.cross_count: list[int] = [0] * bs
        self.cross_residue: list[int] = [0] * n  # by participant: its crossings' schedule modulo block_size
        self.cross_ends: list[int] = []  # (packed: HEAP_SHIFT)
        self.cross_done = j  # (schedule j's decodes' blocks are taken: ``avail``)
        alive: list[int] = ad.alive
        for i in alive:
            self._track(i, j + 1, False)
        heapify(self.cross_ends)
        s0: list[int] = a.s0
        rem: list[int] = a.rem
        stops: list[int] = []  # (packed: HEAP_SHIFT)
        for i in decoders:
            stops.append(((s0[i] + rem[i]) << HEAP_SHIFT) | i)
        heapify(stops)
        self.stops = stops

    def _track(self, i: int, after: int, push: bool = True) -> None:
        """Note participant i's blocks at its completion, and its block crossings from schedule ``after`` on (after
        ``cross_done``; the first one less than ``block_size`` schedules after it, as every caller's ``after`` is
        the participant's first decode schedule or the walk's first check point); ``push``: onto the heap of
        crossing ends (else appended, the caller heapifies)."""
        a = self.a
        bs: int = self.bs
        s0: list[int] = a.s0
        rem: list[int] = a.rem
        dfirst: list[int] = a.dfirst
        top = s0[i] + rem[i]
        first = dfirst[i]
        blocks: list[int] = self.blocks
        residues: list[int] = self.cross_residue
        if len(blocks) <= i:  # (lists by participant, grown as participants join)
            more = i + 1 - len(blocks)
            blocks.extend([0] * more)
            residues.extend([0] * more)
        blocks[i] = blocks_at_end(a, i, bs)
        nxt = first if first >= after else first + (after - first + bs - 1) // bs * bs
        if nxt >= top:
            return
        assert after > self.cross_done and nxt - after < bs, "a participant's crossings tracked late"
        residue = nxt % bs
        self.cross_count[residue] += 1
        residues[i] = residue
        if push:
            heappush(self.cross_ends, (top << HEAP_SHIFT) | i)
        else:
            self.cross_ends.append((top << HEAP_SHIFT) | i)

    def joined(self, participants) -> None:
        """Participants admitted at the current schedule: the blocks their admission allocates now; their decodes
        from the next schedule, or, for a prompt chunked (the last), once its rest is done (:meth:`chunk_done`)."""
        a = self.a
        order = self.order
        for i in participants:
            blocks = -(-(a.c0[i] + a.alloc0[i]) // self.bs)
            self.avail -= blocks
            if order is not None:
                self._follow_admission(order, i, blocks)
                order = self.order
            done = sum(a.chunks[i])
            if done < a.first_tokens[i]:
                self.pending = i
                self.pending_done = done
            else:
                self._decoding(i)

    def _follow_admission(self, order: FreeOrder, i: int, blocks: int) -> None:
        """The free queue's order after participant i's admission allocated ``blocks`` blocks (its hit, a whole
        number of blocks, among them); a hit on blocks whose places are not followed ends the following."""
        a = self.a
        r = a.reqs[i - a.n_run]
        hit = a.c0[i] // self.bs if r.prev_blocks is not None else 0
        if id(r) in order.runs:
            order.touch(r, hit)
        elif hit:
            self.order = None
            return
        order.take(blocks - hit)

    def _decoding(self, i: int) -> None:
        """Participant i's prompt is done (:meth:`Admitting.finish_prompt`) with its last chunk at the current
        schedule: it decodes from the next one; its block crossings and decode end are tracked."""
        a, ad = self.a, self.ad
        self._track(i, a.s0[i] + len(a.chunks[i]))
        self.num_decodes += 1
        self.dbase_sum += ad.dbase[i]
        self.decoding.add(i)
        heappush(self.stops, ((a.s0[i] + a.rem[i]) << HEAP_SHIFT) | i)

    def decoders(self, j: int) -> list[int] | tuple[int, int]:
        """The decodes of schedule j for :meth:`Admitting.admit`: their count and Σ contexts when the cost model
        reads no more, else the participants decoding, in batch order."""
        if self.aggregates:
            return self.num_decodes, self.dbase_sum + self.num_decodes * j
        ad, a = self.ad, self.a
        d0, s0, rem = ad.d0, a.s0, a.rem
        return [i for i in ad.alive if d0[i] <= j < s0[i] + rem[i] and i != self.pending]

    def next_decode_end(self) -> int | None:
        """The first schedule without one of the current decodes (a decode's end), or None."""
        return self.stops[0] >> HEAP_SHIFT if self.stops else None

    def rest(self, j: int):
        """At schedule j: None without a prompt part-way done; else (participant, tokens, tokens computed) of the
        chunk the scheduler's running phase gives it after the decodes, or False when it cannot tell."""
        i = self.pending
        if i is None:
            return None
        a = self.a
        done = self.pending_done
        n = decisions.running_chunk(self.inst, a.reqs[i - a.n_run], done, self.num_decodes)
        if n is None or not 0 < n <= a.first_tokens[i] - done:
            return False
        return i, n, done

    def chunk_blocks(self, n: int) -> int:
        """The blocks the pending prompt's next chunk of ``n`` tokens takes (beyond what its admission took)."""
        i: int = self.pending
        bs: int = self.bs
        alloc0: list[int] = self.a.alloc0
        done: int = self.pending_done
        held = max(alloc0[i], done)
        return max(0, -(-max(held, done + n) // bs) - -(-held // bs))

    def chunk_done(self, n: int) -> None:
        """The current schedule computes ``n`` more tokens of the pending prompt (its last chunk, or not)."""
        i = self.pending
        blocks = self.chunk_blocks(n)
        self.avail -= blocks
        if self.order is not None:
            self.order.take(blocks)
        a = self.a
        a.chunks[i].append(n)
        self.pending_done += n
        if self.pending_done == a.first_tokens[i]:
            self.pending = None
            self.ad.finish_prompt(a, i)
            self._decoding(i)

    def close(self) -> None:
        """The walk ends: a prompt still part-way done is given its rest as one more chunk (beyond the jump's last
        schedule, so never applied), which completes its participant's schedule."""
        i = self.pending
        if i is not None:
            a = self.a
            a.chunks[i].append(a.first_tokens[i] - self.pending_done)
            self.pending = None
            self.ad.finish_prompt(a, i)

    def _cross_until(self, s: int) -> int | None:
        """Take the block crossings of the schedules after ``cross_done`` up to ``s``; the first schedule that runs
        out of blocks (it preempts, or the walk ends there), or None. That schedule's takes are not applied to the
        free order (:meth:`preempt` applies them in running order, with the victims' frees)."""
        t: int = self.cross_done
        if s <= t:
            return None
        count: list[int] = self.cross_count
        ends: list[int] = self.cross_ends
        residue: list[int] = self.cross_residue
        bs: int = self.bs
        order = self.order
        avail: int = self.avail
        while t < s:
            t += 1
            while ends and ends[0] >> HEAP_SHIFT <= t:  # (participants whose last decode came before schedule t)
                count[residue[heappop(ends) & HEAP_MASK]] -= 1
            n = count[t % bs]
            if n:
                avail -= n
                if avail < 0:  # (its takes are left to the free order's preemption: _QueueWalk.preempt)
                    self.avail, self.cross_done = avail, t
                    return t
                if order is not None:
                    order.take(n)
        self.avail, self.cross_done = avail, s
        return None

    def stop_until(self, s: int) -> None:
        """Drop from the decoding batch the participants whose last decode came before schedule ``s``."""
        stops: list[int] = self.stops
        dbase = self.ad.dbase
        while stops and stops[0] >> HEAP_SHIFT <= s:
            i = heappop(stops) & HEAP_MASK
            self.num_decodes -= 1
            self.dbase_sum -= dbase[i]
            self.decoding.discard(i)

    def preempt(self, s: int, victims: list, needs_block: list[bool]) -> bool:
        """Schedule ``s`` (its decodes short of blocks) makes the preemptions ``victims`` (:func:`walk_preemptions`,
        with ``needs_block``: which running participants take a block in ``s``) and then only decodes: each victim's blocks are freed (to the free order, in running order among the
        decodes' takes), its schedules end before ``s`` (``rem``; it completes no more: ``fin``), it leaves the
        batch and the heaps, and it waits with the state ``Instance.preempt`` leaves; schedule ``s`` is priced.
        False when that pricing fails (the victims are recorded; :meth:`ExtendedJump.keep` gives them back their
        schedules when the jump ends before ``s``)."""
        a, ad = self.a, self.ad
        if len(a.dts) != s:
            return False
        async_: bool = ad.async_
        alive: list[int] = ad.alive
        s0: list[int] = a.s0  # (typed locals: native indexing when compiled)
        rem: list[int] = a.rem
        order = self.order
        if order is not None:  # schedule s's takes and frees, in running order
            taken = 0
            v_at = 0
            kept = len(alive) - len(victims)
            for x in range(kept):
                i = alive[x]
                while v_at < len(victims) and victims[v_at][0] == i:
                    order.take(taken)
                    taken = 0
                    self._free_victim(order, victims[v_at], s)
                    v_at += 1
                if needs_block[x]:
                    taken += 1
            order.take(taken)
            while v_at < len(victims):  # (the last decode preempted itself)
                self._free_victim(order, victims[v_at], s)
                v_at += 1
        free = self.avail
        fin: list[int] = a.fin
        out0: list[int] = a.out0
        for before, v, reason, blocks, crossing in victims:
            free += blocks
            if crossing:
                free += 1  # (its own block in s was counted as taken)
            r = a.req(v)
            self.saved.append(as_preempted_now(r, out0[v] + outputs_before(a, v, s, async_)))
            self._leave(v, s)
            a.mid_victims.append((s, before, reason, v, rem[v], fin[v]))
            rem[v] = s - s0[v]
            fin[v] = NEVER
        self.avail = free
        return self._run(s, 1)

    def _free_victim(self, order: "FreeOrder", victim: tuple, s: int) -> None:
        """A victim's blocks (:func:`walk_preemptions`'s entry) freed in the free order at schedule ``s``
        (``BlockPool.free_unique``)."""
        a = self.a
        v: int = victim[1]
        blocks: int = victim[3]
        full = full_blocks_at_end(a, v, self.bs, self.ad.async_, s - a.s0[v])
        order.free(blocks - full, full, a.req(v))

    def _leave(self, v: int, s: int) -> None:
        """Participant ``v``, decoding in schedule ``s``, leaves the walk before it: the running participants, the
        completions' heap, the decoding batch and the block crossings."""
        a, ad = self.a, self.ad
        s0: list[int] = a.s0
        rem: list[int] = a.rem
        fin: list[int] = a.fin
        dbase: list[int] = ad.dbase
        top = s0[v] + rem[v]
        remove_value(ad.alive, v)
        heap_remove(ad.heap, (fin[v] << HEAP_SHIFT) | v)
        entry = (top << HEAP_SHIFT) | v
        heap_remove(self.stops, entry)
        self.num_decodes -= 1
        self.dbase_sum -= dbase[v]
        self.decoding.discard(v)
        if heap_remove(self.cross_ends, entry):
            residues: list[int] = self.cross_residue
            self.cross_count[residues[v]] -= 1

    def advance(self, j: int) -> None:
        """Move to check point ``j`` (the schedule after the last planned one): completions before it free their
        blocks, decodes that ended leave the batch, schedule j's crossings take blocks."""
        ad = self.ad
        heap: list[int] = ad.heap
        alive: list[int] = ad.alive
        while heap and heap[0] >> HEAP_SHIFT < j:
            i = heappop(heap) & HEAP_MASK
            remove_value(alive, i)
            blocks = self.blocks[i]
            self.avail += blocks
            if self.order is not None:
                full = full_blocks_at_end(self.a, i, self.bs, self.ad.async_)
                self.order.free(blocks - full, full)
        self.stop_until(j)
        self._cross_until(j)

    def decodes(self, j: int, last: int) -> bool:
        """Plan schedules j..last as pure decodes (no completion before ``last``; the decodes ending at ``last``
        leave it); False when they cannot all be planned: one runs out of blocks (the schedules before it are
        planned) or has nothing to run."""
        short = self._cross_until(last)
        top = last if short is None else short - 1
        first_end = self.next_decode_end()
        run_end = first_end if first_end is not None and first_end <= top else top + 1
        if run_end > j and not self._run(j, run_end - j):
            return False
        if run_end <= top:  # async: the requests whose last token is in flight sit out schedule `last`
            self.stop_until(top)
            if not self._run(top, 1):
                return False
        return short is None

    def _run(self, s: int, steps: int) -> bool:
        """Price ``steps`` pure-decode schedules from ``s`` of the current batch and append them (with their CPU
        work as :func:`_numpy_segment` adds it); False when the batch is empty, the cost model has no steady form,
        or under async a schedule's CPU work would show (the schedules before it are appended)."""
        b = self.num_decodes
        if not b:
            return False
        cost = self.inst.cost_model
        dbase = self.ad.dbase
        lo = hi = 0
        if self.ranged:
            lo = min(dbase[i] for i in self.decoding) + s
            hi = max(dbase[i] for i in self.decoding) + s
        times: list[float] | None = cost.steady_decode_times(b, self.dbase_sum + b * s, hi, lo,
                                                             int(self.pad_table[b]), steps)
        if times is None:
            return False
        ad, a = self.ad, self.a
        ends = a.ends
        hidden_by = None  # async: schedule s + t's CPU work, made when one step ends, must be done when the next does
        if ad.cpu_on:
            cpu = decode_cpu(self.inst.options, b)
            if ad.async_:
                hidden_by = cpu
            else:
                times = [d + cpu for d in times]
        end: float = ends[-1]
        if hidden_by is None:  # one step at a time, as the event loop adds them
            for d in times:
                end += d
                ends.append(end)
        else:
            for t, d in enumerate(times):
                if not ends[-2] + hidden_by <= end:
                    a.dts += times[:t]
                    a.counts += [b] * t
                    return False
                end += d
                ends.append(end)
        a.dts += times
        a.counts += [b] * steps
        return True


def _heads_admitted(inst, heads: list[Request], m: int, num_running: int, num_scheduled_tokens: int, num_free_blocks: int,
                    num_waiting: int, first_hit: int | None = None) -> tuple[int, tuple[int, int] | None] | None:
    """How many of the waiting heads ``heads[m:]`` (service order; ``num_waiting`` wait from ``heads[m]`` on) a
    schedule admits before one it leaves blocked (0: the first stays blocked), by the scheduler's declared rules,
    and, when the budget chunks the last one's prompt, (tokens of its first chunk, tokens whose blocks its
    admission allocates) (None: every prompt whole);
    None when that is not certain: a head it cannot tell about, or the end of ``heads`` (the next request may
    arrive during the jump). A head preempted before (recompute) is admitted as any other: its whole prompt is
    then its prompt and outputs so far; with ``first_hit`` (tokens), ``heads[m]`` is one whose own freed blocks
    give it that prefix hit (:func:`resumed_hit`), admitted by ``decisions.admits_resumed`` to compute the
    rest."""
    taken = 0
    for x in range(m, len(heads)):  # (heads[m:], without the copy)
        head = heads[x]
        left = num_waiting - taken
        kind, tokens, amount = decisions.head_decision(inst, head, num_running, num_scheduled_tokens,
                                                       num_free_blocks, left)
        if kind == decisions.BLOCKED:
            return taken, None
        prompt = head.num_tokens
        resumed = not taken and first_hit is not None
        hit: int = first_hit if resumed and first_hit is not None else 0
        if resumed:
            if not decisions.admits_resumed(inst, head, hit, num_running, num_scheduled_tokens, num_free_blocks, left):
                return None
            amount = decisions.blocks_admitted(inst, head, hit, num_running, num_scheduled_tokens, left)
        elif kind == decisions.CHUNK:
            if not _admission_ends_after(inst, heads, x, left, num_running + 1, num_scheduled_tokens + tokens,
                                         num_free_blocks):
                return None
            return taken + 1, (tokens, amount)
        elif kind != decisions.WHOLE:
            return None
        computed = prompt - hit
        num_free_blocks -= amount  # (the blocks its admission takes)
        num_running += 1
        num_scheduled_tokens += computed
        taken += 1
    return None


def _admission_ends_after(inst, heads: list[Request], x: int, num_waiting: int, num_running: int,
                          num_scheduled_tokens: int, num_free_blocks: int) -> bool:
    """Whether a schedule admits nothing after ``heads[x]``, admitted with a first chunk of its prompt: none waits
    behind it, or the next head stays blocked with ``num_running`` running and ``num_scheduled_tokens`` scheduled
    (the chunk's included). A chunk cut by the budget spends it; one cut by ``long_prefill_token_threshold`` does
    not, and vLLM goes on admitting (vllm/v1/core/sched/scheduler.py, the waiting loop runs while budget is left).
    ``num_free_blocks`` is counted before the chunk's blocks: more than there are, so a head blocked with them is
    blocked (a head admitted with them may not be: False then, the jump does not plan that schedule)."""
    if num_waiting <= 1:
        return True
    if x + 1 >= len(heads):
        return False  # the next head is not known here
    return decisions.head_decision(inst, heads[x + 1], num_running, num_scheduled_tokens, num_free_blocks,
                                   num_waiting - 1)[0] == decisions.BLOCKED
