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


# None pending: cache-after-output, the one this harness found, is fixed (lab/core/outputs.py
# cache_computed_blocks; docs/vllm_parity.md).
PATCHES: list[Patch] = []

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
