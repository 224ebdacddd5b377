"""Orca: iteration-level scheduling with whole prefills (Yu et al., "Orca: A Distributed Serving System for
Transformer-Based Generative Models", OSDI'22, §4.2 and Algorithm 1; also microsoft/sarathi-serve
``sarathi/core/scheduler/orca_scheduler.py``).

Every step runs every running request (a decode token each) plus the waiting requests admitted in arrival order;
an admitted request's prompt is computed whole in its first step — Orca never chunks. Orca's Algorithm 1 admits a
request only if KV slots for its prompt and its ``max_tokens`` can be reserved, so a running request never runs
out of KV and nothing is ever preempted (``reserve: max_tokens``; in a replay ``max_tokens`` is the trace's output
length, the best case for Orca). Sarathi-Serve's reimplementation reserves ``max_model_len`` per request
(``reserve: max_model_len``); ``reserve: none`` allocates as the sequence grows and preempts by the victim rule
(close to vLLM V0 without chunked prefill).

Orca has no token budget: a step is limited by ``max_num_seqs`` and KV only (``max_tokens_per_step`` adds a cap;
a prompt longer than the cap runs alone).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lab.core.sched_api import EngineView, SchedulerBase, SchedulerConfig, SchedulerOutput
from policies.common import admit_whole_prompts, allocate_or_preempt, is_running, resolve_victim_rule


class OrcaScheduler(SchedulerBase):
    """Orca iteration-level batching: whole prefills, KV reserved for the whole sequence at admission."""

    def max_step_tokens(self, config: SchedulerConfig) -> int | None:
        """No engine-side cap: Orca has no token budget (a prompt longer than ``max_tokens_per_step`` runs alone)."""
        return None

    name = "orca"
    admits_kv_holding = True  # requests holding remote KV first (policies/common.py next_waiting)

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        reserve: Literal["max_tokens", "max_model_len", "none"] = Field(
            "max_tokens", description="KV reserved at admission: prompt + max_tokens (Orca Alg. 1), "
                                      "max_model_len (Sarathi-Serve's Orca) or none (grow and preempt)")
        max_tokens_per_step: int | None = Field(None, ge=1, description="cap on tokens of one step (None = no cap)")

    def __init__(self, options: "OrcaScheduler.Options | None" = None) -> None:
        self.options = options or self.Options()

    def _reservation(self, engine: EngineView, r) -> int:
        reserve = self.options.reserve
        if reserve == "max_tokens":  # KV for prompt + max_tokens - 1 (the last token is never fed back)
            return max(0, r.max_tokens - r.num_output_tokens - 1)
        if reserve == "max_model_len":
            return max(0, engine.config.max_model_len - r.num_tokens)
        return 0

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        cfg = engine.config
        out = SchedulerOutput()
        rule = resolve_victim_rule(engine)
        tokens = 0
        for r in list(engine.running):
            if not is_running(r):
                continue
            n = min(r.num_tokens - r.num_computed_tokens, cfg.max_model_len - 1 - r.num_computed_tokens)
            if n <= 0:
                continue
            ok, _ = allocate_or_preempt(engine, out, r, n, rule)
            if ok:
                out.add(r, n)
                tokens += n
        if out.preempted:
            return out
        admit_whole_prompts(engine, out, tokens, self.options.max_tokens_per_step, lambda r: self._reservation(engine, r))
        return out
