"""Exact decode fast-forward: many identical decode steps advanced in one jump.

A stretch qualifies when the last real schedule gave every running request exactly one token, admitted nobody and
preempted nobody, and nothing arrived or finished since. Until the first request would finish, the first step whose
block allocations exceed the free blocks (a preemption), or the horizon, every following step schedules the same
batch again: contexts grow by one token per step, so the step shapes (and times) are known in advance, and the KV
block operations (a new block when a context crosses a block boundary, registering a block's hash when it fills)
happen in a known order. The jump replays exactly those block operations, in the same order as step-by-step
simulation, and applies the per-request counters and the per-step records in bulk. An arrival during a jump
materialises the completed steps at its time (so a router sees the same state as step by step) and the
interrupted step continues normally. The result equals step-by-step simulation exactly (tests/test_fastforward.py
checks it on random workloads); ``simulation.fast_forward: false`` turns it off.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from lab.costmodel.base import BatchShape
from lab.request import Request, RequestStatus

# Longest jump planned at once (bounds the planning work wasted when an arrival interrupts it).
MAX_JUMP_STEPS = 4096


class Plan:
    """A planned stretch of identical decode steps.

    ``k`` schedules are planned. Sync: schedule j executes in [now + cum[j-1], now + cum[j]). Async: the step
    already in flight (``first``) executes first and schedule j runs after it, one step later; the last planned
    schedule is left in flight when the jump ends.
    """

    __slots__ = ("reqs", "B", "C0", "O0", "P0", "k", "dts", "ends", "used", "events", "start", "first",
                 "async_", "shape_base", "padded", "applied_sched", "applied_out", "num_waiting", "new_first")

    def __init__(self) -> None:
        self.applied_sched = 0
        self.applied_out = 0


def steady_batch(inst) -> bool:
    """Whether the instance's state allows a jump now (see the module docstring)."""
    running = inst.running
    if not running or not (inst.steady or not inst.waiting):
        return False  # with requests waiting, the last real schedule must have shown them blocked
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


def plan(inst, stop_time: float) -> Plan | None:
    """Plan a jump from now, or return None when fewer than two steps qualify."""
    env_now = inst.env.now
    running = inst.running
    kv = inst.kv
    bs = kv.block_size
    async_ = inst.async_scheduling
    first = inst._inflight if async_ else None
    B = len(running)
    # A request about to finish ends any stretch: check that first, it is the common reason to stop.
    need = 2 if async_ else 3
    for r in running:
        if r.max_tokens - r.num_output_tokens - r.num_output_placeholders < need:
            return None
    C0 = []
    O0 = []
    caching = kv.enable_prefix_caching
    rem_min = None
    new_first = 0
    for r in running:
        c = r.num_computed_tokens
        o = r.num_output_tokens
        p = r.num_output_placeholders
        ntok = r.prompt_len + o
        if async_:
            if p != 1 or c != ntok:
                return None
        elif p != 0 or c != ntok - 1:
            return None
        if r.last_token_time != env_now:
            # async: a request whose last prompt chunk is in the step in flight gets its first token from it
            if not (async_ and o == 0 and r.first_token_time is None):
                return None
            new_first += 1
        if len(r.blocks) != -(-c // bs):
            return None
        if caching and r.num_cached_blocks != ((c - 1) // bs if async_ else c // bs):
            return None
        rem = r.max_tokens - o - p
        if rem_min is None or rem < rem_min:
            rem_min = rem
        C0.append(c)
        O0.append(o)
    if async_:
        if first is None or first.reqs != running or len(first.samples) != B or not all(first.samples):
            return None
        k_bound = rem_min
    else:
        k_bound = rem_min - 1
    k_bound = min(k_bound, MAX_JUMP_STEPS)
    if k_bound < 2:
        return None
    # Step times of schedules 0..k-1 (contexts C0 + j), computed in growing chunks until they reach the next
    # expected arrival (a jump is cut there anyway) or the horizon.
    sum0 = sum(C0)
    shape = BatchShape.decode_only(C0, 0, sum0, max(C0), min(C0))
    sizes = inst.options.cudagraph_sizes
    padded = sizes[bisect_left(sizes, B)] if sizes and B <= sizes[-1] else 0
    shape.padded_tokens = padded
    opt = inst.options
    cpu = opt.cpu_base_s + opt.cpu_per_seq_s * B + opt.cpu_per_token_s * B
    hint = inst.arrival_hint()
    kk = min(k_bound, 32)
    while True:
        dts = decode_step_times(inst.cost_model, shape, kk)
        if cpu:
            dts = np.maximum(dts, cpu) if async_ else dts + cpu
        # End times added one step at a time, as the event loop adds them (cumsum is sequential).
        if async_:
            ends = np.cumsum(np.concatenate(([env_now, first.dt], dts[:kk - 1])))[1:]  # in flight, sched 0..kk-2
        else:
            ends = np.cumsum(np.concatenate(([env_now], dts)))[1:]
        if kk == k_bound or ends[-1] >= hint or ends[-1] >= stop_time:
            break
        kk = min(k_bound, kk * 4)
    # Every executed step must end strictly before the horizon; the step during which the next arrival is expected
    # is the last one worth planning.
    k = min(kk, int(np.searchsorted(ends, stop_time, side="left")), int(np.searchsorted(ends, hint, side="left")) + 1)
    if k < 2:
        return None
    # KV: the first schedule whose allocations exceed the free blocks would preempt, so the jump stops before it.
    free = len(kv.pool.free_queue)
    allocs = [0] * k
    for c in C0:
        for j in range((-c) % bs, k, bs):
            allocs[j] += 1
    cum_alloc = []
    total = 0
    for j, a in enumerate(allocs):
        total += a
        if total > free:
            k = j
            break
        cum_alloc.append(total)
    if k < 2:
        return None
    used0 = kv.pool.num_gpu_blocks - 1 - free
    p = Plan()
    p.reqs = list(running)
    p.B = B
    p.C0 = C0
    p.O0 = O0
    p.k = k
    p.dts = dts[:k]
    p.ends = ends[:k]
    p.used = [used0 + a for a in cum_alloc[:k]]
    p.start = env_now
    p.first = first
    p.async_ = async_
    p.shape_base = (sum0, max(C0), min(C0))
    p.padded = padded
    p.num_waiting = len(inst.waiting)
    p.events = _block_events(C0, k, bs, async_, caching)
    p.new_first = new_first
    return p


def _block_events(C0: list[int], k: int, bs: int, async_: bool, caching: bool) -> list[tuple[int, int, int]]:
    """(schedule j, request position, kind) in execution order; kind 0 = take a new block, 1 = register the
    block that just filled. Within one request's allocation the new block comes first (vLLM ``allocate_slots``)."""
    ev = []
    for i, c in enumerate(C0):
        for j in range((-c) % bs, k, bs):
            ev.append((j, i, 0))
        if caching:
            # sync: a block fills when C0 + j + 1 is a multiple of bs; async (one token behind): when C0 + j is
            for j in range(((-c) % bs) if async_ else ((-c - 1) % bs), k, bs):
                ev.append((j, i, 1))
    ev.sort()
    return ev


def decode_step_times(cost, shape: BatchShape, k: int) -> np.ndarray:
    """Times of ``k`` decode steps whose contexts grow by one token per step, starting from ``shape``. Uses the
    cost model's vectorised ``decode_step_times`` when it has one."""
    fn = getattr(cost, "decode_step_times", None)
    if fn is not None:
        return np.asarray(fn(shape, k), dtype=float)
    out = np.empty(k)
    s0, mx, mn = shape.decode_sum, shape.decode_max, shape.decode_min
    for j in range(k):
        sh = BatchShape.decode_only(shape.decode_context, j, s0, mx, mn)
        sh.padded_tokens = shape.padded_tokens
        out[j] = cost.step_time(sh)
    return out


def step_for(plan: Plan, j: int):
    """The engine's step object for planned schedule ``j`` (scheduled at its planned time)."""
    from lab.engine import _Step

    B = plan.B
    s0, mx, mn = plan.shape_base
    shape = BatchShape.decode_only(plan.C0, j, s0, mx, mn)
    shape.padded_tokens = plan.padded
    if plan.async_:
        at = plan.start if j == 0 else float(plan.ends[j - 1])
    else:
        at = plan.start if j == 0 else float(plan.ends[j - 1])
    return _Step(list(plan.reqs), [1] * B, [True] * B, shape, float(plan.dts[j]), at, plan.used[j], 0)


def apply(inst, plan: Plan, n_sched: int, n_out: int) -> None:
    """Bring the instance to the state after ``n_sched`` planned schedules and ``n_out`` completed steps
    (async: the first completed step is the one in flight when the plan was made)."""
    kv = inst.kv
    pool = kv.pool
    bs = kv.block_size
    reqs = plan.reqs
    a0 = plan.applied_sched
    if n_sched > a0:
        for (j, i, kind) in plan.events:
            if j < a0:
                continue
            if j >= n_sched:
                break
            r = reqs[i]
            if kind == 0:
                r.blocks.extend(pool.get_new_blocks(1))
            else:
                kv._register(r, (plan.C0[i] + j + 1) // bs if not plan.async_ else (plan.C0[i] + j) // bs)
    o0 = plan.applied_out
    if n_out > o0:
        # the completed steps' durations and end times
        if plan.async_:
            durs = [plan.first.dt] + plan.dts.tolist()
            starts = [plan.start] + plan.ends.tolist()
            useds = [plan.first.used_blocks] + plan.used
        else:
            durs = plan.dts.tolist()
            starts = [plan.start] + plan.ends.tolist()
            useds = plan.used
        last_end = float(plan.ends[n_out - 1])
        B = plan.B
        usable = pool.num_gpu_blocks - 1
        steps = inst.steps
        iid = inst.instance_id
        nw = plan.num_waiting
        q0 = o0
        if o0 == 0 and plan.async_:
            # the step in flight at planning time: its own shape (it may hold last prompt chunks)
            d = durs[0]
            sh = plan.first.shape
            if B - plan.new_first:
                inst.itl.add(float(plan.ends[0]) - starts[0], B - plan.new_first)
            steps.append(iid, starts[0], d, sh.num_tokens, sh.num_tokens - sh.num_decodes, sh.num_decodes,
                         sh.num_seqs, useds[0], useds[0] / usable, B, nw, plan.first.num_preempted, B,
                         plan.first.xfer)
            inst.busy_time += d
            q0 = 1
        if n_out > q0:
            ends = plan.ends.tolist()
            st = starts[q0:n_out]
            inst.itl.extend([e - s_ for e, s_ in zip(ends[q0:n_out], st)], B)
            n = n_out - q0
            u = useds[q0:n_out]
            ds = durs[q0:n_out]
            steps.extend(iid, st, ds, B, 0, B, B, u, [x / usable for x in u], B, nw, 0, B, 0.0, n=n)
            busy = inst.busy_time
            for d in ds:
                busy += d
            inst.busy_time = busy
        if o0 == 0 and plan.new_first:
            t_first = float(plan.ends[0])
            for r in reqs:
                if r.first_token_time is None:
                    r.first_token_time = t_first
                    if r.events is not None:
                        r.events.append((t_first, "first_token"))
        for i, r in enumerate(reqs):
            r.num_output_tokens = plan.O0[i] + n_out
            r.last_token_time = last_end
    if n_sched > a0 or n_out > o0:
        # every planned step gives each request one token and one sample, so the tokens and samples still in
        # flight are equal: 1 for the step in flight at planning time (async) plus schedules not yet completed
        in_flight = (1 if plan.async_ else 0) + n_sched - n_out
        for i, r in enumerate(reqs):
            r.num_computed_tokens = plan.C0[i] + n_sched
            r.num_output_placeholders = in_flight
            r.inflight_tokens = in_flight
    plan.applied_sched = max(a0, n_sched)
    plan.applied_out = max(o0, n_out)
    assert all(r.status == RequestStatus.RUNNING for r in reqs)


def progress_at(plan: Plan, t: float) -> tuple[int, int, int]:
    """At time ``t`` inside the jump: (schedules done, steps completed, index of the step executing).

    Sync: step q executes in [ends[q-1], ends[q]); it was scheduled at its start. Async: the step in flight at
    planning is step 0 of the execution order and ends at ends[0]; planned schedule j executes as step j+1 and was
    scheduled when step j started."""
    done = int(np.searchsorted(plan.ends, t, side="right"))  # steps with end <= t
    if plan.async_:
        # executing step `done` (0 = the first in-flight one); schedules happen at the start of each step
        n_sched = min(done + 1, plan.k)
        return n_sched, done, done
    return min(done + 1, plan.k), done, done
