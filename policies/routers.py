"""Routers (global schedulers) that assign each arriving request to one instance of a cluster.

A router sees every instance through :class:`lab.sched_api.InstanceView` (running list, waiting queue, KV cache
manager, outstanding tokens) at the request's arrival time and returns an index. Ties always go to the lowest
index, and the only random router draws from a generator seeded with the experiment's seed, so a run is
deterministic.

- ``round_robin``: i, i+1, ... regardless of load.
- ``least_requests``: fewest outstanding requests (running + waiting) — "least outstanding requests" / join the
  shortest queue (e.g. Envoy's LEAST_REQUEST, the vLLM production stack's default).
- ``least_tokens``: fewest outstanding tokens (prompt still to compute + output still to generate).
- ``power_of_two``: two distinct instances drawn at random, the less loaded wins (Mitzenmacher, "The Power of Two
  Choices in Randomized Load Balancing", 2001).
- ``prefix_aware``: llm-d's KV-cache-aware scoring (llm-d inference scheduler: ``prefix-cache-scorer`` weight 3,
  ``queue-scorer`` weight 2 by default): score = w_prefix · (prefix tokens the instance holds / prompt tokens) +
  w_queue · (max_q − q_i)/(max_q − min_q) + w_kv · (1 − KV usage); the highest score wins.
- ``session_affinity``: every request of a session goes to the instance that served the session's first request
  (chosen by least outstanding requests). The session is ``Request.session_id``, else the first
  ``prefix_blocks`` prefix blocks (Mooncake ``hash_ids``, or 16-token groups of the token ids; the default 2
  skips the system prompt every Mooncake request shares in ``hash_ids[0]``); a request shorter than that has
  no session and goes to the least loaded instance.

Only ``round_robin`` declares ``routes_by_arrival_order`` (lab/core/sched_api.py ``RouterBase``): every other
router reads instance state (session affinity too, for each session's first request and for requests without a
session), so its choice is known only at the arrival.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lab.core.request import Request
from lab.core.sched_api import InstanceView, RouterBase


def _outstanding_requests(inst: InstanceView) -> int:
    return inst.num_outstanding_requests


def _argmin(values: list) -> int:
    best = 0
    for i in range(1, len(values)):
        if values[i] < values[best]:
            best = i
    return best


class RoundRobinRouter(RouterBase):
    """Round robin: instance i, i+1, ... in arrival order, regardless of load."""

    name = "round_robin"
    routes_by_arrival_order = True  # the k-th arrival goes to instance k mod N, whatever the instances hold

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, instances: list[InstanceView], now: float) -> int:
        i = self._next % len(instances)
        self._next += 1
        return i


class LeastRequestsRouter(RouterBase):
    """Least outstanding requests: the instance with the fewest running + waiting requests."""

    name = "least_requests"

    def route(self, request: Request, instances: list[InstanceView], now: float) -> int:
        return _argmin([_outstanding_requests(x) for x in instances])


class LeastTokensRouter(RouterBase):
    """Least outstanding tokens: the instance with the fewest tokens still to compute or generate."""

    name = "least_tokens"

    def route(self, request: Request, instances: list[InstanceView], now: float) -> int:
        return _argmin([x.num_outstanding_tokens for x in instances])


class PowerOfTwoRouter(RouterBase):
    """Power of two choices: draw two instances at random (seeded), send to the less loaded one."""

    name = "power_of_two"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        load: Literal["requests", "tokens"] = Field("requests", description="load measure: outstanding requests or tokens")
        seed: int | None = Field(None, description="RNG seed (default: the experiment's seed)")

    def __init__(self, options: "PowerOfTwoRouter.Options | None" = None) -> None:
        self.options = options or self.Options()
        self.rng = random.Random(self.options.seed or 0)

    def route(self, request: Request, instances: list[InstanceView], now: float) -> int:
        n = len(instances)
        if n == 1:
            return 0
        a, b = self.rng.sample(range(n), 2)
        if self.options.load == "tokens":
            la, lb = instances[a].num_outstanding_tokens, instances[b].num_outstanding_tokens
        else:
            la, lb = _outstanding_requests(instances[a]), _outstanding_requests(instances[b])
        return b if lb < la else a


class PrefixAwareRouter(RouterBase):
    """Prefix-cache-aware (llm-d KV-aware scoring): longest cached prefix, balanced against queue and KV load."""

    name = "prefix_aware"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        prefix_weight: float = Field(3.0, ge=0, description="weight of the prefix-hit fraction score")
        queue_weight: float = Field(2.0, ge=0, description="weight of the (min-max normalised) queue score")
        kv_weight: float = Field(0.0, ge=0, description="weight of the free-KV score (1 - KV usage)")

    def __init__(self, options: "PrefixAwareRouter.Options | None" = None) -> None:
        self.options = options or self.Options()

    def route(self, request: Request, instances: list[InstanceView], now: float) -> int:
        o = self.options
        n = len(instances)
        if n == 1:
            return 0
        prompt = max(1, request.num_tokens)
        queues = [_outstanding_requests(x) for x in instances]
        qmin, qmax = min(queues), max(queues)
        scores = []
        for i, inst in enumerate(instances):
            s = 0.0
            if o.prefix_weight:
                _, hit = inst.kv.get_computed_blocks(request)
                s += o.prefix_weight * hit / prompt
            if o.queue_weight:
                s += o.queue_weight * ((qmax - queues[i]) / (qmax - qmin) if qmax > qmin else 1.0)
            if o.kv_weight:
                s += o.kv_weight * (1.0 - inst.kv.usage())
            scores.append(s)
        best = 0
        for i in range(1, n):
            if scores[i] > scores[best]:
                best = i
        return best


class SessionAffinityRouter(RouterBase):
    """Session affinity: every request of a session goes where its first request went (least loaded then)."""

    name = "session_affinity"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        prefix_blocks: int = Field(2, ge=1, description="leading prefix blocks that identify a session "
                                                        "when the trace has no session_id")

    def __init__(self, options: "SessionAffinityRouter.Options | None" = None) -> None:
        self.options = options or self.Options()
        self.sessions: dict = {}

    def session_key(self, request: Request):
        """``session_id``, else the first ``prefix_blocks`` prefix blocks, else the request itself (no
        affinity)."""
        if request.session_id is not None:
            return ("session", request.session_id)
        k = self.options.prefix_blocks
        if request.hash_ids is not None and len(request.hash_ids) >= k:
            return ("hash", tuple(request.hash_ids[:k]))
        if request.prompt_token_ids is not None and len(request.prompt_token_ids) >= 16 * k:
            return ("tokens", tuple(request.prompt_token_ids[:16 * k]))
        return ("request", request.index)

    def route(self, request: Request, instances: list[InstanceView], now: float) -> int:
        key = self.session_key(request)
        i = self.sessions.get(key)
        if i is None or i >= len(instances):
            i = _argmin([_outstanding_requests(x) for x in instances])
            if key[0] != "request":
                self.sessions[key] = i
        return i
