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

from lab.core.kv_cache import unique_content
from lab.core.request import Request, RequestStatus
from lab.core.sched_api import EngineView, SchedulerBase, SchedulerConfig, SchedulerOutput
from policies.common import (aligned_split, allocate_or_preempt, allocate_waiting, lookup, next_waiting,
                             preemption_reason, resolve_victim_rule, schedule_drafts, start_cpu_load, take_waiting)

_RUNNING = RequestStatus.RUNNING


def admission_lookahead(config: SchedulerConfig, request: Request) -> int:
    """Lookahead slots a waiting request's admission allocates: none for a request with nothing computed (a new
    or recomputing one), ``num_lookahead_tokens`` for one that holds computed state (its remote KV arrived, or
    swapped out): vLLM's ``effective_lookahead_tokens`` (vllm/v1/core/sched/scheduler.py, "an edge case when P/D
    disaggregation is used with spec decoding where an extra block gets allocated")."""
    return config.num_lookahead_tokens if request.num_computed_tokens else 0


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
        """Phase 1: running requests in admission order; returns the budget left.

        Built in two moves that give the same schedule as one request at a time: the tokens of every request are
        planned first, as if each allocation succeeds (a request's tokens depend only on its own state and the
        budget), and allocated in one call (``kv.allocate_running``). Only when an allocation fails does the
        scheduler go on request by request from there, preempting (:meth:`_schedule_running_from`)."""
        running = list(engine.running)
        reqs, news, drafts, left = self._plan_running(engine, running, budget, threshold)
        done = engine.kv.allocate_running(reqs, news, engine.config.num_lookahead_tokens)
        complete = done == len(reqs)
        out.requests += reqs if complete else reqs[:done]
        out.num_new_tokens += news if complete else news[:done]
        for i in drafts:
            if i < done:
                schedule_drafts(out, reqs[i], news[i])
        if complete:
            return left
        start = running.index(reqs[done])  # a Request compares by identity
        return self._schedule_running_from(engine, out, running, start, budget - sum(news[:done]), threshold)

    @staticmethod
    def _plan_running(engine: EngineView, running: list, budget: int,
                      threshold: int) -> tuple[list, list[int], list[int], int]:
        """Phase 1's tokens if every allocation succeeds: (the requests scheduled, in ``running`` order, their
        token counts, indices into those of the requests with drafts, the budget left). Changes nothing."""
        max_model_len = engine.config.max_model_len
        gate = engine.pipeline_async  # async PP (V2 runner): a decode waits for its eligible scheduler step
        step_index = engine.num_scheduler_steps
        split = aligned_split(engine)  # a Mamba hybrid caching its state: prefill chunks end on block boundaries
        reqs: list = []
        news: list[int] = []
        drafts: list[int] = []
        add_req = reqs.append
        add_new = news.append
        for r in running:
            if budget <= 0:
                break
            if r.status is not _RUNNING:
                continue
            p = r.num_output_placeholders
            c = r.num_computed_tokens
            if gate and r.next_decode_eligible_step > step_index:
                continue
            if p and c + 2 - p >= r.prompt_len + r.stop_at:
                continue  # async: the step in flight samples its last token; do not schedule past it
            k = r.num_spec_tokens
            n = r.prompt_len + r.num_output_tokens + k + p - c
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if c + n >= max_model_len:
                n = max_model_len - 1 - c
            if split is not None and n > 0:
                n = split(r, n, 0)
            if n <= 0:
                continue
            if k:
                drafts.append(len(reqs))
            add_req(r)
            add_new(n)
            budget -= n
        return reqs, news, drafts, budget

    def _schedule_running_from(self, engine: EngineView, out: SchedulerOutput, running: list, start: int,
                               budget: int, threshold: int) -> int:
        """Phase 1 from ``running[start]`` on, one request at a time (allocation with preemption); returns the
        budget left."""
        cfg = engine.config
        kv = engine.kv
        max_model_len = cfg.max_model_len
        lookahead = cfg.num_lookahead_tokens
        allocate = kv.allocate_slots
        out_reqs = out.requests
        out_news = out.num_new_tokens
        rule = None
        gate = engine.pipeline_async
        step_index = engine.num_scheduler_steps
        split = aligned_split(engine)
        for r in running[start:]:
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
            if split is not None and n > 0:
                n = split(r, n, 0)
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

    def decode_preemption_reason(self, engine: EngineView, requester: Request) -> str | None:
        """:meth:`schedule`'s preemption in a schedule whose phase 1 only decodes (see
        :meth:`SchedulerBase.decode_preemption_reason`): with the ``last`` victim rule (``auto`` with an FCFS
        queue), recompute preemption and victims put back at the head of the waiting queue, phase 1 preempts the
        last running request until the decode fits (:func:`policies.common.allocate_or_preempt`) and phase 2 does
        not run. None for any other rule, swap preemption, requeue at the tail, and for a subclass with a phase 1
        or a ``schedule`` of its own."""
        cls = type(self)
        if cls.schedule is not VLLMV1Scheduler.schedule or cls.schedule_running is not VLLMV1Scheduler.schedule_running:
            return None
        cfg = engine.config
        if (resolve_victim_rule(engine) != "last" or cfg.preemption_mode != "recompute"
                or cfg.preemption_requeue == "tail"):
            return None
        return preemption_reason(requester, 1, "last")

    def head_stays_blocked(self, engine: EngineView, head: Request, num_running: int, num_scheduled_tokens: int,
                           num_free_blocks: int) -> bool:
        """:meth:`schedule_waiting`'s decision on ``head`` for a schedule whose phase 1 only decoded (see
        :meth:`SchedulerBase.head_stays_blocked`): blocked by ``max_num_seqs``, by no budget left, by a prompt
        that does not fit the budget without chunked prefill, or by KV (its blocks, from
        ``KVCacheManager.blocks_to_admit``, above the free blocks less the watermark). False (cannot tell) with
        a CPU KV tier, a swapped-out head, prefix hits that may change, or a padded one-token admission, and for a
        subclass with an admission phase of its own (this rule describes this class's :meth:`schedule_waiting`)."""
        if type(self).schedule_waiting is not VLLMV1Scheduler.schedule_waiting:
            return False
        cfg = engine.config
        if num_running >= cfg.max_num_seqs:
            return True
        budget = cfg.max_num_batched_tokens - num_scheduled_tokens
        if budget <= 0:
            return True
        if engine.kv_offload is not None or head.num_computed_tokens:
            return False
        threshold = cfg.long_prefill_token_threshold
        if threshold and cfg.threshold_only_when_contended and num_running + len(engine.waiting) <= 1:
            threshold = 0
        n = head.num_tokens
        if 0 < threshold < n:
            n = threshold
        if not cfg.enable_chunked_prefill and n > budget:
            # (unless a prefix hit, shared content's or its own freed blocks', may leave fewer tokens to compute:
            # cannot tell)
            return not engine.kv.enable_prefix_caching or (unique_content(head) and head.prev_blocks is None)
        if n > budget:
            n = budget
        if cfg.pad_new_one_token_requests and n == 1:
            return False
        need = engine.kv.blocks_to_admit(head, n, admission_lookahead(cfg, head), cfg.scheduler_reserve_full_isl)
        if need is None:
            return False
        reserve = int(cfg.watermark * engine.kv.pool.num_gpu_blocks) if cfg.watermark and num_running else 0
        return need > num_free_blocks - reserve

    def admits_whole(self, engine: EngineView, request: Request, num_running: int, num_scheduled_tokens: int,
                     num_free_blocks: int, num_waiting: int = 1) -> bool:
        """:meth:`schedule_waiting`'s decision on ``request``, the waiting head, for a schedule whose phase 1 only
        decoded (see :meth:`SchedulerBase.admits_whole`): admitted whole when a ``max_num_seqs`` slot is free, its
        whole prompt fits the budget left after the tokens already scheduled and the long-prefill threshold (off
        when uncontended: ``num_running + num_waiting <= 1``, the same sum before and after each admission), and its
        blocks (``KVCacheManager.blocks_to_admit``, no prefix hit: content unique to it, or caching off) fit the
        free blocks less the watermark. A request preempted before (recompute) is admitted with its prompt and
        outputs so far. False (cannot tell) with a CPU KV tier, a request holding computed state, one whose own
        blocks, freed by a preemption, prefix caching may hit, a padded one-token admission, and for a subclass with
        an admission phase of its own (or a ``schedule`` of its own)."""
        if request.prev_blocks is not None and engine.kv.enable_prefix_caching:
            return False  # its own blocks freed by a preemption may be hit, or handed out by then
        return self._admits(engine, request, 0, num_running, num_scheduled_tokens, num_free_blocks, num_waiting)

    def admits_resumed(self, engine: EngineView, request: Request, num_hit_tokens: int, num_running: int,
                       num_scheduled_tokens: int, num_free_blocks: int, num_waiting: int) -> bool:
        """:meth:`admits_whole` for a request preempted before whose prefix hit here is ``num_hit_tokens`` (see
        :meth:`SchedulerBase.admits_resumed`): the rest of its sequence must fit the budget and the long-prefill
        threshold; its blocks count as its whole sequence's (``KVCacheManager.blocks_to_admit`` with
        ``num_tokens``: each hit block, free, is taken out of the free queue as a new block would be)."""
        if request.prev_blocks is None or not unique_content(request):
            return False
        return self._admits(engine, request, num_hit_tokens, num_running, num_scheduled_tokens, num_free_blocks,
                            num_waiting)

    def _admits(self, engine: EngineView, request: Request, num_hit_tokens: int, num_running: int,
                num_scheduled_tokens: int, num_free_blocks: int, num_waiting: int) -> bool:
        """:meth:`schedule_waiting`'s decision to admit ``request`` whole after a prefix hit of ``num_hit_tokens``
        (see :meth:`admits_whole`, :meth:`admits_resumed`)."""
        cls = type(self)
        if cls.schedule_waiting is not VLLMV1Scheduler.schedule_waiting or cls.schedule is not VLLMV1Scheduler.schedule:
            return False
        cfg = engine.config
        if num_running >= cfg.max_num_seqs or engine.kv_offload is not None or request.num_computed_tokens:
            return False
        n = request.num_tokens - num_hit_tokens
        threshold = cfg.long_prefill_token_threshold
        if threshold and cfg.threshold_only_when_contended and num_running + num_waiting <= 1:
            threshold = 0
        if 0 < threshold < n or n > cfg.max_num_batched_tokens - num_scheduled_tokens:
            return False
        if cfg.pad_new_one_token_requests and n == 1:
            return False
        if engine.kv.enable_prefix_caching and not unique_content(request):
            return False
        # (its whole sequence's blocks: with a hit, each hit block leaves the free queue as a new block would)
        need = engine.kv.blocks_to_admit(request, request.num_tokens, admission_lookahead(cfg, request),
                                         cfg.scheduler_reserve_full_isl)
        if need is None:
            return False
        reserve = int(cfg.watermark * engine.kv.pool.num_gpu_blocks) if cfg.watermark and num_running else 0
        return need <= num_free_blocks - reserve

    def admits_chunk(self, engine: EngineView, request: Request, num_running: int, num_scheduled_tokens: int,
                     num_free_blocks: int, num_waiting: int) -> tuple[int, int] | None:
        """:meth:`schedule_waiting`'s first chunk for the waiting head ``request`` when its whole prompt does not
        fit the budget left (see :meth:`SchedulerBase.admits_chunk`): with chunked prefill, the budget left, when
        it is below the prompt, the long-prefill threshold does not cut the prompt first, and its blocks fit the
        free blocks less the watermark (the chunk's blocks only); None in the cases :meth:`admits_whole` cannot
        tell about."""
        cls = type(self)
        if cls.schedule_waiting is not VLLMV1Scheduler.schedule_waiting or cls.schedule is not VLLMV1Scheduler.schedule:
            return None
        cfg = engine.config
        kv = engine.kv
        if not cfg.enable_chunked_prefill or num_running >= cfg.max_num_seqs or engine.kv_offload is not None:
            return None
        if request.num_computed_tokens or (request.prev_blocks is not None and kv.enable_prefix_caching):
            return None
        n = request.num_tokens
        budget = cfg.max_num_batched_tokens - num_scheduled_tokens
        threshold = cfg.long_prefill_token_threshold
        if threshold and cfg.threshold_only_when_contended and num_running + num_waiting <= 1:
            threshold = 0
        if 0 < threshold < n or not 0 < budget < n:
            return None
        if kv.enable_prefix_caching and not unique_content(request):
            return None
        need = kv.blocks_to_admit(request, budget, admission_lookahead(cfg, request), cfg.scheduler_reserve_full_isl)
        if need is None:
            return None
        reserve = int(cfg.watermark * kv.pool.num_gpu_blocks) if cfg.watermark and num_running else 0
        return (budget, budget) if need <= num_free_blocks - reserve else None

    def running_chunk(self, engine: EngineView, request: Request, num_computed_tokens: int,
                      num_scheduled_tokens: int) -> int | None:
        """:meth:`_plan_running`'s tokens for ``request``, part-way through its prompt (see
        :meth:`SchedulerBase.running_chunk`): what is left of it, cut to the budget left; None under a long-prefill
        threshold (in force or not depends on the queue) or past the model length."""
        cls = type(self)
        if cls.schedule_running is not VLLMV1Scheduler.schedule_running or cls.schedule is not VLLMV1Scheduler.schedule:
            return None
        cfg = engine.config
        budget = cfg.max_num_batched_tokens - num_scheduled_tokens
        n = request.num_tokens - num_computed_tokens
        if cfg.long_prefill_token_threshold or budget <= 0 or request.num_tokens >= cfg.max_model_len:
            return None
        return n if n < budget else budget

    def schedule_waiting(self, engine: EngineView, out: SchedulerOutput, budget: int, threshold: int) -> int:
        """Phase 2: admit waiting requests in queue order; stops at the first that does not fit."""
        cfg = engine.config
        kv = engine.kv
        running = engine.running
        full_isl = cfg.scheduler_reserve_full_isl
        watermark_blocks = int(cfg.watermark * kv.pool.num_gpu_blocks) if cfg.watermark else 0
        split = aligned_split(engine)
        while budget > 0:
            if len(running) >= cfg.max_num_seqs:
                out.waiting_blocked = True
                break
            r = next_waiting(engine)
            if r is None:
                break
            lookahead = admission_lookahead(cfg, r)
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
            if split is not None:
                n = split(r, n, num_hit)
            pad = 0
            if cfg.pad_new_one_token_requests and n == 1 and num_hit + 1 == r.num_tokens:
                pad = min(cfg.num_speculative_tokens, budget - 1, max(0, cfg.max_model_len - 1 - r.num_tokens))
                n += pad
            if not allocate_waiting(engine, r, n, hits, num_hit, num_lookahead_tokens=lookahead,
                                    full_sequence_must_fit=full_isl, reserved_blocks=reserve):
                out.waiting_blocked = True  # by KV: it needs no fewer blocks while the batch only decodes
                break
            take_waiting(engine, r)
            engine.admit(r, num_hit)
            out.add(r, n)
            budget -= n
            if pad > 0:
                out.num_spec_tokens[r] = pad
                out.padded_drafts.add(r)
        return budget
