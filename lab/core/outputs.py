"""A step's effect on its requests' counters: the one place where a schedule's tokens are counted as computed
(:func:`count_scheduled_tokens`, vLLM's ``_update_after_schedule``), and where outputs append tokens, roll drafts
back and finish requests (:class:`StepOutputs`, vLLM's ``update_from_output``).

As vLLM's ``Scheduler.update_from_output`` (vllm/v1/core/sched/scheduler.py): every request that sampled gets
1 + accepted tokens (accepted = drafts the rejection sampler kept, 0 without speculative decoding), its
``num_computed_tokens`` goes back by the rejected drafts (their KV slots stay allocated and are overwritten by the
next step), and a request that reached its output length (``stop_at``: ``max_tokens``, or fewer where a pool
hands it on) finishes here and frees its blocks at once. Inter-token
latencies and lifecycle events are recorded here too.
"""

from __future__ import annotations

from itertools import repeat
from typing import Callable, Protocol

from lab.core.kv_cache import KVCacheManager
from lab.core.request import Request, RequestStatus
from lab.core.samples import WeightedSamples
from lab.core.step import ScheduledStep

_RUNNING = RequestStatus.RUNNING


class DraftAcceptance(Protocol):
    """The drafter's random part under speculative decoding (lab/core/speculation.py ``Speculator``).

    ``propose`` returns the drafts the drafter proposes for a request's next step (0..k; 0 when an n-gram lookup
    misses). ``num_accepted`` returns an integer in [0, num_draft_tokens]: drafts 1..a were accepted and a + 1 was
    not (token i counts only if 1..i-1 did); it also keeps the spec-decode counters. Both must be deterministic for
    a given seed and call order. ``num_speculative_tokens`` is k, the most drafts ``propose`` returns.
    """

    num_speculative_tokens: int

    def propose(self, request: Request) -> int: ...

    def num_accepted(self, request: Request, num_draft_tokens: int) -> int: ...


def count_scheduled_tokens(requests: list[Request], num_new_tokens: list[int], num_spec_tokens: list[int] | None,
                           now: float, block_size: int, placeholders: bool,
                           propose: Callable[[Request], int] | None) -> tuple[list[int], list[bool], int]:
    """Count a schedule's tokens as computed (vLLM ``_update_after_schedule``): C += n for each request, its
    in-flight tokens too, and a request whose C reaches ``num_tokens`` + placeholders + its drafts (``k``, from
    ``num_spec_tokens``; None = none) samples at the end of the step; under async scheduling (``placeholders``) it
    then holds 1 + k output placeholders and, with ``propose``, its next drafts as placeholders. ``now`` (seconds)
    is its first scheduled time if it had none.

    Returns (each request's tokens computed before, whether each samples, -1), or, at the first request that is
    not running or whose blocks of ``block_size`` tokens do not hold its C + n tokens, the lists so far and that
    request's index (nothing of it counted: the caller reports the broken scheduler contract).
    """
    before: list[int] = []
    samples: list[bool] = []
    for i in range(len(requests)):
        r = requests[i]
        n = num_new_tokens[i]
        k = num_spec_tokens[i] if num_spec_tokens is not None else 0
        c = r.num_computed_tokens
        if r.status is not _RUNNING or len(r.blocks) * block_size < c + n:
            return before, samples, i
        before.append(c)
        c += n
        r.num_computed_tokens = c
        r.inflight_tokens += n
        if c >= r.prompt_len + r.num_output_tokens + r.num_output_placeholders + k:
            if placeholders:
                r.num_output_placeholders += 1 + k
                if propose is not None:  # async: the next drafts are placeholders, the real ones stay on the GPU
                    r.num_spec_tokens = propose(r)
            samples.append(True)
        else:
            samples.append(False)
        if r.first_scheduled_time is None:
            r.first_scheduled_time = now
    return before, samples, -1


def record_first_token(request: Request, now: float) -> None:
    """A request's first output token came at ``now`` (seconds): its TTFT end and, if kept, its event."""
    request.first_token_time = now
    if request.events is not None:
        request.events.append((now, "first_token"))


_VERIFIED_TEXT: dict[tuple[int, bool, int, int], str] = {}


def verified_text(num_drafts: int, placeholder: bool, accepted: int, emitted: int) -> str:
    """The detail of a ``verified`` event: ``"3 drafts, 2 accepted, 3 tokens emitted"`` (``"placeholder drafts"``
    for padded ones). Made once per distinct tuple (few: drafts <= k, accepted <= drafts, emitted <= accepted + 1)
    and shared, instead of formatted for each of a run's verifications."""
    key = (num_drafts, placeholder, accepted, emitted)
    text = _VERIFIED_TEXT.get(key)
    if text is None:
        text = _VERIFIED_TEXT[key] = (f"{num_drafts} {'placeholder ' if placeholder else ''}drafts, {accepted} "
                                      f"accepted, {emitted} tokens emitted")
    return text


def release_request(request: Request, now: float, kv: KVCacheManager,
                    on_done: Callable[[Request], None] | None,
                    on_hand_off: Callable[[Request], None] | None) -> None:
    """A request reached ``stop_at`` output tokens at ``now`` (seconds).

    With all ``max_tokens`` produced it finishes: its KV blocks are freed (cached content stays hittable) and
    ``on_done`` reports it. With fewer, its pool hands it on (status WAITING) through ``on_hand_off``, which owns
    the request's blocks from then on: it frees them on this instance, or keeps them pinned here for the next
    pool to read (prefill/decode disaggregation, ``kv.detach``), before the request reaches the next pool, so a
    request never arrives holding another instance's block ids (lab/cluster/cluster.py ``Cluster._leave``). The
    request leaves with its tokens' KV computed except the last sampled token's (``num_computed_tokens =
    num_tokens - 1``, as after any decode): drafts accepted past ``stop_at`` were not emitted, and a step of it
    still in flight here (async scheduling) is dropped with its placeholders and drafts. The event is recorded
    either way."""
    finished = request.num_output_tokens >= request.max_tokens
    request.status = RequestStatus.FINISHED if finished else RequestStatus.WAITING
    if finished:
        request.finish_time = now
    request.num_output_placeholders = 0
    request.inflight_tokens = 0
    request.num_spec_tokens = 0  # draft token ids never leave the instance
    if request.events is not None:
        request.events.append((now, "finished" if finished else "handed_off"))
    if finished or on_hand_off is None:
        kv.free(request, finished=True)
        if on_done is not None and finished:
            on_done(request)
        return
    num_tokens = request.prompt_len + request.num_output_tokens
    if request.num_computed_tokens > num_tokens - 1:
        request.num_computed_tokens = num_tokens - 1
    on_hand_off(request)


def cache_computed_blocks(request: Request, kv: KVCacheManager) -> None:
    """Register the request's full blocks up to the tokens its finished steps computed, as vLLM 0.33 does after
    each output under async scheduling or speculative decoding (vllm/v1/core/sched/scheduler.py:2402-2415,
    ``update_from_output``: ``cache_blocks(request, num_computed_tokens - num_in_flight_tokens)``, where a stop has
    trimmed the computed tokens to all but the last token, ``_update_request_with_output``). A schedule's
    allocation registers at least as many for a request that runs on, so this matters for one that finishes, is
    handed on or is preempted before its next allocation: it frees one more hashed block (to the free queue's
    tail, still hittable) when its computed tokens fill a block. Found by the parity harness (docs/vllm_parity.md).
    No-op without prefix caching."""
    if not kv.enable_prefix_caching:
        return
    last = request.prompt_len + request.num_output_tokens - 1
    computed = request.num_computed_tokens - request.inflight_tokens
    num_full = (computed if computed < last else last) // kv.block_size
    if num_full > request.num_cached_blocks:
        kv.register_full_blocks(request, num_full)


class StepOutputs:
    """Applies steps' outputs on one instance.

    Args:
        kv: the instance's KV cache manager.
        itl: receives every inter-token latency (seconds): one sample per step output that carries tokens of a
            request, however many tokens it carries (shared/specs/metrics.md).
        on_done: called with each request that finishes.
        on_hand_off: called with each request that leaves for another pool (``stop_at < max_tokens``); set by
            the cluster (lab/cluster/cluster.py).
        async_placeholders: under async scheduling a sampling request holds output placeholders (P) for its step
            in flight; they are released here.
        acceptance: the drafter (speculative decoding): after a step, a request that sampled and runs on gets its
            next drafts from it (under async scheduling the engine sets them as placeholders at schedule time),
            and it decides how many scheduled drafts the target accepts. None = no speculative decoding.
    """

    def __init__(self, kv: KVCacheManager, itl: WeightedSamples, on_done: Callable[[Request], None] | None,
                 async_placeholders: bool, acceptance: DraftAcceptance | None = None) -> None:
        self.kv = kv
        self.itl = itl
        self.on_done = on_done
        self.on_hand_off: Callable[[Request], None] | None = None
        self.async_placeholders = async_placeholders
        self.acceptance = acceptance
        # vLLM registers full blocks after each output under async scheduling or speculative decoding
        self.caches_after_output = (async_placeholders or acceptance is not None) and kv.enable_prefix_caching

    def release(self, request: Request, now: float) -> None:
        """:func:`release_request` for a request that reached ``stop_at`` at ``now``, its computed blocks first
        registered where vLLM registers them after the output (:func:`cache_computed_blocks`)."""
        if self.caches_after_output:
            cache_computed_blocks(request, self.kv)
        release_request(request, now, self.kv, self.on_done, self.on_hand_off)

    def apply(self, step: ScheduledStep, now: float) -> tuple[int, int]:
        """Apply ``step``'s outputs at ``now``; returns (tokens emitted, requests finished).

        Raises:
            ValueError: the step carries drafts but no acceptance model was given, or the model returned a count
                outside [0, drafts].
        """
        start = step.start
        if self.acceptance is not None:
            for r, n in zip(step.requests, step.num_new_tokens):
                r.inflight_tokens -= n
            return self._apply_with_drafts(step, now, step.num_spec_tokens)
        if step.num_spec_tokens is not None:
            raise ValueError("a step scheduled draft tokens but the instance has no draft acceptance model")
        itl = self.itl
        placeholders = self.async_placeholders
        caches, kv = self.caches_after_output, self.kv
        finished = sampled = same_gap = 0  # same_gap: samples equal to this step's gap (previous token at its start)
        # One pass: a request's in-flight count drops as its output is applied (nothing reads another request's
        # count meanwhile; releasing a finished request sets its own to 0).
        for r, n, s in zip(step.requests, step.num_new_tokens, step.samples):
            r.inflight_tokens -= n
            if not s or r.status is not _RUNNING:
                continue  # a non-final prefill chunk, or a request preempted while the step was in flight
            if placeholders:
                r.num_output_placeholders -= 1
            sampled += 1
            r.num_output_tokens = k = r.num_output_tokens + 1
            last = r.last_token_time
            if r.first_token_time is None:
                record_first_token(r, now)
            elif last == start:
                same_gap += 1
            elif last is not None:  # (always: a request with a first token has a last one)
                itl.add(now - last)
            r.last_token_time = now
            if k >= r.stop_at:
                self.release(r, now)
                finished += 1
            elif caches:
                cache_computed_blocks(r, kv)
        if same_gap:
            itl.add(now - start, same_gap)
        return sampled, finished

    def _apply_with_drafts(self, step: ScheduledStep, now: float, spec: list[int] | None) -> tuple[int, int]:
        """The general form: request i emits 1 + accepted_i tokens and rolls C back by drafts_i - accepted_i; under
        sync scheduling a request that sampled and runs on gets its next drafts now (vLLM ``post_step``). ITL
        samples equal to the step's gap (the request's previous token at the step's start) are added as one
        weighted sample, as :meth:`apply` adds them."""
        finished = emitted_total = same_gap = 0
        padded = step.padded_drafts
        start = step.start
        model = self.acceptance
        propose = None if self.async_placeholders else model.propose  # type: ignore[union-attr]
        placeholders = self.async_placeholders
        itl = self.itl
        for r, s, k in zip(step.requests, step.samples, spec if spec is not None else repeat(0)):
            if not s or r.status is not _RUNNING:
                continue  # a non-final chunk: no token, and drafts proposed after it are discarded
            if placeholders:
                r.num_output_placeholders -= 1 + k
            accepted = 0
            if k:
                if not (padded and r in padded):
                    accepted = model.num_accepted(r, k)  # type: ignore[union-attr]
                    if not 0 <= accepted <= k:
                        self._bad_acceptance(r, k, accepted)
                r.num_computed_tokens -= k - accepted  # rejected drafts: their slots are overwritten next step
            out = r.num_output_tokens
            stop = r.stop_at
            emitted = 1 + accepted if out + 1 + accepted <= stop else stop - out
            r.num_output_tokens = out = out + emitted
            emitted_total += emitted
            if k and r.events is not None:
                r.events.append((now, "verified", verified_text(k, bool(padded and r in padded), accepted, emitted)))
            last = r.last_token_time
            if r.first_token_time is None:
                record_first_token(r, now)
            elif last == start:
                same_gap += 1
            elif last is not None:  # one ITL sample per step output, however many tokens
                itl.add(now - last)
            r.last_token_time = now
            if out >= stop:
                self.release(r, now)
                finished += 1
                continue
            if self.caches_after_output:
                cache_computed_blocks(r, self.kv)
            if propose is not None:
                r.num_spec_tokens = propose(r)
        if same_gap:
            itl.add(now - start, same_gap)
        return emitted_total, finished

    @staticmethod
    def _bad_acceptance(request: Request, num_draft_tokens: int, accepted: int) -> None:
        raise ValueError(f"request {request.request_id}: acceptance model returned {accepted} accepted of "
                         f"{num_draft_tokens} draft tokens (expected 0..{num_draft_tokens})")
