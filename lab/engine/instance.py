"""One engine instance as a SimPy process: schedule -> step time from the cost model -> wait -> apply outputs.

The instance owns the mechanisms every policy shares: the running list, the waiting queue, the paged KV cache, the
request state machine and the step log. The scheduler (a policy) decides what runs; the instance advances
``num_computed_tokens`` at schedule time (as vLLM's ``_update_after_schedule`` does), waits the step time and then
appends one sampled token to every request whose C reached ``num_tokens``, finishing those that reached their
output length and freeing their blocks at once (vLLM ``update_from_output``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable

from bisect import bisect_left
from heapq import heappush

import numpy as np
import simpy
from simpy.core import NORMAL
from simpy.events import Event

from lab.engine import fastforward as ff
from lab.core.batch import BatchShape
from lab.costmodel.base import CostModel
from lab.core.kv_cache import KVCacheManager
from lab.core.queues import make_queue
from lab.core.request import Request, RequestStatus
from lab.core.samples import WeightedSamples
from lab.core.sched_api import Scheduler, SchedulerConfig

STEP_COLUMNS = (
    "instance", "start", "duration", "scheduled_tokens", "prefill_tokens", "decode_requests", "batch_size",
    "kv_blocks_used", "kv_usage", "num_running", "num_waiting", "num_preempted", "output_tokens", "transfer_s",
)
# what a StepLog stores per row; "instance" and "kv_usage" (= kv_blocks_used / usable blocks) are added when read
_LOGGED = tuple(c for c in STEP_COLUMNS if c not in ("instance", "kv_usage"))


@dataclass(frozen=True)
class EngineOptions:
    """How an instance executes steps (independent of the scheduling policy).

    Attributes:
        async_scheduling: vLLM's async scheduling: the next step is scheduled while the current one runs (one step
            of lookahead), so a step's CPU work overlaps the previous step's GPU work. Only used with schedulers that
            declare ``supports_async``.
        cpu_base_s, cpu_per_seq_s, cpu_per_token_s: CPU time of one step (scheduling, input preparation, sampling
            and output processing) = base + per_seq · sequences + per_token · tokens. Sync scheduling adds it to
            the GPU time; async scheduling hides it behind the GPU unless it is longer.
        cudagraph_sizes: sorted token counts with a captured CUDA graph; a step's token count is padded up to the
            next size (full graphs for pure decodes, piecewise graphs for mixed steps; larger steps run unpadded).
            Empty = no padding (eager mode).
        record_breakdown: also record each step's cost breakdown (slower; used by ``servelab validate``).
        fast_forward: advance stretches of identical decode steps in one jump (lab/engine/fastforward.py); exact.
    """

    async_scheduling: bool = False
    cpu_base_s: float = 0.0
    cpu_per_seq_s: float = 0.0
    cpu_per_token_s: float = 0.0
    cudagraph_sizes: tuple[int, ...] = ()
    record_breakdown: bool = False
    fast_forward: bool = True


class _At(Event):
    """An event that fires at absolute time ``t`` (a Timeout computes ``now + delay``, which can round away from
    ``t``; a jump must land exactly where step-by-step simulation would). Built like simpy's Timeout."""

    def __init__(self, env: simpy.Environment, t: float) -> None:
        self.env = env
        self.callbacks = []
        self._value = None
        self._ok = True
        heappush(env._queue, (t, NORMAL, next(env._eid), self))  # simpy 4: Environment.schedule, absolute time


class _Step:
    """A step that has been scheduled: its requests, their token counts, and whether each samples a token."""

    __slots__ = ("reqs", "news", "samples", "shape", "dt", "scheduled_at", "used_blocks", "num_preempted", "xfer")

    def __init__(self, reqs, news, samples, shape, dt, scheduled_at, used_blocks, num_preempted, xfer=0.0):
        self.reqs = reqs
        self.news = news
        self.samples = samples
        self.shape = shape
        self.dt = dt
        self.scheduled_at = scheduled_at
        self.used_blocks = used_blocks
        self.num_preempted = num_preempted
        self.xfer = xfer


class StepLog:
    """Per-step records of one instance, kept column-wise in compact arrays (one row per step).

    Rows hold ``start, duration, scheduled_tokens, prefill_tokens, decode_requests, batch_size, kv_blocks_used,
    num_running, num_waiting, num_preempted, output_tokens, transfer_s``; :meth:`frames` adds ``instance`` and
    ``kv_usage``. With ``spill_path`` set, every ``chunk_rows`` rows are written to that Parquet file and dropped
    from memory, so a long run's memory does not grow with its history.
    """

    def __init__(self, instance_id: int = 0, usable_blocks: int = 1, spill_path: str | None = None,
                 chunk_rows: int = 1 << 16) -> None:
        self.instance_id = instance_id
        self.usable_blocks = usable_blocks
        self.cols = {c: array("d") for c in _LOGGED}
        self._cols = list(self.cols.values())
        self.spill_path = spill_path
        self.chunk_rows = chunk_rows
        self.spilled_rows = 0
        self._writer = None

    def append(self, *row: float) -> None:
        for c, v in zip(self._cols, row):
            c.append(v)

    def extend(self, start: list, duration: list, batch: list, used: list, running: int, waiting: int) -> None:
        """Append pure-decode rows (fast-forward): ``batch[i]`` requests each computing and sampling one token."""
        n = len(start)
        (c_start, c_dur, c_sched, c_pre, c_dec, c_batch, c_used, c_run, c_wait, c_pree, c_out,
         c_xfer) = self._cols
        c_start.extend(start)
        c_dur.extend(duration)
        c_sched.extend(batch)
        zeros = [0.0] * n
        c_pre.extend(zeros)
        c_dec.extend(batch)
        c_batch.extend(batch)
        c_used.extend(used)
        c_run.extend([running] * n)
        c_wait.extend([waiting] * n)
        c_pree.extend(zeros)
        c_out.extend(batch)
        c_xfer.extend(zeros)

    def maybe_spill(self) -> None:
        if self.spill_path is not None and len(self._cols[0]) >= self.chunk_rows:
            self.flush()

    def _frame_columns(self) -> dict:
        cols = {k: np.frombuffer(v, dtype=float) if len(v) else np.array([], float) for k, v in self.cols.items()}
        n = len(cols["start"])
        out = {"instance": np.full(n, float(self.instance_id))}
        for c in STEP_COLUMNS[1:]:
            out[c] = cols["kv_blocks_used"] / self.usable_blocks if c == "kv_usage" else cols[c]
        return out

    def flush(self) -> None:
        """Write the rows held in memory to the spill file."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        n = len(self._cols[0])
        if not n or self.spill_path is None:
            return
        table = pa.table(self._frame_columns())
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.spill_path, table.schema)
        self._writer.write_table(table)
        self.spilled_rows += n
        self.cols = {c: array("d") for c in _LOGGED}
        self._cols = list(self.cols.values())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def frames(self, chunk_rows: int = 1 << 19):
        """The whole log as a sequence of DataFrames (spilled chunks first, then the rows in memory)."""
        import pandas as pd
        import pyarrow.parquet as pq

        if self.spilled_rows:
            self.close()
            for batch in pq.ParquetFile(self.spill_path).iter_batches(batch_size=chunk_rows):
                yield batch.to_pandas()
        if len(self._cols[0]):
            yield pd.DataFrame(self._frame_columns())

    def __len__(self) -> int:
        return self.spilled_rows + len(self._cols[0])


class Instance:
    """A vLLM-style engine instance.

    Args:
        env: the SimPy environment (its clock is seconds).
        instance_id: index of this instance in the deployment.
        config: scheduler limits.
        scheduler: the scheduling policy.
        kv: this instance's KV cache manager.
        cost_model: step-time model.
        itl_samples: shared store receiving every inter-token latency sample (seconds).
        on_done: called with each request that finishes or is rejected.
        record_events: keep each request's (time, event) history.
        options: step execution options (async scheduling, CPU overhead, CUDA-graph padding).
    """

    def __init__(self, env: simpy.Environment, instance_id: int, config: SchedulerConfig, scheduler: Scheduler,
                 kv: KVCacheManager, cost_model: CostModel, itl_samples: WeightedSamples,
                 on_done: Callable[[Request], None] | None = None, record_events: bool = False,
                 options: EngineOptions | None = None) -> None:
        self.env = env
        self.instance_id = instance_id
        self.config = config
        self.scheduler = scheduler
        self.kv = kv
        self.cost_model = cost_model
        self.options = options or EngineOptions()
        self.async_scheduling = self.options.async_scheduling and bool(getattr(scheduler, "supports_async", False))
        self.running: list[Request] = []
        # A scheduler may own its waiting-queue order (e.g. shortest job first) through make_queue(config).
        own_queue = getattr(scheduler, "make_queue", None)
        self.waiting = own_queue(config) if own_queue is not None else make_queue(config.queue_policy)
        # a queue whose order changes with time alone says until when it is stable (lab/core/queues.py WaitingQueue)
        self._order_stable_until = getattr(self.waiting, "order_stable_until", None)
        self.itl = itl_samples
        self.on_done = on_done
        self.record_events = record_events
        self.steps = StepLog(instance_id, kv.pool.num_gpu_blocks - 1)
        self.breakdown: dict[str, array] = {}
        self.num_preemptions = 0
        self.busy_time = 0.0
        self.transfer_total = 0.0
        # Swap preemption (issue #5): KV bytes per token on one GPU, host-link bytes/s, CPU swap space in tokens.
        self.swap_bytes_per_token = 0.0
        self.swap_bandwidth = 0.0
        self.swap_capacity_tokens = 0
        self.swap_used_tokens = 0
        self._transfer_s = 0.0
        self._wakeup: simpy.Event | None = None
        # fast-forward state
        self.stop_time = float("inf")
        self.steady = False
        self._admitted = 0
        self._inflight: _Step | None = None
        self._plan: ff.Plan | None = None
        self._cont = None
        self.jumping: set | None = None
        self._ff_pad_table = None
        # Expected time of this instance's next arrival (sizes fast-forward plans; correctness never depends on it)
        self.arrival_hint: Callable[[], float] = lambda: float("inf")
        self._last_arrival = 0.0
        self._gap_ema = 0.0
        self.num_jumps = 0
        self.jumped_steps = 0
        self._ff = (self.options.fast_forward and not self.options.record_breakdown
                    and bool(getattr(scheduler, "supports_fast_forward", False)))
        self.process = env.process(self._loop())

    # ---- the EngineView a scheduler sees ----
    @property
    def now(self) -> float:
        return self.env.now

    def admit(self, request: Request, num_computed_tokens: int) -> None:
        self._admitted += 1
        request.num_computed_tokens = num_computed_tokens
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if not request.prefix_hit_recorded:
            request.prefix_hit_recorded = True
            request.prefix_hit_tokens = num_computed_tokens
            self.kv.prefix_queries += request.num_tokens
            self.kv.prefix_hits += num_computed_tokens
        swap_detail = self._swap_in(request) if request.swapped_tokens else ""
        if request.events is not None:
            if not resumed:
                request.events.append((self.env.now, "scheduled",
                                       f"prefix hit {num_computed_tokens} of {request.num_tokens} tokens"))
            else:
                request.events.append((self.env.now, "resumed", swap_detail or (
                    f"recompute {request.num_tokens - num_computed_tokens} tokens (prefix hit {num_computed_tokens})")))

    def preempt(self, request: Request, reason: str = "", requeue: str | None = None) -> None:
        running = self.running
        if running and running[-1] is request:
            running.pop()
        else:
            running.remove(request)
        lost = request.num_computed_tokens
        swapped = self.config.preemption_mode == "swap" and self._swap_out(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        if not swapped:
            request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token sampled by a step in flight is dropped
        request.num_preemptions += 1
        self.num_preemptions += 1
        where = self.config.preemption_requeue
        if (requeue if where == "auto" else where) == "tail":
            self.waiting.add(request)
        else:
            self.waiting.prepend(request)
        if request.events is not None:
            how = (f"swap-out {request.swapped_tokens} tokens" if swapped else
                   f"recompute, {lost} computed tokens dropped"
                   + (" (CPU swap space full)" if self.config.preemption_mode == "swap" and lost > 0 else ""))
            request.events.append((self.env.now, "preempted", f"{how}; {reason}" if reason else how))

    # ---- swap preemption: new mechanism of issue #5 (merge as a block) ----
    def configure_swap(self, kv_bytes_per_token: float, pcie_bandwidth: float, swap_space_bytes: float) -> None:
        """Enable swap preemption's costs: KV bytes per token on one GPU, host-link bandwidth (B/s, one
        direction) and the CPU swap space of this instance (bytes; vLLM V0 ``swap_space``, per GPU)."""
        self.swap_bytes_per_token = float(kv_bytes_per_token)
        self.swap_bandwidth = float(pcie_bandwidth)
        self.swap_capacity_tokens = int(swap_space_bytes // kv_bytes_per_token) if kv_bytes_per_token else 0

    def transfer_time(self, num_tokens: int) -> float:
        """Seconds to copy ``num_tokens`` tokens of KV over the host link, one direction."""
        return num_tokens * self.swap_bytes_per_token / self.swap_bandwidth if self.swap_bandwidth else 0.0

    def _swap_out(self, request: Request) -> bool:
        """Copy a running request's computed KV to CPU memory; False (recompute instead) when it has none or
        the CPU swap space cannot hold it. The PCIe time is added to the step being scheduled."""
        c = request.num_computed_tokens - request.inflight_tokens  # tokens of steps still running are not kept
        if c <= 0 or self.swap_used_tokens + c > self.swap_capacity_tokens:
            return False
        self.swap_used_tokens += c
        request.num_computed_tokens = c
        request.swapped_tokens = c
        request.num_swaps += 1
        self._transfer_s += self.transfer_time(c)
        return True

    def _swap_in(self, request: Request) -> str:
        """Copy a swapped request's KV back (its blocks were just allocated by the scheduler); returns the event
        detail. The PCIe time is added to the step being scheduled."""
        c = request.swapped_tokens
        self.swap_used_tokens -= c
        request.swapped_tokens = 0
        dt = self.transfer_time(c)
        self._transfer_s += dt
        return f"swap-in {c} tokens ({dt * 1e3:.3f} ms over PCIe)"

    def take_transfer_time(self) -> float:
        """Host-link time accumulated while scheduling this step (swap-outs and swap-ins); resets it."""
        t = self._transfer_s
        self._transfer_s = 0.0
        return t

    @property
    def num_outstanding_tokens(self) -> int:
        """Tokens still to compute (prompt and recompute) or generate for every request on this instance."""
        total = 0
        for r in self.running:
            total += r.total_tokens - r.num_computed_tokens
        for r in self.waiting:
            total += r.total_tokens - r.num_computed_tokens
        return total

    # ---- arrivals ----
    def add_request(self, request: Request) -> None:
        """Accept an arriving request, or reject it with a reason if it can never be served."""
        p = self._plan
        if p is not None:
            if self.env.now > (p.start if p.k == 1 else p.ends_l[p.k - 2]):
                # It arrives during the jump's last step, whose schedule is already made: nothing before the jump
                # ends can see it, so the jump runs to its end (the step records count it as waiting).
                p.deferred_arrivals += 1
            else:
                self.materialize()
        self.steady = False
        now = self.env.now
        gap = now - self._last_arrival
        self._gap_ema = gap if not self._gap_ema else 0.8 * self._gap_ema + 0.2 * gap
        self._last_arrival = now
        request.instance_id = self.instance_id
        if self.record_events:
            request.events = [(self.env.now, "arrived")]
        reason = self.rejection_reason(request)
        if reason:
            self._reject(request, reason)
            return
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        ev = self._wakeup
        if ev is not None and not ev.triggered:
            ev.succeed()

    def rejection_reason(self, request: Request) -> str:
        """Why this request can never be served here ('' if it can)."""
        cfg = self.config
        if request.total_tokens > cfg.max_model_len:
            return (f"prompt + output tokens ({request.prompt_len} + {request.max_tokens}) exceed "
                    f"max_model_len ({cfg.max_model_len})")
        need = self.kv.blocks_for(request.total_tokens - 1)
        if need > self.kv.pool.num_usable_blocks:
            return (f"needs {need} KV blocks for {request.total_tokens - 1} tokens; the cache has "
                    f"{self.kv.pool.num_usable_blocks}")
        if not cfg.enable_chunked_prefill and request.prompt_len > cfg.max_num_batched_tokens:
            return (f"prompt ({request.prompt_len} tokens) exceeds max_num_batched_tokens "
                    f"({cfg.max_num_batched_tokens}) with chunked prefill off")
        return ""

    def _reject(self, request: Request, reason: str) -> None:
        if request.swapped_tokens:  # its KV copy in CPU memory is dropped
            self.swap_used_tokens -= request.swapped_tokens
            request.swapped_tokens = 0
        request.status = RequestStatus.REJECTED
        request.reason = reason
        request.finish_time = None
        if request.events is not None:
            request.events.append((self.env.now, "rejected"))
        if self.on_done:
            self.on_done(request)

    # ---- the engine loop ----
    def _launch(self) -> _Step | None:
        """Schedule one step and apply vLLM's ``_update_after_schedule``: C += n, and a request whose C reaches
        ``num_tokens`` + placeholders will sample a token (P += 1). Returns None when nothing was scheduled."""
        self._admitted = 0
        out = self.scheduler.schedule(self)
        reqs = out.requests
        if not reqs:
            self.steady = False
            return None
        now = self.env.now
        news = out.num_new_tokens
        if self._ff:
            self.steady = (not out.preempted and not self._admitted and len(reqs) == len(self.running)
                           and reqs == self.running and news.count(1) == len(news))
        before = []
        samples = []
        add_before = before.append
        add_sample = samples.append
        for r, n in zip(reqs, news):
            c = r.num_computed_tokens
            add_before(c)
            c += n
            r.num_computed_tokens = c
            r.inflight_tokens += n
            if c >= r.prompt_len + r.num_output_tokens + r.num_output_placeholders:
                r.num_output_placeholders += 1
                add_sample(True)
            else:
                add_sample(False)
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
        shape = BatchShape.from_requests(news, before)
        opt = self.options
        sizes = opt.cudagraph_sizes
        cost = self.cost_model
        if sizes and shape.num_tokens <= sizes[-1]:
            shape.padded_tokens = sizes[bisect_left(sizes, shape.num_tokens)]
        dt = cost.step_time(shape)
        if opt.record_breakdown:
            self._record_breakdown(shape)
        cpu = opt.cpu_base_s + opt.cpu_per_seq_s * shape.num_seqs + opt.cpu_per_token_s * shape.num_tokens
        if cpu:
            dt = max(dt, cpu) if self.async_scheduling else dt + cpu
        xfer = 0.0
        if self._transfer_s:  # swap preemption: PCIe copies scheduled with this step
            xfer = self.take_transfer_time()
            self.transfer_total += xfer
            dt += xfer
        pool = self.kv.pool
        used = pool.num_gpu_blocks - 1 - len(pool.free_queue)
        return _Step(reqs, news, samples, shape, dt, now, used, len(out.preempted), xfer)

    def _record_breakdown(self, shape: BatchShape) -> None:
        n = len(self.steps)
        for k, v in self.cost_model.breakdown(shape).items():
            col = self.breakdown.get(k)
            if col is None:
                col = self.breakdown[k] = array("d", [0.0] * n)
            col.append(v)
        for k, col in self.breakdown.items():
            if len(col) < n + 1:
                col.append(0.0)

    def _finish_step(self, step: _Step, start: float) -> None:
        """Apply a step's outputs at the current time (vLLM ``update_from_output``)."""
        now = self.env.now
        kv = self.kv
        itl = self.itl
        finished = 0
        sampled = 0
        same_gap = 0  # samples equal to this step's gap (requests whose previous token came at its start)
        for r, n in zip(step.reqs, step.news):
            r.inflight_tokens -= n
        for r, s in zip(step.reqs, step.samples):
            if not s or r.status != RequestStatus.RUNNING:
                continue  # a non-final prefill chunk, or a request preempted while the step was in flight
            r.num_output_placeholders -= 1
            sampled += 1
            r.num_output_tokens += 1
            if r.first_token_time is None:
                r.first_token_time = now
                if r.events is not None:
                    r.events.append((now, "first_token"))
            elif r.last_token_time == start:
                same_gap += 1
            else:
                itl.add(now - r.last_token_time)
            r.last_token_time = now
            if r.num_output_tokens >= r.max_tokens:
                r.status = RequestStatus.FINISHED
                r.finish_time = now
                r.num_output_placeholders = 0
                kv.free(r, finished=True)
                finished += 1
                if r.events is not None:
                    r.events.append((now, "finished"))
                if self.on_done:
                    self.on_done(r)
        if same_gap:
            itl.add(now - start, same_gap)
        if finished:
            self.steady = False
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        shape = step.shape
        usable = kv.pool.num_gpu_blocks - 1
        steps = self.steps
        if steps.spill_path is not None:
            steps.maybe_spill()
        steps.append(start, step.dt, shape.num_tokens, shape.num_tokens - shape.num_decodes, shape.num_decodes,
                     shape.num_seqs, step.used_blocks, len(self.running), len(self.waiting), step.num_preempted, sampled,
                     step.xfer)

    def expected_next_arrival(self) -> float:
        """When the next request is expected here: now plus the mean recent gap between arrivals (the expected wait
        of a Poisson stream, whatever has elapsed). Only sizes fast-forward plans; an arrival at any other time is
        still handled exactly."""
        if not self._gap_ema:
            return float("inf")
        return self.env.now + self._gap_ema

    def materialize(self) -> None:
        """If a jump is under way, apply every step it has completed by now and turn the step executing now into
        an ordinary in-flight step, so the instance's state reads exactly as step-by-step simulation's."""
        p = self._plan
        if p is None:
            return
        self._plan = None
        if self.jumping is not None:
            self.jumping.discard(self)
        n_sched, n_out, q = ff.progress_at(p, self.env.now)
        ff.apply(self, p, n_sched, n_out)
        if n_out >= p.k:  # the jump is complete at this very instant
            self._cont = (None, None, ff.step_for(p, p.k - 1) if p.async_ else None)
        elif p.async_:
            step = p.first if q == 0 else ff.step_for(p, q - 1)
            start = p.start if q == 0 else float(p.ends[q - 1])
            self._cont = (step, start, ff.step_for(p, q))
        else:
            step = ff.step_for(p, q)
            self._cont = (step, p.start if q == 0 else float(p.ends[q - 1]), None)
        self.process.interrupt()

    def _loop(self):
        env = self.env
        inflight: _Step | None = None
        while True:
            if (self._ff and (inflight is not None or not self.async_scheduling)
                    and ff.steady_batch(self)):
                self._inflight = inflight
                stop = self.stop_time
                if self._order_stable_until is not None and self.waiting:
                    stop = min(stop, self._order_stable_until())  # a jump ends before the waiting order can change
                p = ff.plan(self, stop)
                self._inflight = None
                if p is not None:
                    self._plan = p
                    if self.jumping is not None:
                        self.jumping.add(self)
                    self.num_jumps += 1
                    try:
                        yield _At(env, float(p.ends[-1]))
                    except simpy.Interrupt:
                        step, start, nxt = self._cont
                        self._cont = None
                        self.jumped_steps += p.applied_out
                        if step is not None:
                            yield _At(env, start + step.dt)
                            self.busy_time += step.dt
                            self._finish_step(step, start)
                        inflight = nxt
                        continue
                    self._plan = None
                    if self.jumping is not None:
                        self.jumping.discard(self)
                    ff.apply(self, p, p.k, p.k)
                    if p.deferred_arrivals:
                        self.steps.cols["num_waiting"][-1] += p.deferred_arrivals
                    self.jumped_steps += p.k
                    inflight = ff.step_for(p, p.k - 1) if p.async_ else None
                    continue
            if inflight is None:
                if not self.running and not self.waiting:
                    self._wakeup = env.event()
                    yield self._wakeup
                    continue
                inflight = self._launch()
                if inflight is None:
                    if self.running:
                        raise RuntimeError(f"instance {self.instance_id}: {len(self.running)} running requests "
                                           "but nothing scheduled")
                    # Nothing runs and the head cannot be admitted even into an empty cache: it never will be.
                    self._reject(self.waiting.pop(), "cannot be admitted into an empty KV cache with these limits")
                    continue
            start = env.now
            # Async scheduling: the next step is scheduled now, while this one runs.
            nxt = self._launch() if self.async_scheduling else None
            yield _At(env, start + inflight.dt)
            self.busy_time += inflight.dt
            self._finish_step(inflight, start)
            inflight = nxt
