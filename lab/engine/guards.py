"""An instance's progress guards: bounded steps without progress end the run with a diagnosis naming the mechanism,
so that no input can livelock the simulator (a preemption cycle, a policy that stalls its requests).

- No request finishes for ``max(1,000,000, 4 x max_model_len)`` steps.
- No token is emitted for :func:`no_output_limit` steps (each preemption dropping the work of a request that never
  gets to emit); the message names the request preempted most often since the last token.
- :data:`MAX_STALLED_SCHEDULES` schedules in a row preempt and schedule nothing.
"""

from __future__ import annotations

from typing import Callable

from lab.core.request import Request
from lab.core.sched_api import SchedulerConfig

# Schedules in a row that only preempt (nothing scheduled) before the run is stopped.
MAX_STALLED_SCHEDULES = 1000


def no_output_limit(config: SchedulerConfig) -> int:
    """Engine steps in a row without an emitted token after which an instance reports a livelock.

    A step emits no token only while every request it computes is in a non-final prefill chunk (or the tokens it
    sampled are dropped by a preemption). Without livelock that lasts at most as long as prefilling
    ``max_num_seqs`` prompts of ``max_model_len`` tokens in chunks of the budget (or of
    ``long_prefill_token_threshold`` when smaller): the limit is twice that, and at least 10,000 steps."""
    chunk = config.max_num_batched_tokens
    if 0 < config.long_prefill_token_threshold < chunk:
        chunk = config.long_prefill_token_threshold
    steps_per_prompt = -(-config.max_model_len // max(1, chunk))
    return max(10_000, 2 * config.max_num_seqs * steps_per_prompt)


class ProgressGuards:
    """Counts steps and schedules without progress on one instance.

    Args:
        config: the instance's scheduler limits (they size the limits).
        fail: raises the instance's error with the rule broken (``Instance._contract_error``); never returns.
        state: the instance's state for a message, e.g. ``at 12.000 s: 3 running, 5 waiting, 40 preemptions so far``.
    """

    def __init__(self, config: SchedulerConfig, fail: Callable[[str], None], state: Callable[[], str]) -> None:
        self.fail = fail
        self.state = state
        self.preempted_only = False  # the last schedule preempted and scheduled nothing
        self.stalled_schedules = 0  # schedules in a row that did
        self.steps_since_finish = 0
        self.no_finish_limit = max(1_000_000, 4 * config.max_model_len)
        self.steps_since_output = 0
        self.no_output_limit = no_output_limit(config)
        self.preemptions_by_request: dict[Request, int] = {}  # since the last emitted token

    def preempted(self, request: Request) -> None:
        """``request`` was preempted."""
        counts = self.preemptions_by_request
        counts[request] = counts.get(request, 0) + 1

    def step_applied(self, sampled: int, finished: int) -> None:
        """A step's outputs were applied: ``sampled`` tokens emitted, ``finished`` requests finished.

        Raises:
            SchedulerContractError: (through ``fail``) a limit is passed.
        """
        if finished:
            self.steps_since_finish = 0
        else:
            self.steps_since_finish += 1
            if self.steps_since_finish > self.no_finish_limit:
                self.fail(f"no progress: no request finished in {self.no_finish_limit:,} steps ({self.state()}); "
                          "a preemption livelock?")
        if sampled:
            self.steps_since_output = 0
            if self.preemptions_by_request:
                self.preemptions_by_request.clear()
        else:
            self.steps_since_output += 1
            if self.steps_since_output > self.no_output_limit:
                self._no_output()

    def _no_output(self) -> None:
        counts = self.preemptions_by_request
        worst = max(counts, key=counts.__getitem__) if counts else None
        most = (f"; request {worst.request_id} was preempted {counts[worst]:,} times since the last token"
                if worst is not None else "")
        self.fail(f"no progress: no token emitted in {self.no_output_limit:,} steps ({self.state()}{most}); a "
                  "preemption livelock")

    def stalled(self) -> None:
        """Another schedule in a row preempted and scheduled nothing.

        Raises:
            SchedulerContractError: (through ``fail``) more than :data:`MAX_STALLED_SCHEDULES` in a row.
        """
        self.stalled_schedules += 1
        if self.stalled_schedules > MAX_STALLED_SCHEDULES:
            self.fail(f"no progress: {MAX_STALLED_SCHEDULES} schedules in a row preempted requests and scheduled "
                      "nothing")
