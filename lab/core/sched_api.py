"""The small typed interface between an engine instance (mechanism) and a scheduler (policy).

A scheduler sees an :class:`EngineView`: the scheduler limits, the running list, the waiting queue, the KV cache
manager and two mechanisms, :meth:`EngineView.admit` and :meth:`EngineView.preempt`. It returns a
:class:`SchedulerOutput` naming the requests that run this step and how many new tokens each gets. The engine then
advances ``num_computed_tokens`` (vLLM does so at schedule time), asks the cost model for the step time, waits, and
applies the step's results. Schedulers never touch engine internals beyond this view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from lab.core.kv_cache import KVCacheManager
from lab.core.queues import WaitingQueue
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
        num_lookahead_tokens: extra KV slots per request (speculative decoding drafts).
        preemption_mode: what :meth:`EngineView.preempt` does: "recompute" (free the blocks, C = 0) or "swap"
            (copy the KV to CPU memory over PCIe, keep C, copy it back when the request is admitted again).
        preemption_victim: which running request a scheduler preempts when KV runs out: "auto" (the policy's
            own rule), "last" (last admitted), "lowest_priority", "most_kv" or "least_progress" (see
            policies/common.py ``pick_victim``).
        preemption_requeue: where a preempted request goes back in the waiting queue: "auto" (the policy's
            own choice; the engine's default is the head), "head" or "tail" (a priority queue orders it by
            priority either way).
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
    preemption_mode: str = "recompute"
    preemption_victim: str = "auto"
    preemption_requeue: str = "auto"


@dataclass(slots=True)
class SchedulerOutput:
    """What one call to ``schedule`` decided.

    Attributes:
        requests: requests that run this step, in batch order.
        num_new_tokens: tokens each gets this step (same order, each >= 1).
        preempted: requests preempted while building this step.
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, n: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(n)

    def remove(self, request: Request) -> int:
        """Un-schedule a request (priority preemption of an already scheduled one); returns its refunded tokens."""
        for i, r in enumerate(self.requests):
            if r is request:
                del self.requests[i]
                return self.num_new_tokens.pop(i)
        return 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class EngineView(Protocol):
    """What an instance exposes to its scheduler.

    ``running`` is in admission order and is the engine's own list: schedulers read it and change it only
    through :meth:`admit` and :meth:`preempt`. ``waiting`` is the waiting queue (FCFS deque, priority heap, or
    the scheduler's own queue from an optional ``make_queue(config)`` method); a scheduler pops or removes the
    request it admits. ``kv`` is the KV cache manager (``get_computed_blocks``, ``allocate_slots``,
    ``num_free_blocks``, ``block_size``).
    """

    config: SchedulerConfig
    running: list[Request]
    waiting: WaitingQueue
    kv: KVCacheManager
    instance_id: int

    @property
    def now(self) -> float: ...

    def admit(self, request: Request, num_computed_tokens: int) -> None:
        """Move the waiting head (already popped by the scheduler) to running with ``num_computed_tokens`` from
        the prefix cache; records prefix-hit statistics on its first scheduling."""
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
    """A scheduling policy: one call per engine step."""

    def schedule(self, engine: EngineView) -> SchedulerOutput: ...


class InstanceView(Protocol):
    """What a router sees of one instance."""

    instance_id: int
    running: list[Request]
    waiting: WaitingQueue
    kv: KVCacheManager

    @property
    def num_outstanding_tokens(self) -> int:
        """Tokens still to compute or generate for every request on this instance."""
        ...


@runtime_checkable
class Router(Protocol):
    """A global scheduler: picks the instance for each arriving request."""

    def route(self, request: Request, instances: "list[InstanceView]", now: float) -> int:
        """Return the index in ``instances`` of the instance that gets ``request``."""
        ...
