"""The in-flight window of an instance: how many scheduled steps (micro-batches) it holds, and when each runs.

vLLM's engine core keeps a batch queue of ``max_concurrent_batches`` scheduled steps (vllm/v1/engine/core.py
``step_with_batch_queue``; the depth from vllm/config/vllm.py): while the queue is not full and the scheduler
yields tokens it schedules and submits without blocking, otherwise it blocks on the oldest step and applies its
output (shared/specs/vllm-v1-scheduling.md §4). Each submitted micro-batch passes the ``pp`` pipeline stages one
after another; a stage works on one micro-batch at a time, in submission order, so a micro-batch's stage ``i``
starts when both its stage ``i - 1`` has ended and stage ``i`` has finished the micro-batch before it. Because the
order is fixed at submission, a micro-batch's start and end are known the moment it is submitted.
"""

from __future__ import annotations

import math
from collections import deque

from lab.core.step import ScheduledStep


def max_concurrent_batches(pipeline_parallel_size: int, async_scheduling: bool) -> int:
    """vLLM's batch-queue depth: 1 (sync, no PP), 2 (async, no PP), ``pp`` (sync PP) or ``pp + 1`` (async PP on
    the V2 model runner, the 0.33 default where supported).

    Raises:
        ValueError: ``pipeline_parallel_size`` < 1.
    """
    if pipeline_parallel_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pipeline_parallel_size}")
    if pipeline_parallel_size == 1:
        return 2 if async_scheduling else 1
    return pipeline_parallel_size + 1 if async_scheduling else pipeline_parallel_size


def delay_until(now: float, t: float) -> float:
    """The largest delay d >= 0 with ``now + d <= t`` in floating point: a SimPy timeout of d fires at ``t`` or, where
    no delay reaches ``t`` exactly (``now + d`` rounds past some floats), one ulp before it. SimPy's public API
    schedules only relative to ``now``; the engine therefore keeps each step boundary's exact time itself
    (``Instance.clock``), so results never depend on that ulp. ``t <= now`` gives 0."""
    if t <= now:
        return 0.0
    f = t
    for _ in range(4):  # the fire time: t itself, or the float just below it when now + d cannot reach t
        d = f - now
        if now + d == f:
            return d
        f = math.nextafter(f, -math.inf)
    d = t - now
    while d > 0 and now + d > t:
        d = math.nextafter(d, -math.inf)
    return d


class InFlightWindow:
    """Scheduled steps of one instance not yet applied, oldest first, with the pipeline's stage clocks.

    Args:
        depth: ``max_concurrent_batches``.
        num_stages: pipeline stages (``pipeline_parallel_size``).
    """

    __slots__ = ("depth", "steps", "stage_free", "num_submitted")

    def __init__(self, depth: int, num_stages: int = 1) -> None:
        if depth < 1 or num_stages < 1:
            raise ValueError(f"in-flight window: depth ({depth}) and stages ({num_stages}) must be >= 1")
        self.depth = depth
        self.steps: deque[ScheduledStep] = deque()
        self.stage_free = [0.0] * num_stages  # when each stage finishes the last micro-batch submitted to it
        self.num_submitted = 0

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.depth

    def submit(self, step: ScheduledStep, now: float) -> None:
        """Place ``step`` (submitted at ``now``) on the pipeline: set its ``start`` (first stage) and ``end`` (last
        stage) and append it. Stages run micro-batches in submission order; the first stage starts no earlier than
        ``step.not_before`` (the tokens it consumes must have left the last stage)."""
        free = self.stage_free
        t = now if now >= step.not_before else step.not_before
        for i, dt in enumerate(step.stage_times):
            begin = t if t >= free[i] else free[i]
            if i == 0:
                step.start = begin
            t = begin + dt
            free[i] = t
        step.end = t
        self.steps.append(step)
        self.num_submitted += 1

    def resume(self, step: ScheduledStep, start: float) -> None:
        """Append a step that is already executing since ``start`` (a fast-forward jump cut short, or the step a
        jump leaves in flight), one stage only."""
        step.start = start
        step.end = start + step.stage_times[0]
        self.stage_free[0] = step.end
        self.steps.append(step)

    def pop_oldest(self) -> ScheduledStep:
        return self.steps.popleft()

    @property
    def oldest(self) -> ScheduledStep:
        return self.steps[0]
