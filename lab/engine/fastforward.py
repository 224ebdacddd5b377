"""Exact decode fast-forward: many decode steps advanced in one jump.

A stretch qualifies when every running request is decoding (one token per step) and the waiting queue is empty or
its head blocked: shown so by the last schedule, or, when something changed since (a completion, a preemption, an
arrival), by the scheduler's admission rule for the jump's first schedule. From then on each step schedules the
running requests that still have tokens to generate: request i takes part in the next ``rem_i`` schedules and
finishes at a known step, so the batch only shrinks, at known steps. Contexts grow by one token per step, so step
shapes and times are known in advance, and the KV block operations happen in a known order: a new block when a
context crosses a block boundary, a block's hash registered when it fills, a finished request's blocks freed
(last first) before the next schedule. The jump replays exactly these operations in that order and applies the
per-request counters and per-step records in bulk, so its results equal step-by-step simulation exactly
(tests/test_fastforward.py checks it on random workloads, clusters and horizons). Under async scheduling the jump
starts with the step in flight, which must run every request with each sampling at its end: a request whose last
prompt chunk is in it gets its first token there, and one that sat out the step before (re-computing its tokens
after a preemption, or back from swap) its next token, whose ITL sample runs from its previous token.

A jump stops before the first schedule after its first whose new blocks would exceed the free blocks (a
preemption; the blocks completions free count from the next schedule on), unless a walk through the queue plans
that preemption (below), and at the horizon. When requests are
waiting, a completion frees blocks and a ``max_num_seqs`` slot, so the next schedule may admit the waiting head:
the scheduler's declared admission rule (``SchedulerBase.head_stays_blocked``, given the running count, the next
schedule's decodes and its free blocks after their allocations) says whether the jump goes on through it; otherwise
(or for a policy that cannot tell) the jump ends right after that completion. An arrival during a jump materialises
the steps completed by then and the step under way continues normally. ``simulation.fast_forward: false`` turns it
off.

The overloaded regime (a long queue, KV or ``max_num_seqs`` full) adds these cases, all exact:

- The schedule that shows the queue blocked may be one that admitted requests or finished a prompt, when the
  policy reports that admission stopped at a request it could not take for KV or ``max_num_seqs``
  (``SchedulerOutput.waiting_blocked``) and every request samples: the next schedule then only decodes, with
  more budget, no more free blocks and no fewer running requests, so that request stays blocked until a
  completion (``Instance._shows_steady``).
- An arrival queued behind that blocked head changes no schedule of the jump (only the head is tried, and in a
  jump through the heads' admissions, FCFS only, the arrival waits behind every head the jump admits), so the
  jump goes on and counts it in the waiting column of the steps ending after it (:func:`absorb_arrival`); an
  arrival that becomes the head, or a queue whose order may change before the jump ends, materialises as before.
  With requests waiting, plans are therefore not cut at the expected next arrival.
- A real step that did not show the head blocked (it completed requests, preempted, or admitted) does not force
  the next step to be real either: the next plan checks its first schedule with the same admission rule
  (``check_head``; ``Instance.steady`` says when it need not).
- A completion that lets the head in does not end the jump when the scheduler's declared rules say what the
  schedule after it does (:func:`_through_queue`): it admits heads with their whole prompts
  (``SchedulerBase.admits_whole``) before one that stays blocked, or the last with a first chunk of its prompt
  (``admits_chunk``) whose next chunks come in the running phase of the schedules after (``running_chunk``). Each
  such schedule is planned as the engine prices it, and the next one is checked the same way (the budget is whole
  again). The jump ends at the first schedule whose decision is not certain, which is then a real one.
- A jump may start with a schedule whose decodes run out of KV blocks, when the scheduler declares how it then
  preempts (``SchedulerBase.decode_preemption_reason``: vLLM V1's ``last`` victim rule, recompute): the decodes
  take their blocks in running order, one that finds none free preempts the last running requests until it fits
  (:func:`_decode_victims`), and the schedule admits nothing. The victims then head the queue, and the walk through
  the queue checks the next schedule on. The jump's apply makes the preemptions at their place among schedule 0's
  block operations (:func:`_preempt_planned`), so the blocks handed out are the engine's; a victim's token from
  the step in flight (async) is dropped, as the engine drops it.
- A later schedule of the walk whose decodes run out of KV blocks preempts the same way
  (:func:`_walk_preemptions`, :meth:`_QueueWalk.preempt`): a victim, running at the jump's start or admitted by
  it, takes part in the schedules before that one only (its ``rem`` cut there; it completes in none), its blocks
  go back to the free order at their place among the decodes' takes, and it heads the queue with the state
  ``Instance.preempt`` leaves (its outputs so far), so the walk may resume it later in the same jump as another
  participant. The apply gives the victim its counters for the schedules before its preemption, then preempts it
  (:func:`_preempt_planned`; the outputs of the steps before that schedule are applied first), and no later sync
  touches that participant; under async its token (or first sample) from the step in flight is dropped, in the
  step's row and the ITL samples as in the request. Such a walk ends instead when a victim would not be decoding
  in that schedule (its last token in flight), a prompt is part-way done, or nothing would be left to decode.
- Under prefix caching, a head preempted before (a victim of the jump's schedule 0, or one waiting at its start)
  may be resumed at a later schedule of the walk: its hit is what is left of its own freed full blocks, which
  depends on the free queue's order. The walk follows that order (:class:`_FreeOrder`: blocks freed to the head
  are taken first, then the queue's blocks in order, then the runs freed to the tail; a head's run is found in the
  queue at the jump's start, :func:`_track_runs`, or is its victim's, appended by schedule 0), so the hit is
  exact; the applied admission looks it up again and raises if it differs.

With nothing waiting and the instance's arrivals known in advance (``Instance.known_arrivals``: an open-loop stream
on one instance or behind round robin, no front end), a jump also goes on through arrivals (:func:`_through_arrivals`):
the first schedule made after an arrival admits it when the scheduler's declared rule
(``SchedulerBase.admits_whole``) says it takes the request alone with its whole prompt; that step is priced as
``Instance.price_step`` prices it, and the request then decodes with the others. The arrival still comes at its time
and waits in the queue until the jump applies its admission (:func:`_admit_planned`). The jump ends at the first
arrival that is not certain (another arrival for the same schedule, a prompt the budget would chunk, a full batch
or cache, content the prefix cache may hold, CPU work that would show); ``tests/test_fastforward.py`` checks these
jumps against step-by-step simulation too.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from contextlib import contextmanager
from heapq import heapify, heappop, heappush
from itertools import accumulate, repeat
from typing import Any, Final

import numpy as np

from lab.core.batch import BatchShape, padded_size, padded_size_table
from lab.core.kv_cache import BlockPool, KVCacheManager, unique_content
from lab.core.outputs import record_first_token
from lab.core.request import Request, RequestStatus
from lab.core.step import ScheduledStep

# Batch size from which _bound counts new blocks with numpy rather than a Python loop (measured crossover ~45).
_VECTOR_BOUND_FROM = 48

# Longest jump planned at once (bounds the planning work wasted when an arrival interrupts it).
MAX_JUMP_STEPS = 4096

# A planned block operation (``Plan.events``) is one int, so that sorting a jump's operations into execution order
# compares ints, not tuples: (schedule j, participant position i, kind) packed as j << 32 | i << 3 | (kind + 1),
# which orders as the tuple does (i < 2**29, kind -1..3; j < MAX_JUMP_STEPS keeps it a short int, unboxed when
# compiled). Kinds: -1 schedule 0's preemptions, 0 a new block, 1 register the block just filled, 2 admit, 3 the
# next chunk of a prompt.
_EV_SCHEDULE_SHIFT: Final = 32
_EV_POS_SHIFT: Final = 3
_EV_POS_MASK: Final = (1 << 29) - 1
_EV_KIND_MASK: Final = (1 << _EV_POS_SHIFT) - 1  # (kind + 1, in the low bits)


# The heaps of a jump's coming events (completions, decode ends, crossing ends: a schedule and a participant) hold
# ints packed as schedule << 32 | participant, which order as the pairs do (schedules >= 0, participants < 2**32) and
# compare without tuples.
_HEAP_SHIFT: Final = 32
_HEAP_MASK: Final = (1 << 32) - 1


def _float_array(values: list) -> np.ndarray:
    """A float64 array of a list of Python floats (or ints): ``np.fromiter`` with the length given, about 40 % less
    work than ``np.array``'s type discovery for the long lists a jump makes (the same values)."""
    return np.fromiter(values, np.float64, len(values))


def _int_array(values: list) -> np.ndarray:
    """An int64 array of a list of Python ints (:func:`_float_array`'s way)."""
    return np.fromiter(values, np.int64, len(values))


def _largest(values: list[int]) -> int:
    """``max(values)`` of a non-empty list of ints, in a typed loop (the builtin compares Python objects)."""
    top = values[0]
    for v in values:
        if v > top:
            top = v
    return top


def _smallest(values: list[int]) -> int:
    """``min(values)`` of a non-empty list of ints, in a typed loop."""
    low = values[0]
    for v in values:
        if v < low:
            low = v
    return low


def _remove_value(values: list[int], x: int) -> None:
    """``values.remove(x)`` for a list of ints, the search in a typed loop.

    Raises:
        ValueError: ``x`` is not in ``values``.
    """
    for k in range(len(values)):
        if values[k] == x:
            del values[k]
            return
    raise ValueError(f"{x} is not in the list")


def _event(j: int, i: int, kind: int) -> int:
    """The packed block operation (schedule ``j``, participant ``i``, ``kind``); see ``_EV_SCHEDULE_SHIFT``."""
    return (j << _EV_SCHEDULE_SHIFT) | (i << _EV_POS_SHIFT) | (kind + 1)


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
        # planned admissions of arrivals known in advance (_through_arrivals) or of the queue's heads
        # (_through_queue); None / empty without
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
        self.from_queue = False  # they are the waiting queue's heads (_through_queue), not arrivals
        self.busy: set[int] = set()  # with from_queue: schedules that admit or compute a prompt chunk
        # schedule 0's preemptions (_decode_victims), in order: (running participants before the decode that needs
        # the block, victim, reason); the victims are not participants
        self.victims: list[tuple[int, Request, str]] = []
        # the preemptions of later schedules (a walk through the queue, :func:`_walk_preemptions`), in order:
        # (schedule, participant whose decode needs the block, reason, victim participant, its rem and fin before);
        # the victim's schedules end before that one (``rem``), and a later admission of it is another participant
        self.mid_victims: list[tuple[int, int, str, int, int, int]] = []
        self.preempted_at: list[int] = []  # their schedules, sorted (one entry per victim)
        self.truncated: dict[int, int] = {}  # victim participant -> the schedule that preempts it


def steady_batch(inst) -> bool:
    """Whether the instance's state allows a jump now (see the module docstring; with requests waiting, plan checks
    the head at the first schedule unless ``Instance.steady``)."""
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
    k = _largest(rem)
    # a closed-loop client sends its next request at a completion; a hand-off enters another pool at it
    if inst.finish_triggers_arrival or inst.hands_off:
        k = min(k, min(fin) + 1)
    k = k_uncut = min(k, MAX_JUMP_STEPS)
    if k < 2:
        return None
    # KV and, with requests waiting, admission at completions bound the jump (before pricing: often to 0 or 1)
    admit_after: int | None
    if victims:  # schedule 0 preempts and admits nothing; schedule 1 is checked (the walk through the queue)
        k, admit_after = 1, 0
    else:
        k, admit_after = _bound(inst, inst.waiting.peek() if waiting else None, running, computed0, rem, fin, k, bs,
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
    hint = inst.arrival_hint() if not waiting else float("inf")
    stretch = _Stretch(computed0, rem, inst.cost_model.uses_decode_range)
    pad_table = _pad_table(opt.cudagraph_sizes, max(inst.config.max_num_seqs, inst.config.max_num_batched_tokens))
    cost = inst.cost_model
    cpu_terms = opt.cpu_base_s or opt.cpu_per_seq_s or opt.cpu_per_token_s
    kk = min(k, 64)  # grow in chunks until the expected arrival: a short jump costs little to plan
    if not kk:  # the jump starts with schedule 0's admission: no decodes before it
        counts, dts = np.zeros(0, dtype=np.int64), np.zeros(0)
        ends = _end_times(env_now, first.dt if async_ else None, dts)  # type: ignore[union-attr]
        last = env_now
    while kk:  # (kk stays above 0: the loop ends with a break)
        # schedules 0..kk-1 only: a plan rarely runs past the first chunk
        in_flight_dt = first.dt if async_ else None  # type: ignore[union-attr]
        counts, dts, ends, shown = ((_priced_in_floats(stretch, cost, kk, pad_table, opt, cpu_terms, async_, env_now,
                                                       in_flight_dt) if kk <= _FLOAT_PRICED else None)
                                    or _priced_with_numpy(stretch, cost, kk, pad_table, opt, cpu_terms, async_,
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
    # Arrivals known in advance: the jump may go on through their admissions (_through_arrivals)
    known = inst.known_arrivals
    arr = None
    if known is not None and not waiting and last > hint and _arrivals_allowed(inst, running, caching):
        cap = k_bound if k_bound < k_uncut else MAX_JUMP_STEPS  # the KV bound among the running requests alone
        arr = _through_arrivals(inst, known, env_now, async_, running, computed0, rem, fin, dts, counts, ends_list,
                                cap, stop_time, pad_table)
        if arr.admissions:
            hint = arr.hint
            dts, counts, ends_list = _float_array(arr.dts), _int_array(arr.counts), arr.ends
            k = len(arr.dts)
        else:
            arr = None
    # A long queue behind a blocked head: the jump may go on through the head's admissions (_through_queue)
    elif waiting and admit_after is not None and k == admit_after + 1 and _walks_queue(inst, running):
        arr = _through_queue(inst, running, computed0, rem, fin, dts, counts, ends_list, MAX_JUMP_STEPS, stop_time,
                             pad_table, admit_after, victims)
        if arr.admissions or victims or arr.mid_victims:  # (without admissions, _bound's plan goes as far; not so
            # after preemptions)
            dts, counts, ends_list = _float_array(arr.dts), _int_array(arr.counts), arr.ends
            k = len(arr.dts)
            admit_after = arr.admit_after
        else:
            arr = None
    # Every executed step must end strictly before the horizon; the step during which the next arrival is expected
    # is the last one worth planning. Async executes k steps (the in-flight one + schedules 0..k-2) for k schedules.
    n_exec = min(bisect_left(ends_list, stop_time), bisect_left(ends_list, hint) + 1)
    k = min(k, n_exec)
    if arr is not None and not waiting:
        k = arr.bound(k, len(kv.pool.free_queue), bs)  # (_through_queue stops before a preemption itself)
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
    n_known = p.num_running if inst.all_content_unique else 0
    unique = [True] * n_known + [unique_content(r) for r in p.reqs[n_known:]]
    if p.admissions:
        n_run = len(running)
        p.events = _block_events(computed0[:n_run], rem[:n_run], k, bs, async_, caching, unique[:n_run])
        _admission_events(p, n_run, k, bs)
    else:
        p.events = _block_events(computed0, rem, k, bs, async_, caching, unique)
    if victims or p.mid_victims:
        # (kind -1: before that decode's block)
        p.events += ({_event(0, before, -1) for before, _, _ in victims or ()}
                     | {_event(j, before, -1) for j, before, _, _, _, _ in p.mid_victims})
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
        _admission_rows(p)
    p.admit_after = admit_after
    p._counts = counts[:k]
    p.block_size = bs
    p.caching_unique = unique if caching else [False] * len(unique)
    return p


_PREEMPTS = "preempts"  # _cut_at_schedule_zero: schedule 0 runs out of KV blocks


def _cut_at_schedule_zero(inst, running: list[Request], check_head: bool) -> bool | str:
    """Whether schedule 0 of a jump already ends it, by the tests :func:`_bound` makes first, in one cheap pass over
    the batch before the plan's own: it runs out of KV blocks (each decode whose context fills its last block
    takes one: it preempts; ``_PREEMPTS`` is returned, :func:`_decode_victims` may plan it), or, with
    ``check_head``, the scheduler's rule admits the waiting head given the running count, the decodes (under async
    a request whose last token is in flight sits the schedule out) and the free blocks after their allocations,
    and that admission is not one a jump can start with (the walk through the queue, :func:`_through_queue`, is not
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
    scheduler = inst.scheduler
    n = len(running)
    if scheduler.head_stays_blocked(inst, head, n, num_decodes, avail):
        return False
    if not _walks_queue(inst, running):
        return True
    left = len(inst.waiting)
    if (scheduler.admits_whole(inst, head, n, num_decodes, avail, left)
            or scheduler.admits_chunk(inst, head, n, num_decodes, avail, left) is not None):
        return False
    hit = _resumed_hit(inst, head, crossing)
    return hit is None or not scheduler.admits_resumed(inst, head, hit, n, num_decodes, avail, left)


def _decode_victims(inst, running: list[Request]) -> list[tuple[int, Request, str]] | None:
    """Schedule 0's preemptions when its decodes run out of KV blocks, as the scheduler declares them
    (``SchedulerBase.decode_preemption_reason``): the decodes take their blocks in running order; one that finds
    none free preempts the last running request (its blocks, each held by it alone, go back to the free queue),
    again until its block fits or it is preempted itself. Returns, in preemption order, (running requests kept
    before that decode, victim, reason); the victims are the running list's last requests. None when a jump may
    not start so: the scheduler preempts otherwise, or the walk through the queue that must follow
    (:func:`_through_queue`) is not allowed."""
    if not _walks_queue(inst, running) or inst.kv_offload is not None:
        return None
    async_ = inst.async_scheduling
    for r in running:  # every request a decode, as the plan checks those it keeps (a victim too)
        p, c, o = r.num_output_placeholders, r.num_computed_tokens, r.num_output_tokens
        if (p != 1 or c != r.prompt_len + o) if async_ else (p or c != r.prompt_len + o - 1):
            return None
    bs: int = inst.kv.block_size
    needs_block = [r.stop_at - r.num_output_tokens - r.num_output_placeholders > 0 and not r.num_computed_tokens % bs
                   for r in running]
    preempted = _last_victims(needs_block, [len(r.blocks) for r in running], len(inst.kv.pool.free_queue))
    if preempted is None or len(preempted) >= len(running):
        return None
    victims: list[tuple[int, Request, str]] = []
    for x, v in preempted:
        reason = inst.scheduler.decode_preemption_reason(inst, running[x])
        if reason is None:
            return None
        victims.append((x, running[v], reason))
    return victims


def _last_victims(needs_block: list[bool], blocks: list[int], free: int) -> list[tuple[int, int]] | None:
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


def _resumed_hit(inst, head: Request, num_taken: int) -> int | None:
    """The prefix-hit tokens of the waiting ``head``, preempted before (recompute) under prefix caching, at
    schedule 0 once its decodes have taken ``num_taken`` blocks from the free queue (its own freed blocks still
    free then: ``KVCacheManager.own_hit_after``); None for any other head (its hit is none, or not its own)."""
    kv: KVCacheManager = inst.kv
    if head.prev_blocks is None or not kv.enable_prefix_caching or head.num_computed_tokens:
        return None
    return kv.own_hit_after(head, num_taken)


def _walks_queue(inst, running: list[Request]) -> bool:
    """Whether a jump may go on through admissions of the waiting queue's heads (:func:`_through_queue`): no
    completion triggers an arrival or leaves for another pool, arrivals join the back of the queue, and
    :func:`_arrivals_allowed`."""
    return (not inst.finish_triggers_arrival and not inst.hands_off and inst.waiting.arrivals_join_back
            and _arrivals_allowed(inst, running, inst.kv.enable_prefix_caching))


def _decode_cpu(opt, counts):
    """CPU seconds of pure-decode schedules of ``counts`` requests, an int or an int array (``Instance.step_cpu_time``
    with as many tokens as sequences and no admission; a zero coefficient's term is left out, which changes no
    sum)."""
    cpu = opt.cpu_base_s + opt.cpu_per_seq_s * counts
    if opt.cpu_per_token_s:
        cpu = cpu + opt.cpu_per_token_s * counts
    return cpu


# A plan's first pricing of up to this many schedules is done in plain floats when the cost model has a steady form
# (:func:`_priced_in_floats`): a few numpy calls on a handful of values cost more than the values.
_FLOAT_PRICED: Final = 64


def _priced_in_floats(stretch: "_Stretch", cost, kk: int, pad_table: np.ndarray, opt, cpu_terms, async_: bool,
                      start: float, in_flight_dt: float | None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """:func:`plan`'s pricing of the pure-decode schedules 0..kk-1 of ``stretch``, computed in plain ints and
    floats, the same values as :func:`_priced_with_numpy` (the same float operations, one step at a time):
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
            cpu: float = _decode_cpu(opt, b)
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
    return _int_array(counts), _float_array(dts), _float_array(ends), shown


def _priced_with_numpy(stretch: "_Stretch", cost, kk: int, pad_table: np.ndarray, opt, cpu_terms, async_: bool,
                       start: float, in_flight_dt: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """:func:`_priced_in_floats` through numpy, for any cost model (``_Stretch.times``)."""
    counts, dts = stretch.times(cost, kk, pad_table)
    if cpu_terms:
        cpu = _decode_cpu(opt, counts)
        if not async_:
            dts = dts + cpu
    # End times added one step at a time, as the event loop adds them (cumsum is sequential).
    ends = _end_times(start, in_flight_dt, dts)
    if async_ and cpu_terms:
        # schedule j's CPU work runs from the boundary it is made at (the start, then the end of executed step
        # j-1) and is hidden only if done by the end of executed step j; the jump stops before the first not
        hidden = np.concatenate(([start], ends[:kk - 1])) + cpu <= ends[:kk]
        if not hidden.all():
            return counts, dts, ends, int(np.argmin(hidden))
    return counts, dts, ends, -1


def _end_times(start: float, in_flight_dt: float | None, dts: np.ndarray) -> np.ndarray:
    """End times of consecutive steps from ``start`` (seconds): the step in flight (async) if ``in_flight_dt`` is
    given, then steps of ``dts``; added one at a time, as the event loop adds them (cumsum is sequential)."""
    head = 1 if in_flight_dt is None else 2
    t = np.empty(len(dts) + head)
    t[0] = start
    if in_flight_dt is not None:
        t[1] = in_flight_dt
    t[head:] = dts
    return t.cumsum()[1:]


class _Stretch:
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
        self.min_rem = _smallest(rem)
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
            times = cost.steady_decode_times(n, total + n * t_from, _largest(ctx) + t_from, _smallest(ctx) + t_from,
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


# An arrival this close to a step boundary (seconds) is not planned: SimPy's clock may differ from the trace's
# arrival time by an ulp, and the order of the two would then be a coin toss.
_ARRIVAL_MARGIN_S = 1e-7
# Waiting requests read at once when a jump plans admissions from the queue (more are read when it admits them all).
_QUEUE_HEADS = 8


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


def _arrivals_allowed(inst, running: list[Request], caching: bool) -> bool:
    """Whether a jump may plan admissions on this instance now: one pipeline stage, no CPU KV tier, no swap copy
    pending, and (with prefix caching) no running request whose blocks others may share (their frees are then
    exact block counts)."""
    if len(inst.options.stage_layers) > 1 or inst.kv_offload is not None or inst.swap.pending_s:
        return False
    return not caching or inst.all_content_unique or all(map(unique_content, running))


class _Arrivals:
    """A jump extended through planned admissions (:func:`_through_arrivals`): every participant, the running
    requests first (position = batch order), then each admitted arrival; step times and end times of all its
    schedules; ``hint``, the time of the first arrival it does not admit (inf if none)."""

    # attributes set outside __init__, declared for the compiled build (mypyc's class layout)
    admissions: Any
    admit_after: Any
    alloc0: Any
    base: Any
    c0: Any
    chunks: Any
    counts: Any
    dfirst: Any
    dts: Any
    ends: Any
    fin: Any
    first_tokens: Any
    held: Any
    hint: Any
    n_run: Any
    rem: Any
    reqs: Any
    s0: Any
    start: Any
    running: Any
    out0: Any
    mid_victims: Any
    __slots__ = ("c0", "rem", "s0", "first_tokens", "fin", "held", "base", "dfirst", "reqs", "admissions", "dts",
                 "counts", "ends", "hint", "n_run", "admit_after", "chunks", "alloc0", "start", "running", "out0",
                 "mid_victims")

    def req(self, i: int) -> Request:
        """Participant i's request."""
        return self.running[i] if i < self.n_run else self.reqs[i - self.n_run]

    def made_at(self, j: int) -> float:
        """When schedule j is made (seconds): at the jump's start for schedule 0, else when executed step j - 1
        ends."""
        return self.ends[j - 1] if j else self.start

    def taken_by(self, alive: list[int], m: int, bs: int) -> int:
        """KV blocks the participants ``alive`` take in schedules 0..m-1: each its prompt's at its admission,
        then one each time a decode's context crosses a block boundary."""
        s0: list[int] = self.s0  # (typed locals: the compiled build reads them without generic indexing)
        rem: list[int] = self.rem
        dfirst: list[int] = self.dfirst
        base: list[int] = self.base
        total = 0
        for i in alive:
            s = s0[i]
            if m > s:
                top = s + rem[i]
                d = (top if top < m else m) - dfirst[i]
                total += base[i] + ((d + bs - 1) // bs if d > 0 else 0)
        return total

    def bound(self, k: int, free: int, bs: int) -> int:
        """The schedules (at most k) before the first that runs out of KV blocks (it would preempt): schedule j
        does when ``free`` plus the blocks freed by completions up to its step falls below the blocks taken by
        schedules 0..j. Between completions that margin only shrinks, so each stretch is checked at its end and
        searched only if it runs out (the same rule as :func:`_bound`, over participants that join)."""
        by_fin = sorted(range(len(self.fin)), key=self.fin.__getitem__)
        fin, s0, held = self.fin, self.s0, self.held
        alive: list[int] = []
        joined = 0  # participants in position order whose first schedule has been reached
        n = len(fin)
        freed = 0
        a = 0
        pos = 0
        while a < k:
            f = fin[by_fin[pos]] if pos < n else k
            b = f if f < k - 1 else k - 1
            while joined < n and s0[joined] <= b:
                alive.append(joined)
                joined += 1

            def short(j: int) -> bool:  # schedule j runs out of blocks
                return self.taken_by(alive, j + 1, bs) > free + freed

            if b >= a and short(b):
                lo, hi = a - 1, b
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if short(mid):
                        hi = mid
                    else:
                        lo = mid
                return hi
            if f >= k - 1:
                return k
            while pos < n and fin[by_fin[pos]] == f:
                i = by_fin[pos]
                freed += held[i]
                _remove_value(alive, i)
                pos += 1
            a = f + 1
        return k

    def keep(self, k: int) -> bool:
        """Drop the admissions and the preemptions (``mid_victims``) at schedule k or later (their arrivals are
        handled as any other; a victim's schedules are its own again); True if any remain."""
        adm = self.admissions
        while adm and adm[-1][0] >= k:
            adm.pop()
        mids = self.mid_victims
        while mids and mids[-1][0] >= k:  # a preemption the jump does not reach: its victim runs on
            _, _, _, i, old_rem, old_fin = mids.pop()
            self.rem[i], self.fin[i] = old_rem, old_fin
        n = self.n_run + len(adm)
        for name in ("c0", "rem", "s0", "first_tokens", "fin", "held", "base", "dfirst", "chunks", "alloc0", "out0"):
            del getattr(self, name)[n:]
        del self.reqs[len(adm):]
        return bool(adm) or bool(mids)


class _DecodeEnds:
    """The decoding batch of a jump through arrivals, for a cost model that reads decodes only through their count
    and Σ contexts (:func:`_through_arrivals` with ``aggregates``): participants by the schedule of their last
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
    """:class:`_Stretch`'s pricing (``steady_times``; ``times`` through a :class:`_Stretch` built on demand) of the
    decodes left in a :class:`_DecodeEnds` from schedule ``j_lo`` on: the same runs, the same integer sums."""

    __slots__ = ("ends", "j_lo")

    def __init__(self, ends: _DecodeEnds, j_lo: int) -> None:
        self.ends = ends
        self.j_lo = j_lo

    def steady_times(self, cost, kk: int, pad_table: np.ndarray, t_from: int = 0) -> list[tuple[int, list[float]]] | None:
        """As :meth:`_Stretch.steady_times` for a cost model that reads no context range (0 passed for it)."""
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
        """:meth:`_Stretch.times` of the same decodes."""
        left = self.ends.by_end[self.ends.lo:]
        j_lo = self.j_lo
        return _Stretch([base + j_lo for _, base in left], [end - j_lo for end, _ in left],
                        cost.uses_decode_range).times(cost, kk, pad_table)


def _through_arrivals(inst, known: KnownArrivals, start: float, async_: bool, running: list[Request], computed0: list[int],
                      rem: list[int], fin: list[int], dts: np.ndarray, counts: np.ndarray, ends: list[float],
                      cap: int, stop_time: float, pad_table: np.ndarray) -> _Arrivals:
    """Extend a planned stretch of decodes (``dts``, ``counts``, ``ends``: schedules from ``start``) through the
    admissions of the next arrivals, while each is certain.

    The next request R arrives at its known time t; the first schedule made after t (j, at the end of the step
    under way) is the one that sees it, with every other request arriving before it (:func:`_seen_together`: in
    a burst, several arrive during one step). The jump admits them there when the scheduler's declared rule
    (``SchedulerBase.admits_whole``) says that schedule admits each, in queue order, with its whole prompt, given
    the running count, the decodes it schedules first, the prompts admitted before it and the free blocks after
    their allocations (:func:`_admits_all`). Schedule j then computes the decodes and their prompts, priced by the
    cost model as the engine prices it (``Instance.price_step``: CUDA-graph padding, CPU work), and from j + 1 on
    they decode with the others until their ``stop_at``. The next stretch of decodes is planned up to the next
    arrival, and so on. The extension stops at the first arrival that is not certain
    (it then sizes the jump as the expected next arrival does), at ``cap`` schedules and before ``stop_time``;
    under async scheduling also before a schedule whose CPU work would show. :meth:`_Arrivals.bound` then cuts the
    whole at the first schedule that would run out of KV blocks."""
    a, ad = _admitting(inst, running, computed0, rem, fin, dts, counts, ends)
    ends = a.ends
    eps = _ARRIVAL_MARGIN_S
    cost = inst.cost_model
    aggregates = not cost.uses_decode_range and not cost.uses_decode_list
    dbase = ad.dbase
    # (aggregates: the decoding batch kept by decode end, so that a schedule and a stretch cost what changes)
    ends_of = _DecodeEnds(list(rem), list(computed0)) if aggregates else None
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
        group = _seen_together(inst, known, m, at, eps)
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
        if not _decode_stretch(inst, a, ad.alive, ad.dbase, j + 1, cap, stop_time, async_, pad_table, ad.cpu_on,
                               ends_of):
            return a


def _seen_together(inst, known: KnownArrivals, m: int, at: float, eps: float) -> list | None:
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
    by the scheduler's declared rule (``SchedulerBase.admits_whole``), each after those before it, as
    :func:`_heads_admitted` applies it to a queue's heads."""
    scheduler = inst.scheduler
    kv: KVCacheManager = inst.kv
    cfg = inst.config
    num_scheduled_tokens = num_decodes
    left = len(group)
    for r in group:
        if num_free_blocks < 0 or not scheduler.admits_whole(inst, r, num_running, num_scheduled_tokens,
                                                             num_free_blocks, left):
            return False
        left -= 1
        if left:
            prompt = r.num_tokens
            need: Any = kv.blocks_to_admit(r, prompt, cfg.num_lookahead_tokens, cfg.scheduler_reserve_full_isl)
            num_free_blocks -= need
            num_running += 1
            num_scheduled_tokens += prompt
    return True


def _through_queue(inst, running: list[Request], computed0: list[int], rem: list[int], fin: list[int], dts: np.ndarray,
                   counts: np.ndarray, ends: list[float], cap: int, stop_time: float, pad_table: np.ndarray,
                   after: Any, victims: list | None = None) -> _Arrivals:
    """Extend a planned stretch of decodes that ends with the completion at step ``after`` (``dts``, ``counts``,
    ``ends``: schedules 0..after; ``after`` = -1: none, schedule 0 is the first checked, when something changed
    since the last schedule that showed the head blocked) through admissions of the waiting queue's heads, while
    each is certain: the
    overloaded regime, where a long queue waits behind a head blocked by KV or ``max_num_seqs`` and each
    completion may let heads in.

    At the schedule j after a completion, the scheduler's declared rules decide (:func:`_heads_admitted`), from the
    running count, the tokens it schedules first and the free blocks after their allocations: if the head stays
    blocked (``SchedulerBase.head_stays_blocked``) the decodes go on to the next completion; if it takes heads with
    their whole prompts (``SchedulerBase.admits_whole``) before one it leaves blocked, schedule j admits them as
    :func:`_through_arrivals` admits an arrival, and the schedule after it (with the whole budget again) is
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
    a, ad = _admitting(inst, running, computed0, rem, fin, dts, counts, ends, freed)
    a.hint = float("inf")  # arrivals join the back of the queue: they do not size the jump
    a.admit_after = after
    j = after + 1
    decoders, avail = ad.at_schedule(a, j)
    walk = _QueueWalk(inst, a, ad, j, decoders, avail, pad_table)
    if inst.kv.enable_prefix_caching:
        walk.order = _free_order(inst, a, victims or [], j, walk.avail < 0)  # (None: no head to follow)
    front = [v for _, v, _ in reversed(victims or ())]
    with _as_preempted(front):
        try:
            _walk_queue(inst, a, ad, walk, j, cap, stop_time, front)
        finally:
            _restore_states(walk.saved)
    walk.close()
    return a


def _free_order(inst, a: _Arrivals, victims: list, j: int, short: bool = False) -> _FreeOrder | None:
    """The free queue's order (:class:`_FreeOrder`) at the walk's first check point ``j`` (schedule ``j``'s decodes'
    blocks taken): the runs of the waiting heads preempted before, found in the queue now, then schedule 0's takes
    and its preemptions ``victims`` in running order, and up to schedule ``j`` each step's completions and each
    schedule's takes (the decodes of the running requests only: the walk starts before any admission; ``short``:
    schedule ``j`` runs out of blocks, its takes are left to its preemptions). None when there is no head to
    follow."""
    kv: KVCacheManager = inst.kv
    bs = kv.block_size
    fq = kv.pool.free_queue
    order = _FreeOrder(fq.n, kv.pool.prepend_unhashed)
    heads = [h for h in inst.waiting.first(_QUEUE_HEADS) if h.prev_blocks is not None and unique_content(h)]
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
            full = _full_blocks_at_end(a, i, bs, async_)
            order.free(_blocks_at_end(a, i, bs) - full, full)
    order.take(_crossings(a, done + 1, j - 1 if short else j, bs))  # (short: schedule j preempts, _QueueWalk.preempt)
    return order


def _preempts_in_walks(inst) -> bool:
    """Whether a walk through the queue may plan preemptions (:func:`_walk_preemptions`), whose victims' hits it
    then follows in the free order: the scheduler declares its decode preemptions (asked about the first running
    request)."""
    running = inst.running
    return (inst.kv_offload is None and bool(running)
            and inst.scheduler.decode_preemption_reason(inst, running[0]) is not None)


def _crossings(a: _Arrivals, lo: int, hi: int, bs: int) -> int:
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


def _track_runs(order: _FreeOrder, kv, heads: list[Request]) -> None:
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

_NEVER: Final = 1 << 40  # the completion step of a participant preempted during the jump (it completes in none)


def _blocks_at_end(a: _Arrivals, i: int, bs: int) -> int:
    """The blocks participant i holds when it completes (those it held, its admission's, its decodes' crossings)."""
    s0: list[int] = a.s0
    rem: list[int] = a.rem
    return _blocks_before(a, i, s0[i] + rem[i], bs)


def _full_blocks_at_end(a: _Arrivals, i: int, bs: int, async_: bool, m: int = -1) -> int:
    """Participant i's registered full blocks when it completes (``num_cached_blocks`` as :func:`_sync_counters`
    sets it): computed tokens // block_size, one token less under async for a request past its prompt; with ``m``
    >= 0, after its first ``m`` schedules instead."""
    if m < 0:
        m = a.rem[i]
    if i < a.n_run:
        c = a.c0[i] + m
        return (c - 1) // bs if async_ else c // bs
    k = len(a.chunks[i])
    c = a.c0[i] + a.first_tokens[i] + m - k
    return c // bs if m <= k or not async_ else (c - 1) // bs


@contextmanager
def _as_preempted(victims: list):
    """While the walk through the queue asks the scheduler's admission rules about schedule 0's victims (not
    preempted yet: the jump's apply preempts them), give them the state ``Instance.preempt`` leaves (recompute):
    waiting, nothing computed or in flight, no blocks held, their own freed blocks remembered (a rule reads only
    that there are some); restored afterwards. The waiting queue itself does not hold them meanwhile: the walk
    passes the rules its length with them (``num_waiting``) and does not ask a rule that could read it short."""
    saved = [_as_preempted_now(r, r.num_output_tokens) for r in victims]
    try:
        yield
    finally:
        _restore_states(saved)


def _walk_queue(inst, a: _Arrivals, ad: _Admitting, walk: "_QueueWalk", j: int, cap: int, stop_time: float,
                front: list) -> None:
    """:func:`_through_queue`'s walk from check point ``j`` (the schedule after a completion, an admission or a
    preemption) until the first schedule that is not certain; it sets ``a.admit_after``. ``front``: requests queued
    ahead of the waiting queue by the jump's schedule 0 (its victims). A schedule whose decodes run out of KV
    blocks preempts as the scheduler declares (:func:`_walk_preemptions`); its victims then head the queue."""
    waiting = inst.waiting
    num_waiting = len(waiting) + len(front)  # with the heads admitted before heads[m] (num_waiting - m wait)
    if front and len(ad.alive) + len(waiting) <= 1:
        return  # a rule may read the queue's length, which does not hold the victims yet (it does not decide then)
    heads = front + waiting.first(_QUEUE_HEADS)
    in_heads = len(heads) - len(front)  # the waiting queue's first requests that heads holds
    m = 0  # heads admitted
    after: int | None
    while True:
        # check point j; the walk's state is schedule j's (its decodes' blocks taken)
        if j >= cap or a.made_at(j) >= stop_time:
            return
        if walk.avail < 0:  # schedule j runs out of KV blocks: it preempts, then only decodes
            found = _walk_preemptions(inst, a, ad, walk, j)
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
        if m + _QUEUE_HEADS // 2 >= len(heads):
            # (four times as many as read so far: a long walk reads the queue's front O(its length) times in all)
            more = waiting.first(max(4 * in_heads, in_heads + _QUEUE_HEADS))[in_heads:]
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
            first_hit = _resumed_hit(inst, heads[0], ad.free - walk.avail)
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


def _walk_preemptions(inst, a: _Arrivals, ad: _Admitting, walk: "_QueueWalk", s: int) -> tuple[list, list[bool]] | None:
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
        held.append(_blocks_before(a, i, s, bs))
        if c:
            num_crossing += 1
    # (before schedule s's decodes take their blocks)
    preempted = _last_victims(needs_block, held, walk.avail + num_crossing)
    if preempted is None or len(preempted) >= len(alive):
        return None
    victims: list[tuple[int, int, str, int, bool]] = []
    for x, y in preempted:
        v = alive[y]
        reason = inst.scheduler.decode_preemption_reason(inst, a.req(alive[x]))
        if reason is None or not d0[v] <= s < s0[v] + rem[v] or not unique_content(a.req(v)):
            return None
        victims.append((alive[x], v, reason, held[y], needs_block[y]))
    for x in range(len(alive) - len(preempted)):
        i = alive[x]
        if d0[i] <= s < s0[i] + rem[i]:
            return victims, needs_block
    return None  # nothing left to decode


def _blocks_before(a: _Arrivals, i: int, s: int, bs: int) -> int:
    """The blocks participant i holds before schedule ``s`` allocates (its admission's, its decodes' crossings in
    the schedules before ``s``)."""
    dfirst: list[int] = a.dfirst
    held: list[int] = a.held
    base: list[int] = a.base
    first = dfirst[i]
    return held[i] + base[i] + ((s - first + bs - 1) // bs if s > first else 0)


def _outputs_before(a: _Arrivals, i: int, s: int, async_: bool) -> int:
    """The outputs participant i has gained in the jump when schedule ``s`` is made (``s`` steps completed), as
    :func:`_sync_admitted_counters` counts them for its schedules before ``s``."""
    m = s - a.s0[i]
    if i < a.n_run:
        return _running_outputs(async_, m, m, s)[0]
    k = len(a.chunks[i])
    first_out = a.s0[i] + k - 1 + (1 if async_ else 0)
    out = s - first_out
    return 0 if out < 0 else (out if out < m - k + 1 else m - k + 1)


def _heap_remove(heap: list[int], entry: int) -> bool:
    """Remove ``entry`` from a heap of ints (kept a heap); False when it is not there."""
    for x in range(len(heap)):
        if heap[x] == entry:
            tail = heap.pop()
            if x < len(heap):
                heap[x] = tail
                heapify(heap)
            return True
    return False


def _as_preempted_now(r: Request, outputs: int) -> tuple:
    """Give request ``r`` the state ``Instance.preempt`` leaves (recompute), with ``outputs`` output tokens, for the
    admission rules the walk asks about it; returns what :func:`_restore_states` puts back."""
    saved = (r, r.status, r.num_computed_tokens, r.num_output_placeholders, r.blocks, r.num_cached_blocks,
             r.prev_blocks, r.num_output_tokens)
    if unique_content(r):
        r.prev_blocks = (r.blocks, [])
    r.status, r.num_computed_tokens, r.num_output_placeholders = RequestStatus.PREEMPTED, 0, 0
    r.blocks, r.num_cached_blocks, r.num_output_tokens = [], 0, outputs
    return saved


def _restore_states(saved: list) -> None:
    """Undo :func:`_as_preempted_now`, the last first."""
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


class _FreeOrder:
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


class _QueueWalk:
    """The state of :func:`_through_queue` at its current schedule: free blocks after that schedule's decode
    allocations (``avail``), the requests decoding in it (``num_decodes``, their context base sum ``dbase_sum``:
    Σ contexts at schedule s = ``dbase_sum`` + ``num_decodes`` · s), and heaps of the coming events: block
    crossings, decode ends (first schedule without a decode) and completions (the jump's ``_Admitting`` heap).

    A decoding participant's context crosses a block boundary every ``block_size`` schedules, so crossings are kept
    as counts by schedule modulo ``block_size`` (``cross_count``; participant i's residue ``cross_residue[i]``),
    with a heap of the schedules at which each participant's crossings end (``cross_ends``: its last decode's
    schedule + 1): taking a schedule's crossings costs one lookup, not a heap pop and push per crossing.
    ``cross_done``: the last schedule whose crossings are taken."""

    __slots__ = ("inst", "a", "ad", "avail", "num_decodes", "dbase_sum", "cross_count", "cross_residue",
                 "cross_ends", "cross_done", "stops", "pad_table", "bs", "ranged", "decoding", "blocks", "pending",
                 "pending_done", "aggregates", "order", "saved")

    def __init__(self, inst, a: _Arrivals, ad: _Admitting, j: int, decoders: list[int], avail: int,
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
        self.order: _FreeOrder | None = None  # the free queue's order, when resumed heads' hits are followed
        self.saved: list = []  # the state of the requests the walk preempted (:func:`_as_preempted_now`)
        self.cross_count: list[int] = [0] * bs
        self.cross_residue: list[int] = [0] * n  # by participant: its crossings' schedule modulo block_size
        self.cross_ends: list[int] = []  # (packed: _HEAP_SHIFT)
        self.cross_done = j  # (schedule j's decodes' blocks are taken: ``avail``)
        alive: list[int] = ad.alive
        for i in alive:
            self._track(i, j + 1, False)
        heapify(self.cross_ends)
        s0: list[int] = a.s0
        rem: list[int] = a.rem
        stops: list[int] = []  # (packed: _HEAP_SHIFT)
        for i in decoders:
            stops.append(((s0[i] + rem[i]) << _HEAP_SHIFT) | i)
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
        blocks[i] = _blocks_at_end(a, i, bs)
        nxt = first if first >= after else first + (after - first + bs - 1) // bs * bs
        if nxt >= top:
            return
        assert after > self.cross_done and nxt - after < bs, "a participant's crossings tracked late"
        residue = nxt % bs
        self.cross_count[residue] += 1
        residues[i] = residue
        if push:
            heappush(self.cross_ends, (top << _HEAP_SHIFT) | i)
        else:
            self.cross_ends.append((top << _HEAP_SHIFT) | i)

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

    def _follow_admission(self, order: _FreeOrder, i: int, blocks: int) -> None:
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
        """Participant i's prompt is done (:meth:`_Admitting.finish_prompt`) with its last chunk at the current
        schedule: it decodes from the next one; its block crossings and decode end are tracked."""
        a, ad = self.a, self.ad
        self._track(i, a.s0[i] + len(a.chunks[i]))
        self.num_decodes += 1
        self.dbase_sum += ad.dbase[i]
        self.decoding.add(i)
        heappush(self.stops, ((a.s0[i] + a.rem[i]) << _HEAP_SHIFT) | i)

    def decoders(self, j: int) -> list[int] | tuple[int, int]:
        """The decodes of schedule j for :meth:`_Admitting.admit`: their count and Σ contexts when the cost model
        reads no more, else the participants decoding, in batch order."""
        if self.aggregates:
            return self.num_decodes, self.dbase_sum + self.num_decodes * j
        ad, a = self.ad, self.a
        d0, s0, rem = ad.d0, a.s0, a.rem
        return [i for i in ad.alive if d0[i] <= j < s0[i] + rem[i] and i != self.pending]

    def next_decode_end(self) -> int | None:
        """The first schedule without one of the current decodes (a decode's end), or None."""
        return self.stops[0] >> _HEAP_SHIFT if self.stops else None

    def rest(self, j: int):
        """At schedule j: None without a prompt part-way done; else (participant, tokens, tokens computed) of the
        chunk the scheduler's running phase gives it after the decodes, or False when it cannot tell."""
        i = self.pending
        if i is None:
            return None
        a = self.a
        done = self.pending_done
        n = self.inst.scheduler.running_chunk(self.inst, a.reqs[i - a.n_run], done, self.num_decodes)
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
            while ends and ends[0] >> _HEAP_SHIFT <= t:  # (participants whose last decode came before schedule t)
                count[residue[heappop(ends) & _HEAP_MASK]] -= 1
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
        while stops and stops[0] >> _HEAP_SHIFT <= s:
            i = heappop(stops) & _HEAP_MASK
            self.num_decodes -= 1
            self.dbase_sum -= dbase[i]
            self.decoding.discard(i)

    def preempt(self, s: int, victims: list, needs_block: list[bool]) -> bool:
        """Schedule ``s`` (its decodes short of blocks) makes the preemptions ``victims`` (:func:`_walk_preemptions`,
        with ``needs_block``: which running participants take a block in ``s``) and then only decodes: each victim's blocks are freed (to the free order, in running order among the
        decodes' takes), its schedules end before ``s`` (``rem``; it completes no more: ``fin``), it leaves the
        batch and the heaps, and it waits with the state ``Instance.preempt`` leaves; schedule ``s`` is priced.
        False when that pricing fails (the victims are recorded; :meth:`_Arrivals.keep` gives them back their
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
            self.saved.append(_as_preempted_now(r, out0[v] + _outputs_before(a, v, s, async_)))
            self._leave(v, s)
            a.mid_victims.append((s, before, reason, v, rem[v], fin[v]))
            rem[v] = s - s0[v]
            fin[v] = _NEVER
        self.avail = free
        return self._run(s, 1)

    def _free_victim(self, order: "_FreeOrder", victim: tuple, s: int) -> None:
        """A victim's blocks (:func:`_walk_preemptions`'s entry) freed in the free order at schedule ``s``
        (``BlockPool.free_unique``)."""
        a = self.a
        v: int = victim[1]
        blocks: int = victim[3]
        full = _full_blocks_at_end(a, v, self.bs, self.ad.async_, s - a.s0[v])
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
        _remove_value(ad.alive, v)
        _heap_remove(ad.heap, (fin[v] << _HEAP_SHIFT) | v)
        entry = (top << _HEAP_SHIFT) | v
        _heap_remove(self.stops, entry)
        self.num_decodes -= 1
        self.dbase_sum -= dbase[v]
        self.decoding.discard(v)
        if _heap_remove(self.cross_ends, entry):
            residues: list[int] = self.cross_residue
            self.cross_count[residues[v]] -= 1

    def advance(self, j: int) -> None:
        """Move to check point ``j`` (the schedule after the last planned one): completions before it free their
        blocks, decodes that ended leave the batch, schedule j's crossings take blocks."""
        ad = self.ad
        heap: list[int] = ad.heap
        alive: list[int] = ad.alive
        while heap and heap[0] >> _HEAP_SHIFT < j:
            i = heappop(heap) & _HEAP_MASK
            _remove_value(alive, i)
            blocks = self.blocks[i]
            self.avail += blocks
            if self.order is not None:
                full = _full_blocks_at_end(self.a, i, self.bs, self.ad.async_)
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
            cpu = _decode_cpu(self.inst.options, b)
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
    give it that prefix hit (:func:`_resumed_hit`), admitted by ``SchedulerBase.admits_resumed`` to compute the
    rest."""
    scheduler = inst.scheduler
    kv: KVCacheManager = inst.kv
    cfg = inst.config
    taken = 0
    for x in range(m, len(heads)):  # (heads[m:], without the copy)
        head = heads[x]
        if scheduler.head_stays_blocked(inst, head, num_running, num_scheduled_tokens, num_free_blocks):
            return taken, None
        left = num_waiting - taken
        prompt = head.num_tokens
        if not taken and first_hit is not None:
            if not scheduler.admits_resumed(inst, head, first_hit, num_running, num_scheduled_tokens,
                                            num_free_blocks, left):
                return None
            computed = prompt - first_hit
        elif not scheduler.admits_whole(inst, head, num_running, num_scheduled_tokens, num_free_blocks, left):
            chunk = scheduler.admits_chunk(inst, head, num_running, num_scheduled_tokens, num_free_blocks, left)
            return None if chunk is None else (taken + 1, chunk)  # (the chunk takes the budget left)
        else:
            computed = prompt
        # (a hit block leaves the free queue as a new block would: the whole sequence's blocks)
        need: Any = kv.blocks_to_admit(head, prompt, cfg.num_lookahead_tokens, cfg.scheduler_reserve_full_isl)
        num_free_blocks -= need
        num_running += 1
        num_scheduled_tokens += computed
        taken += 1
    return None


class _Admitting:
    """The bookkeeping of a jump being extended through admissions (:func:`_admitting`): participants alive (not
    yet completed, in a heap by completion step), the blocks completions have freed, each participant's first
    decode schedule and the context base of its decodes (context at schedule j = ``dbase[i]`` + j)."""

    # attributes set outside __init__, declared for the compiled build (mypyc's class layout)
    alive: Any
    async_: Any
    cpu_on: Any
    d0: Any
    dbase: Any
    free: Any
    freed: Any
    heap: Any
    inst: Any
    __slots__ = ("inst", "alive", "heap", "freed", "free", "dbase", "d0", "async_", "cpu_on")

    def at_schedule(self, a: _Arrivals, j: int) -> tuple[list[int], int]:
        """Schedule j (completions before it applied): the participants it decodes, and the free blocks after its
        decodes' allocations (negative: it preempts)."""
        avail = self.free_at(a, j)
        d0: list[int] = self.d0
        s0: list[int] = a.s0
        rem: list[int] = a.rem
        alive: list[int] = self.alive
        return [i for i in alive if d0[i] <= j < s0[i] + rem[i]], avail

    def free_at(self, a: _Arrivals, j: int) -> int:
        """The free blocks after schedule j's decodes' allocations, completions before it applied (negative: it
        preempts)."""
        heap: list[int] = self.heap
        alive: list[int] = self.alive
        while heap and heap[0] >> _HEAP_SHIFT < j:
            i = heappop(heap) & _HEAP_MASK
            _remove_value(alive, i)
            self.freed += a.held[i]
        return self.free + self.freed - a.taken_by(alive, j + 1, self.inst.kv.block_size)

    def next_completion(self) -> int | None:
        """The step of the next completion among the participants alive, or None."""
        return self.heap[0] >> _HEAP_SHIFT if self.heap else None

    def admit(self, a: _Arrivals, reqs: list[Request], j: int, at: float, decoders: list[int] | tuple[int, int],
              last_chunk: tuple[int, int] | None = None, rest: tuple[int, int, int] | None = None,
              first_hit: int | None = None) -> bool:
        """Plan schedule j (made at ``at``) as the decodes of ``decoders`` (participants; or their count and Σ
        contexts, for a cost model that reads only those: ``uses_decode_list``), then ``rest`` (participant, tokens,
        tokens computed before: a chunk of a prompt part-way done, in the running phase), then the whole prompts of
        ``reqs`` (in admission order; the last computes only the first chunk ``last_chunk[0]`` when given, its
        admission allocating the blocks of ``last_chunk[1]`` tokens), priced as ``Instance.price_step`` prices it;
        add each of ``reqs`` as a participant (its schedules are completed when its prompt is done:
        ``_QueueWalk``, or here for a whole prompt). ``first_hit``: ``reqs[0]`` computes its sequence after a
        prefix hit of that many tokens (its own blocks, :func:`_resumed_hit`; whole, not chunked). False (nothing
        added) when under async its CPU work would show."""
        inst = self.inst
        opt = inst.options
        async_ = self.async_
        hit = first_hit or 0
        prompts = [r.num_tokens for r in reqs]  # tokens each computes before its decodes
        if hit:
            prompts[0] -= hit
        news = list(prompts)
        if last_chunk is not None:
            news[-1] = last_chunk[0]
        contexts = [0] * len(news)
        if hit:
            contexts[0] = hit
        if rest is not None:
            news.insert(0, rest[1])
            contexts.insert(0, rest[2])
        dbase = self.dbase
        if isinstance(decoders, tuple):
            num_decodes = decoders[0]
            shape = _aggregate_shape(num_decodes, decoders[1], news, contexts)
        else:
            num_decodes = len(decoders)
            ctx = [dbase[i] + j for i in decoders]
            shape = (BatchShape.decodes_and_prefills(ctx, news, contexts) if min(news) > 1
                     else BatchShape.from_requests([1] * len(ctx) + news, ctx + contexts))
        if opt.cudagraph_sizes:
            shape.padded_tokens = padded_size(opt.cudagraph_sizes, shape.num_tokens)
        dt = inst.cost_model.step_time(shape)
        ends, dts_l, counts_l = a.ends, a.dts, a.counts
        if self.cpu_on:
            cpu = (opt.cpu_base_s + opt.cpu_per_seq_s * shape.num_seqs + opt.cpu_per_token_s * shape.num_tokens
                   + opt.cpu_per_new_request_s * len(reqs))
            if not async_:
                dt += cpu
            elif at + cpu > ends[j]:
                return False  # its CPU work would show: the jump ends before it
        off = 1 if async_ else 0
        del dts_l[j:], counts_l[j:], ends[j + off:]
        dts_l.append(dt)
        counts_l.append(num_decodes)
        ends.append((ends[-1] if ends else a.start) + dt)  # (none left: sync schedule 0, made at the start)
        bs = inst.kv.block_size
        # (typed locals: native appends when compiled)
        c0: list[int] = a.c0
        rem: list[int] = a.rem
        s0: list[int] = a.s0
        first_tokens: list[int] = a.first_tokens
        chunks: list[list[int]] = a.chunks
        alloc0: list[int] = a.alloc0
        held: list[int] = a.held
        base: list[int] = a.base
        dfirst: list[int] = a.dfirst
        fin: list[int] = a.fin
        d0: list[int] = self.d0
        alive: list[int] = self.alive
        admissions: list[tuple[int, int]] = a.admissions
        a_reqs: list[Any] = a.reqs
        for n, (r, prompt) in enumerate(zip(reqs, prompts)):
            chunked = last_chunk is not None and n == len(reqs) - 1
            left = r.stop_at - r.num_output_tokens  # (a request resumed after a preemption has some already)
            i = len(c0)
            computed = hit if n == 0 else 0  # (its own blocks' tokens, hit: the first request's only)
            c0.append(computed)
            a.out0.append(r.num_output_tokens)
            rem.append(left)  # its outputs; its schedules once its prompt is done (finish_prompt)
            s0.append(j)
            first_tokens.append(prompt)
            chunks.append([last_chunk[0]] if chunked else [prompt])  # type: ignore[index]
            alloc0.append(last_chunk[1] if chunked else prompt)  # type: ignore[index]
            held.append(0)
            base.append(-(-(computed + prompt) // bs))  # (a hit block leaves the free queue as a new one)
            dfirst.append(0)
            fin.append(0)
            dbase.append(0)
            d0.append(0)
            alive.append(i)
            admissions.append((j, i))
            a_reqs.append(r)
            if not chunked:
                self.finish_prompt(a, i)
        return True

    def finish_prompt(self, a: _Arrivals, i: int) -> None:
        """Participant i's prompt is done with the last of its ``chunks`` (at schedule s0 + chunks - 1): set its
        schedules (``rem``, until its ``stop_at``), completion step, decode contexts and first block crossing."""
        k = len(a.chunks[i])
        j = a.s0[i]
        prompt = a.first_tokens[i]
        left = a.rem[i]
        a.rem[i] = left + k - 1
        a.dfirst[i] = j + k + (-prompt) % self.inst.kv.block_size
        self.dbase[i] = a.c0[i] + prompt - j - k
        self.d0[i] = j + k
        f = a.fin[i] = j + left + k - 2 + (1 if self.async_ else 0)
        heappush(self.heap, (f << _HEAP_SHIFT) | i)


def _aggregate_shape(num_decodes: int, decode_sum: int, news: list[int], contexts: list[int]) -> BatchShape:
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


def _admitting(inst, running: list[Request], computed0: list[int], rem: list[int], fin: list[int], dts: np.ndarray,
               counts: np.ndarray, ends: list[float], freed: int = 0) -> tuple[_Arrivals, _Admitting]:
    """A planned stretch of decodes of ``running`` (``dts``, ``counts``, ``ends``) as the start of a jump to be
    extended through admissions: the participants so far (the running requests) and their bookkeeping;
    ``freed``: blocks schedule 0's preemptions free."""
    n_run = len(running)
    bs = inst.kv.block_size
    a = _Arrivals()
    a.n_run = n_run
    a.c0, a.rem, a.fin = list(computed0), list(rem), list(fin)
    a.s0, a.first_tokens, a.base = [0] * n_run, [1] * n_run, [0] * n_run
    a.chunks = [(1,)] * n_run
    a.alloc0 = [0] * n_run
    a.held = [len(r.blocks) for r in running]
    a.dfirst = [(-c) % bs for c in computed0]
    a.reqs, a.admissions = [], []
    a.running = running
    a.out0 = [r.num_output_tokens for r in running]
    a.mid_victims = []  # (schedule, participant whose decode needs the block, reason, victim, rem, fin before)
    a.dts, a.counts, a.ends = dts.tolist(), counts.tolist(), ends
    a.start = inst.now
    a.admit_after = None
    ad = _Admitting()
    ad.inst = inst
    ad.alive = list(range(n_run))
    ad.heap = [(f << _HEAP_SHIFT) | i for i, f in enumerate(fin)]  # (packed: _HEAP_SHIFT)
    heapify(ad.heap)
    ad.freed = 0
    ad.free = len(inst.kv.pool.free_queue) + freed
    ad.dbase = list(computed0)  # participant i's decode at schedule j has context dbase[i] + j
    ad.d0 = [0] * n_run  # its first decode schedule
    ad.async_ = inst.async_scheduling
    opt = inst.options
    ad.cpu_on = opt.cpu_base_s or opt.cpu_per_seq_s or opt.cpu_per_token_s or opt.cpu_per_new_request_s
    return a, ad


def _decode_stretch(inst, a: _Arrivals, alive: list[int], dbase: list[int], j_lo: int, cap: int,
                    stop_time: float, async_: bool, pad_table: np.ndarray, cpu_on,
                    ends_of: _DecodeEnds | None = None) -> bool:
    """Plan the decodes of ``alive`` from schedule ``j_lo`` on (appended to ``a``), in chunks until the next
    arrival (``a.hint``), ``cap`` schedules, the last participant's last schedule or ``stop_time``. False when
    the jump cannot go on after it (no participant left, or under async a schedule whose CPU work would show).
    ``ends_of``: the same decodes kept by decode end (an aggregate cost model), read instead of ``alive``."""
    ctx: list[int] = []
    rem: list[int] = []
    if ends_of is not None:
        ends_of.advance(j_lo)
        last_sched = ends_of.last_end()
    else:
        s0, rem_all = a.s0, a.rem
        last_sched = 0
        for i in alive:
            top_i = s0[i] + rem_all[i]
            if top_i > last_sched:
                last_sched = top_i
            if top_i > j_lo:
                ctx.append(dbase[i] + j_lo)
                rem.append(top_i - j_lo)
    top = last_sched if last_sched < cap else cap
    if j_lo >= top:
        return False
    stretch = ends_of.stretch(j_lo) if ends_of is not None else _Stretch(ctx, rem, inst.cost_model.uses_decode_range)
    ends = a.ends
    kk = min(top - j_lo, _first_chunk(a))
    counts: list[int] = []
    dts: list[float] = []
    seg: list[float] = []
    done = 0  # schedules priced in plain floats so far (a longer chunk prices only the ones after them)
    while True:
        # plain floats when the cost model offers them (the same sums without numpy's cost per call), else numpy
        part = _steady_segment(inst, a, stretch, kk, pad_table, async_, cpu_on, done, dts, seg) if done >= 0 else None
        if part is None:
            counts, dts, seg, hidden = _numpy_segment(inst, a, stretch, kk, pad_table, async_, cpu_on)
            done = -1  # (a longer chunk is priced whole again)
        else:
            counts += part[0]
            dts += part[1]
            seg += part[2]
            hidden = part[3]
            done = kk
        if not hidden or kk == top - j_lo or _past_next_arrival(seg, a.hint, async_) or seg[-1] >= stop_time:
            break
        kk = min(top - j_lo, _next_chunk(kk, seg, dts, a.hint))
    a.dts += dts
    a.counts += counts
    ends += seg
    return hidden


def _numpy_segment(inst, a: _Arrivals, stretch: Any, kk: int, pad_table: np.ndarray, async_: bool,
                   cpu_on) -> tuple[list[int], list[float], list[float], bool]:
    """:func:`_steady_segment` through numpy (any cost model, any CPU overlap): (decodes, step seconds, end times,
    all CPU work hidden); when some schedule's CPU work would show, the schedules before it and False."""
    counts, dts = stretch.times(inst.cost_model, kk, pad_table)
    ends = a.ends
    if cpu_on:
        cpu = _decode_cpu(inst.options, counts)
        if not async_:
            dts = dts + cpu
    seg = _end_times(ends[-1], None, dts)
    # async: schedule j_lo + t is made when executed step j_lo + t - 1 ends and must be done when j_lo + t
    # ends. That holds when its CPU time is at most that step's duration (a.dts[-1], the admission's, for t = 0;
    # rounding is monotone and the end is the start plus the duration, rounded), so the exact sums are compared
    # only when that quick test fails.
    if async_ and cpu_on and not (cpu[0] <= a.dts[-1] and (cpu[1:] <= dts[:-1]).all()):
        made = np.concatenate(([ends[-2], ends[-1]], seg[:max(kk - 2, 0)]))[:kk]
        done = np.concatenate(([ends[-1]], seg[:kk - 1]))
        hidden = made + cpu <= done
        if not hidden.all():
            cut = int(np.argmin(hidden))
            return counts[:cut].tolist(), dts[:cut].tolist(), seg[:cut].tolist(), False
    return counts.tolist(), dts.tolist(), seg.tolist(), True


def _past_next_arrival(seg, hint: float, async_: bool) -> bool:
    """Whether planned end times ``seg`` reach far enough past the next arrival at ``hint`` for the schedule that
    sees it to be planned too (made when the first step ending after it ends, so its admission can be): two ends
    after it, three under async (the ends then start with the step in flight's)."""
    need = 3 if async_ else 2
    return seg[-need] > hint if len(seg) >= need else seg[-1] >= hint


def _first_chunk(a: _Arrivals) -> int:
    """Schedules to price first after an admission: about as many as fit before the next arrival at the pace of
    the last decode step (the one before the admission's), with a tenth to spare; at least 8, at most 64. A
    chunk that falls short grows; one that ends before the first completion is priced in plain floats
    (:func:`_steady_segment`)."""
    dts = a.dts
    pace = dts[-2] if len(dts) > 1 else dts[-1]
    gap = a.hint - a.ends[-1]
    if not gap < 48 * pace:
        return 64
    return max(8, int(gap / pace * 1.1) + 2)


def _next_chunk(kk: int, seg: list[float], dts: list[float], hint: float) -> int:
    """Schedules to price next when the first ``kk`` (end times ``seg``, step seconds ``dts``) fall short of the next
    arrival at ``hint``: as many more as fit before it at the pace of the last one, with a tenth and the three past
    it (:func:`_past_next_arrival`) to spare, at most four times as many (as many when no arrival is known). The
    whole chunk is priced again: a chunk much longer than needed is discarded past the arrival's admission."""
    if hint == float("inf"):
        return kk * 4
    more = int((hint - seg[-1]) / dts[-1] * 1.1) + 4 if dts[-1] > 0 else 3 * kk
    return kk + min(max(more, 8), 3 * kk)


def _steady_segment(inst, a: _Arrivals, stretch: Any, kk: int, pad_table: np.ndarray, async_: bool,
                    cpu_on, t_from: int = 0, prev_dts: list[float] | None = None,
                    prev_seg: list[float] | None = None) -> tuple[list[int], list[float], list[float], bool] | None:
    """(decodes, step seconds, end times, True) of the stretch's schedules t_from..kk-1 after the jump's last
    planned step (and ``prev_dts``, ``prev_seg``: the stretch's schedules before ``t_from``, priced so), as plain
    ints and floats (:meth:`_Stretch.steady_times`: tens of steps between arrivals cost less so than through numpy)
    when the cost model offers it and, under async, their CPU work passes the quick test of :func:`_numpy_segment`;
    else None (priced with numpy there)."""
    runs = stretch.steady_times(inst.cost_model, kk, pad_table, t_from)
    if runs is None:
        return None
    counts: list[int] = []
    dts: list[float] = []
    opt = inst.options
    before: float = prev_dts[-1] if prev_dts else a.dts[-1]  # the step before the first one
    for b, times in runs:
        counts += [b] * len(times)
        if cpu_on:
            cpu = _decode_cpu(opt, b)
            if not async_:
                times = [d + cpu for d in times]
            elif not (cpu <= (dts[-1] if dts else before) and (len(times) < 2 or cpu <= min(times[:-1]))):
                return None
        dts += times
    seg: list[float] = []
    end: float = prev_seg[-1] if prev_seg else a.ends[-1]
    for d in dts:  # one step at a time, as the event loop adds them
        end += d
        seg.append(end)
    return counts, dts, seg, True


def _bound(inst, head, running: list[Request], computed0: list[int], rem: list[int], fin: list[int], k: int, bs: int,
           free: int, async_: bool, check_head: bool = False) -> tuple[int, int | None]:
    """How many of schedules 0..k-1 the jump may make: ``(k', f)``, where ``f`` is the completion step after which
    the next schedule may admit the waiting ``head`` (the jump then ends with that step, ``k' = f + 1``), or None.

    KV: request i takes a block at schedules j0, j0 + bs, ... below rem_i (j0 = -C_i mod bs), and a request
    completing at the output of step f_i frees all its blocks for schedule f_i + 1 on; schedule j preempts when
    the blocks taken by schedules 0..j exceed ``free`` plus those freed by then, so the jump stops before it.
    Between completions the blocks taken only grow, so the first such schedule is found by binary search.

    Admission: with requests waiting behind ``head`` (shown blocked by the last real schedule), a schedule between
    completions cannot admit it (free blocks only shrink, the budget and ``max_num_seqs`` slots do not grow); at a
    completion the scheduler's :meth:`~lab.core.sched_api.SchedulerBase.head_stays_blocked` decides, from the
    running count, the decodes of the next schedule and its free blocks after their allocations, whether the
    jump goes on. The completion ending the jump is also ``f`` when the jump's length cut it (the next schedule
    has not been checked). With ``check_head``, schedule 0 is checked the same way first (something changed since
    the last schedule that showed the head blocked): ``(0, -1)`` when it may admit the head (a jump can then start
    with that admission, :func:`_through_queue` from ``after`` = -1)."""
    j0s = [(-c) % bs for c in computed0]

    if len(rem) < _VECTOR_BOUND_FROM:
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
        if avail >= 0 and not inst.scheduler.head_stays_blocked(inst, head, n, num_decodes, avail):
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
            if avail >= 0 and not inst.scheduler.head_stays_blocked(inst, head, n - pos, num_decodes, avail):
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
            if not inst.scheduler.head_stays_blocked(inst, head, n - pos, num_decodes, avail):
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


_PAD_TABLES: dict[tuple, tuple] = {}


def _pad_table(sizes: tuple[int, ...], top: int) -> np.ndarray:
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


def _admission_events(p: Plan, n_run: int, k: int, bs: int) -> None:
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
    shift = _EV_SCHEDULE_SHIFT
    for j, i in admissions:
        ev.append(_event(j, i, 2))
        prompt_schedules = len(chunks[i])
        for t in range(1, prompt_schedules):
            ev.append(_event(j + t, i, 3))
        top = min(s0[i] + rem[i], k)
        new_block = _event(0, i, 0)
        for jd in range(j + prompt_schedules + (-first_tokens[i]) % bs, top, bs):
            ev.append((jd << shift) | new_block)
    ev.sort()


def _admission_rows(p: Plan) -> None:
    """For each planned admission at schedule j: the row of step j - 1 (the last before schedule j) counts the
    arrival as waiting (a queue head is counted in ``num_waiting`` already, and leaves it from row j on: see
    :func:`_rows`), and the row of each step that computes its prompt (j, async j + 1, and the next ones for a
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


def _block_events(computed0: list[int], rem: list[int], k: int, bs: int, async_: bool, caching: bool,
                  unique: list[bool]) -> list[int]:
    """The decodes' block operations (:func:`_event`: schedule j, request position, kind) in execution order; kind
    0 = take a new block, 1 = register the block that just filled. Within one request's allocation the new block
    comes first (vLLM ``allocate_slots``)."""
    if not caching or all(unique):
        return _new_block_events(computed0, rem, k, bs)
    ev: list[int] = []
    shift = _EV_SCHEDULE_SHIFT
    for i, c in enumerate(computed0):
        top = min(rem[i], k)
        new_block = _event(0, i, 0)
        for j in range((-c) % bs, top, bs):
            ev.append((j << shift) | new_block)
        if caching and not unique[i]:
            # sync: a block fills when computed0 + j + 1 is a multiple of bs; async (one token behind): when computed0 + j is
            register = _event(0, i, 1)
            for j in range(((-c) % bs) if async_ else ((-c - 1) % bs), top, bs):
                ev.append((j << shift) | register)
    ev.sort()
    return ev


def _new_block_events(computed0: list[int], rem: list[int], k: int, bs: int) -> list[int]:
    """:func:`_block_events` when no block is registered (kind 0 only), made in order without a sort: request i
    takes a new block at the schedules j = (-computed0[i]) mod bs, + bs, ... below min(rem[i], k), so the requests
    are grouped by that residue, and each schedule j reads the group of j mod bs (in position order), dropping
    the requests past their last schedule."""
    tops = [m if m < k else k for m in rem]
    groups: list[list[int]] = [[] for _ in range(bs)]
    for i, c in enumerate(computed0):
        groups[(-c) % bs].append(i)
    ev: list[int] = []
    shift = _EV_SCHEDULE_SHIFT
    for j in range(max(tops, default=0)):
        members = groups[j % bs]
        if not members:
            continue
        if any(tops[i] <= j for i in members):
            members = groups[j % bs] = [i for i in members if tops[i] > j]
        base = j << shift
        for i in members:
            ev.append(base | (i << _EV_POS_SHIFT) | 1)  # (_event(j, i, 0))
    return ev


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
        out, in_flight = _running_outputs(async_, m, sched, n_out)
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


def _running_outputs(async_: bool, m: int, sched: int, n_out: int) -> tuple[int, int]:
    """(outputs, steps in flight) of a request running at the jump's start that takes part in ``m`` schedules,
    after ``sched`` of its schedules and ``n_out`` steps: async, the step in flight at the start gives it one
    output and schedule j's step (j + 1) the next; sync, schedule j's step (j) gives it one."""
    if async_:
        out = 0 if n_out == 0 else (n_out if n_out < m + 1 else m + 1)
        return out, 1 + sched - out
    out = n_out if n_out < m else m
    return out, sched - out


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
            out, in_flight = _running_outputs(async_, m, sched, n_out)
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
    (:func:`_block_events`, :func:`_admission_events`; kind -1: schedule 0's preemptions, right before the block of
    the decode they make room for, :func:`_preempt_planned`)."""
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
            j = e >> _EV_SCHEDULE_SHIFT
            if j >= s_end:
                break
            i = (e >> _EV_POS_SHIFT) & _EV_POS_MASK
            kind = (e & _EV_KIND_MASK) - 1
            if j > j_prev:  # schedules without block operations in between
                used.extend([cur] * (j - j_prev))
                j_prev = j
            if kind == 0:
                reqs[i].blocks.append(pool.get_new_block())
                cur += 1
            elif kind == 2:
                _admit_planned(inst, plan, i, j, n_out)
                cur = usable - len(pool.free_queue)
            elif kind == 3:
                _rest_planned(inst, plan, i, j, n_out)
                cur = usable - len(pool.free_queue)
            elif kind == -1:
                _preempt_planned(inst, plan, j, i)
                cur = usable - len(pool.free_queue)
            else:
                kv.register_full_blocks(reqs[i], (plan.computed0[i] + j + 1) // bs if not async_
                                        else (plan.computed0[i] + j) // bs)
            ev_pos += 1
        if s_end > j_prev:
            used.extend([cur] * (s_end - j_prev))
        a_s = max(a_s, s_end)
        if o_end > a_o:
            _effects(inst, plan, a_o, o_end, a_s)
            a_o = o_end
    _rows(inst, plan, q_first, a_o, a_s)
    plan._ev_pos = ev_pos
    plan.applied_sched, plan.applied_out = a_s, a_o
    if plan.num_waiting and plan.admit_after is not None and a_s > plan.admit_after:
        inst.steady = False  # the next schedule was not checked: a real one, or a plan that checks it first
    elif plan.from_queue and a_s in plan.busy:
        # every other schedule of the jump is a checked pure decode that leaves the head blocked; this one admits
        # or computes a prompt chunk (a real one if the jump is materialised before it)
        inst.steady = False
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


def _admit_planned(inst, plan: Plan, i: int, j: int, n_out: int) -> None:
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
    inst.num_planned_admissions += 1
    if r.first_scheduled_time is None:
        r.first_scheduled_time = at
    if len(plan.chunks[i]) == 1:
        _first_sample(inst, plan, i, r, j, n_out)


def _preempt_planned(inst, plan: Plan, j: int, before: int) -> None:
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


def _effects(inst, plan: Plan, q0: int, q1: int, n_sched: int) -> None:
    """Apply what the outputs of steps q0..q1-1 do to requests (their rows come from :func:`_rows`; a planned
    admission's first token comes with it, :func:`_admit_planned`): the first tokens and ITL samples of the step in
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


def _rows(inst, plan: Plan, q0: int, q1: int, n_sched: int) -> None:
    """Log the rows of steps q0..q1-1 in one go (after :func:`_effects`), with their ITL samples and busy time.
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
    steps.extend(st, ds, decodes, _float_array(plan.used[q - off:q1 - off]), running, waits, prefill,
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
        inst.steady = False  # the schedule after this completion may admit: it is a real one


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
