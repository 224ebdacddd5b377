"""Applying a plan: the requests' counters, KV block operations, admissions and preemptions, completions, step-log rows and ITL samples, up to any step (:func:`apply`), and the step a cut jump leaves in flight (:func:`step_for`)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any

import numpy as np

from lab.core.batch import BatchShape, padded_size
from lab.core.kv_cache import BlockPool, KVCacheManager
from lab.core.outputs import record_first_token
from lab.core.request import Request, RequestStatus
from lab.core.step import ScheduledStep
from lab.engine.jump.base import (EV_KIND_MASK, EV_POS_MASK, EV_POS_SHIFT, EV_SCHEDULE_SHIFT, Plan, float_array,
    running_outputs)


def step_for(plan: Plan, j: int) -> ScheduledStep:
    """The engine's step object for planned schedule ``j`` (scheduled at its planned time)."""
    if plan.s0 is not None:
        return _step_with_admissions(plan, j)
    idx = [i for i, m in enumerate(plan.rem) if m > j]
    reqs = [plan.reqs[i] for i in idx]
    ctx = [plan.computed0[i] + j for i in idx]
    B = len(reqs)
    shape = BatchShape.decode_only(ctx, sum(ctx), max(ctx), min(ctx))
    shape.padded_tokens = padded_size(plan.sizes, B)
    at = plan.start if j == 0 else plan.ends_list[j - 1]
    used = plan.used[j] if j < len(plan.used) else 0
    return ScheduledStep(reqs, [1] * B, [True] * B, shape, [float(plan.dts[j])], at, used,
                         0 if j else len(plan.victims))


def _step_with_admissions(plan: Plan, j: int) -> ScheduledStep:
    """:func:`step_for` in a jump with planned admissions: participant i takes part in schedules s0_i ..
    s0_i + rem_i - 1, computing its prompt's ``chunks[i]`` at the first ones (the last samples its first token),
    then one token a schedule."""
    reqs = []
    news: list[int] = []
    before: list[int] = []
    samples: list[bool] = []
    s0: list[int] = plan.s0  # (typed locals: native indexing and arithmetic when compiled)
    rem: list[int] = plan.rem
    ft: list[int] = plan.first_tokens
    chunks: list[Any] = plan.chunks  # (a running participant's is a tuple)
    c0: list[int] = plan.computed0
    for i, r in enumerate(plan.reqs):
        done = j - s0[i]
        if 0 <= done < rem[i]:
            ch = chunks[i]
            k = len(ch)  # schedules of its prompt
            reqs.append(r)
            if done < k:
                news.append(ch[done])
                before.append(c0[i] + sum(ch[:done]))
            else:
                news.append(1)
                before.append(c0[i] + ft[i] + done - k)
            samples.append(done >= k - 1)
    shape = BatchShape.from_requests(news, before)
    shape.padded_tokens = padded_size(plan.sizes, shape.num_tokens)
    at = plan.start if j == 0 else plan.ends_list[j - 1]
    used = plan.used[j] if j < len(plan.used) else 0
    preempted = len(plan.victims) if not j else (bisect_right(plan.preempted_at, j) - bisect_left(plan.preempted_at, j))
    return ScheduledStep(reqs, news, samples, shape, [float(plan.dts[j])], at, used, preempted)


def _sync_counters(plan: Plan, indices: list[int], n_sched: int, n_out: int) -> None:
    """Set the counters of the requests at ``indices`` (positions in the plan) for ``n_sched`` schedules and
    ``n_out`` steps applied: C, outputs, placeholders and tokens in flight, full blocks (unique content), time of
    the last token."""
    if plan.s0 is not None:
        _sync_admitted_counters(plan, indices, n_sched, n_out)
        return
    reqs: list[Request] = plan.reqs
    async_ = plan.async_
    ends_list = plan.ends_list
    cu = plan.caching_unique
    bs = plan.block_size
    rem: list[int] = plan.rem
    computed0: list[int] = plan.computed0
    outputs0: list[int] = plan.outputs0
    for i in indices:
        r = reqs[i]
        m = rem[i]
        sched = n_sched if n_sched < m else m
        out, in_flight = running_outputs(async_, m, sched, n_out)
        c = computed0[i] + sched
        r.num_computed_tokens = c
        r.num_output_tokens = outputs0[i] + out
        r.num_output_placeholders = in_flight if async_ else 0
        r.inflight_tokens = in_flight + _first_step_extra(plan, i, n_out)
        if cu[i]:
            # full blocks registered by the last schedule: min(C, num_tokens at that schedule) // block_size
            r.num_cached_blocks = (c - 1) // bs if async_ else c // bs
        if out:
            r.last_token_time = ends_list[out - 1]


def _first_step_extra(plan: Plan, i: int, n_out: int) -> int:
    """Tokens beyond one that running participant ``i`` computes in the async step in flight at the jump's start
    (its last prompt chunk there), while that step has not completed (``n_out`` = 0); else 0."""
    if not plan.async_ or n_out:
        return 0
    return plan.first.num_new_tokens[i] - 1


def _sync_admitted_counters(plan: Plan, indices: list[int], n_sched: int, n_out: int) -> None:
    """:func:`_sync_counters` in a jump with planned admissions: participant i's schedules start at s0_i (its
    prompt at the first, or in chunks at the first few) and, for an admitted request, its outputs one step
    after each schedule that samples (sync: the same step). A participant whose first schedule is not applied yet
    is left as it is."""
    reqs: list[Request] = plan.reqs
    async_ = plan.async_
    off = 1 if async_ else 0
    ends_list = plan.ends_list
    cu = plan.caching_unique
    bs = plan.block_size
    # (typed locals: the compiled build indexes them without generic operations)
    s0: list[int] = plan.s0
    rem: list[int] = plan.rem
    ft: list[int] = plan.first_tokens
    chunks: list[list[int]] = plan.chunks
    computed0: list[int] = plan.computed0
    outputs0: list[int] = plan.outputs0
    ends: list[float] = ends_list
    num_running: int = plan.num_running
    for i in indices:
        m = rem[i]
        sched = n_sched - s0[i]
        if sched <= 0:
            continue
        if sched > m:
            sched = m
        r = reqs[i]
        if i < num_running:  # running at the jump's start
            out, in_flight = running_outputs(async_, m, sched, n_out)
            last = out - 1
            c = computed0[i] + sched
            inflight_tokens = in_flight + _first_step_extra(plan, i, n_out)
            prefilling = False
        else:  # admitted at schedule s0: its first output from step s0 + k - 1 (+ 1 async), then one a step
            ch = chunks[i]
            k = len(ch)
            first_out = s0[i] + k - 1 + off
            out = n_out - first_out
            out = 0 if out < 0 else (out if out < m - k + 1 else m - k + 1)
            sampling = sched - k + 1  # its schedules so far that sample
            in_flight = (sampling if sampling > 0 else 0) - out
            last = first_out + out - 1
            c = computed0[i] + (sum(ch[:sched]) if sched < k else ft[i] + sched - k)
            done = n_out - s0[i] - off  # its schedules whose steps have completed
            done = 0 if done < 0 else (done if done < sched else sched)
            # tokens in flight: those of its schedules whose steps have not completed (its chunks, then decodes)
            inflight_tokens = sum(ch[done:sched])  # (empty from the k-th on)
            if sched > k:
                inflight_tokens += sched - (done if done > k else k)
            prefilling = sched <= k
        r.num_computed_tokens = c
        r.num_output_tokens = outputs0[i] + out
        r.num_output_placeholders = in_flight if async_ else 0
        r.inflight_tokens = inflight_tokens
        if cu[i]:
            # full blocks registered by the last schedule: min(C, num_tokens at that schedule) // block_size
            r.num_cached_blocks = c // bs if prefilling or not async_ else (c - 1) // bs
        if out:
            r.last_token_time = ends[last]


def apply(inst, plan: Plan, n_sched: int, n_out: int) -> None:
    """Bring the instance to the state after ``n_sched`` planned schedules and ``n_out`` completed steps, in the
    order the event loop would: schedule 0, step 0's output, schedule 1, step 1's output, ... Stretches without a
    completion are applied in bulk (their outputs touch no KV block). Block operations come from ``plan.events``
    (:func:`block_events`, :func:`admission_events`; kind -1: schedule 0's preemptions, right before the block of
    the decode they make room for, :func:`preempt_planned`)."""
    kv: KVCacheManager = inst.kv  # (typed: the compiled build calls the pool natively, once a block)
    pool: BlockPool = kv.pool
    bs = kv.block_size
    reqs: list[Request] = plan.reqs
    usable = pool.num_gpu_blocks - 1
    events: list[int] = plan.events
    ev_pos: int = plan._ev_pos
    a_s: int = plan.applied_sched
    a_o: int = plan.applied_out
    async_ = plan.async_
    fin_steps: list[int] = plan.stops
    q_first = a_o
    while a_s < n_sched or a_o < n_out:
        i_f = bisect_left(fin_steps, a_o)
        qf = fin_steps[i_f] if i_f < len(fin_steps) else 1 << 60
        o_end = min(n_out, qf + 1)
        s_end = min(n_sched, o_end) if o_end > a_o else n_sched
        # schedules a_s .. s_end-1: block operations in order, and the blocks in use after each
        cur = usable - len(pool.free_queue)
        used = plan.used
        n_ev = len(events)
        j_prev = a_s
        while ev_pos < n_ev:
            e = events[ev_pos]
            j = e >> EV_SCHEDULE_SHIFT
            if j >= s_end:
                break
            i = (e >> EV_POS_SHIFT) & EV_POS_MASK
            kind = (e & EV_KIND_MASK) - 1
            if j > j_prev:  # schedules without block operations in between
                used.extend([cur] * (j - j_prev))
                j_prev = j
            if kind == 0:
                reqs[i].blocks.append(pool.get_new_block())
                cur += 1
            elif kind == 2:
                admit_planned(inst, plan, i, j, n_out)
                cur = usable - len(pool.free_queue)
            elif kind == 3:
                _rest_planned(inst, plan, i, j, n_out)
                cur = usable - len(pool.free_queue)
            elif kind == -1:
                preempt_planned(inst, plan, j, i)
                cur = usable - len(pool.free_queue)
            else:
                kv.register_full_blocks(reqs[i], (plan.computed0[i] + j + 1) // bs if not async_
                                        else (plan.computed0[i] + j) // bs)
            ev_pos += 1
        if s_end > j_prev:
            used.extend([cur] * (s_end - j_prev))
        a_s = max(a_s, s_end)
        if o_end > a_o:
            effects(inst, plan, a_o, o_end, a_s)
            a_o = o_end
    write_rows(inst, plan, q_first, a_o, a_s)
    plan._ev_pos = ev_pos
    plan.applied_sched, plan.applied_out = a_s, a_o
    if plan.num_waiting and plan.admit_after is not None and a_s > plan.admit_after:
        inst.jump.steady = False  # the next schedule was not checked: a real one, or a plan that checks it first
    elif plan.from_queue and a_s in plan.busy:
        # every other schedule of the jump is a checked pure decode that leaves the head blocked; this one admits
        # or computes a prompt chunk (a real one if the jump is materialised before it)
        inst.jump.steady = False
    running = RequestStatus.RUNNING
    if not plan.mid_victims:
        _sync_counters(plan, [i for i, r in enumerate(reqs) if r.status == running], n_sched, n_out)
        return
    # a participant the jump preempted is synced no more (its request, admitted again, is another participant);
    # under async the token of its step in flight is dropped when that step ends, as Instance.finish_step drops it
    gone = plan.truncated
    _sync_counters(plan, [i for i, r in enumerate(reqs) if r.status == running and not gone.get(i, n_sched) < n_sched],
                   n_sched, n_out)
    seen: set[int] = set()
    for s, _, _, v, _, _ in reversed(plan.mid_victims):  # (a request's last preemption applied)
        r = reqs[v]
        if s >= n_sched or id(r) in seen:
            continue
        seen.add(id(r))
        if r.status != running and n_out > s:
            r.inflight_tokens = 0


def admit_planned(inst, plan: Plan, i: int, j: int, n_out: int) -> None:
    """Planned schedule ``j`` admits participant ``i`` (an arrival now in the waiting queue, or its head) as
    ``schedule_waiting`` would: its prompt's blocks, then the running list, at the schedule's time. Its first
    token comes at the end of the step that computes the prompt, if that is among the ``n_out`` steps applied
    (else the step is left in flight and gives it as any step does).

    A head preempted before, under prefix caching, first looks up its own freed blocks (the hit the plan made
    its computed tokens, ``computed0``).

    Raises:
        RuntimeError: its blocks could not be allocated, or its prefix hit is not the planned one (the plan's KV
            accounting is wrong).
    """
    r = plan.reqs[i]
    at = plan.start if j == 0 else plan.ends_list[j - 1]
    waiting = inst.waiting
    if waiting.peek() is r:
        waiting.pop()
    else:
        waiting.remove(r)
    gate = inst.config.scheduler_reserve_full_isl  # as allocate_waiting passes it (a check only: it holds)
    chunk = plan.chunks[i][0]
    kv: KVCacheManager = inst.kv
    hits: list[int] = []
    num_hit = 0
    if r.prev_blocks is not None and kv.enable_prefix_caching:  # its own blocks freed by its preemption
        hits, num_hit = kv.get_computed_blocks(r)
        if num_hit != plan.computed0[i]:
            raise RuntimeError(f"fast-forward: planned admission of request {r.request_id} found a prefix hit of "
                               f"{num_hit} tokens, planned {plan.computed0[i]}")
    if not kv.allocate_slots(r, chunk, hits, num_hit, full_sequence_must_fit=gate,
                             num_reserved_tokens=plan.alloc0[i] - chunk):
        raise RuntimeError(f"fast-forward: planned admission of request {r.request_id} found no KV blocks")
    inst.admit(r, num_hit, at)
    inst.jump.num_planned_admissions += 1
    if r.first_scheduled_time is None:
        r.first_scheduled_time = at
    if len(plan.chunks[i]) == 1:
        _first_sample(inst, plan, i, r, j, n_out)


def preempt_planned(inst, plan: Plan, j: int, before: int) -> None:
    """Schedule ``j``'s preemptions for the decode of participant ``before`` (schedule 0: after the first ``before``
    running participants; the next one's block, or its own preemption, comes after them), in order, as the
    scheduler makes them (``Instance.preempt``: the victim's blocks freed, put back at the head of the waiting
    queue). A victim of a later schedule first gets its counters for the schedules before it."""
    if not j:
        for at_decode, victim, reason in plan.victims:
            if at_decode == before:
                inst.preempt(victim, reason, at=plan.start)
        return
    for s, at_decode, reason, v, _, _ in plan.mid_victims:
        if s == j and at_decode == before:
            r = plan.reqs[v]
            _sync_counters(plan, [v], j, j)
            inst.preempt(r, reason, at=plan.ends_list[j - 1])


def _rest_planned(inst, plan: Plan, i: int, j: int, n_out: int) -> None:
    """Planned schedule ``j`` computes the next chunk of participant ``i``'s prompt, in the running phase as
    ``KVCacheManager.allocate_running`` allocates it: the blocks its tokens so far need beyond those its admission
    allocated; the last chunk's step gives its first sample (:func:`_first_sample`).

    Raises:
        RuntimeError: its blocks could not be allocated (the plan's KV accounting is wrong).
    """
    r = plan.reqs[i]
    kv: KVCacheManager = inst.kv
    t = j - plan.s0[i]  # the chunk's index
    chunks: list[int] = plan.chunks[i]  # (an admitted participant's: a list)
    done = 0
    for x in range(t + 1):  # (sum(chunks[:t + 1]), without the copy)
        done += chunks[x]
    alloc0: list[int] = plan.alloc0
    need = -(-max(done, alloc0[i]) // kv.block_size) - len(r.blocks)
    if need > len(kv.pool.free_queue):
        raise RuntimeError(f"fast-forward: planned prefill chunk of request {r.request_id} found no KV blocks")
    if need > 0:
        r.blocks.extend(kv.pool.get_new_blocks(need))
    if t == len(chunks) - 1:
        _first_sample(inst, plan, i, r, j, n_out)


def _first_sample(inst, plan: Plan, i: int, r: Request, j: int, n_out: int) -> None:
    """Request ``r``'s sample at the end of the step of planned schedule ``j`` (its prompt's last), if that step
    is among the ``n_out`` applied (else the step is left in flight and gives it as any step does): its first
    token, or for a request resumed after a preemption its next, an ITL sample from its previous one."""
    q = j + 1 if plan.async_ else j
    if q < n_out and plan.truncated.get(i, -1) != q:  # (async: a preemption at schedule q drops it)
        if r.first_token_time is None:
            record_first_token(r, plan.ends_list[q])
        else:
            inst.itl.add(plan.ends_list[q] - r.last_token_time)


def effects(inst, plan: Plan, q0: int, q1: int, n_sched: int) -> None:
    """Apply what the outputs of steps q0..q1-1 do to requests (their rows come from :func:`write_rows`; a planned
    admission's first token comes with it, :func:`admit_planned`): the first tokens and ITL samples of the step in
    flight at the start, completions; only the last step may carry completions."""
    q = q0
    if plan.async_ and q == 0:
        first = plan.first
        end = plan.ends_list[0]
        for i in plan.earlier:
            inst.itl.add(end - plan.reqs[i].last_token_time)
        # schedule 0's victims were in the step in flight: their tokens from it are dropped (and no longer in
        # flight), as Instance.finish_step drops the output of a request preempted meanwhile
        victims = [v for _, v, _ in plan.victims]
        if plan.new_first:
            for r in first.requests:
                if r.first_token_time is None and not _among(r, victims):
                    record_first_token(r, end)
        if victims:
            for r, n in zip(first.requests, first.num_new_tokens):
                if _among(r, victims):
                    r.inflight_tokens -= n
        _finishes(inst, plan, 0, n_sched)
        q = 1
    last = q1 - 1
    if last >= q:
        _finishes(inst, plan, last, n_sched)


def _among(r: Request, requests: list[Request]) -> bool:
    """Whether ``r`` is one of ``requests`` (a few), by identity."""
    for x in requests:
        if x is r:
            return True
    return False


def write_rows(inst, plan: Plan, q0: int, q1: int, n_sched: int) -> None:
    """Log the rows of steps q0..q1-1 in one go (after :func:`effects`), with their ITL samples and busy time.
    A row's running count is the instance's now, less the admissions after it, plus the completions after it."""
    if q1 <= q0:
        return
    async_ = plan.async_
    counts = plan_counts(plan)
    steps = inst.steps
    nw = plan.num_waiting
    arrivals = plan.arrivals
    wait_rows = plan.wait_rows
    ends = plan.ends_list
    fins = plan.fin_sorted
    adm = plan.adm_sched
    running_end = len(inst.running)
    n_fin = bisect_left(fins, q1)
    n_adm = bisect_left(adm, n_sched)
    pre: list[int] = plan.preempted_at  # (a victim is neither running nor waiting... until its schedule's row)
    n_pre = bisect_left(pre, n_sched)

    def running_at(q: int) -> int:  # the async step in flight's row
        return running_end - n_adm + bisect_right(adm, q) + n_fin - bisect_right(fins, q) + n_pre - bisect_right(pre, q)

    q = q0
    if async_ and q == 0:
        first = plan.first
        end = ends[0]
        sh = first.shape
        B = len(first.requests) - len(plan.victims)  # (a victim's token is dropped)
        same_gap = B - plan.new_first - len(plan.earlier)  # requests whose last token came at the jump's start
        if same_gap:
            inst.itl.add(end - plan.start, same_gap)
        steps.append(plan.start, first.dt, sh.num_tokens, sh.num_tokens - sh.num_decodes, sh.num_decodes,
                     sh.num_seqs, first.used_blocks, running_at(0),
                     nw + bisect_left(arrivals, end) + wait_rows.get(0, 0)
                     - (bisect_right(adm, 0) if plan.from_queue else 0),
                     first.num_preempted, B, first.transfer_s, first.busy_s)
        inst.busy_time += first.dt
        q = 1
        if q >= q1:
            return
    off = 1 if async_ else 0
    ds = plan.dts[q - off:q1 - off]
    # the rows' start and end times: every planned end is the one before plus its step's seconds (added one at a
    # time: cumsum is sequential), so they follow from the durations without converting ``ends``
    t = np.empty(q1 - q + 1)
    t[0] = plan.start if q == 0 else ends[q - 1]
    t[1:] = ds
    t = t.cumsum()
    st, e = t[:-1], t[1:]
    gaps = e - st
    decodes = counts[q - off:q1 - off]
    running: Any
    waits: Any
    rows = np.arange(q, q1)
    if fins or adm or pre:
        running = (running_end - n_adm + n_fin + np.searchsorted(adm, rows, "right")
                   - np.searchsorted(fins, rows, "right")).astype(float)
        if pre:  # a victim runs until its schedule's row
            running += n_pre - np.searchsorted(pre, rows, "right")
    else:
        running = running_end
    if wait_rows or arrivals or plan.from_queue:
        waits = np.full(q1 - q, float(nw))
        for x, c in wait_rows.items():
            if q <= x < q1:
                waits[x - q] += c
        if arrivals:
            waits += np.searchsorted(arrivals, e, "left")
        if plan.from_queue:  # a head admitted at schedule j waits no more from row j on
            waits -= np.searchsorted(adm, rows, "right")
            if pre:  # and a victim of schedule j waits from row j on
                waits += np.searchsorted(pre, rows, "right")
    else:
        waits = nw
    prefill = batch = output = None
    admitted_at = plan.admitted_at
    weights = decodes
    dropped_rows = None
    if pre and async_:
        # a victim of schedule j was in the step in flight then (row j): its token from it is dropped
        dropped = [x - q for x in pre if q <= x < q1]
        if dropped:
            dropped_rows = np.array(dropped, dtype=np.int64)
            # (one whose prompt's last chunk is in that step drops its first sample: not an ITL sample)
            decoding = [x - q for x, _, _, v, _, _ in plan.mid_victims
                        if q <= x < q1 and (v < plan.num_running or x - 1 >= plan.s0[v] + len(plan.chunks[v]))]
            if decoding:
                weights = weights.copy()
                np.subtract.at(weights, np.array(decoding, dtype=np.int64), 1)
    inside: list = []
    if admitted_at:
        inside = [(x - q, lst) for x, lst in admitted_at.items() if q <= x < q1]
        if inside:
            # per row with admissions (each row once), what they add; then one indexed add per column (not a numpy
            # scalar store per admission, nor a list per row of the stretch)
            rows_in: list[int] = []
            more_batch: list[int] = []
            more_output: list[int] = []
            more_prefill: list[int] = []
            more_decodes: list[int] = []
            for y, lst in inside:
                n_prefill = n_decode = n_sampled = 0
                for tokens, sampled in lst:
                    n_sampled += sampled
                    if tokens > 1:
                        n_prefill += tokens
                    else:
                        n_decode += 1  # a one-token prompt (chunk) is a decode in the step's shape
                rows_in.append(y)
                more_batch.append(len(lst))
                more_output.append(n_sampled)
                more_prefill.append(n_prefill)
                more_decodes.append(n_decode)
            at_rows = np.array(rows_in, dtype=np.int64)
            batch = decodes.copy()
            batch[at_rows] += more_batch
            output = decodes.copy()
            output[at_rows] += more_output
            prefill = np.zeros(q1 - q, dtype=np.int64)
            prefill[at_rows] = more_prefill
            decodes = decodes.copy()
            decodes[at_rows] += more_decodes
    if (inside or dropped_rows is not None) and not weights.all():  # a step of prompts alone: no ITL sample
        keep = weights > 0
        gaps, weights = gaps[keep], weights[keep]
    if dropped_rows is not None:
        if output is None:  # (StepLog.extend reads ``output`` with ``prefill`` and ``batch``)
            batch = decodes
            prefill = np.zeros(q1 - q, dtype=np.int64)
            output = decodes.copy()
        np.subtract.at(output, dropped_rows, 1)
    inst.itl.extend_pairs(gaps, weights)
    steps.extend(st, ds, decodes, float_array(plan.used[q - off:q1 - off]), running, waits, prefill,
                 batch, output)
    if plan.victims and q <= off:  # the row of the step schedule 0 made
        steps.set_preempted(q1 - off, len(plan.victims))
    for x in pre:  # the rows of the steps later schedules that preempted made
        if q <= x + off < q1:
            steps.set_preempted(q1 - x - off, bisect_right(pre, x) - bisect_left(pre, x))
    # the steps' durations added one at a time, as the event loop adds them (cumsum is sequential)
    inst.busy_time = float(np.concatenate(([inst.busy_time], ds)).cumsum()[-1])


def plan_counts(plan: Plan) -> np.ndarray:
    """Requests taking part in each planned schedule."""
    return plan._counts


def _finishes(inst, plan: Plan, q: int, n_sched: int) -> None:
    """Finish the requests whose last token came out of step ``q`` (in batch order): free their blocks at once."""
    done = plan.finish_at.get(q)
    if not done:
        return
    kv: KVCacheManager = inst.kv
    end = plan.ends_list[q]
    _sync_counters(plan, done, n_sched, q + 1)
    reqs: list[Request] = plan.reqs
    for i in done:
        inst.complete(reqs[i], end)
    # (every other request in the running list is RUNNING: only these changed status; a new list, as the running
    # list may be shared with the step in flight)
    running: list[Request] = inst.running
    gone = [reqs[i] for i in done]  # (a few: compared by identity)
    kept: list[Request] = []
    for r in running:
        for g in gone:
            if r is g:
                break
        else:
            kept.append(r)
    inst.running = kept
    if plan.num_waiting and q == plan.admit_after:
        inst.jump.steady = False  # the schedule after this completion may admit: it is a real one


def absorb_arrival(plan: Plan, t: float, stable_until: float) -> bool:
    """Count an arrival at ``t`` that joined the waiting queue behind its blocked head without ending the jump;
    False when the jump must be materialised instead (the queue's order may change before the jump ends).

    While requests wait behind a head the last real schedule showed blocked, the schedules of the jump try only
    that head (vLLM and Sarathi stop admitting at the first request that does not fit), so a request queued
    behind it changes nothing but the waiting count of the steps that end after ``t`` — what materialising at
    ``t`` would record (steps ending by ``t`` are done then). An arrival during the last planned step is counted
    in that step's row, as :meth:`lab.engine.instance.Instance._before_arrival` does."""
    if not plan.num_waiting or plan.ends_list[-1] >= stable_until:
        return False
    if t > (plan.start if plan.num_schedules == 1 else plan.ends_list[plan.num_schedules - 2]):
        plan.deferred_arrivals += 1
    else:
        plan.arrivals.append(t)
    return True


def progress_at(plan: Plan, t: float) -> tuple[int, int, int]:
    """At time ``t`` inside the jump: (schedules done, steps completed, index of the step executing).

    Step q ends at ends[q]; each schedule happens when the step before it ends (schedule 0 at the start), so while
    step q executes, schedules 0..q are done (sync: step q is schedule q; async: schedule q is the one made at the
    start of step q, to execute next)."""
    done = bisect_right(plan.ends_list, t)  # steps with end <= t
    return min(done + 1, plan.num_schedules), done, done
