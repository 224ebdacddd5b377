"""Shortest job first on a predicted output length, with starvation protection.

The waiting queue is ordered by the predicted number of output tokens (shortest first, arrival order among
equals); everything else — chunked prefill, the token budget, preemption of running requests, head-of-line
admission — is vLLM V1's (policies/vllm_v1.py). The policy is non-preemptive: a short arrival does not preempt a
running long request.

Predictors (``options.predictor``):

- ``oracle``: the true output length (the trace's; an upper bound on what any predictor can achieve).
- ``noisy``: the true length times ``exp(N(0, noise_sigma))``, drawn per request from a generator seeded with
  ``(seed, request index)`` — the same prediction on every instance and in every run with the same seed.
- ``bucketed``: the index of the bucket (``buckets``, upper bounds in tokens) the (optionally noisy) length falls
  in; requests in one bucket are served in arrival order. This is what a length classifier predicts (Zheng et
  al., "Response Length Perception and Sequence Scheduling", NeurIPS'23; Jin et al., "S³", 2023).

Starvation protection: a request that has waited longer than ``starvation_s`` goes before every request that has
not, oldest first (the "starvation threshold" promotion of Fu et al., "Efficient LLM Scheduling by Learning to
Rank", NeurIPS'24). A preempted request goes back ahead of everything (as vLLM's FCFS prepends it) so it does not
starve either. Sources: Qiu et al., "Efficient Interactive LLM Serving with Proxy Model-based Sequence Length
Prediction" (SSJF), 2024.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from itertools import islice
from typing import Iterable, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lab.core.request import Request
from lab.core.sched_api import EngineView, SchedulerConfig, SchedulerOutput
from policies.vllm_v1 import VLLMV1Scheduler


class LengthPredictor:
    """Predicts a request's output length (tokens, or a bucket index for ``bucketed``).

    Args:
        kind: ``oracle``, ``noisy`` or ``bucketed``.
        noise_sigma: sigma of the multiplicative log-normal noise (``noisy``; ``bucketed`` too when > 0).
        buckets: ascending bucket upper bounds (``bucketed``); lengths above the last bound get the last index + 1.
        seed: seeds the per-request noise.
    """

    def __init__(self, kind: str = "oracle", noise_sigma: float = 0.5, buckets: Iterable[int] = (),
                 seed: int = 0) -> None:
        self.kind = kind
        self.noise_sigma = noise_sigma
        self.buckets = list(buckets)
        self.seed = seed

    def _noisy(self, r: Request) -> float:
        if self.noise_sigma <= 0:
            return float(r.max_tokens)
        z = np.random.default_rng([self.seed, r.index]).standard_normal()
        return r.max_tokens * math.exp(self.noise_sigma * z)

    def predict(self, r: Request) -> float:
        if self.kind == "oracle":
            return float(r.max_tokens)
        if self.kind == "noisy":
            return max(1.0, round(self._noisy(r)))
        length = self._noisy(r) if self.noise_sigma > 0 else float(r.max_tokens)
        return float(bisect.bisect_left(self.buckets, length))


class SJFQueue:
    """Waiting queue in predicted-length order with starvation promotion (implements ``WaitingQueue``).

    A heap keyed ``(prediction, arrival_time, index)`` plus an arrival-order deque for the starvation check, both
    with lazy deletion (an entry is live while its token matches the request's current one), and a front deque
    for preempted requests. ``now`` must be set before ``peek``/``pop`` (the scheduler does it every step).
    O(log n) per operation.
    """

    arrivals_join_back = False  # an arrival may be served before requests already waiting

    def __init__(self, predictor: LengthPredictor, starvation_s: float | None) -> None:
        self.predictor = predictor
        self.starvation_s = starvation_s
        self.now = 0.0
        self._heap: list[tuple[float, float, int, int, Request]] = []
        self._fifo: deque[tuple[int, Request]] = deque()
        self._front: deque[Request] = deque()
        self._live: dict[int, int] = {}  # id(request) -> token of its live entry (-1 = in the front deque)
        self._next = 0
        self._pred: dict[int, float] = {}

    def prediction(self, r: Request) -> float:
        p = self._pred.get(r.index)
        if p is None:
            p = self._pred[r.index] = self.predictor.predict(r)
        return p

    def add(self, request: Request) -> None:
        self._next += 1
        tok = self._next
        self._live[id(request)] = tok
        heapq.heappush(self._heap, (self.prediction(request), request.arrival_time, request.index, tok, request))
        self._fifo.append((tok, request))

    def prepend(self, request: Request) -> None:
        self._live[id(request)] = -1
        self._front.appendleft(request)

    def _clean(self) -> None:
        live = self._live
        h = self._heap
        while h and live.get(id(h[0][4])) != h[0][3]:
            heapq.heappop(h)
        f = self._fifo
        while f and live.get(id(f[0][1])) != f[0][0]:
            f.popleft()

    def _head(self) -> Request:
        if self._front:
            return self._front[0]
        self._clean()
        f = self._fifo
        if self.starvation_s is not None and f and self.now - f[0][1].arrival_time > self.starvation_s:
            return f[0][1]
        if not self._heap:
            raise IndexError("peek from an empty SJF queue")
        return self._heap[0][4]

    def peek(self) -> Request:
        return self._head()

    def order_stable_until(self) -> float:
        """When the oldest waiting request passes ``starvation_s`` and becomes the head, if it had not yet when the
        scheduler last looked (``now``); ``inf`` when there is no protection or nothing waits. Before then the
        order changes only by an arrival or a pop. The threshold is strict: a schedule at exactly that time still
        sees the old head."""
        if self.starvation_s is None:
            return float("inf")
        self._clean()
        if not self._fifo:
            return float("inf")
        t = self._fifo[0][1].arrival_time + self.starvation_s
        return t if t >= self.now else float("inf")

    def pop(self) -> Request:
        r = self._head()
        self.remove(r)
        return r

    def remove(self, request: Request) -> None:
        tok = self._live.pop(id(request))
        if tok == -1:
            self._front.remove(request)

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def first(self, n: int) -> list[Request]:
        """The first ``n`` requests in service order (fewer if fewer wait); with starvation protection the head
        alone, since the order behind it may change with time."""
        if self.starvation_s is not None:
            return [self._head()][:n] if self._live else []
        return list(islice(iter(self), n))

    def __iter__(self) -> Iterator[Request]:
        live = self._live
        rest = sorted((e for e in self._heap if live.get(id(e[4])) == e[3]), key=lambda e: e[:3])
        return iter(list(self._front) + [e[4] for e in rest])


class SJFScheduler(VLLMV1Scheduler):
    """Shortest predicted job first (oracle / noisy / bucketed predictor) with starvation protection."""

    name = "sjf"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        predictor: Literal["oracle", "noisy", "bucketed"] = Field("oracle", description="output-length predictor")
        noise_sigma: float = Field(0.5, ge=0, description="log-normal sigma of the prediction error (noisy, bucketed)")
        buckets: list[int] = Field(default_factory=lambda: [32, 64, 128, 256, 512, 1024, 2048],
                                   description="bucket upper bounds in tokens (bucketed)")
        starvation_s: float | None = Field(30.0, gt=0, description="wait after which a request is served first "
                                                                    "(None = no protection)")
        seed: int | None = Field(None, description="noise seed (default: the experiment's seed)")

        @field_validator("buckets")
        @classmethod
        def _ascending(cls, v: list[int]) -> list[int]:
            if not v or any(b <= a for a, b in zip(v, v[1:])) or v[0] < 1:
                raise ValueError("buckets must be a non-empty ascending list of positive token counts")
            return v

    def __init__(self, options: "SJFScheduler.Options | None" = None) -> None:
        self.options = options or self.Options()
        o = self.options
        self.predictor = LengthPredictor(o.predictor, o.noise_sigma, o.buckets, o.seed or 0)
        self.queue: SJFQueue | None = None

    def make_queue(self, config: SchedulerConfig) -> SJFQueue:
        """The engine's waiting queue: predicted-length order (replaces ``policy.queue``)."""
        self.queue = SJFQueue(self.predictor, self.options.starvation_s)
        return self.queue

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        q = engine.waiting
        if isinstance(q, SJFQueue):
            q.now = engine.now
        return super().schedule(engine)
