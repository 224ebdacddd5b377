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

from lab.core.request import Request, RequestStatus
from lab.core.sched_api import WAITS, Admission, EngineView, SchedulerBase, SchedulerConfig, SchedulerOutput
from policies.common import (aligned_split, allocate_or_preempt, allocate_waiting, lookup, next_waiting,
                             preemption_reason, resolve_victim_rule, schedule_drafts, start_cpu_load, take_waiting)

_RUNNING = RequestStatus.RUNNING


def effective_threshold(config: SchedulerConfig, num_requests: int) -> int:
    """The long-prefill threshold in force in a schedule that began with ``num_requests`` running + waiting
    requests: vLLM 0.19 and later apply it only when more than one request is there
    (``threshold_only_when_contended``); 0 = none."""
    t = config.long_prefill_token_threshold
    return 0 if t and config.threshold_only_when_contended and num_requests <= 1 else t


def watermark_blocks(config: SchedulerConfig, num_gpu_blocks: int, num_running: int) -> int:
    """Free blocks an admission must leave (``watermark`` of the cache), when requests are running; 0 else."""
    return int(config.watermark * num_gpu_blocks) if config.watermark and num_running else 0


def tokens_to_run(config: SchedulerConfig, request: Request, num_computed: int, budget: int, threshold: int,
                  split=None) -> int:
    """Phase 1's tokens for a running request with ``num_computed`` tokens computed (vLLM: ``num_tokens_with_spec
    + num_output_placeholders - num_computed_tokens``), cut by the long-prefill ``threshold``, the ``budget`` left
    and ``max_model_len`` (``min(n, max_model_len - 1 - num_computed_tokens)``, necessary with drafts), and for a
    Mamba hybrid caching its state to a block boundary (``split``); 0 or less: none this step. Under async
    scheduling none either once the step in flight samples its last token (its ``max_tokens`` is certain)."""
    p = request.num_output_placeholders
    if p and num_computed + 2 - p >= request.prompt_len + request.stop_at:
        return 0
    n = request.prompt_len + request.num_output_tokens + request.num_spec_tokens + p - num_computed
    if 0 < threshold < n:
        n = threshold
    if n > budget:
        n = budget
    cap = config.max_model_len - 1 - num_computed
    if n > cap:
        n = cap
    if split is not None and n > 0:
        n = split(request, n, 0)
    return n


def step_budget(config: SchedulerConfig) -> int:
    """The token budget a schedule starts with (vLLM ``max_num_scheduled_tokens``): ``max_num_batched_tokens``, less
    ``max_num_seqs`` x the drafter's slots per request when they are reserved up front (vLLM before PR #51725:
    ``VllmConfig._set_max_num_scheduled_tokens``; ``draft_slot_budget: reserved``)."""
    if config.draft_slot_budget == "reserved":
        return config.max_num_batched_tokens - config.draft_slots_per_request * config.max_num_seqs
    return config.max_num_batched_tokens


def request_slots(config: SchedulerConfig) -> int:
    """Budget slots each scheduled request takes besides its tokens: the drafter's slots per request when they
    are charged per request (vLLM 0.33, PR #51725 "adaptive budget for spec scheduled tokens"), else 0."""
    return config.draft_slots_per_request if config.draft_slot_budget == "per_request" else 0


def admission_lookahead(config: SchedulerConfig, request: Request) -> int:
    """Lookahead slots a waiting request's admission allocates: ``num_lookahead_tokens``, whether it holds computed
    state or not (vLLM 0.33 ``effective_lookahead_tokens``, vllm/v1/core/sched/scheduler.py:1401-1406; checked by
    the parity harness, docs/vllm_parity.md). Only an admission that starts an asynchronous KV load allocates none
    (:func:`start_cpu_load` is called with 0)."""
    return config.num_lookahead_tokens


def padded_drafts(config: SchedulerConfig, num_computed: int, budget: int, running_scheduled: bool,
                  prefill_scheduled: bool) -> int | None:
    """Placeholder drafts vLLM 0.33 pads onto the admission of a request with one token to compute (for a uniform
    decode batch; vllm/v1/core/sched/scheduler.py:1307-1330): ``num_speculative_tokens`` when no running request
    scheduled in this step is part-way through its prompt (``prefill_scheduled``), some running request was
    scheduled or the request has ``num_computed`` > 0 (a prefix hit), and the padded tokens plus the one sampled
    still fit ``max_model_len``; else 0. None: the padded 1 + k tokens exceed the ``budget`` left, and admission
    stops there (vLLM prefers not scheduling it to scheduling it unpadded)."""
    k = config.num_speculative_tokens
    if prefill_scheduled or not (running_scheduled or num_computed > 0):
        return 0
    if num_computed + 1 + k + 1 > config.max_model_len:
        return 0
    return None if 1 + k > budget else k


def pads_one_token_admissions(config: SchedulerConfig) -> bool:
    """Whether an admission with one token to compute may be padded with placeholder drafts (vLLM 0.33
    ``pad_new_one_token_requests`` under speculative decoding; :func:`padded_drafts`)."""
    return bool(config.pad_new_one_token_requests and config.num_speculative_tokens)


def running_phase_of(requests: list[Request]) -> tuple[bool, bool]:
    """What phase 1 of a schedule leaves for :func:`padded_drafts`: whether it scheduled a running request, and
    whether one of them was part-way through its prompt (:func:`was_prefill_chunk`)."""
    return bool(requests), any(was_prefill_chunk(r) for r in requests)


def was_prefill_chunk(request: Request) -> bool:
    """Whether a running request's previous step computed part of its prompt without sampling (vLLM's
    ``is_prefill_chunk``, set when it was scheduled): no output placeholders, and more than one token short of
    its tokens, or one short with no output yet (a decode is one short after its output, and has one). A request
    recomputing after a preemption that is one token short reads as a decode here: the difference
    docs/vllm_parity.md records (resumed-one-short)."""
    c = request.num_computed_tokens
    n = request.num_tokens
    return not request.num_output_placeholders and (c < n - 1 or c == n - 1 and not request.num_output_tokens)


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
    skips_blocked_waiting = True  # engine.skip_blocked_waiting (schedule_waiting)
    preempts_for_priority = True  # engine.priority_preemption: max_num_seqs (schedule_waiting)

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        cfg = engine.config
        out = SchedulerOutput()
        num_requests = len(engine.running) + len(engine.waiting)
        budget = self.schedule_running(engine, out, step_budget(cfg), effective_threshold(cfg, num_requests))
        if not out.preempted:
            self.schedule_waiting(engine, out, budget, num_requests)
        return out

    # ---- phase 1: the running requests ----
    def schedule_running(self, engine: EngineView, out: SchedulerOutput, budget: int, threshold: int) -> int:
        """Phase 1: running requests in admission order; returns the budget left.

        Built in two moves that give the same schedule as one request at a time: the tokens of every request are
        planned first (:func:`tokens_to_run`), as if each allocation succeeds (a request's tokens depend only on
        its own state and the budget), and allocated in one call (``kv.allocate_running``). Only when an
        allocation fails does the scheduler go on request by request from there, preempting
        (:meth:`_schedule_running_from`)."""
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
        return self._schedule_running_from(engine, out, running, start,
                                           budget - sum(news[:done]) - done * request_slots(engine.config), threshold)

    @staticmethod
    def _plan_running(engine: EngineView, running: list, budget: int,
                      threshold: int) -> tuple[list, list[int], list[int], int]:
        """Phase 1's tokens if every allocation succeeds: (the requests scheduled, in ``running`` order, their
        token counts, indices into those of the requests with drafts, the budget left). Changes nothing."""
        cfg = engine.config
        gate = engine.pipeline_async  # async PP (V2 runner): a decode waits for its eligible scheduler step
        step_index = engine.num_scheduler_steps
        split = aligned_split(engine)  # a Mamba hybrid caching its state: prefill chunks end on block boundaries
        slots = request_slots(cfg)  # the drafter's budget slots per scheduled request (draft models)
        reqs: list = []
        news: list[int] = []
        drafts: list[int] = []
        for r in running:
            if budget <= 0:
                break
            if r.status is not _RUNNING or (gate and r.next_decode_eligible_step > step_index):
                continue
            n = tokens_to_run(cfg, r, r.num_computed_tokens, budget - slots, threshold, split)
            if n <= 0:
                continue
            if r.num_spec_tokens:
                drafts.append(len(reqs))
            reqs.append(r)
            news.append(n)
            budget -= n + slots
        return reqs, news, drafts, budget

    def _schedule_running_from(self, engine: EngineView, out: SchedulerOutput, running: list, start: int,
                               budget: int, threshold: int) -> int:
        """Phase 1 from ``running[start]`` on, one request at a time (allocation with preemption); returns the
        budget left."""
        cfg = engine.config
        lookahead = cfg.num_lookahead_tokens
        rule = resolve_victim_rule(engine)
        gate = engine.pipeline_async
        step_index = engine.num_scheduler_steps
        split = aligned_split(engine)
        slots = request_slots(cfg)
        for r in running[start:]:
            if budget <= 0:
                break
            if r.status is not _RUNNING or (gate and r.next_decode_eligible_step > step_index):
                continue  # (preempted earlier in this step, or waiting for its eligible step)
            n = tokens_to_run(cfg, r, r.num_computed_tokens, budget - slots, threshold, split)
            if n <= 0:
                continue
            scheduled = len(out.requests)
            ok, refunded = allocate_or_preempt(engine, out, r, n, rule, lookahead)
            budget += refunded + slots * (scheduled - len(out.requests))  # victims un-scheduled: tokens and slots
            if ok:
                out.add(r, n)
                budget -= n + slots
                if r.num_spec_tokens:
                    schedule_drafts(out, r, n)
        return budget

    def running_tokens(self, engine: EngineView, request: Request, num_computed_tokens: int,
                       num_scheduled_tokens: int) -> int | None:
        """:func:`tokens_to_run` after ``num_scheduled_tokens`` tokens (see :meth:`SchedulerBase.running_tokens`);
        None under a long-prefill threshold (whether it is in force depends on the queue at that schedule)."""
        cfg = engine.config
        if cfg.long_prefill_token_threshold:
            return None
        n = tokens_to_run(cfg, request, num_computed_tokens,
                          step_budget(cfg) - num_scheduled_tokens - request_slots(cfg), 0, aligned_split(engine))
        return n if n > 0 else 0

    def decode_preemption_reason(self, engine: EngineView, requester: Request) -> str | None:
        """Phase 1's preemption in a schedule that only decodes (see :meth:`SchedulerBase.decode_preemption_reason`):
        with the ``last`` victim rule (``auto`` with an FCFS queue), recompute preemption and victims put back at
        the head of the waiting queue, :func:`policies.common.allocate_or_preempt` preempts the last running
        request until the decode fits, and phase 2 does not run. None for any other rule, swap preemption or
        requeue at the tail."""
        cfg = engine.config
        if (resolve_victim_rule(engine) != "last" or cfg.preemption_mode != "recompute"
                or cfg.preemption_requeue == "tail"):
            return None
        return preemption_reason(requester, 1, "last")

    # ---- phase 2: the waiting requests ----
    def admission(self, engine: EngineView, request: Request, num_hit_tokens: int | None, num_running: int,
                  num_scheduled_tokens: int, num_requests: int,
                  running_phase: tuple[bool, bool] | None = None) -> Admission | None:
        """Phase 2's decision on ``request`` (see :meth:`SchedulerBase.admission`): it waits when ``max_num_seqs``
        is full, the budget is spent, or (chunked prefill off) its uncached tokens exceed the budget left; else it
        computes its uncached tokens cut by the long-prefill threshold (:func:`effective_threshold`), the budget
        and a Mamba hybrid's block alignment, with its lookahead slots (:func:`admission_lookahead`), the
        ``scheduler_reserve_full_isl`` gate and the watermark; a one-token admission may be padded with placeholder
        drafts (vLLM 0.33 ``pad_new_one_token_requests``, :func:`padded_drafts`), which needs ``running_phase``:
        (whether phase 1 scheduled a running request, whether one of those was part-way through its prompt). With
        ``num_hit_tokens`` unknown a prompt over the budget may still be shortened by a hit, and without
        ``running_phase`` the padding cannot be told: None then."""
        cfg = engine.config
        budget = step_budget(cfg) - num_scheduled_tokens - request_slots(cfg)
        if num_running >= cfg.max_num_seqs or budget <= 0:
            return WAITS
        hit = num_hit_tokens or 0
        n = request.num_tokens - hit
        pad = 0
        if n == 1 and pads_one_token_admissions(cfg):
            if running_phase is None or num_hit_tokens is None:
                return None
            pad = padded_drafts(cfg, hit, budget, *running_phase)
            if pad is None:
                return WAITS
        threshold = effective_threshold(cfg, num_requests)
        if 0 < threshold < n:
            n = threshold
        if not cfg.enable_chunked_prefill and n > budget:
            return WAITS if num_hit_tokens is not None else None
        if n > budget:
            n = budget
        split = aligned_split(engine)
        if split is not None:
            n = split(request, n, hit)
        return Admission(n, admission_lookahead(cfg, request), 0,
                         watermark_blocks(cfg, engine.kv.pool.num_gpu_blocks, num_running),
                         cfg.scheduler_reserve_full_isl, pad)

    def schedule_waiting(self, engine: EngineView, out: SchedulerOutput, budget: int, num_requests: int) -> int:
        """Phase 2: admit waiting requests in queue order (:meth:`admission`); stops at the first that waits or
        whose blocks do not fit (head-of-line blocking), unless ``skip_blocked_waiting`` lets it pass over that many
        such requests (they keep their places). With ``priority_preemption: max_num_seqs`` a full running list does
        not stop a waiting request of strictly higher priority: the lowest-priority running request is preempted
        for it (:meth:`_priority_victim`). ``num_requests``: running + waiting when the schedule began."""
        cfg = engine.config
        running = engine.running
        slots = request_slots(cfg)
        start = step_budget(cfg)
        skipped = 0  # waiting requests passed over in this schedule
        phase1 = running_phase_of(out.requests) if pads_one_token_admissions(cfg) else None  # (read only then)
        while budget > 0:
            if len(running) >= cfg.max_num_seqs:
                victim = self._priority_victim(engine, skipped)
                if victim is None:
                    out.waiting_blocked = True
                    break
                scheduled = len(out.requests)
                budget += out.remove(victim)
                budget += slots * (scheduled - len(out.requests))
                engine.preempt(victim, reason=f"priority: a waiting request of priority lower than {victim.priority} "
                                              f"and max_num_seqs ({cfg.max_num_seqs}) full")
                out.preempted.append(victim)
                continue
            r = self._candidate(engine, skipped)
            if r is None:
                break
            hits, num_hit = lookup(engine, r)
            if engine.kv_offload is not None:
                loading = start_cpu_load(engine, r, hits, num_hit, num_lookahead_tokens=0,
                                         full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                                         reserved_blocks=watermark_blocks(cfg, engine.kv.pool.num_gpu_blocks,
                                                                          len(running)))
                if loading is not None:
                    if loading:
                        continue
                    if self._may_skip(engine, skipped):
                        skipped += 1
                        continue
                    break
            adm = self.admission(engine, r, num_hit, len(running), start - budget, num_requests, phase1)
            if adm is None or not adm.num_new_tokens:  # (None: a policy of its own that cannot tell stops here)
                if adm is not None and budget - slots > 0 and self._may_skip(engine, skipped):
                    skipped += 1  # its prompt does not fit the budget left (chunked prefill off)
                    continue
                break
            n = adm.num_new_tokens + adm.num_padded_drafts
            if not allocate_waiting(engine, r, n, hits, num_hit, num_lookahead_tokens=adm.num_lookahead_tokens,
                                    full_sequence_must_fit=adm.full_sequence_must_fit,
                                    reserved_blocks=adm.reserved_blocks):
                if self._may_skip(engine, skipped):
                    skipped += 1
                    continue
                out.waiting_blocked = True  # by KV: it needs no fewer blocks while the batch only decodes
                break
            take_waiting(engine, r)
            engine.admit(r, num_hit)
            out.add(r, n)
            budget -= n + slots
            if adm.num_padded_drafts:
                out.num_spec_tokens[r] = adm.num_padded_drafts
                out.padded_drafts.add(r)
        return budget

    @staticmethod
    def _candidate(engine: EngineView, skipped: int) -> Request | None:
        """The next request phase 2 tries: the next waiting one (:func:`policies.common.next_waiting`), or, after
        ``skipped`` requests were passed over, the one behind them in the waiting queue's order; None when none."""
        if not skipped:
            return next_waiting(engine)
        ahead = engine.waiting.first(skipped + 1)
        return ahead[skipped] if len(ahead) > skipped else None

    @staticmethod
    def _may_skip(engine: EngineView, skipped: int) -> bool:
        """Whether admission may pass over the request it could not admit (``skip_blocked_waiting``); never a
        request holding KV that arrived (those are admitted first, in order)."""
        return skipped < engine.config.skip_blocked_waiting and not engine.kv_holding

    @staticmethod
    def _priority_victim(engine: EngineView, skipped: int) -> Request | None:
        """Under ``priority_preemption: max_num_seqs`` with the priority queue and ``max_num_seqs`` full: the running
        request the next waiting one preempts, the lowest-priority one (largest ``(priority, arrival_time)``), when
        the waiting one's priority value is strictly lower (vLLM PR #54530, open: equal priorities never preempt each
        other, or a preempted request, earlier by arrival, would take its slot back at once); else None."""
        cfg = engine.config
        if cfg.priority_preemption != "max_num_seqs" or cfg.queue_policy != "priority":
            return None
        head = VLLMV1Scheduler._candidate(engine, skipped)
        running = [r for r in engine.running if r.status is _RUNNING]
        if head is None or not running:
            return None
        victim = max(running, key=lambda q: (q.priority, q.arrival_time, q.index))
        return victim if head.priority < victim.priority else None

    def fast_forward_allowed(self, config: SchedulerConfig) -> bool:
        """No jump when admission may pass over a blocked head (``skip_blocked_waiting``) or a waiting request may
        preempt a running one (``priority_preemption`` under the priority queue): the jump plans neither."""
        return not config.skip_blocked_waiting and not (config.priority_preemption != "none"
                                                         and config.queue_policy == "priority")
