"""A jump extended through planned admissions, shared by both extensions (arrivals known in advance, the waiting queue's heads): the participants and their bookkeeping (:class:`ExtendedJump`, :class:`Admitting`) and the decode stretches between admissions (:func:`decode_stretch`)."""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Any

import numpy as np

from lab.core.batch import BatchShape, padded_size
from lab.core.request import Request
from lab.engine.jump.base import HEAP_MASK, HEAP_SHIFT, aggregate_shape, decode_cpu, end_times, remove_value
from lab.engine.jump.pricing import DecodeEnds, Stretch


class ExtendedJump:
    """A jump extended through planned admissions (:func:`through_arrivals`): every participant, the running
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
        searched only if it runs out (the same rule as :func:`plan_bound`, over participants that join)."""
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
                remove_value(alive, i)
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


class Admitting:
    """The bookkeeping of a jump being extended through admissions (:func:`start_extension`): participants alive (not
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

    def at_schedule(self, a: ExtendedJump, j: int) -> tuple[list[int], int]:
        """Schedule j (completions before it applied): the participants it decodes, and the free blocks after its
        decodes' allocations (negative: it preempts)."""
        avail = self.free_at(a, j)
        d0: list[int] = self.d0
        s0: list[int] = a.s0
        rem: list[int] = a.rem
        alive: list[int] = self.alive
        return [i for i in alive if d0[i] <= j < s0[i] + rem[i]], avail

    def free_at(self, a: ExtendedJump, j: int) -> int:
        """The free blocks after schedule j's decodes' allocations, completions before it applied (negative: it
        preempts)."""
        heap: list[int] = self.heap
        alive: list[int] = self.alive
        while heap and heap[0] >> HEAP_SHIFT < j:
            i = heappop(heap) & HEAP_MASK
            remove_value(alive, i)
            self.freed += a.held[i]
        return self.free + self.freed - a.taken_by(alive, j + 1, self.inst.kv.block_size)

    def next_completion(self) -> int | None:
        """The step of the next completion among the participants alive, or None."""
        return self.heap[0] >> HEAP_SHIFT if self.heap else None

    def admit(self, a: ExtendedJump, reqs: list[Request], j: int, at: float, decoders: list[int] | tuple[int, int],
              last_chunk: tuple[int, int] | None = None, rest: tuple[int, int, int] | None = None,
              first_hit: int | None = None) -> bool:
        """Plan schedule j (made at ``at``) as the decodes of ``decoders`` (participants; or their count and Σ
        contexts, for a cost model that reads only those: ``uses_decode_list``), then ``rest`` (participant, tokens,
        tokens computed before: a chunk of a prompt part-way done, in the running phase), then the whole prompts of
        ``reqs`` (in admission order; the last computes only the first chunk ``last_chunk[0]`` when given, its
        admission allocating the blocks of ``last_chunk[1]`` tokens), priced as ``Instance.price_step`` prices it;
        add each of ``reqs`` as a participant (its schedules are completed when its prompt is done:
        ``_QueueWalk``, or here for a whole prompt). ``first_hit``: ``reqs[0]`` computes its sequence after a
        prefix hit of that many tokens (its own blocks, :func:`resumed_hit`; whole, not chunked). False (nothing
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
            shape = aggregate_shape(num_decodes, decoders[1], news, contexts)
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

    def finish_prompt(self, a: ExtendedJump, i: int) -> None:
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
        heappush(self.heap, (f << HEAP_SHIFT) | i)


def start_extension(inst, running: list[Request], computed0: list[int], rem: list[int], fin: list[int], dts: np.ndarray,
               counts: np.ndarray, ends: list[float], freed: int = 0) -> tuple[ExtendedJump, Admitting]:
    """A planned stretch of decodes of ``running`` (``dts``, ``counts``, ``ends``) as the start of a jump to be
    extended through admissions: the participants so far (the running requests) and their bookkeeping;
    ``freed``: blocks schedule 0's preemptions free."""
    n_run = len(running)
    bs = inst.kv.block_size
    a = ExtendedJump()
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
    ad = Admitting()
    ad.inst = inst
    ad.alive = list(range(n_run))
    ad.heap = [(f << HEAP_SHIFT) | i for i, f in enumerate(fin)]  # (packed: HEAP_SHIFT)
    heapify(ad.heap)
    ad.freed = 0
    ad.free = len(inst.kv.pool.free_queue) + freed
    ad.dbase = list(computed0)  # participant i's decode at schedule j has context dbase[i] + j
    ad.d0 = [0] * n_run  # its first decode schedule
    ad.async_ = inst.async_scheduling
    opt = inst.options
    ad.cpu_on = opt.cpu_base_s or opt.cpu_per_seq_s or opt.cpu_per_token_s or opt.cpu_per_new_request_s
    return a, ad


def decode_stretch(inst, a: ExtendedJump, alive: list[int], dbase: list[int], j_lo: int, cap: int,
                    stop_time: float, async_: bool, pad_table: np.ndarray, cpu_on,
                    ends_of: DecodeEnds | None = None) -> bool:
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
    stretch = ends_of.stretch(j_lo) if ends_of is not None else Stretch(ctx, rem, inst.cost_model.uses_decode_range)
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


def _numpy_segment(inst, a: ExtendedJump, stretch: Any, kk: int, pad_table: np.ndarray, async_: bool,
                   cpu_on) -> tuple[list[int], list[float], list[float], bool]:
    """:func:`_steady_segment` through numpy (any cost model, any CPU overlap): (decodes, step seconds, end times,
    all CPU work hidden); when some schedule's CPU work would show, the schedules before it and False."""
    counts, dts = stretch.times(inst.cost_model, kk, pad_table)
    ends = a.ends
    if cpu_on:
        cpu = decode_cpu(inst.options, counts)
        if not async_:
            dts = dts + cpu
    seg = end_times(ends[-1], None, dts)
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


def _first_chunk(a: ExtendedJump) -> int:
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


def _steady_segment(inst, a: ExtendedJump, stretch: Any, kk: int, pad_table: np.ndarray, async_: bool,
                    cpu_on, t_from: int = 0, prev_dts: list[float] | None = None,
                    prev_seg: list[float] | None = None) -> tuple[list[int], list[float], list[float], bool] | None:
    """(decodes, step seconds, end times, True) of the stretch's schedules t_from..kk-1 after the jump's last
    planned step (and ``prev_dts``, ``prev_seg``: the stretch's schedules before ``t_from``, priced so), as plain
    ints and floats (:meth:`Stretch.steady_times`: tens of steps between arrivals cost less so than through numpy)
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
            cpu = decode_cpu(opt, b)
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
