"""vLLM V0's scheduler (``vllm/core/scheduler.py`` ``Scheduler``, vLLM 0.6.x; the concurrent partial prefills of
0.7.0 and later V0 releases, PR #10235), for replaying papers' baselines (Sarathi-Serve's and DistServe's vLLM). It
runs when ``engine.vllm_version`` is ``"0.6"`` and ``policy.scheduler`` is ``vllm_v1`` (or by its own name).

Chunked prefill off (``_schedule_default``; V0's default for a ``max_model_len`` up to 32K):

1. **Prefill first.** Waiting requests are admitted in queue order, each with its whole prompt, while their prompt
   tokens fit the step budget (``max_num_batched_tokens``), ``max_num_seqs`` allows and the prompt's blocks fit
   with V0's block-manager watermark (1 % of the blocks) left free (``BlockSpaceManager.can_allocate``: LATER stops
   admission, head-of-line). A step that admits anything is a **prefill-only step**: the running requests do not
   decode in it.
2. **Priority preemption** (priority queue, ``priority_preemption: v0``; ``_schedule_priority_preemption``, PR
   #5958, 0.6.2): in a step that admitted nothing, while the waiting head has a higher priority (a lower
   ``(priority, arrival_time)``) than the lowest-priority running request and cannot be scheduled (no
   ``max_num_seqs`` slot, or its prompt's blocks do not fit), that running request is preempted (recompute, back to
   the waiting queue); the head is admitted at the next step, which is a prefill step.
3. **Decode.** Every running request computes one token (1 + k with speculative drafts, V0 verifying them by batch
   expansion: lab/costmodel/batch_expansion.py), in running order; a decode that finds no free block preempts the
   last running request (``running_queue.pop()``; recompute, back at the head of the waiting queue) until it fits
   or preempts itself.

Chunked prefill on (``_schedule_chunked_prefill``): decodes first (V0 re-orders its running queue so), then the
unfinished prefills, each the rest of its prompt cut to the budget left, then waiting requests with a first chunk,
each admission allocating its whole prompt's blocks with the watermark left free (V0's ``can_allocate`` counts the
whole prompt) — Sarathi-Serve's stall-free batching, which was built on this scheduler, with a budget of
``max_num_batched_tokens`` (V0's default 512 with chunking). V0 admits even in a step that preempted.

**Concurrent partial prefills** (chunked prefill only; ``max_num_partial_prefills`` > 1, ``PartialPrefillMetadata``):
at most ``max_num_partial_prefills`` prompts are in chunked prefill in one step (unfinished ones continue first, new
ones are admitted while the count allows); a waiting prompt longer than ``long_prefill_token_threshold`` (default 4 %
of ``max_model_len``) is passed over, keeping its place, while ``max_long_partial_prefills`` long prompts are
already prefilling, so shorter ones behind it start (V0's ``leftover_waiting_sequences``: the one place a V0 or V1
vLLM admits past the head); and each prefill's chunk is at most ``max_num_batched_tokens`` divided by the number of
prompts that can prefill this step (``partial_prefill_budget_lookup_list``).

Left out: the swapped queue (a swapped-out request waits in the waiting queue and is admitted as a waiting request
with its KV copied back), beam search, the scheduler delay factor (0 by default), multi-step scheduling, and LoRA.
"""

from __future__ import annotations

from lab.core.request import Request, RequestStatus
from lab.core.sched_api import WAITS, Admission, EngineView, SchedulerBase, SchedulerConfig, SchedulerOutput
from policies.common import (allocate_or_preempt, allocate_waiting, lookup, next_waiting, resolve_victim_rule,
                             schedule_drafts, take_waiting, verify_tokens)

_RUNNING = RequestStatus.RUNNING


def _priority_key(r: Request) -> tuple:
    """V0's ``_get_priority``: (priority, arrival time); arrival order breaks ties between equal instants."""
    return (r.priority, r.arrival_time, r.index)


def is_decoding(r: Request) -> bool:
    """A running request past its prompt (it has sampled a token and has one token left to compute)."""
    return bool(r.num_output_tokens) and r.prompt_len + r.num_output_tokens - r.num_computed_tokens == 1


class VLLMV0Scheduler(SchedulerBase):
    """vLLM V0 (0.6): prefill-only steps without chunked prefill, decodes-first chunked prefill with whole-prompt KV
    allocation, V0's priority preemption and concurrent partial prefills."""

    name = "vllm_v0"
    supports_fast_forward = True  # chunked prefill (Sarathi-like decisions below); off otherwise (fast_forward_allowed)
    supports_speculation = True  # decodes verify 1 + k tokens (V0's spec decode worker, batch-expansion scoring)
    preempts_for_priority = True  # engine.priority_preemption: v0 (_priority_preemption)

    def max_step_tokens(self, config: SchedulerConfig) -> int | None:
        """No engine-side cap: V0's budget counts prompt tokens and decode slots, not the draft tokens a decode
        verifies (lookahead slots)."""
        return None

    def fast_forward_allowed(self, config: SchedulerConfig) -> bool:
        """Only with chunked prefill (a schedule there is decodes, then prompt chunks, as the jump plans them),
        without partial-prefill limits (their chunk budget depends on the queue) and without the priority queue (a
        waiting request may preempt). Without chunked prefill a step that admits is prefill-only, which the jump
        does not plan."""
        return (config.enable_chunked_prefill and config.max_num_partial_prefills == 1
                and config.queue_policy != "priority")

    # ---- decisions ----
    def admission(self, engine: EngineView, request: Request, num_hit_tokens: int | None, num_running: int,
                  num_scheduled_tokens: int, num_requests: int) -> Admission | None:
        """``_schedule_prefills``' decision on ``request``: it waits when ``max_num_seqs`` is full or the budget is
        spent, and, chunked prefill off, when its prompt does not fit the budget left; else it computes its whole
        uncached prompt (chunked prefill off) or the part the budget left takes, its admission allocating the rest
        of its prompt's blocks too (``num_reserved_tokens``) and leaving V0's watermark free."""
        cfg = engine.config
        budget = cfg.max_num_batched_tokens - num_scheduled_tokens
        if num_running >= cfg.max_num_seqs or budget <= 0:
            return WAITS
        remaining = request.num_tokens - (num_hit_tokens or 0)
        watermark = int(cfg.v0_watermark * engine.kv.pool.num_gpu_blocks)
        if not cfg.enable_chunked_prefill:
            if remaining > budget:
                return WAITS if num_hit_tokens is not None else None
            return Admission(remaining, reserved_blocks=watermark)
        n = min(remaining, budget)
        return Admission(n, num_reserved_tokens=remaining - n, reserved_blocks=watermark)

    def running_tokens(self, engine: EngineView, request: Request, num_computed_tokens: int,
                       num_scheduled_tokens: int) -> int | None:
        """An unfinished prefill's next chunk (chunked prefill): the rest of its prompt cut to the budget left and
        ``max_model_len``; None with partial-prefill limits (the chunk then depends on the queue)."""
        cfg = engine.config
        if cfg.max_num_partial_prefills > 1:
            return None
        n = min(request.num_tokens - num_computed_tokens, cfg.max_num_batched_tokens - num_scheduled_tokens,
                cfg.max_model_len - 1 - num_computed_tokens)
        return n if n > 0 else 0

    # ---- one step ----
    def schedule(self, engine: EngineView) -> SchedulerOutput:
        out = SchedulerOutput()
        if engine.config.enable_chunked_prefill:
            self._schedule_chunked(engine, out)
        else:
            self._schedule_default(engine, out)
        return out

    def _schedule_default(self, engine: EngineView, out: SchedulerOutput) -> None:
        cfg = engine.config
        tokens = 0
        while True:  # 1. prefills, whole prompts
            r = next_waiting(engine)
            if r is None:
                break
            hits, num_hit = lookup(engine, r)
            adm = self.admission(engine, r, num_hit, len(engine.running), tokens, 0)
            if adm is None or not adm.num_new_tokens:
                break
            if not allocate_waiting(engine, r, adm.num_new_tokens, hits, num_hit,
                                    reserved_blocks=adm.reserved_blocks):
                break  # AllocStatus.LATER
            take_waiting(engine, r)
            engine.admit(r, num_hit)
            out.add(r, adm.num_new_tokens)
            tokens += adm.num_new_tokens
        if out.requests:
            return  # a prefill step: no decodes in it
        if cfg.queue_policy == "priority" and cfg.priority_preemption == "v0":
            self._priority_preemption(engine, out)
        self._decode(engine, out)

    def _priority_preemption(self, engine: EngineView, out: SchedulerOutput) -> None:
        """``_schedule_priority_preemption``: the waiting head preempts the lowest-priority running requests while
        it ranks above them and cannot be scheduled (no ``max_num_seqs`` slot, or its prompt's blocks with the
        watermark do not fit the free blocks)."""
        if not engine.waiting:
            return
        cfg = engine.config
        kv = engine.kv
        head = engine.waiting.peek()
        watermark = int(cfg.v0_watermark * kv.pool.num_gpu_blocks)
        victims = sorted((r for r in engine.running if r.status is _RUNNING), key=_priority_key)
        while victims and _priority_key(victims[-1]) > _priority_key(head):
            if (len(engine.running) < cfg.max_num_seqs and head.num_tokens <= cfg.max_num_batched_tokens
                    and kv.blocks_for(head.num_tokens) <= kv.num_free_blocks - watermark):
                break
            victim = victims.pop()
            engine.preempt(victim, reason=f"V0 priority preemption: waiting request {head.request_id} (priority "
                                          f"{head.priority}) outranks it and cannot be scheduled")
            out.preempted.append(victim)

    def _decode(self, engine: EngineView, out: SchedulerOutput) -> None:
        """Every running request decodes (1 + its drafts), preempting the last running request when its slots do
        not fit."""
        rule = resolve_victim_rule(engine)
        lookahead = engine.config.num_speculative_tokens  # V0 allocates k lookahead slots for every method
        for r in list(engine.running):
            if r.status is not _RUNNING:
                continue
            n = verify_tokens(engine, r)
            ok, _ = allocate_or_preempt(engine, out, r, n, rule, lookahead)
            if ok:
                out.add(r, n)
                if r.num_spec_tokens:
                    schedule_drafts(out, r, n)

    def _schedule_chunked(self, engine: EngineView, out: SchedulerOutput) -> None:
        cfg = engine.config
        kv = engine.kv
        rule = resolve_victim_rule(engine)
        budget = cfg.max_num_batched_tokens
        decodes = [r for r in engine.running if is_decoding(r)]
        prefills = [r for r in engine.running if not is_decoding(r)]
        ones = [1] * len(decodes)
        done = kv.allocate_running(decodes, ones)  # the common case: every decode fits
        out.requests += decodes[:done]
        out.num_new_tokens += ones[:done]
        budget -= done
        for r in decodes[done:]:
            if r.status is not _RUNNING:
                continue
            ok, refunded = allocate_or_preempt(engine, out, r, 1, rule)
            budget += refunded
            if ok:
                out.add(r, 1)
                budget -= 1
        partial = cfg.max_num_partial_prefills > 1
        threshold = cfg.long_prefill_token_threshold
        running_prefills = [r for r in prefills if r.status is _RUNNING]
        long_now = sum(1 for r in running_prefills if r.num_tokens - r.num_computed_tokens > threshold) if partial else 0
        cap = self._slot_budget(engine, running_prefills, long_now) if partial else budget
        num_prefills = 0
        for r in prefills:  # 2. unfinished prefills (their blocks were allocated at admission)
            if budget <= 0:
                break
            if r.status is not _RUNNING:
                continue
            n = self.running_tokens(engine, r, r.num_computed_tokens, cfg.max_num_batched_tokens - budget) \
                if not partial else min(r.num_tokens - r.num_computed_tokens, budget, cap,
                                        cfg.max_model_len - 1 - r.num_computed_tokens)
            if not n or n <= 0:
                continue
            ok, refunded = allocate_or_preempt(engine, out, r, n, rule, r.num_tokens - r.num_computed_tokens - n)
            budget += refunded
            if ok:
                out.add(r, n)
                budget -= n
                num_prefills += 1
        skipped = 0  # 3. waiting requests (V0 admits in a step that preempted too)
        while budget > 0:
            if partial and num_prefills >= cfg.max_num_partial_prefills:
                break
            r = next_waiting(engine) if not skipped else self._behind(engine, skipped)
            if r is None:
                break
            hits, num_hit = lookup(engine, r)
            if partial and r.num_tokens - num_hit > threshold and long_now >= cfg.max_long_partial_prefills:
                skipped += 1  # a long prompt while the long prefills are at their limit: shorter ones go first
                continue
            adm = self.admission(engine, r, num_hit, len(engine.running), cfg.max_num_batched_tokens - budget, 0)
            if adm is None or not adm.num_new_tokens:
                break
            n = min(adm.num_new_tokens, cap) if partial else adm.num_new_tokens
            if not allocate_waiting(engine, r, n, hits, num_hit,
                                    num_reserved_tokens=adm.num_reserved_tokens + adm.num_new_tokens - n,
                                    reserved_blocks=adm.reserved_blocks):
                out.waiting_blocked = not skipped  # by KV: it needs its whole prompt's blocks, whatever the budget
                return
            take_waiting(engine, r)
            engine.admit(r, num_hit)
            out.add(r, n)
            budget -= n
            num_prefills += 1
            if partial and r.num_tokens - num_hit > threshold:
                long_now += 1
        out.waiting_blocked = not skipped and budget > 0 and len(engine.running) >= cfg.max_num_seqs

    @staticmethod
    def _behind(engine: EngineView, skipped: int) -> Request | None:
        ahead = engine.waiting.first(skipped + 1)
        return ahead[skipped] if len(ahead) > skipped else None

    @staticmethod
    def _slot_budget(engine: EngineView, running_prefills: list[Request], long_now: int) -> int:
        """The chunk budget of one prefill with concurrent partial prefills: ``max_num_batched_tokens`` divided by
        the prompts that can prefill this step (``PartialPrefillMetadata.from_queues``: the unfinished ones, then
        waiting ones in queue order up to ``max_num_partial_prefills``, long ones only while the long limit
        allows), or the whole budget when that is one."""
        cfg = engine.config
        count = len(running_prefills)
        longs = long_now
        if count < cfg.max_num_partial_prefills:
            for r in engine.waiting.first(4 * cfg.max_num_partial_prefills + 16):
                if count >= cfg.max_num_partial_prefills:
                    break
                if r.num_tokens - r.num_computed_tokens > cfg.long_prefill_token_threshold:
                    if longs >= cfg.max_long_partial_prefills:
                        continue
                    longs += 1
                count += 1
        count = min(max(count, 1), cfg.max_num_partial_prefills)
        return cfg.max_num_batched_tokens // count
