"""SGLang's scheduler (sglang 0.5.x ``managers/scheduler.py`` ``get_next_batch_to_run`` /
``get_new_batch_prefill`` / ``update_running_batch``, ``managers/schedule_policy.py`` ``SchedulePolicy`` and
``PrefillAdder``, ``managers/schedule_batch.py`` ``retract_decode``), as shared/specs/vllm-v1-scheduling.md §8
summarises it.

- **Prefill first.** Each step first tries to build a prefill (extend) batch; if it gets one, the step runs it
  alone and the running requests do not decode (``enable_mixed_chunk`` adds them to it); otherwise every running
  request decodes one token.
- **One chunked request at a time** (``chunked_req``). It continues first, with up to ``chunked_prefill_size``
  tokens; a waiting request whose prompt does not fit the chunk left becomes the next chunked request.
- **PrefillAdder admission.** Waiting requests are taken in policy order while ``max_num_seqs``,
  ``max_prefill_tokens`` and the chunk allow, and while prompt + ``min(max_new_tokens, 4096)`` fits the KV left
  after reserving ``min(max_new - generated, 4096) * new_token_ratio`` tokens for every running request. A
  ``NO_TOKEN`` outcome marks the batch full: no prefill is tried again until a running request finishes or is
  retracted (SGLang's ``batch_is_full``).
- **new_token_ratio** starts at ``0.7 * schedule_conservativeness``, decays linearly to ``0.14 x`` that over 600
  decode steps, returns to the start when the engine is idle, and after a retraction is set to
  ``(Σ generated + 20 * n) / Σ max_new_tokens`` over the requests still running.
- **Retraction.** When the next decode step's tokens do not fit the free KV, running requests are retracted
  (recompute; the retracted request goes to the tail of the waiting queue and later re-hits its own cached
  prefix) in SGLang's order — fewest generated tokens first, then longest prompt — until the next decode step of
  the rest fits (``retract_rule: next_decode``, sglang 0.5 ``ScheduleBatch.retract_decode`` looping on
  ``check_decode_mem``; older releases retracted until the free KV held ``retract_decode_steps`` = 20 tokens per
  remaining request: ``decode_steps``); at least one is retracted, and the ratio becomes
  ``(Σ generated + 20 · n) / (Σ max_new_tokens + 1)``.
- **Overlap scheduler** (on by default in SGLang; ``--disable-overlap-schedule`` is ``engine.async_scheduling:
  false``): the next batch is scheduled while the current one runs (the engine's async scheduling, with output
  placeholders), so the CPU's scheduling work hides behind the GPU; a request whose last token is in flight is not
  scheduled again.
- **max_running_requests.** SGLang's default is ``min(pool tokens // 2, request-slot pool)``, the slot pool
  ``min(max(pool tokens / context_len x 512, 2048), 4096)`` (sglang ``model_runner.py`` ``init_memory_pool``): for
  ``policy.scheduler: sglang`` an unset ``engine.max_num_seqs`` takes it (lab/experiment/resolve.py), not
  vLLM's per-GPU default.
- **prefill_decode_interval** (``--prefill-decode-interval``, default 0 = off; sglang ``_should_defer_prefill`` /
  ``_arm_prefill_decode_interval``): after a step that prefilled, the next N steps decode, even with a chunked
  request pending.
- **Orders** (``schedule_policy``): ``fcfs``; ``lof`` (longest ``max_new_tokens`` first); ``lpm`` (longest prefix
  match first) and ``dfs-weight`` (depth-first over the prefix tree, heavier subtrees first), both falling back
  to FCFS when more than 128 requests wait (SGLang applies the cap to ``lpm`` only; here it also bounds
  ``dfs-weight``'s per-step cost).

Radix cache approximation: SGLang's token-granular radix tree is modelled by the engine's block-hash prefix cache
(engine.block_size plays SGLang's ``page_size``): a prefix matches whole blocks, freed blocks stay cached and are
evicted least recently used, a request's tail blocks first (as SGLang evicts leaves first). Retracted requests
keep their generated tokens' blocks cached too (SGLang keeps only the prompt in the tree). The prefix tree of
``dfs-weight`` is the tree of the waiting requests' matched block-hash chains.
"""

from __future__ import annotations

import heapq
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from lab.core.queues import FixedOrder, make_queue
from lab.core.request import Request
from lab.core.sched_api import EngineView, SchedulerBase, SchedulerConfig, SchedulerOutput
from policies.common import (allocate_waiting, is_running, lookup, pick_victim, schedule_drafts, take_waiting)


def decode_tokens(engine: EngineView, request: Request) -> int:
    """Tokens a running request past its prompt computes in the next step: its last sampled token and its drafts
    (``num_tokens + drafts + placeholders - computed``: 1 + k; the overlap scheduler counts the tokens of the step in
    flight), cut at ``max_model_len``; 0 once the step in flight samples its last token."""
    p = request.num_output_placeholders
    c = request.num_computed_tokens
    if p and c + 2 - p >= request.prompt_len + request.stop_at:
        return 0
    n = request.num_tokens + request.num_spec_tokens + p - c
    cap = engine.config.max_model_len - 1 - c
    return n if n <= cap else cap


def kv_groups_per_token(engine: EngineView) -> int:
    """KV cache groups in whose blocks each token takes a slot: 1, or a sliding-window hybrid's groups under the one
    shared pool servelab runs it on (lab/core/kv_groups.py; SGLang itself keeps separate full and SWA pools,
    docs/hybrid_models.md). SGLang's token arithmetic (the KV left for admission, a decode step's blocks) counts a
    free token that many times over, counting the sliding-window blocks freed outside the window as held: a
    conservative count, without which admission over-fills the shared pool and a decode that cannot allocate is
    retracted again and again."""
    hybrid = engine.kv.hybrid
    return len(hybrid.groups) if hybrid is not None else 1


def sglang_max_running_requests(pool_tokens: int, context_len: int) -> int:
    """SGLang's default ``--max-running-requests`` for a KV pool of ``pool_tokens`` tokens: ``pool_tokens // 2``, at
    most the request-slot pool's size ``min(max(int(pool_tokens / context_len * 512), 2048), 4096)`` (sglang
    ``model_executor/model_runner.py`` ``init_memory_pool`` and the scheduler's ``max_running_requests``)."""
    slots = min(max(int(pool_tokens / max(context_len, 1) * 512), 2048), 4096)
    return max(1, min(pool_tokens // 2, slots))


class LongestOutputFirstQueue(FixedOrder):
    """Waiting queue ordered by ``max_tokens`` descending (SGLang ``lof``), then priority when the priority
    policy is on, then arrival; a requeued request is simply pushed again. Implements ``WaitingQueue``."""

    arrivals_join_back = False  # an arrival may be served before requests already waiting

    def __init__(self, use_priority: bool = False) -> None:
        self._h: list[tuple[tuple, Request]] = []
        self.use_priority = use_priority

    def _key(self, r: Request) -> tuple:
        k = (-r.max_tokens, r.arrival_time, r.index)
        return ((r.priority,) + k) if self.use_priority else k

    def add(self, request: Request) -> None:
        heapq.heappush(self._h, (self._key(request), request))

    prepend = add

    def peek(self) -> Request:
        return self._h[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._h)[1]

    def remove(self, request: Request) -> None:
        self._h = [e for e in self._h if e[1] is not request]
        heapq.heapify(self._h)

    def __len__(self) -> int:
        return len(self._h)

    def __bool__(self) -> bool:
        return bool(self._h)

    def __iter__(self) -> Iterator[Request]:
        return iter([e[1] for e in sorted(self._h, key=lambda e: e[0])])

    def first(self, n: int) -> list[Request]:
        """The first ``n`` requests in service order (fewer if fewer wait)."""
        return [e[1] for e in heapq.nsmallest(n, self._h, key=lambda e: e[0])]


def dfs_weight_order(requests: list[Request], matched_blocks: list[int]) -> list[int]:
    """SGLang's ``dfs-weight`` order of waiting requests (indices into ``requests``).

    Each request's last matched node is the hash of its last cached prefix block (the root when nothing
    matched); a node's weight is the number of waiting requests whose last node lies in its subtree. The order is
    a depth-first walk from the root visiting children by descending weight (first seen first among equals) and
    emitting a node's own requests after its children, as ``_get_dfs_priority`` does.
    """
    root = None
    children: dict = {root: {}}
    own: dict = {}
    for i, (r, m) in enumerate(zip(requests, matched_blocks)):
        parent = root
        for h in r.block_hashes[:m]:
            kids = children[parent]
            if h not in kids:
                kids[h] = None
                children[h] = {}
            parent = h
        own.setdefault(parent, []).append(i)
    weight: dict = {}
    stack = [(root, False)]
    while stack:  # post-order: subtree sums
        node, done = stack.pop()
        if done:
            weight[node] = len(own.get(node, ())) + sum(weight[c] for c in children[node])
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children[node])
    order: list[int] = []
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.extend(own.get(node, ()))
            continue
        stack.append((node, True))
        kids = sorted(children[node], key=lambda c: -weight[c])  # stable: first seen first among equals
        stack.extend((c, False) for c in reversed(kids))
    return order


class SGLangScheduler(SchedulerBase):
    """SGLang: prefill-first steps, one chunked request, PrefillAdder with new_token_ratio, retraction."""

    def max_step_tokens(self, config: SchedulerConfig) -> int | None:
        """No engine-side cap: SGLang budgets prefills with its own ``max_prefill_tokens`` / ``chunked_prefill_size``; decodes always run."""
        return None

    name = "sglang"
    supports_speculation = True  # a decode step verifies each request's drafts (EAGLE worker, topk 1)
    admits_kv_holding = True  # (policies/common.py next_waiting)
    supports_async = True  # SGLang's overlap scheduler: tokens in flight counted (decode_tokens)

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        schedule_policy: Literal["fcfs", "lof", "lpm", "dfs-weight"] = Field("fcfs", description="waiting order")
        chunked_prefill_size: int | None = Field(
            None, description="tokens of one prefill chunk (None = engine.max_num_batched_tokens; -1 = no chunking)")
        max_prefill_tokens: int = Field(16384, ge=1, description="prompt tokens of one prefill batch")
        schedule_conservativeness: float = Field(1.0, gt=0, description="scales the initial new_token_ratio")
        init_new_token_ratio: float = Field(0.7, gt=0, le=1, description="initial new_token_ratio (before scaling)")
        min_new_token_ratio_factor: float = Field(0.14, gt=0, le=1, description="floor of the ratio, as a fraction of the initial one")
        new_token_ratio_decay_steps: int = Field(600, ge=1, description="decode steps to decay from the initial ratio to its floor")
        clip_max_new_tokens: int = Field(4096, ge=1, description="max_new_tokens clipped to this in the KV estimate")
        retract_decode_steps: int = Field(20, ge=1, description="decode steps per remaining request in the ratio "
                                          "after a retraction (and the decode_steps rule's target)")
        retract_rule: Literal["next_decode", "decode_steps"] = Field(
            "next_decode", description="retract until the next decode fits (sglang 0.5), or until retract_decode_steps "
            "tokens per remaining request are free (older sglang)")
        prefill_decode_interval: int = Field(0, ge=0, description="decode steps forced after each prefill step "
                                             "(--prefill-decode-interval; 0 = off)")
        enable_mixed_chunk: bool = Field(False, description="running requests decode in prefill steps too")
        cache_aware_max_waiting: int = Field(128, ge=1, description="lpm / dfs-weight fall back to fcfs above this many waiting")

    def __init__(self, options: "SGLangScheduler.Options | None" = None) -> None:
        self.options = o = options or self.Options()
        self.init_ratio = min(o.init_new_token_ratio * o.schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * o.min_new_token_ratio_factor, 1.0)
        self.decay = (self.init_ratio - self.min_ratio) / o.new_token_ratio_decay_steps
        self.new_token_ratio = self.init_ratio
        self.chunked_req: Request | None = None
        self.batch_is_full = False
        self._expected_bs = 0
        self.num_retractions = 0
        self._defer_prefill = 0  # decode steps still forced by prefill_decode_interval

    def make_queue(self, config: SchedulerConfig):
        """``lof`` keeps its own heap; other orders use the engine's FCFS deque or priority heap."""
        if self.options.schedule_policy == "lof":
            return LongestOutputFirstQueue(config.queue_policy == "priority")
        return make_queue(config.queue_policy)

    # ---- one step ----
    def schedule(self, engine: EngineView) -> SchedulerOutput:
        running = engine.running
        if not running:
            self.new_token_ratio = self.init_ratio  # idle: back to the initial estimate
            self.batch_is_full = False  # an empty batch is never full (else a retracted last request is stuck)
        chunked = self.chunked_req
        if chunked is not None and not is_running(chunked):
            self.chunked_req = chunked = None
        decoding = [r for r in running if r is not chunked]
        if len(decoding) < self._expected_bs:
            self.batch_is_full = False  # a request finished: the batch has room again
        if self._defer_prefill and decoding:  # _should_defer_prefill (a chunked request waits too)
            self._defer_prefill -= 1
            out = SchedulerOutput()
        else:
            self._defer_prefill = 0
            out = self._prefill(engine, decoding)
            if out.requests:  # _arm_prefill_decode_interval: a prefill step ran
                self._defer_prefill = self.options.prefill_decode_interval
        if not out.requests:
            self._decode(engine, decoding, out)
        if not out.requests and engine.running and not any(r.num_output_placeholders for r in engine.running):
            # Only the chunked request is left and even it cannot get a chunk: retract it (never expected; with
            # the overlap scheduler a schedule may be empty while the step in flight samples the last tokens).
            r = engine.running[-1]
            engine.preempt(r, reason="SGLang: no prefill or decode could be scheduled", requeue="tail")
            out.preempted.append(r)
            self.chunked_req = None
        self._expected_bs = len(engine.running) - (self.chunked_req is not None and is_running(self.chunked_req))
        return out

    def _reserve(self, r: Request) -> int:
        return min(r.max_tokens - r.num_output_tokens, self.options.clip_max_new_tokens)

    def _candidates(self, engine: EngineView) -> Iterator[Request]:
        """Waiting requests in policy order. The caller looks each one up again right before allocating (an
        admission can evict blocks an earlier lookup found)."""
        yield from list(engine.kv_holding)  # KV already here (disaggregated decode side) goes first
        waiting = engine.waiting
        policy = self.options.schedule_policy
        if policy in ("lpm", "dfs-weight") and len(waiting) <= self.options.cache_aware_max_waiting:
            reqs = list(waiting)
            matches = [lookup(engine, r) for r in reqs]
            if policy == "lpm":
                order = sorted(range(len(reqs)), key=lambda i: -matches[i][1])
            else:
                order = dfs_weight_order(reqs, [len(m[0]) for m in matches])
            for i in order:
                yield reqs[i]
            return
        while waiting:  # fcfs / lof / priority: the queue's own order; the loop only resumes after an admission
            yield waiting.peek()

    def _prefill(self, engine: EngineView, decoding: list[Request]) -> SchedulerOutput:
        o = self.options
        cfg = engine.config
        kv = engine.kv
        waiting = engine.waiting
        out = SchedulerOutput()
        if self.chunked_req is None and (self.batch_is_full or not (waiting or engine.kv_holding)):
            return out
        running_bs = len(decoding)
        if running_bs >= cfg.max_num_seqs and self.chunked_req is None:
            self.batch_is_full = True
            return out
        bs = kv.block_size
        free_tokens = kv.num_free_blocks * bs // kv_groups_per_token(engine)
        rem_total = free_tokens - self.new_token_ratio * sum(self._reserve(r) for r in decoding)
        rem_input = o.max_prefill_tokens
        chunk = o.chunked_prefill_size if o.chunked_prefill_size is not None else cfg.max_num_batched_tokens
        rem_chunk: int | None = None if chunk == -1 else chunk
        mixed = o.enable_mixed_chunk and bool(decoding)
        if mixed:
            rem_input -= running_bs
            if rem_chunk is not None:
                rem_chunk -= running_bs

        r = self.chunked_req
        if r is not None:  # the chunked request continues first
            extend = r.num_tokens - r.num_computed_tokens
            limit = int(rem_total) if rem_chunk is None else min(rem_chunk, int(rem_total))
            n = extend if extend <= limit else limit // bs * bs
            if n > 0 and kv.allocate_slots(r, n):
                out.add(r, n)
                truncated = n < extend
                rem_total -= n + (0 if truncated else self._reserve(r))
                rem_input -= n
                if rem_chunk is not None:
                    rem_chunk -= n
                if not truncated:
                    self.chunked_req = None

        if (waiting or engine.kv_holding) and rem_input > 0 and (rem_chunk is None or rem_chunk > 0):
            for r in self._candidates(engine):
                if len(engine.running) >= cfg.max_num_seqs:  # the chunked request holds a slot too (SGLang
                    self.batch_is_full = True                    # counts it in PrefillAdder.can_run_list)
                    break
                hits, num_hit = lookup(engine, r)
                extend = r.num_tokens - num_hit
                reserve = self._reserve(r)
                if extend + reserve >= rem_total:
                    self.batch_is_full = True  # NO_TOKEN
                    break
                if extend > rem_input and out.requests:
                    break
                if rem_chunk is None or extend <= rem_chunk:
                    n, becomes_chunked = extend, False
                else:
                    n, becomes_chunked = rem_chunk // bs * bs, True
                    if n <= 0 or self.chunked_req is not None:
                        break
                if not allocate_waiting(engine, r, n, hits, num_hit):
                    self.batch_is_full = True
                    break
                take_waiting(engine, r)
                engine.admit(r, num_hit)
                out.add(r, n)
                rem_total -= n + (0 if becomes_chunked else reserve)
                rem_input -= n
                if rem_chunk is not None:
                    rem_chunk -= n
                if becomes_chunked:
                    self.chunked_req = r
                    break
                if rem_total <= 0:
                    self.batch_is_full = True
                    break
                if rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
                    break

        if mixed and out.requests:
            ns = [decode_tokens(engine, d) for d in decoding]
            if self._decode_need(engine, decoding) <= kv.num_free_blocks:
                for d, n in zip(decoding, ns):
                    if n > 0 and kv.allocate_slots(d, n):
                        out.add(d, n)
                        if d.num_spec_tokens:
                            schedule_drafts(out, d, n)
        return out

    def _decode(self, engine: EngineView, decoding: list[Request], out: SchedulerOutput) -> None:
        if not decoding:
            return
        kv = engine.kv
        decoding = [r for r in decoding if decode_tokens(engine, r) > 0]  # (not one whose last token is in flight)
        if not decoding:
            return
        if self._decode_need(engine, decoding) > kv.num_free_blocks:
            decoding = self._retract(engine, decoding, out)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.decay, self.min_ratio)
        lookahead = engine.config.num_lookahead_tokens
        for r in decoding:
            if not is_running(r):
                continue
            n = decode_tokens(engine, r)  # EAGLE/MTP verify: the sampled token and its drafts (topk 1 chain)
            if not kv.allocate_slots(r, n, num_lookahead_tokens=lookahead):
                engine.preempt(r, reason="SGLang: decode out of KV after retraction", requeue="tail")
                out.preempted.append(r)
                continue
            out.add(r, n)
            if r.num_spec_tokens:
                schedule_drafts(out, r, n)

    @staticmethod
    def _decode_need(engine: EngineView, decoding: list[Request]) -> int:
        """New blocks the next decode step of ``decoding`` takes (``check_decode_mem``), in every KV cache group
        (:func:`kv_groups_per_token`)."""
        bs = engine.kv.block_size
        return kv_groups_per_token(engine) * sum(
            max(0, -(-(r.num_computed_tokens + decode_tokens(engine, r)) // bs) - len(r.blocks)) for r in decoding)

    def _retract(self, engine: EngineView, decoding: list[Request], out: SchedulerOutput) -> list[Request]:
        """``retract_decode``: retract until the next decode step of the rest fits (``next_decode``) or the free KV
        holds ``retract_decode_steps`` tokens per remaining request (``decode_steps``), at least one retraction,
        then re-estimate ``new_token_ratio``."""
        o = self.options
        kv = engine.kv
        rule = engine.config.preemption_victim
        if rule == "auto":  # SGLang: sort by (generated, -prompt) descending and pop from the end
            order = sorted(decoding, key=lambda r: (r.num_output_tokens, -r.prompt_len), reverse=True)
        else:
            order = list(decoding)
        first = True
        while first or (self._decode_need(engine, order) > kv.num_free_blocks if o.retract_rule == "next_decode"
                        else kv.num_free_blocks * kv.block_size < o.retract_decode_steps * len(order)):
            if len(order) == 1:
                break
            first = False
            victim = order.pop() if rule == "auto" else pick_victim(order, rule)
            if rule != "auto":
                order.remove(victim)
            engine.preempt(victim, requeue="tail",
                           reason=f"SGLang retraction: decode needs more KV than is free ({kv.num_free_blocks} "
                                  f"blocks); {len(order)} requests keep running")
            out.preempted.append(victim)
            self.num_retractions += 1
        total_decoded = sum(r.num_output_tokens for r in order)
        total_max = sum(r.max_tokens for r in order)
        if order:
            self.new_token_ratio = min(1.0, (total_decoded + o.retract_decode_steps * len(order)) / (total_max + 1))
        self.batch_is_full = False
        # keep admission order for the decode batch
        keep = {id(r) for r in order}
        return [r for r in decoding if id(r) in keep]
