"""A request whose KV is computed on one instance and read by another (prefill/decode disaggregation).

The state vLLM's NIXL connector keeps across the two sides (shared/specs/vllm-v1-scheduling.md §5): on the
prefill (P) side the request's blocks stay pinned after it finishes (``delay_free``) until the decode (D) side
has read them or a lease expires; on the D side the request waits for blocks, then for the read
(``WAITING_FOR_REMOTE_KVS``), then is admitted with C = num_tokens - 1. The timestamps (seconds) decompose its
TTFT exactly: P queue, prefill, handover, wait for D's blocks, transfer, D queue, first decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PinnedBlocks:
    """KV blocks a finished request still holds on its P instance (freed by :meth:`KVCacheManager.free_pinned`).

    Attributes:
        blocks: the blocks, in the request's order.
        num_cached: how many leading blocks are registered for prefix caching.
        unique: the content is unique to the request (no token or hash ids).
    """

    blocks: list
    num_cached: int
    unique: bool


@dataclass
class RemoteKV:
    """The KV of one request on its way from a P instance to a D instance.

    Attributes:
        source: the P instance (an object with ``kv``, ``instance_id``, ``num_pinned_blocks`` and ``wake()``).
        pinned: its blocks on P, or None once freed.
        num_tokens: prompt tokens whose KV P computed.
        bytes_per_token: KV bytes one token moves (target layers, plus drafter layers when they are sent).
        drafter_bytes_per_token: the drafter's share of ``bytes_per_token``.
        expired: P's lease ran out before D started reading: P freed the blocks and D recomputes.
        num_loaded_tokens: tokens D read (prompt minus its own prefix hits); 0 until the read starts.
        first_token: where the request's first output token comes from (lab/cluster/transfer.py ``TransferCost``).
    """

    source: object
    pinned: PinnedBlocks | None
    num_tokens: int
    bytes_per_token: float
    drafter_bytes_per_token: float = 0.0
    expired: bool = False
    num_loaded_tokens: int = 0
    d_instance: int | None = None
    times: dict = field(default_factory=dict)
    first_token: str = "decode_recomputes"

    def release_pinned(self) -> None:
        """Free the blocks still pinned on P (after D's read, at lease expiry, or when D rejects the request)."""
        pinned = self.pinned
        if pinned is None:
            return
        src = self.source
        src.num_pinned_blocks -= len(pinned.blocks)
        src.kv.free_pinned(pinned)
        self.pinned = None
        src.wake()  # requests waiting on P for these blocks may fit now

    @property
    def bytes(self) -> float:
        """Bytes D read (0 when it recomputed)."""
        return self.num_loaded_tokens * self.bytes_per_token

    @property
    def drafter_bytes(self) -> float:
        """The drafter's share of :attr:`bytes`."""
        return self.num_loaded_tokens * self.drafter_bytes_per_token
