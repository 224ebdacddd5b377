"""The small typed interface between an engine instance (mechanism) and a scheduler (policy).

A scheduler sees an :class:`EngineView`: the scheduler limits, the running list, the waiting queue, the KV cache
manager and two mechanisms, :meth:`EngineView.admit` and :meth:`EngineView.preempt`. It returns a
:class:`SchedulerOutput` naming the requests that run this step and how many new tokens each gets. The engine then
advances ``num_computed_tokens`` (vLLM does so at schedule time), asks the cost model for the step time, waits, and
applies the step's results. Schedulers never touch engine internals beyond this view.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from lab.core.kv_cache import KVCacheManager
from lab.core.queues import WaitingQueue, make_queue
from lab.core.kv_offload import KVOffloader
from lab.core.request import Request


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Engine limits a scheduler works within (names and defaults as vLLM's ``SchedulerConfig``).

    Attributes:
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: most requests in the running list.
        max_model_len: longest sequence (prompt + output) in tokens.
        enable_chunked_prefill: split prompts across steps; when off a waiting request is admitted only if its
            whole remainder fits the leftover budget.
        long_prefill_token_threshold: cap on tokens per request per step (0 = off).
        threshold_only_when_contended: vLLM 0.33 applies the threshold only when more than one request is
            running or waiting; legacy vLLM applied it always.
        scheduler_reserve_full_isl: admit a waiting request only if blocks for its whole current sequence fit.
        watermark: fraction of blocks kept free when admitting waiting requests while something runs.
        queue_policy: "fcfs" or "priority".
        num_lookahead_tokens: extra KV slots per request for the drafter's own KV beyond the target query (vLLM:
            k for EAGLE, MTP and draft models, 0 for n-gram).
        num_speculative_tokens: k, drafts per step under speculative decoding (0 = off).
        pad_new_one_token_requests: vLLM 0.33 pads a newly admitted request that computes one token to 1 + k
            query tokens with placeholder drafts (never accepted) so decode steps keep a uniform CUDA-graph shape.
        preemption_mode: what :meth:`EngineView.preempt` does: "recompute" (free the blocks, C = 0) or "swap"
            (copy the KV to CPU memory over PCIe, keep C, copy it back when the request is admitted again).
        preemption_victim: which running request a scheduler preempts when KV runs out: "auto" (the policy's
            own rule), "last" (last admitted), "lowest_priority", "most_kv" or "least_progress" (see
            policies/common.py ``pick_victim``).
        preemption_requeue: where a preempted request goes back in the waiting queue: "auto" (the policy's
            own choice; the engine's default is the head), "head" or "tail" (a priority queue orders it by
            priority either way).
        skip_blocked_waiting: waiting requests admission may pass over, in one schedule, when the one in front of
            them cannot be admitted (its KV blocks do not fit, or, chunked prefill off, its prompt exceeds the
            budget left); they keep their places. 0 = head-of-line blocking (every vLLM version and SGLang).
        priority_preemption: what a waiting request of higher priority does to running ones under the priority
            queue: "none" (it waits; vLLM V1), "max_num_seqs" (it preempts the lowest-priority running request when
            ``max_num_seqs`` is full and its priority value is strictly lower; the open vLLM PR #54530), "v0"
            (vLLM V0's ``_schedule_priority_preemption``: the head preempts lower-priority running requests while
            it cannot be scheduled, by slots, budget or KV).
        draft_slots_per_request: token-budget slots a scheduled request takes for its drafter beyond its own
            tokens (vLLM ``SpeculativeConfig.max_num_new_slots_for_drafting``: 1 for a draft model, 0 for EAGLE,
            MTP and n-gram).
        draft_slot_budget: how those slots are charged: "per_request" (each scheduled request's, vLLM 0.33, PR
            #51725) or "reserved" (``max_num_seqs`` x slots taken off the budget up front, vLLM before it:
            ``VllmConfig._set_max_num_scheduled_tokens``).
        max_num_partial_prefills, max_long_partial_prefills: vLLM V0's concurrent partial prefills (0.7.0 to the
            last V0; V1 never enforced them): at most this many prompts in chunked prefill in one step, and at
            most this many of them longer than ``long_prefill_token_threshold`` (1 = off).
        v0_watermark: the fraction of blocks vLLM V0's block manager keeps free when admitting (0.01).
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 131072
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    threshold_only_when_contended: bool = True
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    queue_policy: str = "fcfs"
    num_lookahead_tokens: int = 0
    num_speculative_tokens: int = 0
    pad_new_one_token_requests: bool = False
    preemption_mode: str = "recompute"
    preemption_victim: str = "auto"
    preemption_requeue: str = "auto"
    skip_blocked_waiting: int = 0
    priority_preemption: str = "none"
    draft_slots_per_request: int = 0
    draft_slot_budget: str = "per_request"
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    v0_watermark: float = 0.01


@dataclass(slots=True)
class SchedulerOutput:
    """What one call to ``schedule`` decided.

    Attributes:
        requests: requests that run this step, in batch order.
        num_new_tokens: tokens each gets this step (same order, each >= 1; draft tokens included).
        preempted: requests preempted while building this step.
        num_spec_tokens: draft tokens scheduled per request (speculative decoding; vLLM
            ``scheduled_spec_decode_tokens``); requests without drafts are absent, and the dict stays empty when
            nothing speculates. Under async scheduling the drafts are placeholders; the engine sets them.
        padded_drafts: requests whose drafts are placeholders that can never be accepted (vLLM 0.33's padding of
            newly admitted one-token requests to 1 + k); they are in ``num_spec_tokens`` too.
        waiting_blocked: admission stopped at a waiting request it could not take because of KV (its allocation
            failed) or ``max_num_seqs``, not the token budget. A policy that supports fast-forward sets it so that
            a step which admitted requests, or finished a prompt, may start a fast-forward jump right after it:
            the same request then stays blocked while the batch only decodes (free blocks only shrink, a pure
            decode step leaves more budget, ``len(running)`` does not drop) until a completion
            (lab/engine/jump/).
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_spec_tokens: dict[Request, int] = field(default_factory=dict)
    padded_drafts: set[Request] = field(default_factory=set)
    waiting_blocked: bool = False

    def add(self, request: Request, n: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(n)

    def remove(self, request: Request) -> int:
        """Un-schedule a request (priority preemption of an already scheduled one); returns its refunded tokens."""
        for i, r in enumerate(self.requests):
            if r is request:
                del self.requests[i]
                self.num_spec_tokens.pop(r, None)
                self.padded_drafts.discard(r)
                return self.num_new_tokens.pop(i)
        return 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Admission(NamedTuple):
    """A scheduler's decision to admit a waiting request in one schedule (:meth:`SchedulerBase.admission`).
    Immutable (a named tuple: the jump asks for one per planned schedule, 10^5 times a run, and a frozen dataclass
    took 1.5 us to build against 0.4 us).

    Attributes:
        num_new_tokens: tokens it computes in this step (0: it waits, and admission stops at it).
        num_lookahead_tokens: KV slots for the drafter's lookahead (``allocate_slots``'s argument).
        num_reserved_tokens: KV slots reserved beyond the step's tokens (Sarathi-Serve: the rest of the prompt).
        reserved_blocks: free blocks its allocation must leave (a watermark).
        full_sequence_must_fit: vLLM's ``scheduler_reserve_full_isl`` gate on the whole sequence.
        num_padded_drafts: placeholder drafts padded onto a one-token admission (vLLM 0.33), computed with it.
    """

    num_new_tokens: int
    num_lookahead_tokens: int = 0
    num_reserved_tokens: int = 0
    reserved_blocks: int = 0
    full_sequence_must_fit: bool = False
    num_padded_drafts: int = 0


# The request waits: admission stops at it.
WAITS = Admission(0)


class SchedulerContractError(RuntimeError):
    """A scheduler returned a step that breaks the engine's rules (the message names the policy and the rule)."""


class EngineStall(SchedulerContractError):
    """The run ran out of events while requests were neither finished nor rejected (no horizon cut them off): some
    mechanism waits for an event that never comes. The message names the requests, their instance and state."""


def contract_violation(out: SchedulerOutput, config: SchedulerConfig, num_running: int,
                       max_step_tokens: int | None) -> str:
    """The first rule of the scheduler contract ``out`` breaks, as a sentence, or '' if it keeps them all.

    Rules checked here, on the whole output (the engine checks per request, while applying the schedule, that a
    scheduled request is running and holds KV blocks for its tokens): one token count per request, every count
    >= 1, no request listed twice, total tokens within ``max_step_tokens`` (the scheduler's own budget,
    :meth:`SchedulerBase.max_step_tokens`; None = no cap), running requests within ``max_num_seqs``, drafts only
    for scheduled requests and fewer than their tokens.
    """
    reqs, news = out.requests, out.num_new_tokens
    if len(reqs) != len(news):
        return f"{len(reqs)} requests but {len(news)} token counts"
    if min(news) < 1:
        i = news.index(min(news))
        return f"request {reqs[i].request_id} scheduled with {news[i]} tokens (expected >= 1)"
    if len(set(reqs)) != len(reqs):  # a Request hashes and compares by identity
        return "a request is scheduled twice in one step"
    if max_step_tokens is not None:
        total = sum(news)
        if total > max_step_tokens:
            return f"{total} tokens scheduled, over the step budget ({max_step_tokens})"
    if num_running > config.max_num_seqs:
        return f"{num_running} requests running, over max_num_seqs ({config.max_num_seqs})"
    if not (out.num_spec_tokens or out.padded_drafts):
        return ""
    if config.num_speculative_tokens == 0 and out.num_spec_tokens:
        return "drafts scheduled but speculative decoding is off"
    for r in out.padded_drafts:
        if r not in out.num_spec_tokens:
            return f"request {r.request_id}: padded drafts without a draft count"
    tokens = dict(zip(reqs, news))  # (by identity: one look-up per draft count, not a scan of the batch)
    for r, k in out.num_spec_tokens.items():
        n = tokens.get(r)
        if n is None:
            return f"drafts given for request {r.request_id}, which is not scheduled"
        if not 0 <= k < n:
            return f"request {r.request_id}: {k} drafts with {n} tokens (expected 0 <= drafts < tokens)"
    return ""


class EngineView(Protocol):
    """What an instance exposes to its scheduler.

    ``running`` is in admission order and is the engine's own list: schedulers read it and change it only
    through :meth:`admit` and :meth:`preempt`. ``waiting`` is the waiting queue the scheduler's ``make_queue``
    built (FCFS deque or priority heap by default); a scheduler pops or removes the request it admits.
    ``num_scheduler_steps`` counts the schedules made so far on this instance; when ``pipeline_async`` (pipeline
    parallelism under async scheduling) a decode is schedulable again only once that count reaches the request's
    ``next_decode_eligible_step``
    (vLLM's V2 model runner rule, shared/specs/vllm-v1-scheduling.md §4). ``kv`` is the KV cache manager (``get_computed_blocks``, ``allocate_slots``,
    ``num_free_blocks``, ``block_size``). ``kv_holding`` holds requests whose KV arrived from another instance
    (prefill/decode disaggregation), for a scheduler that ``admits_kv_holding`` to admit before ``waiting``.
    ``kv_offload`` is the CPU tier of the KV cache (lab/core/kv_offload.py; None when KV offloading is off): a
    scheduler that ``supports_kv_offload`` looks a waiting request up there after its GPU prefix hit and, on a
    hit, allocates its blocks and hands it to :meth:`start_cpu_load` (policies/common.py ``start_cpu_load``).
    """

    config: SchedulerConfig
    running: list[Request]
    waiting: WaitingQueue
    kv: KVCacheManager
    instance_id: int
    num_scheduler_steps: int
    pipeline_async: bool
    kv_holding: "deque[Request]"
    kv_offload: "KVOffloader | None"

    @property
    def now(self) -> float: ...

    def admit(self, request: Request, num_computed_tokens: int) -> None:
        """Move the waiting head (already popped by the scheduler) to running with ``num_computed_tokens`` from
        the prefix cache; records prefix-hit statistics on its first scheduling."""
        ...

    def start_cpu_load(self, request: Request, num_gpu_hit: int, num_cpu_tokens: int) -> None:
        """Copy ``num_cpu_tokens`` tokens of the request's KV back from the CPU tier into the blocks just allocated
        for it (after its ``num_gpu_hit`` GPU prefix-hit tokens). The request, already taken out of ``waiting``,
        waits for the copy (vLLM ``WAITING_FOR_REMOTE_KVS``) and then joins ``kv_holding`` holding C = the loaded
        tokens (``num_tokens - 1`` when the load covered them all)."""
        ...

    def preempt(self, request: Request, reason: str = "", requeue: str | None = None) -> None:
        """Preempt a running request by ``config.preemption_mode`` and put it back in the waiting queue.

        Recompute: free its blocks (they keep their hashes, so a later prefix hit is possible) and set C = 0.
        Swap: copy its KV to CPU memory (PCIe time added to this step), free its blocks and keep C; admitting it
        again copies the KV back (PCIe time again). Falls back to recompute when the CPU swap space is full.
        ``reason`` is written to the request's event log. The request goes back at the head of the waiting
        queue, or at the tail when ``config.preemption_requeue`` is "tail" — or, when that is "auto", when the
        scheduler passes ``requeue="tail"`` (its own rule, e.g. SGLang appends retracted requests)."""
        ...


@runtime_checkable
class Scheduler(Protocol):
    """A scheduling policy: one call per engine step, plus what the engine may ask of it (see
    :class:`SchedulerBase`, which every policy subclasses)."""

    name: str
    supports_async: bool
    supports_fast_forward: bool
    supports_pipelining: bool
    supports_speculation: bool
    admits_kv_holding: bool
    supports_kv_offload: bool
    skips_blocked_waiting: bool
    preempts_for_priority: bool

    def make_queue(self, config: SchedulerConfig) -> WaitingQueue: ...

    def fast_forward_allowed(self, config: SchedulerConfig) -> bool: ...

    def max_step_tokens(self, config: SchedulerConfig) -> int | None: ...

    def schedule(self, engine: EngineView) -> SchedulerOutput: ...

    def admission(self, engine: EngineView, request: Request, num_hit_tokens: int | None, num_running: int,
                  num_scheduled_tokens: int, num_requests: int) -> "Admission | None": ...

    def running_tokens(self, engine: EngineView, request: Request, num_computed_tokens: int,
                       num_scheduled_tokens: int) -> int | None: ...

    def decode_preemption_reason(self, engine: EngineView, requester: Request) -> str | None: ...


class SchedulerBase:
    """Base class of every scheduling policy: it declares the capabilities the engine reads, with safe defaults.

    Override in a subclass:

    - :meth:`schedule` (required): build one step from the :class:`EngineView`.
    - ``supports_async``: the policy schedules correctly with a step in flight (it counts output placeholders,
      ``num_output_placeholders``, as tokens to compute), so async scheduling may overlap its CPU work.
    - ``supports_fast_forward``: the policy keeps no state between steps that would change a steady decode batch's
      schedule, so the engine may advance decode stretches in one jump (lab/engine/jump/). Such a policy
      may set ``SchedulerOutput.waiting_blocked`` (a jump may then start right after a step that admitted).
    - ``supports_pipelining``: the policy skips a request with nothing left to compute (n <= 0: a decode whose
      step is in flight) and, under async PP, one before its ``next_decode_eligible_step``, so several
      micro-batches may be in flight (pipeline parallelism). Without it a PP instance runs one micro-batch at a
      time.
    - ``supports_speculation``: the policy schedules a request's drafts (``Request.num_spec_tokens``) with it —
      1 + k query tokens, in the budget and the KV (``num_lookahead_tokens``) — and reports them in
      ``SchedulerOutput.num_spec_tokens``; speculative decoding is refused with a policy that does not.
    - ``admits_kv_holding``: the policy admits ``EngineView.kv_holding`` (requests whose KV another instance sent
      and which hold their blocks) before ``waiting``, as vLLM 0.33 drains ``kv_holding_waiting`` first. Without it
      the engine puts such requests at the head of ``waiting``.
    - ``supports_kv_offload``: the policy looks waiting requests up in ``EngineView.kv_offload`` (the CPU tier)
      after their GPU prefix hit and starts their loads (policies/common.py ``start_cpu_load``); KV offloading is
      refused with a policy that does not.
    - ``skips_blocked_waiting``: the policy honours ``SchedulerConfig.skip_blocked_waiting`` (admission past a
      blocked waiting request); ``engine.skip_blocked_waiting`` is refused with a policy that does not.
    - ``preempts_for_priority``: the policy honours ``SchedulerConfig.priority_preemption`` (a waiting request of
      higher priority preempting running ones); refused with a policy that does not.
    - :meth:`fast_forward_allowed`: whether the jump stays exact under a configuration (default True).
    - :meth:`make_queue`: the waiting queue the policy wants (default: FCFS or priority by ``config.queue_policy``).
    - :meth:`max_step_tokens`: the most tokens one of its steps may hold (default ``max_num_batched_tokens``;
      None for a policy with a budget of its own, e.g. Orca's whole prompts).
    - Its decisions, written once and called by its own :meth:`schedule` and by a fast-forward jump alike
      (lab/engine/jump/decisions.py asks them about the schedules a jump plans): :meth:`admission` (is the next
      waiting request admitted, with how many tokens and which KV arguments), :meth:`running_tokens` (how many
      tokens a running request gets) and :meth:`decode_preemption_reason` (who is preempted when a decode finds no
      KV block). The defaults say "cannot tell": a policy that does not provide them runs exactly, step by step,
      wherever the answer is needed.
    """

    name = "scheduler"
    supports_async = False
    supports_fast_forward = False
    supports_pipelining = False
    supports_speculation = False
    admits_kv_holding = False
    supports_kv_offload = False
    skips_blocked_waiting = False
    preempts_for_priority = False

    def make_queue(self, config: SchedulerConfig) -> WaitingQueue:
        """The waiting queue of an instance run by this policy."""
        return make_queue(config.queue_policy)

    def fast_forward_allowed(self, config: SchedulerConfig) -> bool:
        """Whether a policy that ``supports_fast_forward`` keeps that promise under ``config`` (default True): a
        knob whose decision the jump cannot ask about (admission past a blocked head, a waiting request preempting
        a running one) turns the jump off for the instance."""
        return True

    def max_step_tokens(self, config: SchedulerConfig) -> int | None:
        """Tokens one step may hold at most (the engine checks every step against it); None = no cap."""
        return config.max_num_batched_tokens

    def schedule(self, engine: EngineView) -> SchedulerOutput:  # pragma: no cover - every policy overrides it
        raise NotImplementedError

    def admission(self, engine: EngineView, request: Request, num_hit_tokens: int | None, num_running: int,
                  num_scheduled_tokens: int, num_requests: int) -> Admission | None:
        """This policy's admission decision on ``request``, the next waiting request it would take, in a schedule
        with ``num_running`` requests in the running list, ``num_scheduled_tokens`` tokens already scheduled (the
        running phase's, then those of the requests admitted before it) and ``num_requests`` running + waiting
        requests when the schedule began; ``num_hit_tokens``: its cached tokens (a prefix hit, or computed state
        it holds), or None when the caller does not know them yet (a planned schedule, where a hit may still come).

        Returns:
            :data:`WAITS` when it is not admitted and admission stops at it (no ``max_num_seqs`` slot, no budget, a
            prompt the budget cannot take); else the tokens it computes now and the arguments of its KV allocation
            (``KVCacheManager.allocate_slots``), which then decides whether its blocks fit; None when the answer
            depends on what ``num_hit_tokens`` would be, or the policy cannot tell (default).
        """
        return None

    def running_tokens(self, engine: EngineView, request: Request, num_computed_tokens: int,
                       num_scheduled_tokens: int) -> int | None:
        """The tokens this policy's running phase gives ``request``, running with ``num_computed_tokens`` computed,
        after ``num_scheduled_tokens`` tokens of the requests scheduled before it in the same schedule; 0 for none,
        None when the policy cannot tell (default; the answer depends on more than these)."""
        return None

    def decode_preemption_reason(self, engine: EngineView, requester: Request) -> str | None:
        """How a schedule whose running phase only decodes (each running request computes one token, in
        running-list order, and none asked for lookahead slots) preempts when a decode finds no free KV block, if
        it preempts as vLLM V1 does with its ``last`` victim rule: the last request of the running list is
        preempted (:meth:`EngineView.preempt`, recompute, put back at the head of the waiting queue), again until
        ``requester``'s block fits or ``requester`` is preempted itself, the decodes after it go on the same way,
        and the schedule then admits nothing. Returns the reason passed to :meth:`EngineView.preempt` for each
        victim (the same text a real schedule records), or None when the policy preempts otherwise or cannot
        tell. A fast-forward jump may start with such a schedule only when this gives a reason. Default: None."""
        return None


class InstanceView(Protocol):
    """What a router sees of one instance."""

    instance_id: int
    pool: str
    running: list[Request]
    waiting: WaitingQueue
    kv: KVCacheManager

    @property
    def num_outstanding_tokens(self) -> int:
        """Tokens still to compute or generate for every request on this instance."""
        ...

    @property
    def num_outstanding_requests(self) -> int:
        """Requests on this instance in any state: running, waiting, holding KV that arrived, waiting for a KV read
        (vLLM counts a request waiting for remote KV among its waiting requests)."""
        ...


@runtime_checkable
class Router(Protocol):
    """A global scheduler: picks the instance for each arriving request (see :class:`RouterBase`, which every
    router subclasses, for the capabilities the simulation reads)."""

    routes_by_arrival_order: bool

    def route(self, request: Request, instances: "list[InstanceView]", now: float) -> int:
        """Return the index in ``instances`` of the instance that gets ``request``."""
        ...


class RouterBase:
    """Base class of every router: it declares the capabilities the simulation reads, with safe defaults.

    Override in a subclass:

    - :meth:`route` (required): the index of the instance that gets the request.
    - ``routes_by_arrival_order``: the choice depends only on the request, its place in the arrival order and the
      number of instances, never on instance state (running, waiting, KV, outstanding tokens) nor on ``now``
      (round robin). An open-loop run then routes its whole arrival stream before it starts, calling
      :meth:`route` once per request in arrival order as it would at each arrival, so every instance knows its
      own next arrival exactly and its fast-forward jumps end there (lab/experiment/simulation.py). The
      instances shown then expose only ``instance_id`` and ``pool``; reading anything else raises
      ``lab.cluster.cluster.RouterError``. Leave it False for a router that reads load or cache state.
    """

    name = "router"
    routes_by_arrival_order = False

    def route(self, request: Request, instances: "list[InstanceView]", now: float) -> int:  # pragma: no cover
        raise NotImplementedError
