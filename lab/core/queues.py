"""Waiting queues, as vLLM V1's request_queue.py has them: FCFS (a deque) and priority (a heap).

Both support the operations the schedulers need: ``add`` (an arrival), ``peek``/``pop`` (the head), ``prepend`` (a
preempted request, which FCFS puts first and the priority heap simply pushes), ``remove``, iteration in service
order, ``first(n)`` (the first n in service order, without ordering the rest) and ``order_stable_until`` (when the
order may change with time alone).
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import islice
from typing import Iterator, Protocol

from lab.core.request import Request


class WaitingQueue(Protocol):
    """What every waiting queue offers a scheduler.

    ``order_stable_until() -> float`` is the earliest time (seconds) at which the head may differ from the head the
    scheduler last saw with no arrival or pop in between: ``inf`` for FCFS and priority order (:class:`FixedOrder`),
    a finite time for a queue whose order changes with time alone (e.g. starvation promotion). The decode
    fast-forward ends a jump before it (lab/engine/jump/). ``arrivals_join_back``: whether an arrival is
    always served after every request already waiting (FCFS); only then does a jump plan the admissions of several
    heads in turn.
    """

    def add(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def prepend(self, request: Request) -> None: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...
    def first(self, n: int) -> list[Request]: ...
    def order_stable_until(self) -> float: ...

    arrivals_join_back: bool  # an arrival is served after everything already waiting (FCFS)


class FixedOrder:
    """Mixin of a queue whose order changes only on arrivals and pops."""

    def order_stable_until(self) -> float:
        return float("inf")


class FCFSQueue(FixedOrder):
    """First come, first served; a preempted request goes back to the head."""

    arrivals_join_back = True

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def first(self, n: int) -> list[Request]:
        """The first ``n`` requests in service order (fewer if fewer wait)."""
        return list(islice(self._q, n))


class PriorityQueue(FixedOrder):
    """Heap on ``(priority, arrival_time, index)``; lower priority values are served first."""

    arrivals_join_back = False

    def __init__(self) -> None:
        self._h: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._h, (request.priority, request.arrival_time, request.index, request))

    def peek(self) -> Request:
        return self._h[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._h)[3]

    def prepend(self, request: Request) -> None:
        self.add(request)

    def remove(self, request: Request) -> None:
        self._h = [e for e in self._h if e[3] is not request]
        heapq.heapify(self._h)

    def __len__(self) -> int:
        return len(self._h)

    def __bool__(self) -> bool:
        return bool(self._h)

    def __iter__(self) -> Iterator[Request]:
        return iter(e[3] for e in sorted(self._h, key=lambda e: e[:3]))

    def first(self, n: int) -> list[Request]:
        """The first ``n`` requests in service order (fewer if fewer wait)."""
        return [e[3] for e in heapq.nsmallest(n, self._h, key=lambda e: e[:3])]


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """Build the waiting queue for ``policy`` ("fcfs" or "priority").

    Raises:
        ValueError: for any other name.
    """
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown queue policy {policy!r}; expected 'fcfs' or 'priority'")
