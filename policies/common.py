"""Building blocks every scheduler shares: prefix lookup, victim selection, allocate-or-preempt and whole-prompt
admission.

These are helpers on top of the :class:`lab.sched_api.EngineView` mechanisms; a user's policy may import them.

Victim rules (``policy.preemption.victim``), applied to the running list (admission order):

- ``last``: the last admitted request (vLLM V1 FCFS, vLLM V0, Sarathi-Serve: ``running.pop(-1)``).
- ``lowest_priority``: the largest ``(priority, arrival_time, index)`` (vLLM V1 priority policy; requests that
  arrive at one instant are told apart by arrival order, as vLLM's own timestamps, taken as each is added, do).
- ``most_kv``: the request holding the most KV blocks (frees the most memory with one preemption); ties go to
  the later admitted. Among the requester and those admitted after it (see :func:`pick_victim`).
- ``least_progress``: the request with the fewest generated tokens, then the longest prompt (least work lost
  when it recomputes; SGLang's retraction order); ties go to the later admitted. Among the requester and those
  admitted after it.
- ``auto``: the policy's own rule (``last`` under FCFS, ``lowest_priority`` under the priority queue for the
  vLLM-style schedulers; SGLang's retraction order for ``sglang``).
"""

from __future__ import annotations

from typing import Callable

from lab.core.kv_cache import Block
from lab.core.request import Request, RequestStatus
from lab.core.sched_api import EngineView, SchedulerOutput

VICTIM_RULES = ("last", "lowest_priority", "most_kv", "least_progress")


def lookup(engine: EngineView, request: Request) -> tuple[list[Block], int]:
    """Prefix-cache hits for a waiting request: ``(hit blocks, computed tokens)``.

    A request that already holds computed state (swapped out: its KV comes back from CPU memory) reports its
    own ``num_computed_tokens`` and no hit blocks.
    """
    if request.num_computed_tokens:
        return [], request.num_computed_tokens
    return engine.kv.get_computed_blocks(request)


def allocate_waiting(engine: EngineView, request: Request, num_new_tokens: int, hits: list[Block],
                     num_computed: int, **kwargs) -> bool:
    """``kv.allocate_slots`` for a waiting request with the result of :func:`lookup` (prefix-hit blocks, or the
    computed state of a swapped-out request); ``kwargs`` go to ``allocate_slots`` (lookahead, watermark, ...).

    Returns:
        True if its slots were allocated (then ``engine.admit(request, num_computed)``).
    """
    return engine.kv.allocate_slots(request, num_new_tokens, hits,
                                    0 if request.num_computed_tokens else num_computed, **kwargs)


def start_cpu_load(engine: EngineView, request: Request, hits: list[Block], num_hit: int, **kwargs) -> bool | None:
    """The KV-offloading step of admitting a waiting request (vLLM's scheduler asking the OffloadingConnector,
    ``get_num_new_matched_tokens``, after ``get_computed_blocks``): look for the blocks after its GPU prefix hit
    (``hits``, ``num_hit`` tokens, from :func:`lookup`) in the CPU tier; on a hit allocate blocks for GPU + CPU
    hit tokens (``kwargs`` go to ``allocate_slots``: lookahead, watermark, full-sequence gate), take the request out
    of the waiting queue and start the load (``engine.start_cpu_load``).

    Returns:
        None: no CPU hit (or offloading off, or the request holds computed state): admit it as usual.
        True: the load started; go on with the next waiting request.
        False: it has a CPU hit but must wait (no free blocks, or its blocks are being loaded for another
        request): stop admitting, as vLLM does at an allocation failure.
    """
    offload = engine.kv_offload
    if offload is None or request.num_computed_tokens:
        return None
    n = offload.lookup(request, num_hit, engine.now)
    if n is None:
        return False
    if not n:
        return None
    if not engine.kv.allocate_slots(request, n, hits, num_hit, delay_cache_blocks=True, **kwargs):
        return False
    take_waiting(engine, request)
    engine.start_cpu_load(request, num_hit, n)
    return True


def aligned_split(engine: EngineView) -> Callable[[Request, int, int], int] | None:
    """The prefill-chunk cut of a Mamba hybrid caching its state (vLLM ``_mamba_block_aligned_split``, align mode:
    ``(request, tokens, prefix-hit tokens) -> tokens`` ending on a block boundary; lab/core/kv_groups.py
    ``HybridKV.aligned_chunk``), or None when the KV cache needs none."""
    hybrid = engine.kv.hybrid
    return hybrid.aligned_chunk if hybrid is not None and hybrid.spec.aligned_split else None


def resolve_victim_rule(engine: EngineView) -> str:
    """The configured victim rule, with ``auto`` mapped to vLLM's (``last`` / ``lowest_priority``)."""
    rule = engine.config.preemption_victim
    if rule == "auto":
        return "lowest_priority" if engine.config.queue_policy == "priority" else "last"
    return rule


def pick_victim(running: list[Request], rule: str, requester: Request | None = None) -> Request:
    """The running request ``rule`` preempts first (see the module docstring).

    With a ``requester`` (the running request that needs KV), ``most_kv`` and ``least_progress`` choose among the
    requester and the requests admitted after it only: a request never preempts one ahead of it in the running
    list. The oldest running request therefore always makes progress, as under vLLM's own ``last`` rule; without
    this, two requests can keep preempting each other and recomputing, forever (a livelock).

    Raises:
        ValueError: an unknown rule, or an empty running list.
    """
    if not running:
        raise ValueError("pick_victim: nothing is running")
    if requester is not None and rule in ("most_kv", "least_progress"):
        for i, r in enumerate(running):
            if r is requester:
                running = running[i:]
                break
    if rule == "last":
        return running[-1]
    n = len(running)
    if rule == "lowest_priority":
        return max(running, key=lambda q: (q.priority, q.arrival_time, q.index))
    if rule == "most_kv":
        i = max(range(n), key=lambda k: (len(running[k].blocks), k))
        return running[i]
    if rule == "least_progress":
        i = min(range(n), key=lambda k: (running[k].num_output_tokens, -running[k].prompt_len, -k))
        return running[i]
    raise ValueError(f"unknown victim rule {rule!r}; expected one of {', '.join(VICTIM_RULES)}")


def preemption_reason(request: Request, num_new_tokens: int, rule: str) -> str:
    """The reason recorded with each victim preempted so that ``request`` gets KV slots for ``num_new_tokens``
    tokens under victim ``rule``."""
    return f"KV cache full: request {request.request_id} needed slots for {num_new_tokens} token(s); victim rule {rule}"


def allocate_or_preempt(engine: EngineView, out: SchedulerOutput, request: Request, num_new_tokens: int,
                        rule: str, num_lookahead_tokens: int = 0) -> tuple[bool, int]:
    """Allocate KV slots for a running request, preempting victims chosen by ``rule`` until it fits.

    A victim already scheduled in ``out`` this step is un-scheduled and its tokens refunded. Every preemption
    is appended to ``out.preempted`` and logged with the reason.

    Returns:
        (True if ``request`` got its slots — False if it was itself preempted —, tokens refunded to the budget).
    """
    kv = engine.kv
    refunded = 0
    while not kv.allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens):
        victim = pick_victim(engine.running, rule, request)
        refunded += out.remove(victim)
        engine.preempt(victim, reason=preemption_reason(request, num_new_tokens, rule))
        out.preempted.append(victim)
        if victim is request:
            return False, refunded
    return True, refunded


def next_waiting(engine: EngineView) -> Request | None:
    """The next request to admit: one whose KV arrived from another instance and holds its blocks first (vLLM 0.33
    drains ``kv_holding_waiting`` before the waiting queue), else the waiting queue's head; None if neither."""
    holding = engine.kv_holding
    if holding:
        return holding[0]
    return engine.waiting.peek() if engine.waiting else None


def take_waiting(engine: EngineView, request: Request) -> None:
    """Remove a request about to be admitted from ``kv_holding`` or from the waiting queue."""
    holding = engine.kv_holding
    if holding and holding[0] is request:
        holding.popleft()
    elif engine.waiting.peek() is request:
        engine.waiting.pop()
    else:
        engine.waiting.remove(request)


def admit_whole_prompts(engine: EngineView, out: SchedulerOutput, tokens: int, max_step_tokens: int | None,
                        reserve: Callable[[Request], int]) -> None:
    """Admit waiting requests in queue order, each with its whole uncached prompt in this step and ``reserve(r)``
    extra KV slots (``num_reserved_tokens``) allocated now, while ``max_num_seqs`` allows; stop at the first that does
    not fit the KV cache or would push the step past ``max_step_tokens`` (None = no cap; a step's first request
    always fits). ``tokens``: the step's tokens already scheduled. Orca and static batching admit this way."""
    max_seqs = engine.config.max_num_seqs
    while len(engine.running) < max_seqs:
        r = next_waiting(engine)
        if r is None:
            break
        hits, num_hit = lookup(engine, r)
        n = r.num_tokens - num_hit
        if max_step_tokens is not None and tokens and tokens + n > max_step_tokens:
            break
        if not allocate_waiting(engine, r, n, hits, num_hit, num_reserved_tokens=reserve(r)):
            break
        take_waiting(engine, r)
        engine.admit(r, num_hit)
        out.add(r, n)
        tokens += n


def schedule_drafts(out: SchedulerOutput, request: Request, num_new_tokens: int) -> None:
    """Record the drafts a just-scheduled running request verifies with its ``num_new_tokens`` tokens (vLLM:
    ``spec[: n + C - num_tokens - P]``, so a capped n trims them; none when n covers no draft) and clear its
    proposals: new drafts arrive after the step (sync) or as placeholders set by the engine (async)."""
    drafts = (num_new_tokens + request.num_computed_tokens - request.prompt_len - request.num_output_tokens
              - request.num_output_placeholders)
    if drafts > 0:
        out.num_spec_tokens[request] = min(drafts, request.num_spec_tokens)
    request.num_spec_tokens = 0


def verify_tokens(engine: EngineView, request: Request) -> int:
    """Tokens a decoding request computes in one step: its last sampled token and its drafts (1 + k), cut so that
    no position reaches ``max_model_len`` (vLLM: ``min(n, max_model_len - 1 - num_computed_tokens)``, "necessary
    when using spec decoding"); :func:`schedule_drafts` then trims the drafts to what is left."""
    n = 1 + request.num_spec_tokens
    cap = engine.config.max_model_len - 1 - request.num_computed_tokens
    return n if n <= cap else cap


def is_running(request: Request) -> bool:
    """Still in the running list (not preempted or finished this step)."""
    return request.status == RequestStatus.RUNNING
