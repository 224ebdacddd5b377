"""Paged KV cache with prefix caching, as vLLM V1's block pool and KV cache manager behave.

Sources: vllm/v1/core/block_pool.py, kv_cache_manager.py and single_type_kv_cache_manager.py, summarised in
shared/specs/vllm-v1-scheduling.md §2. The free queue is a queue with lazy removal (head = next block to hand out
and to evict; O(1) pop, removal from the middle, append and prepend), block 0 is the reserved null block, and a
block keeps its hash after it is freed, so a later lookup can hit it until the block is handed out again.
"""

from __future__ import annotations

from typing import Any

from lab.core.remote_kv import PinnedBlocks
from lab.core.request import Request


def unique_content(request: Request) -> bool:
    """Content unique to the request (no token ids, no hash ids): no other request can ever hit its blocks."""
    return request.prompt_token_ids is None and request.hash_ids is None


# A KV block is its id, an int in 0..num_gpu_blocks-1 (0 is the reserved null block): ``block_size`` token slots
# of every layer on the rank. Its state lives in the pool's per-block sequences (``ref_cnt``, ``free_seq``,
# ``block_hash``, ``in_map``), indexed by id: dense storage touches far less memory than one object per block
# (with 16 instances of ~30,000 blocks each, freeing a request's ~100 scattered block objects cost ~40 us, mostly
# cache misses).
Block = int


class FreeBlockQueue:
    """The free-block queue: head = next block to hand out (and evict), tail = most recently freed.

    Entries (block id, sequence number) in two parallel lists read from index ``head`` on, with a gap kept in
    front for prepends: taking ``n`` blocks from the head is one slice, and freeing a request's blocks at the tail
    one ``extend`` (no object per entry). Removal is lazy: taking a free block out of the middle (a prefix hit) only
    marks its entry stale (``free_seq[b] = -1``), and stale entries are skipped when they reach the head. O(1)
    amortised everything, like vLLM's ``FreeKVCacheBlockQueue`` (a doubly linked list) with the same interface.
    ``free_seq`` is the pool's list, by block id, of the sequence number of each block's live entry (-1: none).
    """

    __slots__ = ("ids", "seqs", "head", "_seq", "n", "stale", "free_seq")
    GAP = 1024  # free slots kept in front of the head for prepends

    def __init__(self, free_seq: list[Any], block_ids: range) -> None:
        """Queue ``block_ids`` (a range of step 1) head to tail, with sequence numbers 1, 2, ..."""
        n = len(block_ids)
        free_seq[block_ids.start:block_ids.stop] = range(1, n + 1)
        self.free_seq = free_seq
        self.ids = [0] * self.GAP + list(block_ids)
        self.seqs = [0] * self.GAP + list(range(1, n + 1))
        self.head = self.GAP
        self._seq = n
        self.n = n
        self.stale = 0  # stale entries still queued; while 0, entries taken from the head need no check

    def __len__(self) -> int:
        return self.n

    def append(self, b: int) -> None:
        s = self._seq = self._seq + 1
        self.free_seq[b] = s
        self.ids.append(b)
        self.seqs.append(s)
        self.n += 1

    def appendleft(self, b: int) -> None:
        s = self._seq = self._seq + 1
        self.free_seq[b] = s
        h = self.head
        if not h:
            self._regap()
            h = self.head
        h -= 1
        self.ids[h] = b
        self.seqs[h] = s
        self.head = h
        self.n += 1

    def _regap(self) -> None:
        """Restore the gap in front of the head (dropping the entries already taken)."""
        h = self.head
        gap = [0] * self.GAP
        self.ids = gap + self.ids[h:]
        self.seqs = gap + self.seqs[h:]
        self.head = self.GAP

    def take(self, n: int) -> list[int]:
        """The ``n`` block ids at the head, removed (no stale entry among them: callers check ``stale``)."""
        h = self.head
        out = self.ids[h:h + n]
        h += n
        self.n -= n
        if h > 4 * self.GAP and h > len(self.ids) >> 1:
            self.head = h
            self._regap()
        else:
            self.head = h
        return out

    def remove(self, b: int) -> None:
        self.free_seq[b] = -1
        self.n -= 1
        self.stale += 1

    def popleft(self) -> int:
        """The live block id at the head, removed (the stale entries before it dropped); the queue must not be
        empty (IndexError otherwise)."""
        return self.take_live(1)[0]

    def take_live(self, n: int) -> list[int]:
        """The first ``n`` live block ids from the head, removed, the stale entries before them dropped (``n`` <=
        the free blocks)."""
        ids, seqs, fs = self.ids, self.seqs, self.free_seq
        h = self.head
        out: list[int] = []
        while len(out) < n:
            b = ids[h]
            s = seqs[h]
            h += 1
            if fs[b] == s:
                out.append(b)
            else:
                self.stale -= 1
        self.head = h
        self.n -= n
        return out

    def peek(self, n: int) -> list[int]:
        """The ``n`` block ids (fewer if fewer are free) that ``n`` pops from the head would hand out, left
        queued."""
        ids, seqs, fs = self.ids, self.seqs, self.free_seq
        out: list[int] = []
        h = self.head
        end = len(ids)
        while len(out) < n and h < end:
            b = ids[h]
            if fs[b] == seqs[h]:
                out.append(b)
            h += 1
        return out

    def blocks(self) -> list[int]:
        """The free block ids from head to tail (for inspection)."""
        fs = self.free_seq
        h = self.head
        return [b for b, s in zip(self.ids[h:], self.seqs[h:]) if fs[b] == s]


class BlockPool:
    """All KV blocks of one instance: their state by block id, the free queue and the hash -> block map of cached
    blocks.

    Per block id ``b``: ``ref_cnt[b]`` (requests holding it), ``free_seq[b]`` (its live free-queue entry, -1 when
    not free), ``block_hash[b]`` (set while it holds registered content) and ``in_map[b]`` (that hash is in the
    lookup map ``cached``).

    Args:
        num_gpu_blocks: blocks in the pool, including the reserved null block 0 (vLLM ``num_gpu_blocks``).
        enable_caching: register full blocks under their hash so later requests can hit them.
        prepend_unhashed: put a freed block without a hash at the head of the free queue (vLLM 0.33); legacy
            vLLM appended every freed block to the tail.

    Raises:
        ValueError: if ``num_gpu_blocks`` < 2 (the null block plus at least one usable block).
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True, prepend_unhashed: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (block 0 is reserved), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.prepend_unhashed = prepend_unhashed
        self.ref_cnt = [0] * num_gpu_blocks
        self.free_seq: list[Any] = [-1] * num_gpu_blocks
        self.block_hash: list[int | None] = [None] * num_gpu_blocks
        self.in_map = bytearray(num_gpu_blocks)
        self.null_block = 0
        self.ref_cnt[0] = 1
        self.free_queue = FreeBlockQueue(self.free_seq, range(1, num_gpu_blocks))
        # hash -> block id, or -> {block id: None} (insertion-ordered) when several blocks hold the same content
        # (computed concurrently).
        self.cached: dict[int, int | dict[int, None]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached ones included (they are evictable)."""
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever hold (all but the null block)."""
        return self.num_gpu_blocks - 1

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage``: 1 - free / (num_blocks - 1); cached free blocks count as free."""
        return 1.0 - len(self.free_queue) / self.num_usable_blocks

    def lookup(self, block_hash: int) -> int | None:
        """Return a cached block holding this hash, or None."""
        entry = self.cached.get(block_hash)
        if entry is None or isinstance(entry, int):
            return entry
        return next(iter(entry))

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue, evicting their hashes.

        Raises:
            RuntimeError: if fewer than ``n`` blocks are free (callers check first; this is an engine bug).
        """
        fq = self.free_queue
        if n > fq.n:
            raise RuntimeError(f"asked for {n} KV blocks with only {fq.n} free")
        if fq.stale:
            out = fq.take_live(n)
        else:
            out = fq.take(n)
        rc = self.ref_cnt
        for b in out:
            rc[b] = 1
        if self.cached:  # a block holds a hash only while it is mapped: without any mapped, nothing to evict
            bh = self.block_hash
            for b in out:
                if bh[b] is not None:
                    self._evict_hash(b)
        return out

    def get_new_block(self) -> int:
        """One block from the head of the free queue (:meth:`get_new_blocks` for n = 1, without the list)."""
        fq = self.free_queue
        if fq.stale or not fq.n:
            return self.get_new_blocks(1)[0]
        h = fq.head
        b = fq.ids[h]
        fq.head = h + 1
        fq.n -= 1
        self.ref_cnt[b] = 1
        if self.block_hash[b] is not None:
            self._evict_hash(b)
        return b

    def _evict_hash(self, b: int) -> None:
        """Forget a block's content as it is handed out again: clear its hash and, if mapped, drop it from the
        lookup map (a hash held by several blocks keeps the others, back to a plain entry when one is left)."""
        if self.in_map[b]:
            h = self.block_hash[b]
            assert h is not None
            cached = self.cached
            entry = cached[h]
            if isinstance(entry, int):
                del cached[h]
            else:
                del entry[b]
                if len(entry) == 1:
                    cached[h] = next(iter(entry))
            self.in_map[b] = 0
        self.block_hash[b] = None

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on prefix-hit blocks, removing free ones from the free queue."""
        fq = self.free_queue
        rc = self.ref_cnt
        for b in blocks:
            if rc[b] == 0:
                fq.remove(b)
            rc[b] += 1

    def free_blocks(self, blocks) -> None:
        """Drop one reference from each block, in the order given (callers pass a request's blocks reversed).

        A block reaching ref_cnt 0 goes to the tail of the free queue if it has a hash (LRU: evicted last), and to
        the head if it has none and ``prepend_unhashed`` (reused first): those as one group in the order given, so
        the first given (a request's last block) is reused first (vLLM 0.33 ``BlockPool.free_blocks``,
        vllm/v1/core/block_pool.py:816-847, ``prepend_n``; checked by the parity harness, docs/vllm_parity.md).
        """
        fq = self.free_queue
        prepend = self.prepend_unhashed
        rc = self.ref_cnt
        bh = self.block_hash
        first: list[int] | None = None
        for b in blocks:
            c = rc[b] - 1
            rc[b] = c
            if not c:
                if prepend and bh[b] is None:
                    if first is None:
                        first = [b]
                    else:
                        first.append(b)
                else:
                    fq.append(b)
        if first is not None:
            for b in reversed(first):
                fq.appendleft(b)

    def free_unique(self, blocks: list[int], num_full: int) -> int:
        """Free the blocks of a request whose content is unique (each held by it alone), last block first: the
        full (registered) ones go to the tail as hashed blocks do, the rest to the head if ``prepend_unhashed``.

        The full blocks' entries share one sequence number, returned (how a resumed request recognises its own):
        the entries of one block always come from different calls, so (block, number) still names one entry, and
        no int object is made per block (in a 16-instance run, each new int cost a cache miss: ~0.3 us a block).
        """
        fq = self.free_queue
        rc = self.ref_cnt
        partial = blocks[num_full:]
        if partial:  # last block first: at the head, the request's last block ends up first (as free_blocks)
            if self.prepend_unhashed:
                for b in partial:
                    rc[b] = 0
                    fq.appendleft(b)
            else:
                for b in reversed(partial):
                    rc[b] = 0
                    fq.append(b)
        seq = fq._seq = fq._seq + 1
        if num_full:
            full_rev = blocks[num_full - 1::-1]
            fq.ids.extend(full_rev)
            entry: Any = seq  # one int object for all the entries (compiled: boxed once, not once a block)
            fq.seqs.extend([entry] * num_full)
            fs = self.free_seq
            for b in full_rev:
                rc[b] = 0
                fs[b] = entry
            fq.n += num_full
        return seq

    def cache_block(self, b: int, block_hash: int) -> None:
        """Register a full block under its hash (vLLM ``cache_full_blocks``)."""
        self.block_hash[b] = block_hash
        self.in_map[b] = 1
        cached = self.cached
        entry = cached.get(block_hash)
        if entry is None:
            cached[block_hash] = b
        elif isinstance(entry, int):
            cached[block_hash] = {entry: None, b: None}
        else:
            entry[b] = None


class KVCacheManager:
    """The KV cache manager a scheduler talks to: prefix lookup, slot allocation and freeing.

    Args:
        num_gpu_blocks: total blocks including the null block.
        block_size: tokens per block (vLLM default 16).
        max_model_len: longest sequence in tokens; allocation never goes past it.
        enable_prefix_caching: look up and register block hashes.
        prepend_unhashed: see :class:`BlockPool`.
        drop_last_hit_block: a prefix hit gives up its last block (vLLM ``use_eagle_block_drop`` under EAGLE,
            EAGLE-3 and MTP speculative decoding: the drafter recomputes that block's hidden states).
        hybrid: a hybrid model's KV cache groups (lab/core/kv_groups.py ``HybridKV``: sliding windows, chunked
            attention, Mamba state beside full attention), or None for full attention only. With one, every method
            below hands over to it; without, nothing changes (the full-attention path is the hot path).
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        prepend_unhashed: bool = True,
        drop_last_hit_block: bool = False,
        hybrid: Any = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.drop_last_hit_block = drop_last_hit_block
        self.hybrid: Any = hybrid
        self.pool = BlockPool(num_gpu_blocks, enable_prefix_caching, prepend_unhashed)
        # Counters for the prefix cache hit rate (queries and hits in tokens, first scheduling only).
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included (:attr:`BlockPool.num_free_blocks`)."""
        return len(self.pool.free_queue)

    def usage(self) -> float:
        """KV cache usage in [0, 1] (:meth:`BlockPool.usage`)."""
        return self.pool.usage()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (a hybrid model: the most its groups need at once)."""
        if self.hybrid is not None:
            return self.hybrid.spec.peak_blocks(num_tokens)
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of the request's sequence (vLLM ``get_computed_blocks``).

        At most ``num_tokens - 1`` tokens, floored to the block size, can hit: a fully cached prompt still computes
        its last token, and in fact its whole last block. With ``drop_last_hit_block`` one more block is given up.

        Returns:
            (hit blocks in order, number of hit tokens).
        """
        if not self.enable_prefix_caching:
            return [], 0
        if self.hybrid is not None:
            return self.hybrid.get_computed_blocks(self, request)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks <= 0:
            return [], 0
        if unique_content(request):
            hits = self._own_hits(request, max_blocks, ())
            return hits, len(hits) * bs
        hashes = request.ensure_block_hashes(max_blocks, bs)
        pool = self.pool
        hits = []
        lookup = pool.lookup
        for i in range(max_blocks):
            b = lookup(hashes[i])
            if b is None:
                break
            hits.append(b)
        if hits and self.drop_last_hit_block:
            hits.pop()
        return hits, len(hits) * bs

    def _own_hits(self, request: Request, max_blocks: int, taken) -> list[Block]:
        """Prefix hits of a request whose content is unique to it: only its own full blocks, freed by a preemption
        and not handed out since (still free, same free-queue entry, not in ``taken``), can hit; at most
        ``max_blocks``, less the last with ``drop_last_hit_block``."""
        prev = request.prev_blocks
        hits = []
        if prev:
            blocks, seqs = prev
            rc = self.pool.ref_cnt
            fs = self.pool.free_seq
            check_taken = bool(taken)
            for i in range(min(max_blocks, len(seqs))):
                b = blocks[i]
                if rc[b] or fs[b] != seqs[i] or (check_taken and b in taken):
                    break
                hits.append(b)
        if hits and self.drop_last_hit_block:
            hits.pop()
        return hits

    def own_hit_after(self, request: Request, num_taken: int) -> int | None:
        """The prefix-hit tokens :meth:`get_computed_blocks` gives ``request`` once ``num_taken`` more blocks have
        been taken from the free queue's head (the decodes a schedule allocates before admitting it), for content
        unique to it (its own blocks freed by a preemption); None for content others may share."""
        if not self.enable_prefix_caching:
            return 0
        if not unique_content(request) or self.hybrid is not None:
            return None
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0 or request.prev_blocks is None:
            return 0
        taken = set(self.pool.free_queue.peek(num_taken)) if num_taken else ()
        return len(self._own_hits(request, max_blocks, taken)) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[Block] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        num_reserved_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> bool:
        """Allocate blocks so the request can hold ``num_new_tokens`` more tokens (vLLM ``allocate_slots``).

        ``need = ceil(min(C + hits + n + lookahead + reserved, max_model_len) / block_size) - held``, where
        ``num_lookahead_tokens`` are slots for speculative drafts (vLLM's meaning) and ``num_reserved_tokens`` are
        slots a policy reserves ahead for its own reasons (Orca's whole output, Sarathi's rest of the prompt). The
        call fails, changing
        nothing, if ``need`` plus the evictable hit blocks plus ``reserved_blocks`` (the watermark) exceeds the free
        blocks. With ``full_sequence_must_fit`` (vLLM's ``scheduler_reserve_full_isl`` gate for waiting requests) it
        also fails unless blocks for the whole current sequence (``num_tokens``) would fit; that is a check, not a
        reservation. On success it touches the hit blocks, pops new blocks from the free queue and registers the
        full blocks up to ``min(C + hits + n, num_tokens)`` under their hashes — unless ``delay_cache_blocks``
        (vLLM's flag for blocks an asynchronous KV load will fill, e.g. from the CPU tier: they are registered with
        :meth:`register_full_blocks` once the KV is there).

        Returns:
            True if the slots were allocated.
        """
        if self.hybrid is not None:
            return self.hybrid.allocate_slots(self, request, num_new_tokens, new_computed_blocks,
                                              num_new_computed_tokens, num_lookahead_tokens, full_sequence_must_fit,
                                              reserved_blocks, num_reserved_tokens, delay_cache_blocks)
        pool = self.pool
        bs = self.block_size
        blocks = request.blocks
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens + num_lookahead_tokens + num_reserved_tokens
        if total > self.max_model_len:
            total = self.max_model_len
        if not new_computed_blocks and not num_new_computed_tokens and not full_sequence_must_fit:
            # fast path for a running request (no prefix hits, no admission gate)
            need = -(-total // bs) - len(blocks)
            if need > 0:
                if need > pool.free_queue.n - reserved_blocks:
                    return False
                if need == 1:
                    blocks.append(pool.get_new_block())
                else:
                    blocks.extend(pool.get_new_blocks(need))
        else:
            held = len(blocks) + len(new_computed_blocks) if new_computed_blocks else len(blocks)
            need = -(-total // bs) - held
            hits = new_computed_blocks or ()
            if need < 0:
                need = 0
            evictable = 0
            rc = pool.ref_cnt
            for b in hits:
                if rc[b] == 0:
                    evictable += 1
            free = len(pool.free_queue) - reserved_blocks
            if need + evictable > free:
                return False
            if full_sequence_must_fit:
                full_need = -(-request.num_tokens // bs) - held
                if full_need + evictable > free:
                    return False
            if hits:
                pool.touch(hits)  # type: ignore[arg-type]
                blocks.extend(hits)
                request.num_cached_blocks = len(blocks)
            if need:
                blocks.extend(pool.get_new_blocks(need))
        if self.enable_prefix_caching and not delay_cache_blocks:
            end = num_computed + num_new_tokens
            ntok = request.prompt_len + request.num_output_tokens  # num_tokens, inlined
            num_full = (end if end < ntok else ntok) // bs
            if num_full > request.num_cached_blocks:
                self.register_full_blocks(request, num_full)
        return True

    def blocks_to_admit(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0,
                        full_sequence_must_fit: bool = False) -> int | None:
        """The free blocks, beyond any reserve, a waiting request needs for its admission with ``num_new_tokens``
        tokens to compute to succeed (:meth:`allocate_slots` with its prefix hits, ``num_lookahead_tokens``,
        ``full_sequence_must_fit`` and ``reserved_blocks``): ``ceil(min(C + n + lookahead, max_model_len) /
        block_size) - held`` (at least 0) and, with ``full_sequence_must_fit``, at least ``ceil(num_tokens /
        block_size) - held``, for a request without prefix hits.

        Hits that are its own blocks freed by a preemption (unique content) change nothing when ``num_new_tokens``
        is its whole sequence (``num_tokens``): h hit blocks are free, so they count against the free blocks as
        h new ones would, and the tokens to compute shrink by as many as they hold. Such hits come and go as the
        free queue hands blocks out, so this is the count whatever they are by the time of the schedule.

        Returns None when the count depends on hits that may change before the schedule: content others may
        share under prefix caching, or its own freed blocks with fewer than its whole sequence to compute; and for a
        hybrid model (its groups' needs change with the window: no jump plans them)."""
        if self.hybrid is not None:
            return None
        if self.enable_prefix_caching:
            if not unique_content(request):
                return None
            if request.prev_blocks is not None and num_new_tokens < request.num_tokens:
                return None
        bs = self.block_size
        held = len(request.blocks)
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if total > self.max_model_len:
            total = self.max_model_len
        need = -(-total // bs) - held
        if full_sequence_must_fit:
            full = -(-request.num_tokens // bs) - held
            if full > need:
                need = full
        return need if need > 0 else 0

    def allocate_running(self, requests: list[Request], num_new_tokens: list[int],
                         num_lookahead_tokens: int = 0) -> int:
        """:meth:`allocate_slots` ``(r, n, num_lookahead_tokens=num_lookahead_tokens)`` for each running request
        ``r`` and its ``n`` of ``zip(requests, num_new_tokens)``, in order, stopping at the first that does not fit
        (no prefix hits, reservation or watermark: a running request's own tokens).

        The same allocations, in the same order, as that loop of calls, without a call per request: a request
        whose tokens fit its last block needs no block, and one registers blocks only as its tokens fill them
        (a decode: once every ``block_size`` steps).

        Returns:
            The index of the first request whose slots could not be allocated (nothing changed for it or after
            it), or ``len(requests)`` when all got theirs.
        """
        if self.hybrid is not None:
            return self.hybrid.allocate_running(self, requests, num_new_tokens, num_lookahead_tokens)
        bs = self.block_size
        max_len = self.max_model_len
        pool = self.pool
        fq = pool.free_queue
        caching = self.enable_prefix_caching
        i = 0
        for r, n in zip(requests, num_new_tokens):
            blocks = r.blocks
            end = r.num_computed_tokens + n
            total = end + num_lookahead_tokens
            if total > len(blocks) * bs:
                if total > max_len:
                    total = max_len
                need = -(-total // bs) - len(blocks)
                if need > 0:
                    if need > fq.n:
                        return i
                    if need == 1:
                        blocks.append(pool.get_new_block())
                    else:
                        blocks.extend(pool.get_new_blocks(need))
            if caching and end // bs > r.num_cached_blocks:
                ntok = r.prompt_len + r.num_output_tokens
                num_full = (end if end < ntok else ntok) // bs
                if num_full > r.num_cached_blocks:
                    self.register_full_blocks(r, num_full)
            i += 1
        return i

    def register_full_blocks(self, request: Request, num_full: int) -> None:
        """Register the request's full blocks up to ``num_full`` (vLLM ``cache_full_blocks``). Content unique to
        the request is only counted: no one else can hit it, and the request recognises its own freed blocks by
        their free-queue entries (see :meth:`free`)."""
        if self.hybrid is not None:
            self.hybrid.cache_blocks(self, request, num_full)
            return
        blocks = request.blocks
        start = request.num_cached_blocks
        if not unique_content(request):  # unique content: nothing else can hit it, only the count matters
            hashes = request.ensure_block_hashes(num_full, self.block_size)
            pool = self.pool
            cached = pool.cached
            cache = pool.cache_block
            bh = pool.block_hash
            in_map = pool.in_map
            for i in range(start, num_full):
                b = blocks[i]
                h = hashes[i]
                if h in cached:
                    cache(b, h)
                else:  # the common case, inlined
                    bh[b] = h
                    in_map[b] = 1
                    cached[h] = b
        request.num_cached_blocks = num_full

    def detach(self, request: Request) -> PinnedBlocks:
        """Take a request's blocks out of it without freeing them (vLLM's ``delay_free``: a P instance keeps a
        finished request's KV pinned until the D side has read it); :meth:`free_pinned` frees them later."""
        if self.hybrid is not None:
            return self.hybrid.detach(self, request)
        pinned = PinnedBlocks(request.blocks, request.num_cached_blocks, unique_content(request))
        request.blocks = []
        request.num_cached_blocks = 0
        request.prev_blocks = None
        return pinned

    def free_pinned(self, pinned: PinnedBlocks) -> None:
        """Free blocks :meth:`detach` took, last block first, as :meth:`free` does for a finished request."""
        if pinned.unique:
            self.pool.free_unique(pinned.blocks, pinned.num_cached)
        else:
            self.pool.free_blocks(reversed(pinned.blocks))
        pinned.blocks = []

    def allocate_for_remote(self, request: Request, num_tokens: int) -> tuple[bool, int]:
        """Blocks for a request whose first ``num_tokens`` tokens' KV another instance will send (vLLM D side:
        local prefix hits are touched, blocks for the rest allocated with no lookahead; nothing is registered
        until the KV has arrived, :meth:`register_full_blocks`).

        Returns:
            (True and the local prefix-hit tokens if the blocks were allocated, else (False, 0); nothing changes
            on failure).
        """
        if self.hybrid is not None:
            return self.hybrid.allocate_for_remote(self, request, num_tokens)
        hits, num_hit = self.get_computed_blocks(request)
        need = self.blocks_for(num_tokens) - len(hits)
        rc = self.pool.ref_cnt
        evictable = sum(1 for b in hits if rc[b] == 0)
        if need + evictable > len(self.pool.free_queue):
            return False, 0
        if hits:
            self.pool.touch(hits)
            request.blocks.extend(hits)
            request.num_cached_blocks = len(hits)
        if need > 0:
            request.blocks.extend(self.pool.get_new_blocks(need))
        return True, num_hit

    def free(self, request: Request, finished: bool = False) -> None:
        """Release all of a request's blocks, last block first (vLLM frees in reverse order).

        Args:
            finished: the request is done, so nothing it holds (block hashes, freed blocks) is needed again.
        """
        if self.hybrid is not None:
            self.hybrid.free(self, request, finished)
            return
        blocks = request.blocks
        if blocks:
            if unique_content(request):
                num_full = request.num_cached_blocks
                seq = self.pool.free_unique(blocks, num_full)
                if not finished:  # a resumed request can hit these while untouched
                    request.prev_blocks = (blocks, [seq] * num_full)
            else:
                self.pool.free_blocks(reversed(blocks))
        request.blocks = []
        request.num_cached_blocks = 0
        if finished:
            request.prev_blocks = None
            request.block_hashes = []
