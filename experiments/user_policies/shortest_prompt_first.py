"""Shortest prompt first: a user scheduler in one file (docs/policies.md walks through it)."""
from itertools import islice

from pydantic import BaseModel, ConfigDict, Field

from lab.core.sched_api import EngineView, SchedulerBase, SchedulerOutput
from policies.common import allocate_or_preempt, allocate_waiting, is_running, lookup


class ShortestPromptFirst(SchedulerBase):
    """Serve running requests first, then admit waiting requests shortest prompt first (chunked)."""

    class Options(BaseModel):  # policy.options; unknown keys are errors
        model_config = ConfigDict(extra="forbid")
        lookahead: int = Field(64, ge=1, description="waiting requests considered per step")

    def __init__(self, options: "ShortestPromptFirst.Options") -> None:
        self.options = options

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = engine.config.max_num_batched_tokens
        for r in list(engine.running):  # 1. running requests, in admission order
            if not is_running(r):
                continue  # preempted a moment ago
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if n > 0:
                ok, refunded = allocate_or_preempt(engine, out, r, n, rule="last")
                budget += refunded
                if ok:
                    out.add(r, n)
                    budget -= n
        if out.preempted:
            return out
        candidates = list(islice(engine.waiting, self.options.lookahead))  # 2. shortest prompt first
        for r in sorted(candidates, key=lambda r: (r.prompt_len, r.arrival_time)):
            if len(engine.running) >= engine.config.max_num_seqs:
                break
            hits, num_computed = lookup(engine, r)  # prefix-cache hits (or swapped-out state)
            n = min(r.num_tokens - num_computed, budget)  # a long prompt continues in phase 1
            if n <= 0:
                break
            if not allocate_waiting(engine, r, n, hits, num_computed):
                break
            engine.waiting.remove(r)
            engine.admit(r, num_computed)
            out.add(r, n)
            budget -= n
        return out
