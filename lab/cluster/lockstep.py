"""Attention data-parallel ranks that step in lock-step (DP attention with expert parallelism).

With expert parallelism the MoE all-to-all joins every DP rank of a deployment in every layer, so vLLM runs the
ranks' forward passes together (vllm/v1/engine/core.py ``DPEngineCoreProc``): a rank with nothing scheduled runs a
dummy batch (``execute_dummy_batch``), and every rank pads its batch to the largest token count across the DP group
(``num_tokens_across_dp``, then CUDA-graph padding), because the collectives need equal shapes. A step of the group
therefore lasts as long as its slowest rank's.

:class:`LockStepGroup` drives the ranks (instances built with ``start=False``) as one SimPy process: each rank
schedules, the per-rank token counts set every rank's padded size and ``BatchShape.group_tokens``, each rank's step
is priced, the group waits for the longest, then every rank applies its outputs at the same instant. Ranks keep
their own schedulers, KV caches and waiting queues; the router still picks a rank for every arrival. Lock-stepped
ranks schedule synchronously (one step in flight) and do not fast-forward.
"""

from __future__ import annotations

import simpy

from lab.core.batch import BatchShape, padded_size
from lab.core.step import ScheduledStep
from lab.engine.instance import Instance
from lab.engine.window import delay_until


class LockStepGroup:
    """DP ranks of one deployment advancing together.

    Args:
        env: the SimPy environment.
        ranks: the rank instances, rank order, each built with ``start=False``.

    Attributes:
        num_steps: steps the group has taken.
        num_dummy_steps: per rank, steps in which it ran only a dummy batch.
    """

    def __init__(self, env: simpy.Environment, ranks: list[Instance]) -> None:
        if not ranks:
            raise ValueError("a lock-step group needs at least one rank")
        for r in ranks:
            if r.process is not None:
                raise ValueError(f"instance {r.instance_id} already runs its own loop; build it with start=False")
        self.env = env
        self.ranks = ranks
        self.num_steps = 0
        self.num_dummy_steps = [0] * len(ranks)
        self.process = env.process(self._loop())

    @property
    def now(self) -> float:
        return max(r.now for r in self.ranks)

    def _idle(self) -> bool:
        return all(not r.running and not r.waiting for r in self.ranks)

    def _loop(self):
        env = self.env
        ranks = self.ranks
        while True:
            if self._idle():
                wakeup = env.event()
                for r in ranks:
                    r.wakeup_event = wakeup
                yield wakeup
                continue
            steps = [r.schedule_step() for r in ranks]
            if all(s is None for s in steps):
                self._reject_unservable()
                continue
            dt = self._price(steps)
            start = self.now
            end = start + dt
            yield env.timeout(delay_until(env.now, end))
            self.num_steps += 1
            for i, (rank, step) in enumerate(zip(ranks, steps)):
                if step is None:
                    self.num_dummy_steps[i] += 1
                    rank.clock = end
                    continue
                step.start, step.end = start, end
                rank.finish_step(step)

    def _price(self, steps: list[ScheduledStep | None]) -> float:
        """Pad every rank to the group's largest token count, price each rank's step (a dummy batch of one token
        for an idle rank) and return the group's step time: the slowest rank's (seconds)."""
        tokens = tuple(s.shape.num_tokens if s is not None else 0 for s in steps)
        top = max(tokens)
        times = []
        for rank, step in zip(self.ranks, steps):
            sizes = rank.options.cudagraph_sizes
            pad = padded_size(sizes, top) or top
            if step is None:
                shape = BatchShape(1, 1, [], [], [0], 1, 0, 0, 0, pad if pad > 1 else 0, [], [], tokens)
                times.append(rank.cost_model.step_time(shape))
                continue
            step.shape.group_tokens = tokens
            if pad > step.shape.num_tokens:
                step.shape.padded_tokens = pad
            rank.price_step(step)
            times.append(step.dt)
        dt = max(times)
        for step in steps:
            if step is not None:
                step.stage_times = [dt]
        return dt

    def _reject_unservable(self) -> None:
        """Nothing was scheduled on any rank: each rank with requests resolves its stall as a single instance does
        (``Instance.resolve_stall``)."""
        for r in self.ranks:
            if r.running or r.waiting:
                r.resolve_stall()
