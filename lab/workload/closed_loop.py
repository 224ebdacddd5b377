"""Closed-loop clients: at most N requests in flight, the next sent when one completes (plus a think time), as
``vllm bench serve --max-concurrency N`` drives a server (a semaphore of N around the sends).

Each request's planned arrival time (from the trace or the generator's rate) is the earliest it may be sent,
measured from the start of its phase; it is sent at the first moment after that when fewer than N requests are in
flight, and its ``arrival_time`` becomes that send time, so TTFT is measured from the client's send. A completed
request (finished or rejected) frees its slot ``think_time_s`` after the client has received its last token (the
engine's finish plus the front-end's streaming time, lab/cluster/frontend.py; with a front-end, ``arrival_time`` is
then the engine's queue entry and ``sent_time`` the send). The first ``num_warmup`` requests given form a
warm-up phase: they are sent the same way, the measured phase starts when the last of them has completed, and they
are marked ``warmup`` and left out of the metrics. The simulation makes them as ``vllm bench serve --num-warmups``
does (:func:`warmup_copies`: extra copies of the first request, run before the benchmark's clock starts).
"""

from __future__ import annotations

from typing import Callable

import simpy

from lab.cluster.frontend import received_time
from lab.core.request import Request
from lab.engine.window import delay_until


def warmup_copies(first: Request, num_warmup: int, start_index: int) -> list[Request]:
    """The warm-up requests of a closed-loop run, as ``vllm bench serve --num-warmups N`` sends them
    (vllm/benchmarks/serve.py): N extra copies of the first request (same prompt and output lengths, same token ids,
    so the first measured request may hit their prefix), all ready at the start, run through the same concurrency
    limit before the benchmark's clock starts; the measured requests are all the others.

    Args:
        first: the run's first request (its planned arrival time is the warm-up's).
        num_warmup: N (>= 1).
        start_index: index of the first copy; copies take ``start_index .. start_index + N - 1`` (pass the number
            of requests, so indices stay unique and non-negative).

    Returns:
        N requests with ids ``warmup-0`` .. ``warmup-{N-1}``; each accepts drafts at the first request's own rate
        (``acceptance_rate``: speculative decoding with ``per_request`` acceptance, set on the workload before the
        copies are made), as the same text would.
    """
    copies = [Request(start_index + k, first.arrival_time, first.prompt_len, first.max_tokens, first.priority,
                      request_id=f"warmup-{k}", prompt_token_ids=first.prompt_token_ids,
                      output_token_ids=first.output_token_ids, hash_ids=first.hash_ids,
                      hash_block_size=first.hash_block_size, session_id=first.session_id)
              for k in range(num_warmup)]
    for c in copies:
        c.acceptance_rate = first.acceptance_rate
    return copies


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
        self._free_at = 0.0  # exact time (seconds) of the latest slot release: a completion's own time (+ think)
        self._warmup_end = 0.0
        for r in requests[:num_warmup]:
            r.warmup = True

    def run(self):
        """The SimPy process: the warm-up phase, then the measured phase."""
        warm, measured = self.requests[:self.num_warmup], self.requests[self.num_warmup:]
        start = self.env.now
        if warm:
            self._warmup_done = self.env.event()
            yield from self._send(warm, start)
            yield self._warmup_done
            start = self._warmup_end
            if self.on_measure_start is not None:
                self.on_measure_start()
        self.measure_start = start
        yield from self._send(measured, start)

    def _send(self, batch: list[Request], start: float):
        """Send ``batch`` from the exact time ``start``; every send time is exact (a planned time or a release
        time), never SimPy's clock, which can lag a timeout's target by one ulp (lab/engine/window.py)."""
        env = self.env
        first = batch[0].arrival_time if batch else 0.0
        clock = start  # the sender's own exact time: a planned send time or the release that unblocked it
        for r in batch:
            planned = start + (r.arrival_time - first)
            if planned > clock:
                if planned > env.now:
                    yield env.timeout(delay_until(env.now, planned))
                clock = planned
            while self.in_flight >= self.concurrency:
                self._slot = env.event()
                yield self._slot
                clock = max(clock, self._free_at)
            self.in_flight += 1
            r.arrival_time = clock
            self.arrive(r)

    def completed(self, request: Request) -> None:
        """A request finished or was rejected: free its slot (after the think time), at the exact time the client
        received its last token (or its rejection)."""
        fin = request.finish_time
        done = received_time(request, fin) if fin is not None else max(self.env.now, request.arrival_time)
        if request.warmup:
            self._pending_warmup -= 1
            self._warmup_end = max(self._warmup_end, done)
            if self._pending_warmup == 0 and self._warmup_done is not None:
                self._warmup_done.succeed()
        if self.think_time_s > 0 or (fin is not None and request.stream_s > 0):
            self.env.process(self._release_later(done + self.think_time_s))
        else:
            self._release(done)

    def _release_later(self, at: float):
        yield self.env.timeout(delay_until(self.env.now, at))
        self._release(at)

    def _release(self, at: float) -> None:
        self._free_at = max(self._free_at, at)
        self.in_flight -= 1
        slot = self._slot
        if slot is not None and not slot.triggered:
            slot.succeed()


class SessionClients:
    """Multi-turn conversations: each session sends its first turn at its start time and turn i+1 when turn i's
    answer has come back (its last token received by the client) plus ``think_time_s``; a session whose turn is rejected stops there.

    Args:
        env: the SimPy environment.
        sessions: each session's turns, in order (lab/workload/synthetic.py ``generate_sessions``).
        starts: each session's start time (seconds).
        arrive: hands a request to the deployment.
        think_time_s: seconds between an answer and the next turn (>= 0).

    Raises:
        ValueError: a negative think time, or as many start times as sessions missing.
    """

    def __init__(self, env: simpy.Environment, sessions: list[list[Request]], starts: list[float],
                 arrive: Callable[[Request], None], think_time_s: float = 0.0) -> None:
        if think_time_s < 0:
            raise ValueError(f"workload.think_time_s must be >= 0, got {think_time_s}")
        if len(starts) != len(sessions):
            raise ValueError(f"{len(sessions)} sessions but {len(starts)} start times")
        self.env = env
        self.sessions = sessions
        self.starts = starts
        self.arrive = arrive
        self.think_time_s = think_time_s
        self._waiting: dict[int, simpy.Event] = {}
        self._sent: set[int] = set()

    def mark_unsent(self) -> None:
        """Give every turn never sent (its session had not got there when the run ended) its reason."""
        for convo in self.sessions:
            for r in convo:
                if r.index not in self._sent and not r.reason:
                    r.reason = "not sent: its session had not reached this turn when the run ended"

    def run(self):
        """The SimPy process: one process per session."""
        for convo, start in zip(self.sessions, self.starts):
            if convo:
                self.env.process(self._session(convo, start))
        yield self.env.timeout(0)

    def _session(self, convo: list[Request], start: float):
        env = self.env
        t = start
        for k, r in enumerate(convo):
            if t > env.now:
                yield env.timeout(delay_until(env.now, t))
            r.arrival_time = t
            self._sent.add(r.index)
            done = self._waiting[r.index] = env.event()
            self.arrive(r)
            yield done
            if r.finish_time is None:  # rejected: the conversation stops; its later turns are never sent
                for later in convo[k + 1:]:
                    later.reason = f"not sent: turn {k + 1} of its session was rejected"
                return
            t = received_time(r, r.finish_time) + self.think_time_s

    def completed(self, request: Request) -> None:
        """A turn finished or was rejected: its session may go on."""
        ev = self._waiting.pop(request.index, None)
        if ev is not None:
            ev.succeed()
