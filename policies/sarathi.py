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

from lab.core.kv_cache import unique_content
from lab.core.request import Request, RequestStatus
from lab.core.sched_api import EngineView, SchedulerBase, SchedulerConfig, SchedulerOutput
from policies.common import (allocate_or_preempt, allocate_waiting, is_running, lookup, next_waiting,
                             resolve_victim_rule, take_waiting)

_RUNNING = RequestStatus.RUNNING


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

    def head_stays_blocked(self, engine: EngineView, head: Request, num_running: int, num_scheduled_tokens: int,
                           num_free_blocks: int) -> bool:
        """Pass 3's decision on ``head`` for a schedule whose pass 1 only decoded (see
        :meth:`SchedulerBase.head_stays_blocked`): blocked by ``max_num_seqs``, by no budget left after the
        decodes, or by KV (blocks for its whole prompt, ``KVCacheManager.blocks_to_admit``, above the free blocks
        less the watermark). False (cannot tell) for a swapped-out head, prefix hits that may change, or a
        subclass with a schedule of its own (this rule describes this class's :meth:`schedule`)."""
        if type(self).schedule is not SarathiScheduler.schedule:
            return False
        if num_running >= engine.config.max_num_seqs:
            return True
        if self.options.chunk_size - num_scheduled_tokens <= 0:
            return True
        if head.num_computed_tokens:
            return False
        need = engine.kv.blocks_to_admit(head, head.num_tokens)
        if need is None:
            return False
        return need > num_free_blocks - int(self.options.watermark * engine.kv.pool.num_gpu_blocks)

    def admits_whole(self, engine: EngineView, request: Request, num_running: int, num_scheduled_tokens: int,
                     num_free_blocks: int, num_waiting: int = 1) -> bool:
        """Pass 3's decision on the waiting head ``request`` for a schedule whose passes 1-2 scheduled
        ``num_scheduled_tokens`` tokens (see :meth:`SchedulerBase.admits_whole`): admitted whole when a
        ``max_num_seqs`` slot is free, its prompt fits the budget left and its blocks the free blocks less the
        watermark; False (cannot tell) for a request holding computed state, prefix hits that may change, or a
        subclass with a schedule of its own."""
        n = self._admission(engine, request, num_running, num_scheduled_tokens, num_free_blocks)
        return n is not None and n == request.num_tokens

    def admits_chunk(self, engine: EngineView, request: Request, num_running: int, num_scheduled_tokens: int,
                     num_free_blocks: int, num_waiting: int) -> tuple[int, int] | None:
        """Pass 3's first chunk for the waiting head ``request`` when its prompt does not fit the budget left (see
        :meth:`SchedulerBase.admits_chunk`): the budget left, its admission reserving the blocks of its whole
        prompt."""
        n = self._admission(engine, request, num_running, num_scheduled_tokens, num_free_blocks)
        return (n, request.num_tokens) if n is not None and n < request.num_tokens else None

    def _admission(self, engine: EngineView, request: Request, num_running: int, num_scheduled_tokens: int,
                   num_free_blocks: int) -> int | None:
        """The tokens pass 3 computes for ``request`` when it admits it (blocks for its whole prompt, no prefix
        hit), or None when it would not or the answer depends on hits."""
        if type(self).schedule is not SarathiScheduler.schedule:
            return None
        kv = engine.kv
        budget = self.options.chunk_size - num_scheduled_tokens
        if num_running >= engine.config.max_num_seqs or budget <= 0 or request.num_computed_tokens:
            return None
        if kv.enable_prefix_caching and (not unique_content(request) or request.prev_blocks is not None):
            return None
        need = kv.blocks_to_admit(request, request.num_tokens)
        if need is None or need > num_free_blocks - int(self.options.watermark * kv.pool.num_gpu_blocks):
            return None
        return min(request.num_tokens, budget)

    def running_chunk(self, engine: EngineView, request: Request, num_computed_tokens: int,
                      num_scheduled_tokens: int) -> int | None:
        """Pass 2's chunk for ``request``, part-way through its prompt (see :meth:`SchedulerBase.running_chunk`):
        what is left of it, cut to the budget left and the model length (its blocks were reserved at admission);
        None when the budget is spent."""
        if type(self).schedule is not SarathiScheduler.schedule:
            return None
        budget = self.options.chunk_size - num_scheduled_tokens
        n = min(request.num_tokens - num_computed_tokens, budget,
                engine.config.max_model_len - 1 - num_computed_tokens)
        return n if n > 0 else None

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
            n = min(r.num_tokens - r.num_computed_tokens, budget, cfg.max_model_len - 1 - r.num_computed_tokens)
            if n <= 0:
                continue
            ok, refunded = allocate_or_preempt(engine, out, r, n, rule,
                                               r.num_tokens - r.num_computed_tokens - n)
            budget += refunded
            if ok:
                out.add(r, n)
                budget -= n
        # Pass 3: admit waiting requests (Sarathi admits even in a step that preempted).
        watermark_blocks = int(self.options.watermark * kv.pool.num_gpu_blocks)
        while budget > 0 and len(engine.running) < cfg.max_num_seqs:
            r = next_waiting(engine)
            if r is None:
                break
            hits, num_hit = lookup(engine, r)
            remaining = r.num_tokens - num_hit
            n = min(remaining, budget)
            if not allocate_waiting(engine, r, n, hits, num_hit, num_reserved_tokens=remaining - n,
                                    reserved_blocks=watermark_blocks):
                out.waiting_blocked = True  # by KV: it needs its whole prompt's blocks, whatever the budget
                break
            take_waiting(engine, r)
            engine.admit(r, num_hit)
            out.add(r, n)
            budget -= n
        else:
            out.waiting_blocked = budget > 0  # stopped by max_num_seqs
        return out
