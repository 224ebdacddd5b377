"""vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py ``Scheduler.schedule``), as
shared/specs/vllm-v1-scheduling.md §1 describes it.

Phase 1 serves the running list in admission order: each request gets the tokens that bring C up to ``num_tokens``,
capped by the long-prefill threshold, the budget and ``max_model_len``; when its blocks cannot be allocated the
scheduler preempts (recompute) the last running request under FCFS, or the lowest-priority one under the priority
policy, and retries. Phase 2 runs only if nothing was preempted: it admits waiting requests in queue order while the
budget and ``max_num_seqs`` allow, looking up the prefix cache first; the first allocation failure stops it
(head-of-line blocking; a waiting request never causes a preemption).
"""

from __future__ import annotations

from lab.sched_api import EngineView, SchedulerOutput


class VLLMV1Scheduler:
    """vLLM V1 FCFS / priority scheduling with chunked prefill and recompute preemption.

    The queue order (``fcfs`` or ``priority``) comes from ``engine.config.queue_policy``. Under async scheduling a
    running request's tokens to compute include its output placeholders (tokens the step in flight will sample),
    so a decode is scheduled again while its previous step runs.
    """

    name = "vllm_v1"
    supports_async = True
    supports_fast_forward = True  # stateless between steps: a steady decode batch stays steady

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        cfg = engine.config
        kv = engine.kv
        running = engine.running
        waiting = engine.waiting
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        if threshold and cfg.threshold_only_when_contended and len(running) + len(waiting) <= 1:
            threshold = 0
        max_model_len = cfg.max_model_len
        lookahead = cfg.num_lookahead_tokens
        priority = cfg.queue_policy == "priority"
        scheduled_ids: set[int] = set()

        allocate = kv.allocate_slots
        out_reqs = out.requests
        out_news = out.num_new_tokens
        # --- Phase 1: running requests, in admission order ---
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            p = r.num_output_placeholders
            c = r.num_computed_tokens
            if p and c + 2 - p >= r.prompt_len + r.max_tokens:
                i += 1  # async: the step in flight samples its last token; do not schedule past it
                continue
            n = r.prompt_len + r.num_output_tokens + p - c
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            cap = max_model_len - 1 - c
            if n > cap:
                n = cap
            if n <= 0:
                i += 1
                continue
            ok = False
            while True:
                if allocate(r, n, None, 0, lookahead):
                    ok = True
                    break
                if priority:
                    victim = max(running, key=lambda q: (q.priority, q.arrival_time))
                    if id(victim) in scheduled_ids:
                        budget += out.remove(victim)
                        scheduled_ids.discard(id(victim))
                else:
                    victim = running[-1]
                vi = running.index(victim) if priority else len(running) - 1
                engine.preempt(victim)
                out.preempted.append(victim)
                if priority and vi < i:
                    i -= 1  # the list shifted left under the cursor
                if victim is r:
                    break
            if not ok:
                if priority:
                    continue  # r preempted itself; the cursor already points at the next request
                break
            out_reqs.append(r)
            out_news.append(n)
            if priority:
                scheduled_ids.add(id(r))
            budget -= n
            i += 1

        # --- Phase 2: waiting requests; only when nothing was preempted ---
        if not out.preempted:
            full_isl = cfg.scheduler_reserve_full_isl
            watermark_blocks = int(cfg.watermark * kv.pool.num_gpu_blocks) if cfg.watermark else 0
            while budget > 0 and waiting:
                if len(running) >= cfg.max_num_seqs:
                    break
                r = waiting.peek()
                if r.num_computed_tokens == 0:
                    hits, num_hit = kv.get_computed_blocks(r)
                else:
                    hits, num_hit = [], r.num_computed_tokens
                n = r.num_tokens - num_hit
                if 0 < threshold < n:
                    n = threshold
                if not cfg.enable_chunked_prefill and n > budget:
                    break
                if n > budget:
                    n = budget
                reserve = watermark_blocks if running else 0
                if not kv.allocate_slots(r, n, hits, num_hit if r.num_computed_tokens == 0 else 0,
                                         num_lookahead_tokens=lookahead,
                                         full_sequence_must_fit=full_isl, reserved_blocks=reserve):
                    break
                waiting.pop()
                engine.admit(r, num_hit)
                out.add(r, n)
                budget -= n
        return out
