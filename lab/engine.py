"""One engine instance as a SimPy process: schedule -> step time from the cost model -> wait -> apply outputs.

The instance owns the mechanisms every policy shares: the running list, the waiting queue, the paged KV cache, the
request state machine and the step log. The scheduler (a policy) decides what runs; the instance advances
``num_computed_tokens`` at schedule time (as vLLM's ``_update_after_schedule`` does), waits the step time and then
appends one sampled token to every request whose C reached ``num_tokens``, finishing those that reached their
output length and freeing their blocks at once (vLLM ``update_from_output``).
"""

from __future__ import annotations

from array import array
from typing import Callable

import simpy

from lab.costmodel.base import BatchShape, CostModel
from lab.kv_cache import KVCacheManager
from lab.queues import make_queue
from lab.request import Request, RequestStatus
from lab.sched_api import Scheduler, SchedulerConfig

STEP_COLUMNS = (
    "instance", "start", "duration", "scheduled_tokens", "prefill_tokens", "decode_requests", "batch_size",
    "kv_blocks_used", "kv_usage", "num_running", "num_waiting", "num_preempted", "output_tokens", "transfer_s",
)


class StepLog:
    """Per-step records of one instance, kept column-wise in compact arrays (one row per step)."""

    def __init__(self) -> None:
        self.cols = {c: array("d") for c in STEP_COLUMNS}

    def append(self, *row: float) -> None:
        for c, v in zip(self.cols.values(), row):
            c.append(v)

    def __len__(self) -> int:
        return len(self.cols["start"])


class Instance:
    """A vLLM-style engine instance.

    Args:
        env: the SimPy environment (its clock is seconds).
        instance_id: index of this instance in the deployment.
        config: scheduler limits.
        scheduler: the scheduling policy.
        kv: this instance's KV cache manager.
        cost_model: step-time model.
        itl_samples: shared array receiving every inter-token latency sample (seconds).
        on_done: called with each request that finishes or is rejected.
        record_events: keep each request's (time, event) history.
    """

    def __init__(self, env: simpy.Environment, instance_id: int, config: SchedulerConfig, scheduler: Scheduler,
                 kv: KVCacheManager, cost_model: CostModel, itl_samples: array,
                 on_done: Callable[[Request], None] | None = None, record_events: bool = False) -> None:
        self.env = env
        self.instance_id = instance_id
        self.config = config
        self.scheduler = scheduler
        self.kv = kv
        self.cost_model = cost_model
        self.running: list[Request] = []
        # A scheduler may own its waiting-queue order (e.g. shortest job first) through make_queue(config).
        own_queue = getattr(scheduler, "make_queue", None)
        self.waiting = own_queue(config) if own_queue is not None else make_queue(config.queue_policy)
        self.itl = itl_samples
        self.on_done = on_done
        self.record_events = record_events
        self.steps = StepLog()
        self.num_preemptions = 0
        self.busy_time = 0.0
        # Swap preemption (issue #5): KV bytes per token on one GPU, host-link bytes/s, CPU swap space in tokens.
        self.swap_bytes_per_token = 0.0
        self.swap_bandwidth = 0.0
        self.swap_capacity_tokens = 0
        self.swap_used_tokens = 0
        self._transfer_s = 0.0
        self._wakeup: simpy.Event | None = None
        self.process = env.process(self._loop())

    # ---- the EngineView a scheduler sees ----
    @property
    def now(self) -> float:
        return self.env.now

    def admit(self, request: Request, num_computed_tokens: int) -> None:
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
        request.num_preemptions += 1
        self.num_preemptions += 1
        where = self.config.preemption_requeue
        if (requeue if where == "auto" else where) == "tail":
            self.waiting.add(request)
        else:
            self.waiting.prepend(request)
        if request.events is not None:
            how = (f"swap-out {lost} tokens" if swapped else
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
        c = request.num_computed_tokens
        if c <= 0 or self.swap_used_tokens + c > self.swap_capacity_tokens:
            return False
        self.swap_used_tokens += c
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
    def _loop(self):
        env = self.env
        kv = self.kv
        pool = kv.pool
        steps = self.steps
        cost = self.cost_model
        itl = self.itl
        iid = self.instance_id
        usable = pool.num_gpu_blocks - 1
        while True:
            if not self.running and not self.waiting:
                self._wakeup = env.event()
                yield self._wakeup
                continue
            out = self.scheduler.schedule(self)
            reqs = out.requests
            if not reqs:
                if self.running:
                    raise RuntimeError(f"instance {iid}: {len(self.running)} running requests but nothing scheduled")
                # Nothing runs and the head cannot be admitted even into an empty cache: it never will be.
                head = self.waiting.pop()
                self._reject(head, "cannot be admitted into an empty KV cache with these limits")
                continue
            start = env.now
            news = out.num_new_tokens
            before = []
            for r, n in zip(reqs, news):
                c = r.num_computed_tokens
                before.append(c)
                r.num_computed_tokens = c + n
                if r.first_scheduled_time is None:
                    r.first_scheduled_time = start
            shape = BatchShape.from_requests(news, before)
            used = usable - len(pool.free_queue)
            xfer = self.take_transfer_time() if self._transfer_s else 0.0  # swap PCIe time (issue #5)
            dt = cost.step_time(shape) + xfer
            yield env.timeout(dt)
            now = env.now
            self.busy_time += dt
            finished = 0
            sampled = 0
            for r in reqs:
                if r.num_computed_tokens < r.num_tokens:
                    continue  # a non-final prefill chunk samples nothing
                sampled += 1
                r.num_output_tokens += 1
                if r.first_token_time is None:
                    r.first_token_time = now
                    if r.events is not None:
                        r.events.append((now, "first_token"))
                else:
                    itl.append(now - r.last_token_time)
                r.last_token_time = now
                if r.num_output_tokens >= r.max_tokens:
                    r.status = RequestStatus.FINISHED
                    r.finish_time = now
                    kv.free(r)
                    finished += 1
                    if r.events is not None:
                        r.events.append((now, "finished"))
                    if self.on_done:
                        self.on_done(r)
            if finished:
                self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
            steps.append(iid, start, dt, shape.num_tokens, shape.num_tokens - len(shape.decode_context),
                         len(shape.decode_context), len(reqs), used, used / usable, len(self.running),
                         len(self.waiting), len(out.preempted), sampled, xfer)
