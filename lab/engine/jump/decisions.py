"""The questions a jump asks about the schedules it plans, answered by the scheduler's own decision functions.

A policy writes each decision once (lab/core/sched_api.py ``SchedulerBase.admission``, ``running_tokens``,
``decode_preemption_reason``) and its ``schedule`` calls them; here the jump asks the same functions about a
schedule it plans, with that schedule's state (running requests, tokens scheduled before, free blocks), and adds
only what the KV cache's mechanism says (``KVCacheManager.blocks_to_admit``: the blocks an admission takes).
Every answer is True / a number only when it is certain; a jump ends where it is not (a real schedule decides).
"""

from __future__ import annotations

from lab.core.kv_cache import KVCacheManager, unique_content
from lab.core.request import Request
from lab.core.sched_api import Admission


def no_hit_possible(kv: KVCacheManager, request: Request) -> bool:
    """Whether ``request`` can have no prefix hit at the schedule: caching off, or content unique to it and no
    blocks of its own freed by a preemption."""
    return not kv.enable_prefix_caching or (unique_content(request) and request.prev_blocks is None)


def _fits(kv: KVCacheManager, request: Request, adm: Admission, num_hit_tokens: int, num_free_blocks: int) -> bool | None:
    """Whether the admission's allocation succeeds with ``num_free_blocks`` free: its blocks (over the hit, the
    step's tokens and the slots it reserves) within the free blocks less its reserve; None when the count depends
    on hits that may change before the schedule (``KVCacheManager.blocks_to_admit``)."""
    need = kv.blocks_to_admit(request, num_hit_tokens + adm.num_new_tokens + adm.num_reserved_tokens,
                              adm.num_lookahead_tokens, adm.full_sequence_must_fit)
    if need is None:
        return None
    return need <= num_free_blocks - adm.reserved_blocks


# What a planned schedule does with the waiting head (:func:`head_decision`'s first value).
BLOCKED = 0  # admission stops at it: it waits (max_num_seqs, no budget left, its prompt or its blocks do not fit)
WHOLE = 1  # admitted with its whole sequence in this step, its blocks fitting
CHUNK = 2  # admitted with a first chunk of its prompt, its blocks fitting
UNKNOWN = 3  # the jump cannot tell (a real schedule decides)


def _modelled(inst, request: Request, adm: Admission | None) -> Admission | None:
    """``adm``, the scheduler's admission of ``request``, when the jump can model it: no CPU KV tier, no state held
    by the request (swapped out, or remote KV that arrived), no padded drafts; else None."""
    if adm is None or adm.num_padded_drafts or inst.kv_offload is not None or request.num_computed_tokens:
        return None
    return adm


def head_decision(inst, head: Request, num_running: int, num_scheduled_tokens: int, num_free_blocks: int,
                  num_waiting: int) -> tuple[int, int, int]:
    """What a schedule the jump plans does with the waiting ``head``, asked of the scheduler's ``admission`` once:
    ``num_running`` requests running, ``num_scheduled_tokens`` tokens already scheduled (the decodes, one each,
    then prompts admitted before it), ``num_free_blocks`` free KV blocks after their allocations, ``num_waiting``
    requests waiting from ``head`` on (running + waiting is the schedule's request count; admissions earlier in
    the schedule move one from waiting to running, leaving the sum as it was when the schedule began).

    Returns ``(kind, tokens, blocks)``: ``(BLOCKED, 0, 0)``; ``(WHOLE, tokens, blocks it takes from the free
    queue)``; ``(CHUNK, tokens it computes now, tokens whose blocks its admission allocates: the chunk, or the
    whole prompt for a policy that reserves it)``; ``(UNKNOWN, 0, 0)``. A head that may still get a prefix hit
    (content others share, or a load from the CPU tier) is BLOCKED when its blocks do not fit even without one
    (a hit its own freed blocks may give does not change its whole sequence's block count,
    ``KVCacheManager.blocks_to_admit``), else UNKNOWN; one holding computed state or given padded drafts is
    BLOCKED only when the scheduler says it waits."""
    held = head.num_computed_tokens
    certain_hit = inst.kv_offload is None and (held or no_hit_possible(inst.kv, head))
    adm = inst.scheduler.admission(inst, head, held if certain_hit else None, num_running, num_scheduled_tokens,
                                   num_running + num_waiting)
    if adm is None:
        return UNKNOWN, 0, 0
    n = adm.num_new_tokens
    if n == 0:
        return BLOCKED, 0, 0
    if _modelled(inst, head, adm) is None:
        return UNKNOWN, 0, 0
    need = inst.kv.blocks_to_admit(head, n + adm.num_reserved_tokens, adm.num_lookahead_tokens,
                                   adm.full_sequence_must_fit)
    if need is None:
        return UNKNOWN, 0, 0
    if need > num_free_blocks - adm.reserved_blocks:
        return BLOCKED, 0, 0
    if not certain_hit:
        return UNKNOWN, 0, 0
    if n == head.num_tokens:
        return WHOLE, n, need
    return CHUNK, n, n + adm.num_reserved_tokens


def head_stays_blocked(inst, head: Request, num_running: int, num_scheduled_tokens: int,
                       num_free_blocks: int) -> bool:
    """Whether a schedule made during a stretch of pure decodes certainly does not admit the waiting ``head``
    (:func:`head_decision` with the instance's waiting queue)."""
    return head_decision(inst, head, num_running, num_scheduled_tokens, num_free_blocks,
                         len(inst.waiting))[0] == BLOCKED


def admits_whole(inst, request: Request, num_running: int, num_scheduled_tokens: int, num_free_blocks: int,
                 num_waiting: int = 1) -> bool:
    """Whether such a schedule admits ``request``, the head of ``num_waiting`` waiting requests, with its whole
    sequence (``request.num_tokens`` tokens) in this step, its blocks fitting (:func:`head_decision`)."""
    return head_decision(inst, request, num_running, num_scheduled_tokens, num_free_blocks, num_waiting)[0] == WHOLE


def _plain(inst, request: Request, num_hit_tokens: int | None, num_running: int, num_scheduled_tokens: int,
           num_requests: int) -> Admission | None:
    """The scheduler's admission of ``request`` (:func:`_modelled`), when the jump can model it."""
    if inst.kv_offload is not None or request.num_computed_tokens:
        return None
    return _modelled(inst, request, inst.scheduler.admission(inst, request, num_hit_tokens, num_running,
                                                             num_scheduled_tokens, num_requests))


def admits_resumed(inst, request: Request, num_hit_tokens: int, num_running: int, num_scheduled_tokens: int,
                   num_free_blocks: int, num_waiting: int) -> bool:
    """:func:`admits_whole` for a request preempted before whose prefix hit at this schedule is known:
    ``num_hit_tokens`` of its own freed blocks, still free (``KVCacheManager.own_hit_after``), so that it computes
    the rest of its sequence in this step."""
    if request.prev_blocks is None or not unique_content(request):
        return False
    adm = _plain(inst, request, num_hit_tokens, num_running, num_scheduled_tokens, num_running + num_waiting)
    return (adm is not None and adm.num_new_tokens == request.num_tokens - num_hit_tokens
            and _fits(inst.kv, request, adm, num_hit_tokens, num_free_blocks) is True)


def admits_chunk(inst, request: Request, num_running: int, num_scheduled_tokens: int, num_free_blocks: int,
                 num_waiting: int) -> tuple[int, int] | None:
    """When such a schedule admits ``request`` with a first chunk of its prompt only: (tokens it computes now,
    tokens whose blocks its admission allocates); None when it would not, or it cannot be told
    (:func:`head_decision`)."""
    kind, tokens, allocated = head_decision(inst, request, num_running, num_scheduled_tokens, num_free_blocks,
                                            num_waiting)
    return (tokens, allocated) if kind == CHUNK else None


def blocks_admitted(inst, request: Request, num_hit_tokens: int, num_running: int, num_scheduled_tokens: int,
                    num_waiting: int) -> int:
    """KV blocks the admission of ``request``, resumed with a prefix hit of ``num_hit_tokens`` of its own freed
    blocks, takes from the free queue, for one :func:`admits_resumed` said is admitted (the next admission in the
    same schedule sees that many fewer): its whole sequence's blocks, a hit block leaving the free queue as a new
    block would.

    Raises:
        ValueError: the scheduler does not admit it there (a caller's error).
    """
    adm = _plain(inst, request, num_hit_tokens, num_running, num_scheduled_tokens, num_running + num_waiting)
    need = None if adm is None else inst.kv.blocks_to_admit(
        request, num_hit_tokens + adm.num_new_tokens + adm.num_reserved_tokens, adm.num_lookahead_tokens,
        adm.full_sequence_must_fit)
    if need is None:
        raise ValueError(f"request {request.request_id}: no certain admission to count blocks for")
    return need


def running_chunk(inst, request: Request, num_computed_tokens: int, num_scheduled_tokens: int) -> int | None:
    """The tokens a planned schedule's running phase gives ``request``, part-way through its prompt with
    ``num_computed_tokens`` computed, after ``num_scheduled_tokens`` tokens of the requests before it; None when
    it gives none or it cannot be told."""
    n = inst.scheduler.running_tokens(inst, request, num_computed_tokens, num_scheduled_tokens)
    return n if n else None


def decode_preemption_reason(inst, requester: Request) -> str | None:
    """The scheduler's victim rule for a decode that finds no free block, when it is vLLM V1's ``last`` rule (see
    ``SchedulerBase.decode_preemption_reason``); None otherwise."""
    return inst.scheduler.decode_preemption_reason(inst, requester)
