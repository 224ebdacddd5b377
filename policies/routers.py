"""Routers (global schedulers) that assign arriving requests to instances."""

from __future__ import annotations

from lab.request import Request
from lab.sched_api import InstanceView


class RoundRobinRouter:
    """Round robin: instance i, i+1, ... in arrival order, regardless of load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, instances: list[InstanceView], now: float) -> int:
        i = self._next % len(instances)
        self._next += 1
        return i
