"""A scheduled step: what one call to a scheduler put into one micro-batch, priced and placed in time."""

from __future__ import annotations

from lab.core.batch import BatchShape
from lab.core.request import Request


class ScheduledStep:
    """One engine step (one micro-batch under pipeline parallelism) from its schedule to its outputs.

    Attributes:
        requests: the requests it runs, batch order.
        num_new_tokens: tokens each computes (same order; drafts included).
        samples: whether each samples at least one token at the end of the step (its C reached ``num_tokens``).
        num_spec_tokens: per request, the draft tokens scheduled with it (speculative decoding), or None when the
            step has no drafts at all.
        shape: the batch shape given to the cost model.
        stage_times: seconds each pipeline stage spends on it (one entry without pipeline parallelism); CPU and
            swap-transfer time are included in the first stage.
        scheduled_at: when it was scheduled (seconds).
        start, end: when its first stage starts and its last stage ends (seconds; set by the in-flight window).
        used_blocks: KV blocks in use right after it was scheduled.
        num_preempted: requests preempted while building it.
        transfer_s: host-link seconds (swap preemption) included in it.
        padded_drafts: requests whose drafts are placeholders that are never accepted (vLLM 0.33 pads newly
            admitted one-token requests to 1 + k), or None.
        not_before: earliest time its first stage may start (seconds): under async pipeline parallelism, when the
            tokens its decodes consume leave the last stage.
    """

    __slots__ = ("requests", "num_new_tokens", "samples", "num_spec_tokens", "shape", "stage_times", "scheduled_at",
                 "start", "end", "used_blocks", "num_preempted", "transfer_s", "not_before",
                 "padded_drafts")

    def __init__(self, requests: list[Request], num_new_tokens: list[int], samples: list[bool], shape: BatchShape,
                 stage_times: list[float], scheduled_at: float, used_blocks: int, num_preempted: int,
                 transfer_s: float = 0.0, num_spec_tokens: list[int] | None = None) -> None:
        self.requests = requests
        self.num_new_tokens = num_new_tokens
        self.samples = samples
        self.num_spec_tokens = num_spec_tokens
        self.shape = shape
        self.stage_times = stage_times
        self.scheduled_at = scheduled_at
        self.start = scheduled_at
        self.end = scheduled_at
        self.used_blocks = used_blocks
        self.num_preempted = num_preempted
        self.transfer_s = transfer_s
        self.not_before = 0.0
        self.padded_drafts: set | None = None

    @property
    def dt(self) -> float:
        """Device time of the step: the sum of its stage times (its duration when nothing else is in flight)."""
        times = self.stage_times
        return times[0] if len(times) == 1 else sum(times)

    @property
    def busy_s(self) -> float:
        """Seconds the pipeline is occupied by it: its longest stage (the whole step without PP)."""
        times = self.stage_times
        return times[0] if len(times) == 1 else max(times)
