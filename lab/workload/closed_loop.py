"""Closed-loop clients: at most N requests in flight, the next sent when one completes (plus a think time), as
``vllm bench serve --max-concurrency N`` drives a server (a semaphore of N around the sends).

Each request's planned arrival time (from the trace or the generator's rate) is the earliest it may be sent,
measured from the start of its phase; it is sent at the first moment after that when fewer than N requests are in
flight, and its ``arrival_time`` becomes that send time, so TTFT is measured from the client's send. A completed
request (finished or rejected) frees its slot after ``think_time_s``. The first ``num_warmup`` requests form a
warm-up phase: they are sent the same way, the measured phase starts when the last of them has completed, and they
are marked ``warmup`` and left out of the metrics (``vllm bench serve --num-warmups``: warm-up requests run before
the benchmark's clock starts).
"""

from __future__ import annotations

from typing import Callable

import simpy

from lab.core.request import Request


class ClosedLoopClients:
    """Sends ``requests`` (planned arrival order) through ``arrive`` with at most ``concurrency`` in flight.

    Args:
        env: the SimPy environment.
        requests: the requests, in planned arrival order; their ``arrival_time`` is rewritten to the send time.
        concurrency: N, requests in flight at most (>= 1).
        arrive: hands a request to the deployment.
        think_time_s: seconds between a completion and the slot's next send (>= 0).
        num_warmup: leading requests sent as a warm-up phase and excluded from metrics.
        on_measure_start: called when the measured phase starts (after the warm-up), e.g. to clear ITL samples.

    Raises:
        ValueError: concurrency < 1, a negative think time, or more warm-up requests than requests.
    """

    def __init__(self, env: simpy.Environment, requests: list[Request], concurrency: int,
                 arrive: Callable[[Request], None], think_time_s: float = 0.0, num_warmup: int = 0,
                 on_measure_start: Callable[[], None] | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"workload.concurrency must be >= 1, got {concurrency}")
        if think_time_s < 0:
            raise ValueError(f"workload.think_time_s must be >= 0, got {think_time_s}")
        if not 0 <= num_warmup < max(1, len(requests)) and num_warmup:
            raise ValueError(f"workload.num_warmup ({num_warmup}) must be below the number of requests "
                             f"({len(requests)})")
        self.env = env
        self.requests = requests
        self.concurrency = concurrency
        self.arrive = arrive
        self.think_time_s = think_time_s
        self.num_warmup = num_warmup
        self.on_measure_start = on_measure_start
        self.in_flight = 0
        self._slot: simpy.Event | None = None
        self._pending_warmup = num_warmup
        self._warmup_done: simpy.Event | None = None
        self.measure_start = 0.0
        for r in requests[:num_warmup]:
            r.warmup = True

    def run(self):
        """The SimPy process: the warm-up phase, then the measured phase."""
        warm, measured = self.requests[:self.num_warmup], self.requests[self.num_warmup:]
        if warm:
            self._warmup_done = self.env.event()
            yield from self._send(warm)
            yield self._warmup_done
            if self.on_measure_start is not None:
                self.on_measure_start()
        self.measure_start = self.env.now
        yield from self._send(measured)

    def _send(self, batch: list[Request]):
        env = self.env
        start = env.now
        first = batch[0].arrival_time if batch else 0.0
        for r in batch:
            earliest = start + (r.arrival_time - first)
            if earliest > env.now:
                yield env.timeout(earliest - env.now)
            while self.in_flight >= self.concurrency:
                self._slot = env.event()
                yield self._slot
            self.in_flight += 1
            r.arrival_time = env.now
            self.arrive(r)

    def completed(self, request: Request) -> None:
        """A request finished or was rejected: free its slot (after the think time)."""
        if request.warmup:
            self._pending_warmup -= 1
            if self._pending_warmup == 0 and self._warmup_done is not None:
                self._warmup_done.succeed()
        if self.think_time_s > 0:
            self.env.process(self._release_later())
        else:
            self._release()

    def _release_later(self):
        yield self.env.timeout(self.think_time_s)
        self._release()

    def _release(self) -> None:
        self.in_flight -= 1
        slot = self._slot
        if slot is not None and not slot.triggered:
            slot.succeed()
