"""The CPU tier of the KV cache: vLLM's native KV offloading (``--kv-offloading-size``, ``--kv-offloading-backend
native``), which vllm/config/vllm.py maps to ``kv_transfer_config = {kv_connector: OffloadingConnector,
kv_role: kv_both, kv_connector_extra_config: {cpu_bytes_to_use: kv_offloading_size · 2^30}}``.

What the real engine does, and what this module reproduces (sources: vllm/distributed/kv_transfer/kv_connector/v1/
offloading/scheduler.py ``OffloadingConnectorScheduler``, .../offloading/worker.py ``OffloadingConnectorWorker``,
vllm/v1/kv_offload/cpu.py ``CPUOffloadingSpec``, vllm/v1/kv_offload/lru_manager.py ``LRUOffloadingManager``):

- **Capacity.** ``num_cpu_blocks = cpu_bytes_to_use // (bytes per GPU block on one rank · world size)``: the size is
  the total over all TP x PP ranks, each rank keeps its own shard of every block.
- **Stores happen as blocks are computed, not at eviction.** Each scheduled step, every scheduled request's full
  blocks up to ``min(C + n, num_tokens)`` past its store pointer are offered to the CPU tier (``prepare_store``:
  blocks already there are skipped; LRU blocks that are ready and not being loaded are evicted to make room; if
  not enough can be evicted nothing is stored and the pointer stays, so the next step tries again). The worker
  queues the copy after the step's forward and submits it at the start of the next step (``prepare_store_kv`` /
  ``start_kv_transfers``), on its own stream: the device-to-host copy overlaps the next step's compute. A block
  whose copy has not finished is in the map but not ready: no hit, and not evictable.
- **Lookup.** A waiting request (new or preempted, C = 0) first takes its GPU prefix hit; the connector then looks
  for the following blocks in CPU (``get_num_new_matched_tokens``): the run of consecutive ready blocks after the
  GPU hit, whole blocks only, possibly the whole prompt (the GPU's ``num_tokens - 1`` cap does not apply; the
  engine recomputes the last token when the load covered everything). Every lookup touches the request's blocks
  (most recent = its first block). A request whose hit blocks another request is loading right now, or one that
  would exceed ``max_num_seqs`` loads at once, is tried again at a later step.
- **Load.** Blocks for the hit are allocated (GPU hit + CPU hit tokens, nothing registered until the KV is there,
  ``delay_cache_blocks``); the request waits for the host-to-device copy (``WAITING_FOR_REMOTE_KVS``) and, once
  the engine learns the load finished (from a step's output, or at once when none runs), it is admitted with C =
  the loaded tokens (``num_tokens - 1`` for a full hit).
- **Prefix caching off**: the tier still works, as in vLLM (vllm/v1/engine/core.py builds the block hasher
  whenever a KV connector is set): GPU hits are 0, loaded blocks are not registered in the GPU cache, and two
  requests may load the same blocks at once.
- **Preemption** flushes the victim's stores: its blocks count as stored, and the next step does not start before
  the copies have finished (``handle_preemptions`` waits for them before the forward).

Host link (one per GPU; PCIe is full duplex, so loads and stores do not share a direction): a copy of ``b`` blocks
takes ``latency_s + b · bytes_per_block_rank / bandwidth``. TP and PP ranks move their own shards over their own
links at the same time, so the time is one rank's shard over one link. Copies in one direction run one after the
other (FIFO, as on one CUDA stream). Simplifications: a finished request's blocks are freed at once (vLLM delays
the free until its last store has finished), and a store counts as ready at the moment its copy ends (vLLM learns
it from the next step's output).
"""

from __future__ import annotations

from collections import OrderedDict

from lab.core.request import Request

_INF = float("inf")


class CPUBlockTier:
    """The CPU blocks of one instance: an LRU map block hash -> state (vLLM ``LRUOffloadingManager`` with the CPU
    backend). Times are seconds; a block is *ready* (a hit, evictable) once its store has finished.

    Args:
        num_blocks: capacity in blocks (>= 0).

    Attributes:
        num_evictions: blocks evicted to make room for stores so far.

    Raises:
        ValueError: a negative capacity.
    """

    __slots__ = ("num_blocks", "_entries", "num_evictions")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"CPU tier capacity must be >= 0 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        # hash -> [ready_at (seconds; inf while its copy has no end time yet), loads in flight]
        self._entries: OrderedDict[int, list] = OrderedDict()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def order(self) -> list[int]:
        """Hashes from least to most recently used (for inspection)."""
        return list(self._entries)

    def is_ready(self, block_hash: int, now: float) -> bool:
        e = self._entries.get(block_hash)
        return e is not None and e[0] <= now

    def lookup(self, hashes: list[int], now: float) -> int:
        """Number of leading ``hashes`` that are stored and ready at ``now``."""
        entries = self._entries
        n = 0
        for h in hashes:
            e = entries.get(h)
            if e is None or e[0] > now:
                break
            n += 1
        return n

    def touch(self, hashes: list[int]) -> None:
        """Mark blocks most recently used, the first of ``hashes`` most recent (a prefix is evicted last)."""
        entries = self._entries
        for h in reversed(hashes):
            if h in entries:
                entries.move_to_end(h)

    def prepare_store(self, hashes: list[int], now: float) -> list[int] | None:
        """Make room for the blocks of ``hashes`` not stored yet and insert them as not ready.

        Evicts least recently used blocks that are ready at ``now`` and not being loaded. Returns the hashes
        inserted (possibly none), or None, changing nothing, when not enough blocks can be evicted."""
        entries = self._entries
        new = [h for h in hashes if h not in entries]
        need = len(entries) + len(new) - self.num_blocks
        if need > 0:
            victims = []
            for h, e in entries.items():
                if e[0] <= now and not e[1]:
                    victims.append(h)
                    if len(victims) == need:
                        break
            else:
                return None
            for h in victims:
                del entries[h]
            self.num_evictions += len(victims)
        for h in new:
            entries[h] = [_INF, 0]
        return new

    def complete_store(self, hashes: list[int], ready_at: float) -> None:
        """The copy of these blocks ends at ``ready_at`` (seconds); from then on they are hits."""
        entries = self._entries
        for h in hashes:
            e = entries.get(h)
            if e is not None and e[0] > ready_at:
                e[0] = ready_at

    def begin_load(self, hashes: list[int]) -> None:
        """Pin blocks being copied back to the GPU (not evictable until :meth:`end_load`)."""
        for h in hashes:
            self._entries[h][1] += 1

    def end_load(self, hashes: list[int]) -> None:
        entries = self._entries
        for h in hashes:
            entries[h][1] -= 1

    def loading(self, hashes: list[int]) -> bool:
        """Whether any of these blocks is being loaded now."""
        entries = self._entries
        return any(entries[h][1] for h in hashes if h in entries)


class KVOffloader:
    """vLLM's OffloadingConnector on one instance: the CPU tier, the per-request store pointers, the host link's
    two directions and the counters (see the module docstring for the mechanism and its vLLM sources).

    Args:
        num_cpu_blocks: CPU tier capacity in blocks (:func:`cpu_tier_blocks`).
        block_size: tokens per block (the GPU block size; vLLM's offloaded block size defaults to it).
        bytes_per_block_rank: KV bytes of one block on one GPU rank (the GPU cache's ``bytes_per_block``).
        world_size: GPU ranks of the instance (TP x PP); bytes counters are over all of them.
        bandwidth: host-link bytes per second, one direction, per GPU (catalog ``pcie_gbps``).
        latency_s: fixed seconds of one copy (launch and link latency).
        max_concurrent_loads: loads in flight at most (vLLM: ``max_num_seqs``).
        dedupe_loads: delay a request whose hit blocks another request is loading (vLLM does it only with prefix
            caching on, ``_blocks_being_loaded``).

    Attributes:
        cpu_hit_requests, cpu_hit_tokens: loads started and the tokens they bring back.
        bytes_stored, bytes_loaded: bytes copied device-to-host / host-to-device (all ranks).
        blocks_stored, blocks_loaded: the same in blocks.

    Raises:
        ValueError: a block size, byte size or bandwidth that is not positive.
    """

    def __init__(self, num_cpu_blocks: int, block_size: int, bytes_per_block_rank: float, world_size: int,
                 bandwidth: float, latency_s: float = 0.0, max_concurrent_loads: int = 1 << 30,
                 dedupe_loads: bool = True) -> None:
        if block_size < 1 or not bytes_per_block_rank > 0 or not bandwidth > 0 or world_size < 1:
            raise ValueError(f"KV offloading needs a block size >= 1, bytes per block > 0, a bandwidth > 0 and "
                             f"world size >= 1 (got {block_size}, {bytes_per_block_rank}, {bandwidth}, {world_size})")
        self.tier = CPUBlockTier(num_cpu_blocks)
        self.block_size = block_size
        self.bytes_per_block_rank = float(bytes_per_block_rank)
        self.world_size = world_size
        self.bandwidth = float(bandwidth)
        self.latency_s = float(latency_s)
        self.max_concurrent_loads = max_concurrent_loads
        self.dedupe_loads = dedupe_loads
        self.d2h_free_at = 0.0  # when the store direction of the host link is free
        self.h2d_free_at = 0.0  # when the load direction is free
        self.flush_until = 0.0  # the next step may not start before this (stores of preempted requests)
        self._next_store: dict[Request, int] = {}  # request -> index of its next block to store
        self._store_done: dict[Request, float] = {}  # request -> end of its last store copy
        self._unsubmitted: dict[object, list[tuple[Request, list[int]]]] = {}  # step -> stores it produced
        self.loads: dict[Request, tuple[list[int], int]] = {}  # request -> (hashes loaded, C after the load)
        self.cpu_hit_requests = 0
        self.cpu_hit_tokens = 0
        self.blocks_stored = 0
        self.blocks_loaded = 0

    @property
    def bytes_per_block(self) -> float:
        """KV bytes of one block over all ranks."""
        return self.bytes_per_block_rank * self.world_size

    @property
    def bytes_stored(self) -> float:
        return self.blocks_stored * self.bytes_per_block

    @property
    def bytes_loaded(self) -> float:
        return self.blocks_loaded * self.bytes_per_block

    @property
    def num_evictions(self) -> int:
        return self.tier.num_evictions

    def copy_time(self, num_blocks: int) -> float:
        """Seconds one copy of ``num_blocks`` blocks takes on the host link (each rank its shard, in parallel)."""
        return self.latency_s + num_blocks * self.bytes_per_block_rank / self.bandwidth

    # ---- lookup and load (scheduler side) ----
    def lookup(self, request: Request, num_gpu_hit: int, now: float) -> int | None:
        """Tokens of ``request`` the CPU tier holds right after its GPU prefix hit of ``num_gpu_hit`` tokens (a
        multiple of the block size): 0 for none, None to try again later (its blocks are being loaded by another
        request, or too many loads are in flight). Touches the request's blocks (vLLM
        ``get_num_new_matched_tokens``)."""
        if len(self.loads) >= self.max_concurrent_loads:
            return None
        bs = self.block_size
        num_blocks = request.num_tokens // bs
        start = num_gpu_hit // bs
        if num_blocks - start < 1:
            return 0
        hashes = request.ensure_block_hashes(num_blocks, bs)[:num_blocks]
        tier = self.tier
        tier.touch(hashes)
        hits = tier.lookup(hashes[start:], now)
        if not hits:
            return 0
        if self.dedupe_loads and tier.loading(hashes[start:start + hits]):
            return None
        return hits * bs

    def start_load(self, request: Request, num_gpu_hit: int, num_cpu_tokens: int, now: float) -> float:
        """Start copying ``num_cpu_tokens`` tokens (whole blocks after the GPU hit) back to the request's newly
        allocated blocks; returns when the copy ends (seconds)."""
        bs = self.block_size
        start = num_gpu_hit // bs
        n = num_cpu_tokens // bs
        hashes = request.block_hashes[start:start + n]
        self.tier.begin_load(hashes)
        begin = now if now >= self.h2d_free_at else self.h2d_free_at
        done = begin + self.copy_time(n)
        self.h2d_free_at = done
        self.loads[request] = (hashes, num_gpu_hit + num_cpu_tokens)
        self._next_store[request] = start + n
        self.cpu_hit_requests += 1
        self.cpu_hit_tokens += num_cpu_tokens
        self.blocks_loaded += n
        request.cpu_loaded_tokens += num_cpu_tokens
        return done

    def finish_load(self, request: Request) -> int:
        """The engine learned the load finished: unpin its CPU blocks; returns the tokens the request now has."""
        hashes, tokens = self.loads.pop(request)
        self.tier.end_load(hashes)
        return tokens

    # ---- stores (worker side) ----
    def schedule_stores(self, step: object, requests: list[Request], now: float) -> None:
        """Offer the full blocks each scheduled request will have computed after ``step`` (C is already advanced)
        to the CPU tier; their copies are timed when the step ends (:meth:`step_ended`)."""
        bs = self.block_size
        tier = self.tier
        nxt = self._next_store
        jobs = []
        for r in requests:
            c = r.num_computed_tokens
            t = r.num_tokens
            num_blocks = (c if c < t else t) // bs
            start = nxt.get(r, 0)
            if num_blocks <= start:
                continue
            hashes = r.ensure_block_hashes(num_blocks, bs)
            new = tier.prepare_store(hashes[start:num_blocks], now)
            if new is None:
                continue  # the tier is full of blocks it cannot evict: try again next step
            nxt[r] = num_blocks
            if new:
                tier.touch(hashes[:num_blocks])
                jobs.append((r, new))
        if jobs:
            self._unsubmitted[step] = jobs

    def step_ended(self, step: object, requests: list[Request], end: float) -> None:
        """``step`` ended at ``end``: its stores start now on the device-to-host direction, one copy per request,
        one after the other; requests of the step that finished are forgotten."""
        jobs = self._unsubmitted.pop(step, None)
        if jobs:
            tier = self.tier
            done_at = self._store_done
            t = end if end >= self.d2h_free_at else self.d2h_free_at
            for r, hashes in jobs:
                t += self.copy_time(len(hashes))
                tier.complete_store(hashes, t)
                done_at[r] = t
                self.blocks_stored += len(hashes)
            self.d2h_free_at = t
        for r in requests:
            if r.finish_time is not None:
                self._next_store.pop(r, None)
                self._store_done.pop(r, None)

    def preempted(self, request: Request, now: float) -> None:
        """A preempted request's stores are flushed before its blocks are reused: the next step waits for them."""
        t = self._store_done.pop(request, 0.0)
        if t > now and t > self.flush_until:
            self.flush_until = t


def cpu_tier_blocks(kv_offloading_size_gib: float, bytes_per_block_rank: int, world_size: int) -> int:
    """CPU blocks for ``kv_offloading_size`` GiB over the instance's ``world_size`` ranks: floor(size · 2^30 /
    (bytes per block per rank · world size)) (vllm/config/vllm.py ``cpu_bytes_to_use``, vllm/v1/kv_offload/cpu.py
    ``CPUOffloadingSpec.num_blocks``)."""
    return int(kv_offloading_size_gib * (1 << 30)) // (int(bytes_per_block_rank) * world_size)
