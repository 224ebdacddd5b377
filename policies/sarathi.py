"""Sarathi-Serve: stall-free batching with a fixed token budget (Agrawal et al., "Taming Throughput-Latency
Tradeoff in LLM Inference with Sarathi-Serve", OSDI'24; microsoft/sarathi-serve
``sarathi/core/scheduler/sarathi_scheduler.py``).

Each step is built in three passes over a token budget of ``chunk_size`` tokens:

1. every running request that has finished its prefill decodes one token, in admission order — decodes are never
   left out for a prefill (when KV runs out the victim rule preempts, ``last`` by default, as Sarathi's
   ``running.pop(-1)``);
2. running requests with an unfinished prefill get the next chunk, ``min(remaining prompt, budget left)``;
3. waiting requests are admitted in queue order while ``max_num_seqs`` allows and the budget has room; like
   Sarathi's block manager, admission allocates KV for the whole remaining prompt at once (``can_allocate`` with
   a 1 % watermark), so later chunks never need new blocks.

Unlike vLLM V1, the budget is small (Sarathi's default chunk is 512 tokens, chosen from the TBT SLO) and decodes
always go first, so a long prompt is spread over many steps whose time stays close to a decode step's.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from lab.core.request import Request, RequestStatus
from lab.core.sched_api import WAITS, Admission, EngineView, SchedulerBase, SchedulerConfig, SchedulerOutput
from policies.common import (allocate_or_preempt, allocate_waiting, is_running, lookup, next_waiting,
                             resolve_victim_rule, take_waiting)

_RUNNING = RequestStatus.RUNNING


def prefill_chunk(config: SchedulerConfig, request: Request, num_computed: int, budget: int) -> int:
    """Pass 2's chunk for a request part-way through its prompt with ``num_computed`` tokens computed: the rest of
    it, cut to the ``budget`` left and ``max_model_len`` (its blocks were reserved at admission); 0 or less: none."""
    return min(request.num_tokens - num_computed, budget, config.max_model_len - 1 - num_computed)


class SarathiScheduler(SchedulerBase):
    """Sarathi-Serve stall-free batching: decodes first, then prefill chunks up to a fixed token budget."""

    def max_step_tokens(self, config: SchedulerConfig) -> int | None:
        """No engine-side cap: decodes are never skipped for lack of budget, so a step can pass ``chunk_size``."""
        return None

    name = "sarathi"
    admits_kv_holding = True  # requests holding remote KV first (policies/common.py next_waiting)
    # Stateless between steps, and a steady decode batch stays steady: pass 1 schedules every decode (one token,
    # allocate_slots as vLLM), pass 2 has no unfinished prefill, and pass 3's admission stays blocked while the
    # batch only decodes (max_num_seqs or the budget are full, or free blocks only shrink until a completion,
    # where a jump with requests waiting ends). Admission reserves only the prompt's blocks, so a decoding request
    # holds ceil(num_computed_tokens / block_size) blocks, as the jump assumes.
    supports_fast_forward = True

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        chunk_size: int = Field(512, ge=1, description="token budget of one step (decodes included)")
        watermark: float = Field(0.01, ge=0, lt=1, description="fraction of KV blocks kept free at admission")

    def __init__(self, options: "SarathiScheduler.Options | None" = None) -> None:
        self.options = options or self.Options()

    def admission(self, engine: EngineView, request: Request, num_hit_tokens: int | None, num_running: int,
                  num_scheduled_tokens: int, num_requests: int) -> Admission | None:
        """Pass 3's decision on ``request`` (see :meth:`SchedulerBase.admission`): it waits when ``max_num_seqs`` is
        full or the step's ``chunk_size`` is spent; else it computes its uncached tokens up to the budget left,
        its admission reserving the blocks of the rest of its prompt, and leaves the watermark free."""
        budget = self.options.chunk_size - num_scheduled_tokens
        if num_running >= engine.config.max_num_seqs or budget <= 0:
            return WAITS
        remaining = request.num_tokens - (num_hit_tokens or 0)
        n = min(remaining, budget)
        return Admission(n, num_reserved_tokens=remaining - n,
                         reserved_blocks=int(self.options.watermark * engine.kv.pool.num_gpu_blocks))

    def running_tokens(self, engine: EngineView, request: Request, num_computed_tokens: int,
                       num_scheduled_tokens: int) -> int | None:
        """Pass 2's chunk for ``request``, part-way through its prompt (see :meth:`SchedulerBase.running_tokens`):
        :func:`prefill_chunk` after ``num_scheduled_tokens`` tokens."""
        return prefill_chunk(engine.config, request, num_computed_tokens,
                             self.options.chunk_size - num_scheduled_tokens)

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        cfg = engine.config
        kv = engine.kv
        out = SchedulerOutput()
        rule = resolve_victim_rule(engine)
        budget = self.options.chunk_size
        # Pass 1: decodes, never skipped for lack of budget. A status changes only by a preemption in this pass,
        # after which each later request is checked again.
        decodes = []
        prefills = []
        for r in engine.running:
            if r.status is not _RUNNING:
                continue
            if r.num_output_tokens and r.prompt_len + r.num_output_tokens - r.num_computed_tokens == 1:
                decodes.append(r)
            else:
                prefills.append(r)
        out_reqs = out.requests
        out_news = out.num_new_tokens
        ones = [1] * len(decodes)
        done = kv.allocate_running(decodes, ones)  # the common case: every decode fits
        out_reqs += decodes[:done] if done < len(decodes) else decodes
        out_news += ones[:done] if done < len(decodes) else ones
        budget -= done
        for r in decodes[done:]:
            if not is_running(r):
                continue
            ok, refunded = allocate_or_preempt(engine, out, r, 1, rule)
            budget += refunded
            if ok:
                out.add(r, 1)
                budget -= 1
        # Pass 2: unfinished prefills (their blocks were allocated at admission).
        for r in prefills:
            if budget <= 0:
                break
            if not is_running(r):
                continue
            n = prefill_chunk(cfg, r, r.num_computed_tokens, budget)
            if n <= 0:
                continue
            ok, refunded = allocate_or_preempt(engine, out, r, n, rule,
                                               r.num_tokens - r.num_computed_tokens - n)
            budget += refunded
            if ok:
                out.add(r, n)
                budget -= n
        # Pass 3: admit waiting requests (Sarathi admits even in a step that preempted).
        while True:
            r = next_waiting(engine)
            if r is None:
                break
            hits, num_hit = lookup(engine, r)
            adm = self.admission(engine, r, num_hit, len(engine.running), self.options.chunk_size - budget, 0)
            if not adm.num_new_tokens:
                break
            if not allocate_waiting(engine, r, adm.num_new_tokens, hits, num_hit,
                                    num_reserved_tokens=adm.num_reserved_tokens, reserved_blocks=adm.reserved_blocks):
                out.waiting_blocked = True  # by KV: it needs its whole prompt's blocks, whatever the budget
                return out
            take_waiting(engine, r)
            engine.admit(r, num_hit)
            out.add(r, adm.num_new_tokens)
            budget -= adm.num_new_tokens
        out.waiting_blocked = budget > 0 and len(engine.running) >= cfg.max_num_seqs  # stopped by max_num_seqs
        return out
