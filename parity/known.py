"""The differences the harness found between vLLM 0.33.0's scheduler and servelab's vllm_v1 that servelab keeps,
each with its vLLM source location (docs/vllm_parity.md lists them). Three kinds:

* **Fixes pending** in servelab (:data:`PATCHES`): each a :class:`Patch` that the harness applies to servelab's
  pure-Python sources for its runs, so that the comparison goes on past it, with a reproducer that still differs
  without it (``python -m parity --known`` and tests/test_vllm_parity.py check both). Once servelab has the fix the
  reproducer agrees unpatched, and the check says to drop the patch.
* **Intended differences** (:data:`INTENDED`): behaviours servelab does not model. Two are compared against the
  vLLM mode that behaves as servelab does (parity/vllm_side.py): stale output dropped ("stale-output") and EAGLE's
  prefix hashes without lookahead tokens ("lookahead-hashes"). A trace that reaches the third
  ("resumed-one-short") is compared up to that schedule and stops there; the run's summary counts those traces by
  name (:func:`reached` is where a further one would be detected). None needs a trace excluded from the random
  draws (:func:`excluded` stays for one that would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from parity.trace import Settings, Trace, TraceRequest


@dataclass
class Patch:
    name: str
    where: str  # servelab file and function
    vllm: str  # vLLM 0.33.0 file:line
    what: str
    apply: Callable[[], Callable[[], None]]  # applies the fix, returns the function that reverts it
    reproducer: Callable[[], Trace]


# ---- pending fix 1: blocks cached after each output under async scheduling or speculative decoding ----

def _cache_computed(request, kv) -> None:
    """vLLM 0.33 ``update_from_output``: ``cache_blocks(request, num_computed_tokens - num_in_flight_tokens)``,
    where a stop has trimmed the computed tokens to all but the last token (``_update_request_with_output``)."""
    if kv.enable_prefix_caching:
        last = request.prompt_len + request.num_output_tokens - 1
        num_full = min(request.num_computed_tokens - request.inflight_tokens, last) // kv.block_size
        if num_full > request.num_cached_blocks:
            kv.register_full_blocks(request, num_full)


def _cache_after_output_fix():
    from lab.core import outputs

    cls = outputs.StepOutputs
    old_apply, old_release = cls.apply, outputs.release_request
    active = [False]  # inside a step's outputs that cache (async scheduling or drafts)

    def release_request(request, now, kv, on_done, on_hand_off):
        if active[0]:
            _cache_computed(request, kv)  # before its blocks are freed
        old_release(request, now, kv, on_done, on_hand_off)

    def apply(self, step, now):
        was_running = [r.status is outputs.RequestStatus.RUNNING for r in step.requests]
        active[0] = self.async_placeholders or self.acceptance is not None
        try:
            res = old_apply(self, step, now)
        finally:
            caching, active[0] = active[0], False
        if caching:
            for r, sampled, was in zip(step.requests, step.samples, was_running):
                if sampled and was and r.status is outputs.RequestStatus.RUNNING:
                    _cache_computed(r, self.kv)
        return res

    cls.apply, outputs.release_request = apply, release_request

    def revert():
        cls.apply, outputs.release_request = old_apply, old_release
    return revert


def _cache_after_output_trace() -> Trace:
    # async scheduling, blocks of 2: request 0 (2 prompt tokens, 3 outputs) finishes at operation 7 with its second
    # block (outputs 0 and 1) computed by its last step; vLLM caches that block at the output and frees it to the
    # tail of the free queue, servelab never cached it and frees it to the head: the next allocation differs
    import random

    from parity.trace import random_settings, random_trace
    rng = random.Random(14)
    return random_trace(rng, random_settings(rng))


PATCHES: list[Patch] = [
    Patch("cache-after-output", "lab/core/outputs.py StepOutputs.apply / release_request, and the fast-forward "
          "jump's registered blocks at a completion (lab/engine/jump/applying.py, free_order.py)",
          "vllm/v1/core/sched/scheduler.py:2402-2415 (update_from_output: cache_blocks(request, "
          "num_computed_tokens - num_in_flight_tokens) when the request had output placeholders or the engine "
          "speculates)",
          "Under async scheduling or speculative decoding vLLM 0.33 registers a request's full blocks after each "
          "of its outputs, up to the tokens its finished steps computed; servelab registers them only when a "
          "schedule allocates (capped at the tokens known then). A request that finishes or is preempted before "
          "its next schedule so frees one more hashed block in vLLM, which goes to the tail of the free queue "
          "(hittable, evicted last) instead of the head.",
          _cache_after_output_fix, _cache_after_output_trace),
]

_applied: list[Callable[[], None]] = []


def apply_patches() -> None:
    """Apply every proposed fix (once) to servelab's sources for this process."""
    if not _applied:
        for p in PATCHES:
            _applied.append(p.apply())


def revert_patches() -> None:
    while _applied:
        _applied.pop()()


@dataclass(frozen=True)
class Intended:
    name: str
    vllm: str  # vLLM 0.33.0 file:line
    what: str


INTENDED: list[Intended] = [
    Intended("stale-output", "vllm/v1/core/sched/scheduler.py:1832-1835 (_preempt_request marks in-flight output "
             "stale), 2316-2338 and 2744-2770 (update_from_output / _update_request_with_output deliver it)",
             "Under async scheduling a request preempted while a step that computes it is in flight still gets "
             "that step's tokens in vLLM 0.33 (appended as stale output, which may even finish it while it waits); "
             "servelab drops them (lab/engine/instance.py _drop_in_flight), as vLLM's drop mode does "
             "(drop_stale_output, scheduler.py:1832-1834 and 2337-2339, used for a prefix-cache reset and KV "
             "connectors with a pending hand-off). The harness sets that mode on vLLM's preempted requests and "
             "compares on."),
    Intended("resumed-one-short", "vllm/v1/core/sched/scheduler.py:998 (prefill_scheduled from is_prefill_chunk), "
             "1307-1316 (padding only without a running prefill chunk), 1863-1865 (is_prefill_chunk set)",
             "servelab tells a running prefill chunk from a decode by its counters (policies/vllm_v1.py "
             "was_prefill_chunk); a request recomputing after a preemption whose last chunk stopped one token "
             "short reads as a decode, so with drafts on a one-token admission in the same step may be padded "
             "where vLLM does not pad it. The comparison stops at a schedule that runs such a request."),
    Intended("lookahead-hashes", "vllm/config/vllm.py:678-692 (num_hash_lookahead_tokens), "
             "vllm/config/speculative.py:478 (disable_lookahead_block_hashes), vllm/v1/core/block_pool.py:362-370",
             "With EAGLE and prefix caching vLLM 0.33 by default extends each block's hash over the tokens the "
             "drafter reads after it; servelab models the rule before it, dropping the last hit block "
             "(use_eagle_block_drop), which 0.33 keeps under disable_lookahead_block_hashes: the harness runs vLLM "
             "with that option."),
]


def reached(preempted: list[str], in_flight: list) -> str | None:
    """The intended difference a schedule reached, where the comparison of the trace stops (the steps before it
    were compared), or None. None so far: "stale-output" is compared against vLLM's drop mode instead
    (parity/vllm_side.py), and "resumed-one-short" is checked by the harness before the schedule's comparison.
    ``preempted``: the requests this schedule preempted; ``in_flight``: the vLLM side's batches in flight."""
    return None


def excluded(trace: Trace) -> str | None:
    """Why random traces of this kind are not compared (they reach a recorded intended difference), or None."""
    return None


def check_all():
    """(name, still differs as recorded, detail) for each recorded difference's reproducer."""
    from parity.harness import run

    out = []
    for p in PATCHES:
        res = run(p.reproducer(), patched=False)
        if res.ok:
            out.append((p.name, False, "servelab now agrees with vLLM: drop the patch from parity/known.py"))
            continue
        first = str(res.divergence).splitlines()[0] if res.divergence else "stalled"
        res = run(p.reproducer(), patched=True)
        out.append((p.name, res.ok, first if res.ok else f"still differs with the fix applied: {res.divergence}"))
    return out
