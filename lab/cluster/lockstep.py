"""Attention data-parallel ranks that step in lock-step (DP attention with expert parallelism).

With expert parallelism the MoE all-to-all joins every DP rank of a deployment in every layer, so vLLM runs the
ranks' forward passes together (vllm/v1/engine/core.py ``DPEngineCoreProc``): a rank with nothing scheduled runs a
dummy batch (``execute_dummy_batch``), and, with CUDA graphs, every rank pads its batch to the largest token count
across the DP group (``num_tokens_across_dp``, then CUDA-graph padding; vllm/v1/worker/gpu_model_runner.py
``get_dp_padding`` / dp_utils.py ``coordinate_batch_across_dp``); in eager mode (``enforce_eager``) vLLM does not pad
and the ranks' counts stay uneven. A step of the group therefore lasts as long as its slowest rank's.

:class:`LockStepGroup` drives the ranks (instances built with ``start=False``) as one SimPy process: each rank
schedules, the per-rank token counts set every rank's padded size and ``BatchShape.group_tokens`` (the counts the
MoE collectives see, :func:`tokens_across_dp`), each rank's step is priced (an idle rank's dummy batch too,
:func:`dummy_batch`: its compute on its padded token count and its full share of the collectives), the group waits
for the longest, then every rank applies its outputs at the same instant. Ranks keep
their own schedulers, KV caches and waiting queues; the router still picks a rank for every arrival. Lock-stepped
ranks do not fast-forward.

Async scheduling (the ranks' ``async_scheduling``, vLLM's default from 0.19): each DP rank's engine core runs
``step_with_batch_queue`` inside the DP busy loop (``DPEngineCoreProc.run_busy_loop`` calls the same
``_process_engine_step``), so every rank schedules step s + 1 while step s runs, and with async scheduling vLLM
exchanges the ranks' token counts over the CPU (``disable_nccl_for_dp_synchronization``, vllm/config/vllm.py) while
preparing the step's inputs. The group therefore keeps two steps in flight: the next group step is scheduled on
every rank as soon as the previous one is submitted, and it starts when the step before it has ended and every
rank's CPU work for it is done (each rank's ``price_step`` sets its ``not_before``), so per-step CPU time shows only
where the slowest rank's CPU work is longer than the step it overlaps. With sync scheduling (vLLM 0.11, or
``engine.async_scheduling: false``) one step is in flight and the CPU time of the slowest rank is added to the
step, as before.
"""

from __future__ import annotations

import simpy

from collections import deque

from lab.core.batch import BatchShape, padded_size
from lab.core.step import ScheduledStep
from lab.engine.instance import Instance
from lab.engine.window import delay_until


def tokens_across_dp(tokens: tuple[int, ...], cudagraph_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Every rank's token count as the MoE collectives see it (vLLM's ``num_tokens_across_dp``), rank order.

    Args:
        tokens: tokens each rank scheduled this step (0: the rank is idle and runs a dummy batch).
        cudagraph_sizes: the ranks' CUDA-graph capture sizes, () in eager mode.

    With CUDA graphs every rank runs the group's largest count padded to its graph size (the largest count itself
    above the largest graph); in eager mode each rank runs its own count and an idle rank one token (vLLM pads
    across DP only when it replays graphs; ``_dummy_run(1)``).
    """
    top = max(tokens)
    if cudagraph_sizes:
        pad = padded_size(cudagraph_sizes, top) or top
        return (pad,) * len(tokens)
    return tuple(t if t > 0 else 1 for t in tokens)


def dummy_batch(tokens: int, group_tokens: tuple[int, ...]) -> BatchShape:
    """The batch an idle rank runs so that the group's collectives have all their members (vLLM
    ``execute_dummy_batch``): one decode position with an empty KV cache, its token-parallel layers and its share of
    the MoE dispatch/combine at ``tokens`` (its entry of ``num_tokens_across_dp``), ``group_tokens`` the group's."""
    return BatchShape(1, 1, [], [], [0], 1, 0, 0, 0, tokens if tokens > 1 else 0, [], [], group_tokens)


class LockStepGroup:
    """DP ranks of one deployment advancing together.

    Args:
        env: the SimPy environment.
        ranks: the rank instances, rank order, each built with ``start=False`` and with the same CUDA-graph sizes.

    Raises:
        ValueError: no ranks, a rank already running its own loop, or ranks with different CUDA-graph sizes.

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
        if len({r.options.cudagraph_sizes for r in ranks}) > 1:
            raise ValueError("the ranks of a lock-step group must share one cudagraph_capture_sizes list (vLLM pads "
                             "every DP rank to the same graph size)")
        if len({r.async_scheduling for r in ranks}) > 1:
            raise ValueError("the ranks of a lock-step group must all schedule asynchronously or all synchronously")
        self.env = env
        self.ranks = ranks
        self.num_steps = 0
        self.num_dummy_steps = [0] * len(ranks)
        self.depth = 2 if ranks[0].async_scheduling else 1  # group steps in flight (vLLM's batch queue)
        self.gpu_free = 0.0  # when the group's last submitted step ends
        self.process = env.process(self._loop())

    @property
    def now(self) -> float:
        return max(r.now for r in self.ranks)

    def _idle(self) -> bool:
        """No rank holds a request in any state: running, waiting, holding or waiting for remote KV."""
        return all(not (r.running or r.waiting or r.kv_holding or r.remote_pending) for r in self.ranks)

    def _sleep(self):
        """Wait until an arrival, a hand-off or a completed KV read wakes any rank (a SimPy event)."""
        wakeup = self.env.event()
        for r in self.ranks:
            r.wakeup_event = wakeup
        return wakeup

    def _loop(self):
        env = self.env
        ranks = self.ranks
        in_flight: deque[tuple[float, list[ScheduledStep | None]]] = deque()
        while True:
            if not in_flight and self._idle():
                yield self._sleep()
                continue
            while len(in_flight) < self.depth:
                steps = [r.schedule_step() for r in ranks]
                if all(s is None for s in steps):
                    break
                self._submit(steps, in_flight)
            if not in_flight:
                if all(r.waits_for_events() for r in ranks):  # e.g. a decode rank's remote KV reads under way
                    yield self._sleep()
                    continue
                if any([r.skip_to_eligible_step() for r in ranks]):  # async PP: every rank's counter, no short cut
                    continue
                self._reject_unservable()
                continue
            end, steps = in_flight.popleft()
            yield env.timeout(delay_until(env.now, end))
            self.num_steps += 1
            for i, (rank, step) in enumerate(zip(ranks, steps)):
                if step is None:
                    self.num_dummy_steps[i] += 1
                    rank.clock = end if end > rank.clock else rank.clock
                    continue
                rank.window.steps.popleft()
                rank.finish_step(step)

    def _submit(self, steps: list[ScheduledStep | None], in_flight: deque) -> None:
        """Price a group step and place it after the one before it: it starts once that step has ended and every
        rank's CPU work for it is done (``not_before``), and ends with its slowest rank."""
        dt = self._price(steps)
        start = self.now
        if self.gpu_free > start:
            start = self.gpu_free
        for step in steps:
            if step is not None and step.not_before > start:
                start = step.not_before
        end = start + dt
        self.gpu_free = end
        for rank, step in zip(self.ranks, steps):
            if step is not None:
                step.start, step.end = start, end
                rank.window.steps.append(step)  # the rank sees its step in flight (outputs dropped on preemption)
        in_flight.append((end, steps))

    def _price(self, steps: list[ScheduledStep | None]) -> float:
        """Pad every rank as vLLM does (:func:`tokens_across_dp`), price each rank's step with the group's counts
        in ``BatchShape.group_tokens`` (an idle rank's :func:`dummy_batch` too) and return the group's step time:
        the slowest rank's (seconds)."""
        tokens = tuple(s.shape.num_tokens if s is not None else 0 for s in steps)
        across = tokens_across_dp(tokens, self.ranks[0].options.cudagraph_sizes)
        times = []
        for rank, step, n in zip(self.ranks, steps, across):
            if step is None:
                times.append(rank.cost_model.step_time(dummy_batch(n, across)))
                continue
            step.shape.group_tokens = across
            if n > step.shape.num_tokens:
                step.shape.padded_tokens = n
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
            if not r.waits_for_events():
                r.resolve_stall()
