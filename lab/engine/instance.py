"""One engine instance as a SimPy process: schedule -> submit to the in-flight window -> wait for the oldest step
-> apply its outputs (vLLM's ``EngineCore.step_with_batch_queue``).

The instance owns the mechanisms every policy shares: the running list, the waiting queue, the paged KV cache, the
request state machine and the step log. The scheduler (a policy) decides what runs; the instance advances
``num_computed_tokens`` at schedule time (as vLLM's ``_update_after_schedule`` does), prices the step with the cost
model, places it on the pipeline (lab/engine/window.py) and, when it ends, applies its outputs
(lab/core/outputs.py): tokens appended, drafts rolled back, finished requests' blocks freed at once.
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Callable

import simpy

from lab.core.batch import BatchShape, padded_size
from lab.core.kv_cache import KVCacheManager
from lab.core.kv_offload import KVOffloader
from lab.core.outputs import DraftAcceptance, StepOutputs, count_scheduled_tokens
from lab.core.request import Request, RequestStatus
from lab.core.samples import WeightedSamples
from lab.core.sched_api import Scheduler, SchedulerConfig, SchedulerContractError, contract_violation
from lab.core.step import ScheduledStep
from lab.core.step_log import StepLog
from lab.costmodel.base import CostModel
from lab.engine import jump as ff
from lab.engine import kv_loads
from lab.engine.guards import ProgressGuards
from lab.engine.jump_context import JumpContext
from lab.engine.swap import SwapSpace
from lab.engine.window import InFlightWindow, delay_until, max_concurrent_batches

_RUNNING = RequestStatus.RUNNING


@dataclass(frozen=True)
class EngineOptions:
    """How an instance executes steps (independent of the scheduling policy).

    Attributes:
        async_scheduling: vLLM's async scheduling: the next step is scheduled while the current one runs, so a
            step's CPU work overlaps the previous step's GPU work. Only used with schedulers that declare
            ``supports_async``.
        cpu_base_s, cpu_per_seq_s, cpu_per_token_s, cpu_per_new_request_s: CPU time of one step (scheduling,
            input preparation, sampling and output processing) = base + per_seq · sequences + per_token · tokens +
            per_new_request · requests admitted by its schedule (new or resumed: vLLM's ``scheduled_new_reqs``,
            whose ``add_request`` and model-runner state the CPU builds). Sync scheduling adds it to the GPU time.
            Async scheduling runs it while the step before is on the GPU (vLLM ``step_with_batch_queue``): the
            step's GPU work starts once both that step has ended and its own CPU work is done, the CPU work
            starting when the previous step's CPU work is done and at the earliest when it is scheduled; so it is
            hidden while shorter than the GPU time it overlaps and shows otherwise (always after an idle spell).
        cudagraph_sizes: sorted token counts with a captured CUDA graph; a step's token count is padded up to the
            next size (full graphs for pure decodes, piecewise graphs for mixed steps; larger steps run unpadded).
            Empty = no padding (eager mode).
        stage_layers: decoder layers on each pipeline stage (``Parallelism.stage_layers``); one entry (or empty)
            = no pipeline parallelism.
        record_breakdown: also record each step's cost breakdown (slower; used by ``servelab validate``).
        fast_forward: advance stretches of identical decode steps in one jump (lab/engine/jump/); exact.
    """

    async_scheduling: bool = False
    cpu_base_s: float = 0.0
    cpu_per_seq_s: float = 0.0
    cpu_per_token_s: float = 0.0
    cpu_per_new_request_s: float = 0.0
    cudagraph_sizes: tuple[int, ...] = ()
    stage_layers: tuple[int, ...] = ()
    record_breakdown: bool = False
    fast_forward: bool = True

    @property
    def pipeline_parallel_size(self) -> int:
        return max(1, len(self.stage_layers))


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
        options: step execution options (async scheduling, CPU overhead, CUDA-graph padding, PP stages).
        pool: name of the pool this instance belongs to ("" in a single-pool deployment).
        acceptance: the drafter (speculative decoding, lab/core/speculation.py ``Speculator``): proposes each
            request's drafts and decides their acceptance; None = no speculative decoding.
        start: start the engine loop as this instance's own SimPy process; False when a lock-step group drives
            its steps (lab/cluster/lockstep.py).

    Raises:
        SchedulerContractError: (from the loop) a schedule that breaks the scheduler contract.
    """

    def __init__(self, env: simpy.Environment, instance_id: int, config: SchedulerConfig, scheduler: Scheduler,
                 kv: KVCacheManager, cost_model: CostModel, itl_samples: WeightedSamples,
                 on_done: Callable[[Request], None] | None = None, record_events: bool = False,
                 options: EngineOptions | None = None, pool: str = "",
                 acceptance: DraftAcceptance | None = None, start: bool = True) -> None:
        self.env = env
        self.instance_id = instance_id
        self.pool = pool
        self.config = config
        self.scheduler = scheduler
        self.kv = kv
        self.cost_model = cost_model
        self.options = opt = options or EngineOptions()
        self.async_scheduling = opt.async_scheduling and scheduler.supports_async
        pp = opt.pipeline_parallel_size
        depth = max_concurrent_batches(pp, self.async_scheduling) if scheduler.supports_pipelining or pp == 1 else 1
        self.window = InFlightWindow(depth, pp)
        self.pipeline_async = pp > 1 and self.async_scheduling and depth > 1
        self.running: list[Request] = []
        self.waiting = scheduler.make_queue(config)
        # requests whose remote KV has arrived, admitted before ``waiting`` (vLLM 0.33 ``kv_holding_waiting``) by
        # schedulers that declare ``admits_kv_holding``; others get them at the head of ``waiting``
        self.kv_holding: deque[Request] = deque()
        self._max_step_tokens = scheduler.max_step_tokens(config)
        self.num_scheduler_steps = 0
        self.itl = itl_samples
        self.on_done = on_done
        self.outputs = StepOutputs(kv, itl_samples, on_done, self.async_scheduling, acceptance)
        self.acceptance = acceptance
        self.record_events = record_events
        self.steps = StepLog(instance_id, kv.pool.num_gpu_blocks - 1, num_slots=depth if pp > 1 else 1)
        self.breakdown: dict[str, array] = {}
        self.num_preemptions = 0
        self.busy_time = 0.0
        self.transfer_total = 0.0
        self.swap = SwapSpace()
        # KV offloading: the CPU tier of the KV cache (vLLM OffloadingConnector; lab/core/kv_offload.py), or None
        self.kv_offload: KVOffloader | None = None
        # prefill/decode disaggregation, decode side: requests waiting for blocks for their remote KV (arrival
        # order), the read that starts once they have them (set by the cluster), and reads that completed while a
        # step was in flight (vLLM learns of finished_recving from a step's output)
        self.remote_pending: deque[Request] = deque()
        self.load_remote_kv: Callable[[Request], simpy.Event] | None = None
        self.loads_done: list[Request] = []
        self.loads_in_flight = 0  # reads under way: their blocks are held, so the cache is not empty
        self.num_remote_loads = 0
        self.guards = ProgressGuards(config, self._contract_error, self._state)
        # prefill side: blocks of finished requests pinned until their decode instance has read them
        self.num_pinned_blocks = 0
        self.peak_pinned_blocks = 0
        self.wakeup_event: simpy.Event | None = None
        # exact time (seconds) of the last step boundary: SimPy may wake the loop one ulp before it (window.py)
        self.clock = 0.0
        # async scheduling: when the CPU finishes the work of the last step scheduled (seconds; price_step)
        self.cpu_free = 0.0
        self._admitted = 0  # requests the schedule under way admitted (its CPU work)
        # fast-forward (lab/engine/jump/): drafts are drawn step by step, and PP, a lock-step group's loop and a
        # recorded cost breakdown run step by step too
        self.jump = JumpContext(self, opt.fast_forward and not opt.record_breakdown and scheduler.supports_fast_forward
                                and scheduler.fast_forward_allowed(config) and pp == 1 and start and acceptance is None)
        self.process = env.process(self._loop()) if start else None

    # ---- the EngineView a scheduler sees ----
    @property
    def now(self) -> float:
        """Current time (seconds): the simulation clock, or the exact end of the step just applied."""
        t = self.env.now
        return t if t > self.clock else self.clock

    def admit(self, request: Request, num_computed_tokens: int, at: float | None = None) -> None:
        """Move ``request`` into the running list with ``num_computed_tokens`` computed (its prefix hit), at the
        current time or, from a fast-forward jump that applies a planned admission, at ``at`` (seconds)."""
        now = self.now if at is None else at
        self._admitted += 1
        request.num_computed_tokens = num_computed_tokens
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        remote = request.remote
        if remote is not None and "d_scheduled" not in remote.times and remote.d_instance == self.instance_id:
            remote.times["d_scheduled"] = now
        if not request.prefix_hit_recorded:
            request.prefix_hit_recorded = True
            request.prefix_hit_tokens = num_computed_tokens
            self.kv.prefix_queries += request.num_tokens
            self.kv.prefix_hits += num_computed_tokens
        swap_detail = self.swap.swap_in(request) if request.swapped_tokens else ""
        if request.events is not None:
            if not resumed:
                request.events.append((now, "scheduled",
                                       f"prefix hit {num_computed_tokens} of {request.num_tokens} tokens"))
            else:
                request.events.append((now, "resumed", swap_detail or (
                    f"recompute {request.num_tokens - num_computed_tokens} tokens (prefix hit {num_computed_tokens})")))

    def preempt(self, request: Request, reason: str = "", requeue: str | None = None, at: float | None = None) -> None:
        """:meth:`EngineView.preempt`; ``at``: the time of the schedule that preempts (seconds), when a fast-forward
        jump applies it later (default: now)."""
        running = self.running
        if running and running[-1] is request:
            running.pop()
        else:
            running.remove(request)
        lost = request.num_computed_tokens
        swapped = self.config.preemption_mode == "swap" and self.swap.swap_out(request)
        self._drop_in_flight(request)
        self.kv.free(request)
        if self.kv_offload is not None:  # its stores in flight finish before its blocks are reused
            self.kv_offload.preempted(request, self.now)
        request.status = RequestStatus.PREEMPTED
        if not swapped:
            request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token sampled by a step in flight is dropped
        request.num_spec_tokens = 0  # and so are its drafts
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.guards.preempted(request)
        where = self.config.preemption_requeue
        if (requeue if where == "auto" else where) == "tail":
            self.waiting.add(request)
        else:
            self.waiting.prepend(request)
        if request.events is not None:
            how = (f"swap-out {request.swapped_tokens} tokens" if swapped else
                   f"recompute, {lost} computed tokens dropped"
                   + (" (CPU swap space full)" if self.config.preemption_mode == "swap" and lost > 0 else ""))
            request.events.append((self.now if at is None else at, "preempted", f"{how}; {reason}" if reason else how))

    def configure_swap(self, kv_bytes_per_token: float, pcie_bandwidth: float, swap_space_bytes: float) -> None:
        """Enable swap preemption's costs: KV bytes per token on one GPU, host-link bandwidth (B/s, one
        direction) and the CPU swap space of this instance (bytes; vLLM V0 ``swap_space``, per GPU)."""
        self.swap = SwapSpace(kv_bytes_per_token, pcie_bandwidth, swap_space_bytes)

    def configure_kv_offload(self, offload: KVOffloader) -> None:
        """Give this instance a CPU tier of the KV cache (KV offloading, lab/core/kv_offload.py). Fast-forward is
        turned off: every step may store blocks, which a jump over decode steps would skip."""
        self.kv_offload = offload
        self.jump.disable()

    def start_cpu_load(self, request: Request, num_gpu_hit: int, num_cpu_tokens: int) -> None:
        """EngineView ``start_cpu_load`` (lab/engine/kv_loads.py ``start_cpu_load``)."""
        kv_loads.start_cpu_load(self, request, num_gpu_hit, num_cpu_tokens)

    @property
    def num_outstanding_tokens(self) -> int:
        """Tokens still to compute (prompt and recompute) or generate for every request on this instance."""
        total = 0
        for r in self.running:
            total += r.total_tokens - r.num_computed_tokens
        for r in self.waiting:
            total += r.total_tokens - r.num_computed_tokens
        for r in self.remote_pending:
            total += r.total_tokens
        for r in self.kv_holding:
            total += r.total_tokens - r.num_computed_tokens
        if self.kv_offload is not None:
            for r in self.kv_offload.loads:
                total += r.total_tokens
        return total

    @property
    def num_outstanding_requests(self) -> int:
        """:meth:`InstanceView.num_outstanding_requests`: running, waiting, KV-holding, waiting for a KV read or a
        load from the CPU tier."""
        n = len(self.running) + len(self.waiting) + len(self.kv_holding) + len(self.remote_pending)
        return n + (len(self.kv_offload.loads) if self.kv_offload is not None else 0)

    # ---- arrivals and hand-offs ----
    def add_request(self, request: Request) -> None:
        """Accept an arriving request, or reject it with a reason if it can never be served."""
        jump = self.jump
        if jump.planned_admission(request):
            self._note_arrival(request)  # the jump under way admits it (lab/engine/jump/)
            # no schedule has seen it yet: if the jump is materialised before its admission, the next plan must not
            # take it for a head shown blocked (as before_arrival says of any arrival)
            jump.steady = False
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
            return
        head = jump.blocked_head()
        deferred = head is None and jump.before_arrival()
        if not self.window.steps and jump.plan_under_way is None and request.arrival_time > self.clock:
            # an idle instance starts at the arrival's exact time, not SimPy's clock, which a delivery after a delay
            # (a closed-loop send, the front end's time in) may leave one ulp before it (window.delay_until)
            self.clock = request.arrival_time
        self._note_arrival(request)
        reason = self.rejection_reason(request)
        if reason:
            if deferred:  # a rejected request never waits: the jump's last row does not count it
                jump.uncount_deferred()
            self._reject(request, reason)
            return
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        if head is not None:
            jump.queued_behind(head)
        self.wake()

    def _note_arrival(self, request: Request) -> None:
        """An arrival's bookkeeping: the jump's gap estimate, the request's instance and its first event."""
        now = self.now
        self.jump.note_arrival(request, now)
        self._take_over(request)
        if self.record_events:
            request.events = [(now, "arrived")]

    def _take_over(self, request: Request) -> None:
        """The request is served here from now on (an arrival, or handed on from another pool)."""
        request.instance_id = self.instance_id
        request.pool = self.pool
        request.served_by.append(self.instance_id)
        self.jump.taken_over(request)

    def receive(self, request: Request, at: float | None = None) -> None:
        """Take over a request handed on from another instance with its computed state: it keeps its tokens,
        timings and ``num_computed_tokens`` (its KV arrived with it) and waits here like a swapped-in request.
        ``at``: the exact instant it arrives (seconds: the hand-off's step end plus the hand-off delay).

        Raises:
            RuntimeError: the request still holds blocks of the instance it left (blocks are released only by the
                instance that allocated them; lab/core/outputs.py ``release_request``).
        """
        if request.blocks:
            raise RuntimeError(f"request {request.request_id} reached instance {self.instance_id} holding "
                               f"{len(request.blocks)} KV block(s) of instance {request.instance_id}")
        deferred = self.jump.before_arrival()
        now = self.now
        if at is not None and at > now:  # SimPy's clock may be one ulp behind the exact hand-off instant
            now = at
            if not self.window.steps:
                self.clock = at
        source = request.pool
        self._take_over(request)
        reason = self.rejection_reason(request)
        if reason:
            if deferred:
                self.jump.uncount_deferred()
            self._reject(request, reason, now)
            return
        request.status = RequestStatus.WAITING
        remote = request.remote
        if remote is not None:  # disaggregated: wait for blocks, then read the KV (vLLM WAITING_FOR_REMOTE_KVS)
            if deferred:  # it waits for its KV read, not in the waiting queue the jump's last step counts
                self.jump.uncount_deferred()
            remote.times["d_arrived"] = now
            remote.d_instance = self.instance_id
            if request.events is not None:
                request.events.append((now, "received", f"remote KV of {remote.num_tokens} tokens on "
                                                         f"instance {remote.source.instance_id}"))
            self.remote_pending.append(request)
            self.wake()
            return
        if request.events is not None:
            request.events.append((now, "received", f"{request.num_computed_tokens} computed tokens "
                                                     f"from pool {source or '-'}"))
        self.waiting.add(request)
        self.wake()

    def wake(self) -> None:
        """Wake the engine loop if it is idle."""
        ev = self.wakeup_event
        if ev is not None and not ev.triggered:
            ev.succeed()

    def rejection_reason(self, request: Request) -> str:
        """Why this request can never be served here ('' if it can)."""
        cfg = self.config
        if request.total_tokens > cfg.max_model_len:
            return (f"prompt + output tokens ({request.prompt_len} + {request.max_tokens}) exceed "
                    f"max_model_len ({cfg.max_model_len})")
        peak = self.peak_kv_tokens(request)
        need = self.kv.blocks_for(peak)
        if need > self.kv.pool.num_usable_blocks:
            extra = peak - (request.total_tokens - 1)
            return (f"needs {need} KV blocks for {peak} tokens"
                    + (f" ({request.total_tokens - 1} + {extra} draft and lookahead slots)" if extra else "")
                    + f"; the cache has {self.kv.pool.num_usable_blocks}")
        if not cfg.enable_chunked_prefill and request.prompt_len > cfg.max_num_batched_tokens:
            return (f"prompt ({request.prompt_len} tokens) exceeds max_num_batched_tokens "
                    f"({cfg.max_num_batched_tokens}) with chunked prefill off")
        return ""

    def peak_kv_tokens(self, request: Request) -> int:
        """The most KV slots ``request`` holds here at once (tokens): its last decode step computes up to
        ``prompt + output - 1`` tokens plus k drafts and reserves ``num_lookahead_tokens`` more slots for the
        drafter (vLLM ``allocate_slots``), capped at ``max_model_len`` as vLLM caps the allocation. Under async
        scheduling that step is scheduled while the one before it is in flight, whose k drafts are counted as
        computed (placeholders) until its output comes back: k more. A request whose peak does not fit an empty
        cache would preempt itself at its last steps for ever."""
        k = self.acceptance.num_speculative_tokens if self.acceptance is not None else 0
        if self.async_scheduling:
            k *= 2
        peak = request.total_tokens - 1 + k + self.config.num_lookahead_tokens
        return min(peak, self.config.max_model_len)

    def _reject(self, request: Request, reason: str, at: float | None = None) -> None:
        if request.swapped_tokens:  # its KV copy in CPU memory is dropped
            self.swap.drop(request)
        if request.remote is not None:  # the KV pinned on its prefill instance is not needed any more
            request.remote.release_pinned()
        if request.blocks:  # e.g. blocks allocated here for a remote KV read
            self.kv.free(request, finished=True)
        request.status = RequestStatus.REJECTED
        request.reason = reason
        request.finish_time = None
        if request.events is not None:
            request.events.append((self.now if at is None else at, "rejected"))
        if self.on_done:
            self.on_done(request)

    def resolve_stall(self) -> None:
        """Nothing was scheduled, nothing is in flight, and requests are here. If the schedule only preempted, it
        made room and may schedule next time (up to ``guards.MAX_STALLED_SCHEDULES`` in a row); with requests running
        it is a scheduler bug; else the waiting head cannot be admitted even into an empty cache and is rejected.

        Raises:
            SchedulerContractError: the stall limit, or nothing scheduled while requests run.
        """
        if self.guards.preempted_only:
            self.guards.stalled()
            return
        if self.kv_holding and not self.running:
            kv_loads.drop_held_kv(self, self.kv_holding.pop())
            return
        if self.running or self.kv_holding:
            self._contract_error(f"nothing scheduled while {len(self.running)} request(s) run, "
                                 f"{len(self.kv_holding)} hold their KV and no step is in flight "
                                 f"({len(self.waiting)} waiting): the instance would stall")
        if self.waiting:
            held = self.kv.pool.num_usable_blocks - self.kv.num_free_blocks
            if held:  # the cache is not empty: waiting requests hold blocks their scheduler does not admit
                self._contract_error(f"the waiting head cannot be admitted while waiting requests hold {held} KV "
                                     "blocks (remote KV that arrived); admit EngineView.kv_holding first and "
                                     "declare admits_kv_holding")
            self.reject_unservable_head()

    def waits_for_events(self) -> bool:
        """Nothing was scheduled and nothing is in flight: True when only an event from outside the engine loop
        can give this instance work (an arrival, a hand-off, a remote KV read that completes, pinned blocks that
        its decode instance frees); False when requests are here that a schedule should be able to serve (the
        caller then resolves the stall)."""
        if self.running:
            return False
        return not (self.waiting or self.kv_holding) or bool(self.loads_in_flight or self.num_pinned_blocks)

    def skip_to_eligible_step(self) -> bool:
        """Async PP with nothing in flight and every running decode gated (``next_decode_eligible_step`` ahead of
        the scheduler's step counter): vLLM's engine loop calls ``schedule()`` again at once, each empty call
        advancing the counter, until a decode is eligible (vllm/v1/engine/core.py ``step_with_batch_queue`` with an
        empty batch queue). Set the counter to the first eligible step; True when the schedule just made gated a
        decode (the loop then schedules again at once), False when it gated none (a stall to resolve)."""
        if not self.pipeline_async or not self.running:
            return False
        first = min(r.next_decode_eligible_step for r in self.running)
        if first < self.num_scheduler_steps:  # eligible at the schedule just made (step num_scheduler_steps - 1)
            return False
        self.num_scheduler_steps = first
        return True

    def reject_unservable_head(self) -> None:
        """Nothing runs and the waiting head cannot be admitted even into an empty cache: it never will be."""
        self._reject(self.waiting.pop(), "cannot be admitted into an empty KV cache with these limits")

    def set_hand_off(self, callback: Callable[[Request], None]) -> None:
        """Where requests that leave this instance for another pool go (lab/cluster/cluster.py)."""
        def leave(request: Request) -> None:
            self._drop_in_flight(request)
            callback(request)
        self.outputs.on_hand_off = leave

    def _drop_in_flight(self, request: Request) -> None:
        """``request`` leaves the running set (preempted, or handed on to another pool) while steps that compute
        it may still be in flight (async scheduling, PP): those steps' outputs for it are dropped — no token, no
        placeholder released — as vLLM discards the output of a request it no longer runs. Without this a step in
        flight would apply its tokens to the request after it was re-admitted here or admitted by another pool."""
        for step in self.window.steps:
            reqs = step.requests
            for i in range(len(reqs)):
                if reqs[i] is request:
                    step.samples = samples = list(step.samples)  # (lists may be shared between planned steps)
                    samples[i] = False
                    step.num_new_tokens = news = list(step.num_new_tokens)
                    news[i] = 0
        request.inflight_tokens = 0

    # ---- one step: schedule, price, apply ----
    def schedule_step(self) -> ScheduledStep | None:
        """Schedule one step and apply vLLM's ``_update_after_schedule``: C += n, and a request whose C reaches
        ``num_tokens`` (+ placeholders and drafts) will sample. Returns None when nothing was scheduled.

        Raises:
            SchedulerContractError: the schedule breaks the scheduler contract (lab/core/sched_api.py).
        """
        self._admitted = 0
        if self.remote_pending:
            kv_loads.start_remote_loads(self)
        try:
            out = self.scheduler.schedule(self)
        except SchedulerContractError:
            raise
        except Exception as e:  # a user's policy may raise anything: report it with the policy and the time
            self._contract_error(f"schedule() raised {type(e).__name__}: {e} (at t = {self.now:.6f} s)")
        self.num_scheduler_steps += 1
        reqs = out.requests
        self.guards.preempted_only = not reqs and bool(out.preempted)
        if not reqs:
            self.jump.steady = False
            if out.num_new_tokens:
                self._contract_error(f"{len(out.num_new_tokens)} token counts for no request")
            return None
        err = contract_violation(out, self.config, len(self.running), self._max_step_tokens)
        if err:
            self._contract_error(err)
        now = self.now
        news = out.num_new_tokens
        spec = [out.num_spec_tokens.get(r, 0) for r in reqs] if out.num_spec_tokens else None
        before, samples = self._advance(reqs, news, spec, now)
        jump = self.jump
        if jump.enabled:
            jump.steady = jump.shows_steady(out, reqs, news, samples, self._admitted)
        shape = BatchShape.from_requests(news, before, spec)
        pool = self.kv.pool
        used = pool.num_gpu_blocks - 1 - len(pool.free_queue)
        step = ScheduledStep(reqs, news, samples, shape, [], now, used, len(out.preempted), 0.0, spec)
        if out.padded_drafts:
            step.padded_drafts = out.padded_drafts
        if self.pipeline_async:
            # V2 runner: a decode is eligible again after pp scheduler steps, and its input token comes from the
            # micro-batch before it, so this one enters stage 0 only once that token has left the last stage
            step.not_before = max(r.token_ready_at for r in reqs)
            nxt = self.num_scheduler_steps - 1 + self.options.pipeline_parallel_size
            for r, s in zip(reqs, samples):
                if s:
                    r.next_decode_eligible_step = nxt
        offload = self.kv_offload
        if offload is not None:
            offload.schedule_stores(step, reqs, now)
            if offload.flush_until > now:  # a preempted request's stores must finish before this step's forward
                if offload.flush_until > step.not_before:
                    step.not_before = offload.flush_until
            offload.flush_until = 0.0
        return step

    def _advance(self, reqs: list[Request], news: list[int], spec: list[int] | None,
                 now: float) -> tuple[list[int], list[bool]]:
        """C += n for every scheduled request (lab/core/outputs.py ``count_scheduled_tokens``, after checking it
        runs and holds KV for its tokens); returns the tokens each had computed before and whether each samples at
        the end of the step.

        Raises:
            SchedulerContractError: a scheduled request is not running or lacks KV blocks for its tokens.
        """
        placeholders = self.async_scheduling
        propose = self.acceptance.propose if placeholders and self.acceptance is not None else None
        before, samples, bad = count_scheduled_tokens(reqs, news, spec, now, self.kv.block_size, placeholders,
                                                      propose)
        if bad >= 0:
            self._bad_request(reqs[bad], news[bad])
        return before, samples

    def _bad_request(self, r: Request, n: int) -> None:
        if r.status is not _RUNNING:
            self._contract_error(f"request {r.request_id} scheduled while {r.status.name.lower()}")
        held = len(r.blocks) * self.kv.block_size - r.num_computed_tokens
        self._contract_error(f"request {r.request_id} scheduled with {n} tokens but KV blocks for only {held}")

    def _state(self) -> str:
        """The instance's state for a diagnosis (time, running, waiting, preemptions so far)."""
        return (f"at {self.now:.3f} s: {len(self.running)} running, {len(self.waiting)} waiting, "
                f"{self.num_preemptions:,} preemptions so far")

    def _contract_error(self, rule: str) -> None:
        cls = type(self.scheduler)
        where = getattr(sys.modules.get(cls.__module__), "__file__", None)  # a user policy names its file
        name = f"{cls.__name__} ({where})" if where and not cls.__module__.startswith("policies.") else cls.__name__
        raise SchedulerContractError(f"instance {self.instance_id}: scheduler {name} broke the scheduler "
                                     f"contract: {rule}")

    def step_cpu_time(self, shape: BatchShape) -> float:
        """CPU seconds of a step of ``shape`` just scheduled (:class:`EngineOptions`: base + per sequence + per
        token + per request admitted by this schedule), plus the host work a cost model says the step adds to the
        CPU under async scheduling (``host_time``: a speculative proposer's launches, lab/costmodel/spec_step.py)."""
        opt = self.options
        cpu = (opt.cpu_base_s + opt.cpu_per_seq_s * shape.num_seqs + opt.cpu_per_token_s * shape.num_tokens
               + opt.cpu_per_new_request_s * self._admitted)
        return cpu + self.cost_model.host_time(shape) if self.async_scheduling else cpu

    def price_step(self, step: ScheduledStep) -> None:
        """Fill ``step.stage_times``: the cost model's time per pipeline stage, with the step's CPU time and its
        swap copies on the first stage. Sync scheduling adds the CPU time to the first stage; async scheduling
        overlaps it with the step in flight instead: ``step.not_before`` becomes the moment the CPU work is done
        (it starts at max(now, end of the previous step's CPU work)), so the GPU waits for it only when it is
        longer than what remains of the step in flight (shared/specs/vllm-v1-scheduling.md §4)."""
        opt = self.options
        shape = step.shape
        if opt.cudagraph_sizes and not shape.padded_tokens:
            shape.padded_tokens = padded_size(opt.cudagraph_sizes, shape.num_tokens)
        cost = self.cost_model
        if len(opt.stage_layers) > 1:
            times = cost.stage_times(shape, opt.stage_layers)
        else:
            times = [cost.step_time(shape)]
        if opt.record_breakdown:
            self._record_breakdown(shape)
        dt = times[0]
        cpu = self.step_cpu_time(shape)
        if cpu:
            if self.async_scheduling:
                now = self.now
                ready = (now if now >= self.cpu_free else self.cpu_free) + cpu
                self.cpu_free = ready
                if ready > step.not_before:
                    step.not_before = ready
            else:
                dt += cpu
        if self.swap.pending_s:  # swap preemption: PCIe copies scheduled with this step
            xfer = self.swap.take_pending()
            self.transfer_total += xfer
            step.transfer_s = xfer
            dt += xfer
        times[0] = dt
        step.stage_times = times

    def _launch(self) -> ScheduledStep | None:
        step = self.schedule_step()
        if step is not None:
            self.price_step(step)
        return step

    def _record_breakdown(self, shape: BatchShape) -> None:
        n = len(self.steps)
        for k, v in self.cost_model.breakdown(shape).items():
            col = self.breakdown.get(k)
            if col is None:
                col = self.breakdown[k] = array("d", [0.0] * n)
            col.append(v)
        for col in self.breakdown.values():
            if len(col) < n + 1:
                col.append(0.0)

    def finish_step(self, step: ScheduledStep) -> None:
        """Apply a step's outputs at its end (vLLM ``update_from_output``) and log it."""
        end = step.end
        self.clock = end
        sampled, finished = self.outputs.apply(step, end)
        self.guards.step_applied(sampled, finished)
        if self.kv_offload is not None:
            self.kv_offload.step_ended(step, step.requests, end)
        if self.loads_done:
            loaded, self.loads_done = self.loads_done, []
            kv_loads.admit_loaded(self, loaded)
        if finished:
            self.jump.steady = False
            self.running = [r for r in self.running if r.status is _RUNNING]
        times = step.stage_times
        if len(times) == 1:
            busy = duration = times[0]
        else:
            busy, duration = max(times), end - step.start
        self.busy_time += busy
        shape = step.shape
        steps = self.steps
        if steps.bounded:
            steps.maybe_spill()
        steps.append(step.start, duration, shape.num_tokens,  # a verify query: 1 decode token + its drafts
                     shape.num_tokens - shape.num_decodes - sum(shape.verify_new),
                     shape.num_decodes + len(shape.verify_new), shape.num_seqs, step.used_blocks, len(self.running),
                     len(self.waiting), step.num_preempted, sampled, step.transfer_s, busy,
                     sum(shape.verify_new) - len(shape.verify_new))

    def complete(self, request: Request, now: float) -> None:
        """A request reached ``stop_at`` output tokens at ``now`` (the fast-forward's entry to the same path
        :meth:`finish_step` takes)."""
        self.outputs.release(request, now)

    # ---- the engine loop ----
    def _loop(self):
        env = self.env
        window = self.window
        in_flight = window.steps
        depth = window.depth
        jump_depth = 1 if self.async_scheduling else 0  # steps in flight when a jump may start
        while True:
            if (self.jump.enabled and len(in_flight) == jump_depth and not self.remote_pending
                    and not self.kv_holding and ff.steady_batch(self)):
                planned = self.jump.plan()
                if planned is not None:
                    yield from self.jump.run(*planned)
                    continue
            while len(in_flight) < depth:
                step = self._launch()
                if step is None:
                    break
                window.submit(step, self.now)
                if self.pipeline_async:
                    for r, sampled in zip(step.requests, step.samples):
                        if sampled:
                            r.token_ready_at = step.end
            if not in_flight:
                if self.waits_for_events():
                    self.wakeup_event = env.event()
                    yield self.wakeup_event
                    continue
                if self.skip_to_eligible_step():
                    continue
                self.resolve_stall()
                continue
            self.guards.stalled_schedules = 0
            step = in_flight.popleft()
            yield env.timeout(delay_until(env.now, step.end))
            self.finish_step(step)
