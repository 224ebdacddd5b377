"""Shortest prompt first: a user scheduler in one file (docs/policies.md walks through it)."""
from itertools import islice
from pydantic import BaseModel, ConfigDict, Field

from lab.core.sched_api import EngineView, SchedulerBase, SchedulerOutput
from policies.common import allocate_or_preempt, allocate_waiting, is_running, lookup, take_waiting


class ShortestPromptFirst(SchedulerBase):
    """Serve running requests first, then admit waiting requests shortest prompt first (chunked)."""
    admits_kv_holding = True  # on a PD decode instance, requests whose KV arrived (engine.kv_holding) come first

    class Options(BaseModel):  # policy.options; unknown keys are errors
        model_config = ConfigDict(extra="forbid")
        lookahead: int = Field(64, ge=1, description="waiting requests considered per step")

    def __init__(self, options: "ShortestPromptFirst.Options") -> None:
        self.options = options

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = engine.config.max_num_batched_tokens
        for r in list(engine.running):  # 1. running requests, in admission order
            if not is_running(r):  # preempted a moment ago
                continue
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if n > 0:
                ok, refunded = allocate_or_preempt(engine, out, r, n, rule="last")
                budget += refunded
                if ok:
                    out.add(r, n)
                    budget -= n
        if out.preempted:
            return out  # no admission in a step that preempted
        shortest = sorted(islice(engine.waiting, self.options.lookahead), key=lambda r: (r.prompt_len, r.arrival_time))
        for r in list(engine.kv_holding) + shortest:  # 2. KV arrived first, then shortest prompt first
            if len(engine.running) >= engine.config.max_num_seqs:
                break
            hits, num_computed = lookup(engine, r)  # prefix-cache hits (or swapped-out state)
            n = min(r.num_tokens - num_computed, budget)  # a long prompt continues in phase 1
            if n <= 0:
                break
            if not allocate_waiting(engine, r, n, hits, num_computed):
                break
            take_waiting(engine, r)  # out of kv_holding or the waiting queue
            engine.admit(r, num_computed)
            out.add(r, n)
            budget -= n
        return out
