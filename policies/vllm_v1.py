"""vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py ``Scheduler.schedule``), as
shared/specs/vllm-v1-scheduling.md §1 describes it.

Phase 1 serves the running list in admission order: each request gets the tokens that bring C up to ``num_tokens``,
capped by the long-prefill threshold, the budget and ``max_model_len``; when its blocks cannot be allocated the
scheduler preempts the last running request under FCFS, or the lowest-priority one under the priority policy
(``policy.preemption.victim`` picks another rule), and retries. Phase 2 runs only if nothing was preempted: it
admits waiting requests in queue order while the budget and ``max_num_seqs`` allow, looking up the prefix cache
first; the first allocation failure stops it (head-of-line blocking; a waiting request never causes a preemption).
"""

from __future__ import annotations

from lab.core.request import RequestStatus
from lab.core.sched_api import EngineView, SchedulerBase, SchedulerOutput
from policies.common import (allocate_or_preempt, allocate_waiting, lookup, next_waiting, resolve_victim_rule,
                             schedule_drafts, start_cpu_load, take_waiting)

_RUNNING = RequestStatus.RUNNING


class VLLMV1Scheduler(SchedulerBase):
    """vLLM V1 FCFS / priority scheduling with chunked prefill and recompute (or swap) preemption.

    The queue order (``fcfs`` or ``priority``) comes from ``engine.config.queue_policy``. No options. Under async
    scheduling a running request's tokens to compute include its output placeholders (tokens the step in flight
    will sample), so a decode is scheduled again while its previous step runs.

    Speculative decoding (shared/specs/vllm-v1-scheduling.md §3): a running request's tokens to compute include
    its drafts, so a decode schedules 1 + k tokens (its last sampled token and k drafts) inside the budget; when the
    budget, the long-prefill threshold or ``max_model_len`` cuts n, the drafts are trimmed to
    ``n + C - num_tokens - P``. A newly admitted request that computes one token is padded to 1 + k with
    placeholder drafts when ``pad_new_one_token_requests`` (vLLM 0.33).
    """

    name = "vllm_v1"
    supports_async = True
    supports_fast_forward = True  # stateless between steps: a steady decode batch stays steady
    supports_pipelining = True  # a request whose step is in flight has n <= 0 (sync) or waits its eligible step
    supports_speculation = True  # a running request computes its drafts with its last sampled token
    admits_kv_holding = True  # requests whose remote KV arrived are admitted before the waiting queue (0.33)
    supports_kv_offload = True  # waiting requests are looked up in the CPU tier after the GPU (OffloadingConnector)

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        cfg = engine.config
        out = SchedulerOutput()
        threshold = cfg.long_prefill_token_threshold
        if threshold and cfg.threshold_only_when_contended and len(engine.running) + len(engine.waiting) <= 1:
            threshold = 0
        budget = self.schedule_running(engine, out, cfg.max_num_batched_tokens, threshold)
        if not out.preempted:
            self.schedule_waiting(engine, out, budget, threshold)
        return out

    def schedule_running(self, engine: EngineView, out: SchedulerOutput, budget: int, threshold: int) -> int:
        """Phase 1: running requests in admission order; returns the budget left."""
        cfg = engine.config
        kv = engine.kv
        max_model_len = cfg.max_model_len
        lookahead = cfg.num_lookahead_tokens
        allocate = kv.allocate_slots
        out_reqs = out.requests
        out_news = out.num_new_tokens
        rule = None
        gate = engine.pipeline_async  # async PP (V2 runner): a decode waits for its eligible scheduler step
        step_index = engine.num_scheduler_steps
        for r in list(engine.running):
            if budget <= 0:
                break
            if r.status is not _RUNNING:
                continue  # preempted earlier in this step
            p = r.num_output_placeholders
            c = r.num_computed_tokens
            if gate and r.next_decode_eligible_step > step_index:
                continue
            if p and c + 2 - p >= r.prompt_len + r.stop_at:
                continue  # async: the step in flight samples its last token; do not schedule past it
            n = r.prompt_len + r.num_output_tokens + r.num_spec_tokens + p - c
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            cap = max_model_len - 1 - c
            if n > cap:
                n = cap
            if n <= 0:
                continue
            if allocate(r, n, None, 0, lookahead):  # the common case, inline
                out_reqs.append(r)
                out_news.append(n)
                budget -= n
                if r.num_spec_tokens:
                    schedule_drafts(out, r, n)
                continue
            rule = rule or resolve_victim_rule(engine)
            ok, refunded = allocate_or_preempt(engine, out, r, n, rule, lookahead)
            budget += refunded
            if ok:
                out.add(r, n)
                budget -= n
                if r.num_spec_tokens:
                    schedule_drafts(out, r, n)
        return budget

    def schedule_waiting(self, engine: EngineView, out: SchedulerOutput, budget: int, threshold: int) -> int:
        """Phase 2: admit waiting requests in queue order; stops at the first that does not fit."""
        cfg = engine.config
        kv = engine.kv
        running = engine.running
        full_isl = cfg.scheduler_reserve_full_isl
        watermark_blocks = int(cfg.watermark * kv.pool.num_gpu_blocks) if cfg.watermark else 0
        lookahead = cfg.num_lookahead_tokens
        while budget > 0:
            if len(running) >= cfg.max_num_seqs:
                break
            r = next_waiting(engine)
            if r is None:
                break
            hits, num_hit = lookup(engine, r)
            reserve = watermark_blocks if running else 0
            if engine.kv_offload is not None:
                loading = start_cpu_load(engine, r, hits, num_hit, num_lookahead_tokens=lookahead,
                                         full_sequence_must_fit=full_isl, reserved_blocks=reserve)
                if loading is not None:
                    if loading:
                        continue
                    break
            n = r.num_tokens - num_hit
            if 0 < threshold < n:
                n = threshold
            if not cfg.enable_chunked_prefill and n > budget:
                break
            if n > budget:
                n = budget
            pad = 0
            if cfg.pad_new_one_token_requests and n == 1 and num_hit + 1 == r.num_tokens:
                pad = min(cfg.num_speculative_tokens, budget - 1, max(0, cfg.max_model_len - 1 - r.num_tokens))
                n += pad
            if not allocate_waiting(engine, r, n, hits, num_hit, num_lookahead_tokens=lookahead,
                                    full_sequence_must_fit=full_isl, reserved_blocks=reserve):
                break
            take_waiting(engine, r)
            engine.admit(r, num_hit)
            out.add(r, n)
            budget -= n
            if pad > 0:
                out.num_spec_tokens[r] = pad
                out.padded_drafts.add(r)
        return budget
