"""Request state, as vLLM V1 keeps it (vllm/v1/request.py).

A request carries its trace facts (arrival time, prompt length, forced output length, optional prefix identity) and
the engine counters the scheduler works with: ``num_computed_tokens`` (C), ``num_output_tokens``, the KV blocks it
holds and the hashes of its full blocks. There is no prefill or decode phase: a step gives a request
``num_new_tokens`` and C catches up with ``num_tokens``.
"""

from __future__ import annotations

import enum
import operator
from typing import Any, Sequence, SupportsIndex, SupportsInt


class RequestStatus(enum.IntEnum):
    """Lifecycle states; the names follow vLLM's ``RequestStatus``."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    REJECTED = 4


# Marker that makes a block's content unique to one request when no token ids are known; ints only, so Python's
# hash() of the content tuple is the same in every process (str hashing is salted per process).
_UNIQUE = -1


def _as_int(value: Any) -> int:
    """``int(value)``, without the call when ``value`` is an int already (compiled: ``int()`` is a generic call,
    ~400 instructions, made four times for every request built)."""
    return value if type(value) is int else int(value)


class Request:
    """One request of a trace, plus the engine's counters for it.

    Args:
        index: position in the trace (0-based); also the tie-breaker of every ordering.
        arrival_time: seconds since the start of the run.
        prompt_tokens: prompt length in tokens (>= 1).
        output_tokens: tokens to generate (>= 1); a replay forces exactly this many (``ignore_eos``).
        priority: lower is served first under the priority policy (vLLM convention).
        request_id: the trace's own id, kept for reports; defaults to ``str(index)``.
        prompt_token_ids: optional token ids of the prompt (prefix caching hashes them).
        output_token_ids: optional token ids of the output (so a resumed request can hit its own output blocks).
        hash_ids: optional per-block content ids of the prompt, as in the Mooncake trace.
        hash_block_size: tokens covered by one entry of ``hash_ids`` (Mooncake: 512).
        session_id: optional conversation / user id (session-affinity routing).

    Raises:
        ValueError: if a length is not positive or ``hash_block_size`` is not positive.
    """

    __slots__ = (
        "index", "request_id", "arrival_time", "prompt_len", "max_tokens", "priority",
        "prompt_token_ids", "output_token_ids", "hash_ids", "hash_block_size",
        "status", "num_computed_tokens", "num_output_tokens", "num_output_placeholders", "inflight_tokens", "num_preemptions",
        "blocks", "num_cached_blocks", "block_hashes", "prev_blocks",
        "first_scheduled_time", "first_token_time", "last_token_time", "finish_time",
        "prefix_hit_tokens", "prefix_hit_recorded", "reason", "instance_id", "events",
        "swapped_tokens", "session_id", "num_swaps", "next_decode_eligible_step", "token_ready_at", "pool", "stop_at", "served_by",
        "num_spec_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "spec_draws",
        "remote", "warmup", "sent_time", "stream_s", "cpu_loaded_tokens",
    )

    def __init__(
        self,
        index: SupportsIndex,
        arrival_time: float,
        prompt_tokens: Any,
        output_tokens: Any,
        priority: SupportsInt = 0,
        request_id: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        output_token_ids: Sequence[int] | None = None,
        hash_ids: Sequence[int] | None = None,
        hash_block_size: Any = 512,
        session_id: str | None = None,
    ) -> None:
        # (the counts are taken as any number type, numpy's too, and kept as ints: the compiled class stores ints)
        if prompt_tokens < 1:
            raise ValueError(f"request {index}: prompt_tokens must be >= 1, got {prompt_tokens}")
        if output_tokens < 1:
            raise ValueError(f"request {index}: output_tokens must be >= 1, got {output_tokens}")
        if hash_block_size < 1:
            raise ValueError(f"request {index}: hash_block_size must be >= 1, got {hash_block_size}")
        self.index = index if type(index) is int else operator.index(index)
        self.request_id: Any = request_id if request_id is not None else str(index)
        self.arrival_time = float(arrival_time)
        self.prompt_len = _as_int(prompt_tokens)
        self.max_tokens = _as_int(output_tokens)
        self.priority = _as_int(priority)
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids
        self.hash_ids = hash_ids
        self.hash_block_size = _as_int(hash_block_size)
        self.status: RequestStatus = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        # vLLM's num_output_placeholders (P): tokens that steps still in flight will sample (async scheduling only;
        # under sync scheduling a request with a step in flight has C = num_tokens and is skipped until it returns)
        self.num_output_placeholders = 0
        # tokens scheduled in steps that have not finished yet (0 between steps under sync scheduling)
        self.inflight_tokens = 0
        self.num_preemptions = 0
        self.blocks: list = []
        self.num_cached_blocks = 0
        self.block_hashes: list[int] = []
        self.prev_blocks: tuple[list[int], list[int]] | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.prefix_hit_tokens = 0
        self.prefix_hit_recorded = False
        self.reason: str = ""
        self.instance_id = 0
        # (time, event) or (time, event, detail) tuples: "arrived", "scheduled", "preempted", "resumed",
        # "first_token", "finished", "rejected"; the detail says why (preemption cause, swap or recompute).
        self.events: list[tuple] | None = None
        # Tokens of KV held in CPU memory while swapped out (0 = none); swap-outs so far.
        self.swapped_tokens = 0
        self.num_swaps = 0
        # Tokens of KV copied back from the CPU tier (KV offloading) instead of computed, over all admissions.
        self.cpu_loaded_tokens = 0
        self.session_id: Any = session_id
        # async scheduling with pipeline parallelism (vLLM V2 runner): the first scheduler step at which a decode of
        # this request may be scheduled again (shared/specs/vllm-v1-scheduling.md §4)
        self.next_decode_eligible_step = 0
        # async scheduling with pipeline parallelism: when the token its newest in-flight micro-batch samples leaves
        # the last stage (seconds); a later micro-batch with this request cannot enter stage 0 before then
        self.token_ready_at = 0.0
        # name of the pool of the instance serving it (lab/cluster); "" in a single-pool deployment
        self.pool: str = ""
        # output tokens at which the request leaves its instance: max_tokens (it finishes), or fewer when a pool
        # hands it on to another pool after that many tokens (lab/cluster; prefill/decode disaggregation)
        self.stop_at = self.max_tokens
        # instances that served it, in order (more than one only when a pool handed it on)
        self.served_by: list[int] = []
        # speculative decoding (shared/specs/vllm-v1-scheduling.md §3): drafts waiting to be verified by the next
        # step (vLLM len(spec_token_ids): the k proposals only, never the sampled token they follow; under async
        # scheduling they are placeholders), and vLLM's per-request counters
        self.num_spec_tokens = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # this request's own i.i.d. draft acceptance rate (trace column or per-request draw); None = the model's
        self.acceptance_rate: float | None = None
        # draws taken from this request's acceptance stream (lab/core/speculation.py)
        self.spec_draws = 0
        # prefill/decode disaggregation: the KV another instance computed for it (lab/core/remote_kv.py), or None
        self.remote: Any = None
        # a closed-loop warm-up request (lab/workload/closed_loop.py): served, but left out of the metrics
        self.warmup = False
        # the API server in front of the engine (lab/cluster/frontend.py): when the client sent the request (seconds;
        # None = at ``arrival_time``, no front-end time before the engine), and the seconds from the engine emitting
        # an output to the client receiving it (detokenization and streaming; 0 = none)
        self.sent_time: float | None = None
        self.stream_s = 0.0

    @property
    def num_tokens(self) -> int:
        """Prompt plus tokens generated so far (vLLM ``num_tokens``)."""
        return self.prompt_len + self.num_output_tokens

    @property
    def total_tokens(self) -> int:
        """Prompt plus the whole forced output: the longest this request's sequence can become."""
        return self.prompt_len + self.max_tokens

    def ensure_block_hashes(self, num_blocks: int, block_size: int) -> list[int]:
        """Extend ``block_hashes`` to cover the first ``num_blocks`` full blocks and return the list.

        The hash of block i chains the hash of block i-1 with the block's content, as vLLM's
        ``hash_block_tokens`` does (a block matches only if its whole prefix matches). Content is, by what the
        trace gives: the token ids; else the ``hash_ids`` entry covering the block plus the block's offset inside
        that entry; else a marker unique to this request. Positions past the known ids are unique to this request,
        so generated tokens never collide across requests. Python's ``hash`` of int tuples is deterministic across
        processes; a 64-bit collision is the only way two different prefixes could match.
        """
        hashes = self.block_hashes
        start = len(hashes)
        if start >= num_blocks:
            return hashes
        parent = hashes[-1] if hashes else 0
        prompt_len = self.prompt_len
        token_ids = self.prompt_token_ids
        out_ids = self.output_token_ids
        hash_ids = self.hash_ids
        for i in range(start, num_blocks):
            lo = i * block_size
            hi = lo + block_size
            content: tuple
            if token_ids is not None and hi <= prompt_len:
                content = tuple(token_ids[lo:hi])
            elif token_ids is not None and out_ids is not None and hi <= prompt_len + len(out_ids):
                if lo >= prompt_len:
                    content = tuple(out_ids[lo - prompt_len:hi - prompt_len])
                else:
                    content = tuple(token_ids[lo:prompt_len]) + tuple(out_ids[:hi - prompt_len])
            elif hash_ids is not None and hi <= prompt_len:
                hb = self.hash_block_size
                j = lo // hb
                last = (hi - 1) // hb
                if last < len(hash_ids):
                    if last == j:
                        content = (hash_ids[j], lo - j * hb)
                    else:  # a block wider than the trace's blocks (a hybrid's raised block size): every id it spans
                        content = (tuple(hash_ids[j:last + 1]), lo - j * hb)
                else:
                    content = (_UNIQUE, self.index, i)
            else:
                content = (_UNIQUE, self.index, i)
            parent = hash((parent, content))
            hashes.append(parent)
        return hashes

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, t={self.arrival_time:.3f}, prompt={self.prompt_len}, "
                f"out={self.num_output_tokens}/{self.max_tokens}, C={self.num_computed_tokens}, "
                f"{self.status.name})")
