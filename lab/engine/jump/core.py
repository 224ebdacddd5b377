"""The jump's core: whether a stretch of decodes qualifies (:func:`steady_batch`) and its plan (:func:`plan`), with schedule 0's preemptions; the extensions may lengthen it."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from lab.core.kv_cache import KVCacheManager, unique_content
from lab.core.request import Request
from lab.core.step import ScheduledStep
from lab.engine.jump.base import (MAX_JUMP_STEPS, Plan, block_event, end_times, float_array, int_array, max_of,
    padding_table)
from lab.engine.jump.pricing import FLOAT_PRICED, Stretch, priced_in_floats, priced_with_numpy
from lab.engine.jump.blocks import admission_events, admission_rows, block_events, last_victims, plan_bound
from lab.engine.jump.arrivals import arrivals_allowed, through_arrivals
from lab.engine.jump.queue_walk import resumed_hit, through_queue, walks_queue
from lab.engine.jump import decisions


def steady_batch(inst) -> bool:
    """Whether the instance's state allows a jump now (see the module docstring; with requests waiting, plan checks
    the head at the first schedule unless ``Instance.jump.steady``)."""
    running: list[Request] = inst.running
    if not running:
        return False
    cfg = inst.config
    B = len(running)
    if B > cfg.max_num_batched_tokens or cfg.num_lookahead_tokens:
        return False
    if inst.waiting and not (B >= cfg.max_num_seqs or B >= cfg.max_num_batched_tokens):
        # Head blocked by KV: it stays blocked only if no new block hash can match a prompt, i.e. no running
        # request's generated tokens have a known identity.
        if inst.kv.enable_prefix_caching and any(r.output_token_ids is not None for r in running):
            return False
    return True


def plan(inst, stop_time: float, first: ScheduledStep | None, check_head: bool = False) -> Plan | None:
    """Plan a jump from now, or return None when fewer than two steps qualify. ``first``: under async scheduling,
    the step in flight (it executes as the jump's step 0). ``check_head``: something changed since the last
    schedule that showed the waiting head blocked (a completion, a preemption, an arrival, or no such schedule),
    so schedule 0 must be checked to leave it blocked too."""
    env_now = inst.now
    running: list[Request] = inst.running
    kv: KVCacheManager = inst.kv
    bs = kv.block_size
    async_ = inst.async_scheduling
    if async_:
        if first is None or first.requests != running or not all(first.samples):
            return None
        if first.start != env_now or inst.cpu_free > env_now:
            return None  # the step in flight waited for CPU work: steps are not back to back
    else:
        first = None
    waiting = bool(inst.waiting)
    victims = None
    cut = _cut_at_schedule_zero(inst, running, check_head and waiting)
    if cut == _PREEMPTS:  # schedule 0 runs out of KV blocks: the jump may start with its preemptions
        victims = _decode_victims(inst, running)
        if not victims:
            return None
        running = running[:len(running) - len(victims)]  # (the victims are the running list's last requests)
        waiting = True
    elif cut:
        return None
    caching = kv.enable_prefix_caching
    computed0 = []
    outputs0 = []
    rem = []
    new_first = 0
    earlier = []  # positions of requests whose previous token came before the step in flight started
    for i, r in enumerate(running):
        c = r.num_computed_tokens
        o = r.num_output_tokens
        ph = r.num_output_placeholders
        if async_:
            if ph != 1 or c != r.prompt_len + o:
                return None
        elif ph or c != r.prompt_len + o - 1:
            return None
        if r.last_token_time != env_now:
            # async: the step in flight runs every request and each samples at its end. One whose last prompt
            # chunk is in it gets its first token; one that sat out the step before (re-computing its tokens after
            # a preemption, or back from swap) its next token, an ITL sample from its previous one (as finish_step)
            if not async_:
                return None
            if o == 0 and r.first_token_time is None:
                new_first += 1
            elif r.first_token_time is not None:
                earlier.append(i)
            else:
                return None
        # (a running request holds exactly ceil(C / block_size) blocks without lookahead slots: allocate_slots
        # guarantees it, so it is not re-checked here; registered blocks are, for content others can hit)
        if caching and r.num_cached_blocks != ((c - 1) // bs if async_ else c // bs) and not unique_content(r):
            return None
        computed0.append(c)
        outputs0.append(o)
        rem.append(r.stop_at - o - ph)
    # Request i finishes at the output of step f_i: sync rem-1, async rem (step 0 is the one in flight).
    fin = [m if async_ else m - 1 for m in rem]
    # k schedules: no schedule without participants; with requests waiting, stop right after the first completion
    # (the next schedule may admit one).
    k = max_of(rem)
    # a closed-loop client sends its next request at a completion; a hand-off enters another pool at it
    if inst.jump.finish_triggers_arrival or inst.jump.hands_off:
        k = min(k, min(fin) + 1)
    k = k_uncut = min(k, MAX_JUMP_STEPS)
    if k < 2:
        return None
    # KV and, with requests waiting, admission at completions bound the jump (before pricing: often to 0 or 1)
    admit_after: int | None
    if victims:  # schedule 0 preempts and admits nothing; schedule 1 is checked (the walk through the queue)
        k, admit_after = 1, 0
    else:
        k, admit_after = plan_bound(inst, inst.waiting.peek() if waiting else None, running, computed0, rem, fin, k, bs,
                                len(kv.pool.free_queue), async_, check_head)
        if k < 2 and admit_after != -1:  # (-1: schedule 0 admits the head; the walk through the queue may plan it)
            return None
    k_bound = k
    # Step times of schedules 0..k-1. Request i takes part while j < rem[i], so with requests sorted by rem the
    # participants of schedule j are a suffix: counts, Σ contexts and the context range follow from suffix sums.
    opt = inst.options
    sizes = opt.cudagraph_sizes
    # With requests waiting behind a blocked head, an arrival that leaves the head in place does not end the jump
    # (absorb_arrival), so the expected arrival does not size the plan.
    hint = inst.jump.arrival_hint() if not waiting else float("inf")
    stretch = Stretch(computed0, rem, inst.cost_model.uses_decode_range)
    pad_table = padding_table(opt.cudagraph_sizes, max(inst.config.max_num_seqs, inst.config.max_num_batched_tokens))
    cost = inst.cost_model
    cpu_terms = opt.cpu_base_s or opt.cpu_per_seq_s or opt.cpu_per_token_s
    kk = min(k, 64)  # grow in chunks until the expected arrival: a short jump costs little to plan
    if not kk:  # the jump starts with schedule 0's admission: no decodes before it
        counts, dts = np.zeros(0, dtype=np.int64), np.zeros(0)
        ends = end_times(env_now, first.dt if async_ else None, dts)  # type: ignore[union-attr]
        last = env_now
    while kk:  # (kk stays above 0: the loop ends with a break)
        # schedules 0..kk-1 only: a plan rarely runs past the first chunk
        in_flight_dt = first.dt if async_ else None  # type: ignore[union-attr]
        counts, dts, ends, shown = ((priced_in_floats(stretch, cost, kk, pad_table, opt, cpu_terms, async_, env_now,
                                                       in_flight_dt) if kk <= FLOAT_PRICED else None)
                                    or priced_with_numpy(stretch, cost, kk, pad_table, opt, cpu_terms, async_,
                                                          env_now, in_flight_dt))
        last = float(ends[-1])  # (read after the loop even when the CPU check ends it)
        if shown >= 0:
            k = k_bound = min(k, shown)  # (k_bound: no arrival is planned past it)
            kk = min(kk, k)
            if k < 2:
                return None
            break
        if kk == k or last >= hint or last >= stop_time:
            break
        kk = min(k, kk * 4)
    k = kk
    ends_list = ends.tolist()
    # Arrivals known in advance: the jump may go on through their admissions (through_arrivals)
    known = inst.jump.known_arrivals
    arr = None
    if known is not None and not waiting and last > hint and arrivals_allowed(inst, running, caching):
        cap = k_bound if k_bound < k_uncut else MAX_JUMP_STEPS  # the KV bound among the running requests alone
        arr = through_arrivals(inst, known, env_now, async_, running, computed0, rem, fin, dts, counts, ends_list,
                                cap, stop_time, pad_table)
        if arr.admissions:
            hint = arr.hint
            dts, counts, ends_list = float_array(arr.dts), int_array(arr.counts), arr.ends
            k = len(arr.dts)
        else:
            arr = None
    # A long queue behind a blocked head: the jump may go on through the head's admissions (through_queue)
    elif waiting and admit_after is not None and k == admit_after + 1 and walks_queue(inst, running):
        arr = through_queue(inst, running, computed0, rem, fin, dts, counts, ends_list, MAX_JUMP_STEPS, stop_time,
                             pad_table, admit_after, victims)
        if arr.admissions or victims or arr.mid_victims:  # (without admissions, plan_bound's plan goes as far; not so
            # after preemptions)
            dts, counts, ends_list = float_array(arr.dts), int_array(arr.counts), arr.ends
            k = len(arr.dts)
            admit_after = arr.admit_after
        else:
            arr = None
    # Every executed step must end strictly before the horizon; the step during which the next arrival is expected
    # is the last one worth planning. Async executes k steps (the in-flight one + schedules 0..k-2) for k schedules.
    n_exec = min(bisect_left(ends_list, stop_time), bisect_left(ends_list, hint) + 1)
    k = min(k, n_exec)
    if arr is not None and not waiting:
        k = arr.bound(k, len(kv.pool.free_queue), bs)  # (through_queue stops before a preemption itself)
    elif arr is not None and (any(j == k or j < k < j + len(arr.chunks[i]) for j, i in arr.admissions)
                              or any(v[0] == k for v in arr.mid_victims)):
        admit_after = k - 1  # the jump ends before an admission (a prompt's rest, a preemption) it planned: a real
        # schedule
    if k < 2:
        return None
    p = Plan()
    p.num_schedules = k
    p.dts = dts[:k]
    p.ends_list = ends_list[:k]
    p.reqs = list(running)
    p.num_running = len(running)
    if arr is not None and arr.keep(k):
        p.reqs += arr.reqs
        rem, computed0, fin = arr.rem, arr.c0, arr.fin
        outputs0 = arr.out0  # (a resumed request's, from before: from its preemption, for one the jump preempts)
        p.s0, p.first_tokens, p.chunks, p.alloc0 = arr.s0, arr.first_tokens, arr.chunks, arr.alloc0
        p.admissions = arr.admissions
        p.planned = {id(r) for r in arr.reqs}
        if arr.mid_victims:
            p.mid_victims = arr.mid_victims
            p.preempted_at = sorted(v[0] for v in arr.mid_victims)
            p.truncated = {v[3]: v[0] for v in arr.mid_victims}
        p.from_queue = waiting
    p.rem = rem
    p.computed0 = computed0
    p.outputs0 = outputs0
    p.start = env_now
    p.first = first
    p.async_ = async_
    p.sizes = sizes
    p.num_waiting = len(inst.waiting) + (len(victims) if victims else 0)
    p.victims = victims or []
    p.new_first = new_first
    p.earlier = earlier
    # requests whose content is unique register nothing anyone can hit: only their count of full blocks matters,
    # which _sync_counters keeps
    # (the instance's flag covers the requests that reached it; planned arrivals are checked one by one)
    n_known = p.num_running if inst.jump.all_content_unique else 0
    unique = [True] * n_known + [unique_content(r) for r in p.reqs[n_known:]]
    if p.admissions:
        n_run = len(running)
        p.events = block_events(computed0[:n_run], rem[:n_run], k, bs, async_, caching, unique[:n_run])
        admission_events(p, n_run, k, bs)
    else:
        p.events = block_events(computed0, rem, k, bs, async_, caching, unique)
    if victims or p.mid_victims:
        # (kind -1: before that decode's block)
        p.events += ({block_event(0, before, -1) for before, _, _ in victims or ()}
                     | {block_event(j, before, -1) for j, before, _, _, _, _ in p.mid_victims})
        p.events.sort()
    # completions by step: step q -> positions finishing at its output, in batch order
    finish_at: dict[int, list[int]] = {}
    for i, f in enumerate(fin):
        if f < k:
            finish_at.setdefault(f, []).append(i)
    p.finish_at = finish_at
    # the steps after which apply stops to give their outputs: completions, and the step before a schedule that
    # preempts (its victim's counters are read then)
    p.stops = sorted(finish_at.keys() | {j - 1 for j in p.preempted_at}) if p.preempted_at else sorted(finish_at)
    p.fin_sorted = sorted(f for f in fin if f < k)
    p.adm_sched = [j for j, _ in p.admissions]
    if p.from_queue:
        p.busy = {j + t for j, i in p.admissions for t in range(len(p.chunks[i]))}
        p.busy.update(p.preempted_at)
    if p.admissions:
        admission_rows(p)
    p.admit_after = admit_after
    p._counts = counts[:k]
    p.block_size = bs
    p.caching_unique = unique if caching else [False] * len(unique)
    return p


_PREEMPTS = "preempts"  # _cut_at_schedule_zero: schedule 0 runs out of KV blocks


def _cut_at_schedule_zero(inst, running: list[Request], check_head: bool) -> bool | str:
    """Whether schedule 0 of a jump already ends it, by the tests :func:`plan_bound` makes first, in one cheap pass over
    the batch before the plan's own: it runs out of KV blocks (each decode whose context fills its last block
    takes one: it preempts; ``_PREEMPTS`` is returned, :func:`_decode_victims` may plan it), or, with
    ``check_head``, the scheduler's rule admits the waiting head given the running count, the decodes (under async
    a request whose last token is in flight sits the schedule out) and the free blocks after their allocations,
    and that admission is not one a jump can start with (the walk through the queue, :func:`through_queue`, is not
    allowed here, or the rule cannot tell how it admits the head). Without ``check_head`` and with a block free per
    request, nothing to test.
    """
    free = len(inst.kv.pool.free_queue)
    if not check_head and free >= len(running):
        return False
    bs: int = inst.kv.block_size
    num_decodes = crossing = 0
    for r in running:
        left: int = r.stop_at - r.num_output_tokens - r.num_output_placeholders
        if left > 0:
            num_decodes += 1
            computed: int = r.num_computed_tokens
            if not computed % bs:
                crossing += 1
    avail = free - crossing
    if avail < 0:
        return _PREEMPTS
    if not check_head:
        return False
    head: Request = inst.waiting.peek()
    n = len(running)
    left = len(inst.waiting)
    kind = decisions.head_decision(inst, head, n, num_decodes, avail, left)[0]
    if kind == decisions.BLOCKED:
        return False
    if not walks_queue(inst, running):
        return True
    if kind == decisions.WHOLE or kind == decisions.CHUNK:
        return False
    hit = resumed_hit(inst, head, crossing)
    return hit is None or not decisions.admits_resumed(inst, head, hit, n, num_decodes, avail, left)


def _decode_victims(inst, running: list[Request]) -> list[tuple[int, Request, str]] | None:
    """Schedule 0's preemptions when its decodes run out of KV blocks, as the scheduler declares them
    (``SchedulerBase.decode_preemption_reason``): the decodes take their blocks in running order; one that finds
    none free preempts the last running request (its blocks, each held by it alone, go back to the free queue),
    again until its block fits or it is preempted itself. Returns, in preemption order, (running requests kept
    before that decode, victim, reason); the victims are the running list's last requests. None when a jump may
    not start so: the scheduler preempts otherwise, or the walk through the queue that must follow
    (:func:`through_queue`) is not allowed."""
    if not walks_queue(inst, running) or inst.kv_offload is not None:
        return None
    async_ = inst.async_scheduling
    for r in running:  # every request a decode, as the plan checks those it keeps (a victim too)
        p, c, o = r.num_output_placeholders, r.num_computed_tokens, r.num_output_tokens
        if (p != 1 or c != r.prompt_len + o) if async_ else (p or c != r.prompt_len + o - 1):
            return None
    bs: int = inst.kv.block_size
    needs_block = [r.stop_at - r.num_output_tokens - r.num_output_placeholders > 0 and not r.num_computed_tokens % bs
                   for r in running]
    preempted = last_victims(needs_block, [len(r.blocks) for r in running], len(inst.kv.pool.free_queue))
    if preempted is None or len(preempted) >= len(running):
        return None
    victims: list[tuple[int, Request, str]] = []
    for x, v in preempted:
        reason = decisions.decode_preemption_reason(inst, running[x])
        if reason is None:
            return None
        victims.append((x, running[v], reason))
    return victims
