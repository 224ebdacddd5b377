"""The KV cache of a hybrid model at run time: vLLM's hybrid KV cache manager over one block pool.

A hybrid model's layers fall into KV cache groups (lab/costmodel/hybrid_kv.py builds them as vLLM does): full
attention, sliding window, chunked local attention, and Mamba / linear-attention state. Every group draws its
blocks from the one :class:`lab.core.kv_cache.BlockPool`, with one block size (vLLM unifies the page size), and a
request needs, per step, the sum over the groups of what that group needs:

- **full attention**: ``ceil(tokens / block_size)`` blocks, all kept until the request ends;
- **sliding window** ``w``: the blocks that cover the last ``w - 1`` computed tokens plus the step's tokens; a block
  whose tokens all fall out of the window is freed (its hash kept, so it can still be hit) before the step
  allocates (vLLM ``remove_skipped_blocks``: ``skipped = max(0, C - w + 1)`` tokens);
- **chunked local attention** ``a``: the blocks of the current chunk (``skipped = C // a * a``);
- **Mamba / linear attention**: one state block per request (``mamba_cache_mode: none``), plus one per speculative
  token; in ``align`` mode (prefix caching) one block per ``block_size`` boundary crossed, the one before it freed a
  step later (so one or two held), each state block registered under the hash of the tokens it summarises.

Sources (read, not copied): vllm/v1/core/single_type_kv_cache_manager.py (``get_num_blocks_to_allocate``,
``remove_skipped_blocks``, ``get_num_skipped_tokens``, ``find_longest_cache_hit``, ``MambaManager``),
vllm/v1/core/kv_cache_coordinator.py (``HybridKVCacheCoordinator``: a prefix hit is one every group can serve)
and docs/design/hybrid_kv_cache_manager.md, at the versions docs/hybrid_models.md names.

Representation: a request's blocks of group 0 (a full-attention group) are ``request.blocks`` itself, so every
engine check that reads ``len(request.blocks) * block_size`` (slots for C + n) holds; the other groups' block
lists (0 = the null block at a position no longer or not yet needed) live in :class:`HybridKV`, keyed by the
request. Block hashes are the request's chained block hashes, salted by group for groups other than 0, so each
group's blocks are cached and evicted independently, as vLLM keys them by (hash, group id).

The full-attention-only case never reaches this module (``KVCacheManager.hybrid is None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lab.core.remote_kv import PinnedBlocks
from lab.core.request import Request

FULL = "full"
SLIDING = "sliding"
CHUNKED = "chunked"
MAMBA = "mamba"  # Mamba-2 and linear attention (Gated DeltaNet): one recurrent state per request

NULL = 0  # the null block (block 0 of the pool)


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group.

    Attributes:
        kind: ``full``, ``sliding``, ``chunked`` or ``mamba``.
        num_layers: the model's layers in the group (padding excluded).
        window: the sliding window (tokens) or the attention chunk size; 0 otherwise.
        layer_kind: the model's name for the layers (``full_attention``, ``linear_attention``, ``mamba``, ...).
    """

    kind: str
    num_layers: int
    window: int = 0
    layer_kind: str = ""


@dataclass(frozen=True)
class KVGroupSpec:
    """What the run-time manager needs to know of a hybrid model's KV cache configuration.

    Attributes:
        groups: the KV cache groups, full-attention ones first (group 0 must be full attention).
        block_size: tokens per block of every attention group (vLLM's unified, possibly raised, block size).
        mamba_mode: ``none`` (one state per request, nothing cached) or ``align`` (vLLM's prefix-caching mode: a
            state block per block boundary crossed, cached under the hash of the tokens before it).
        num_speculative_blocks: extra state blocks a Mamba group holds per request for speculative decoding.
        max_num_batched_tokens: the step budget (the largest step a request can take, for peak needs).
        aligned_split: prefill chunks end on block boundaries (vLLM ``_mamba_block_aligned_split`` in align mode).
    """

    groups: tuple[KVGroup, ...]
    block_size: int
    mamba_mode: str = "none"
    num_speculative_blocks: int = 0
    max_num_batched_tokens: int = 8192
    aligned_split: bool = False

    def __post_init__(self) -> None:
        if not self.groups or self.groups[0].kind != FULL:
            raise ValueError("a hybrid KV cache needs a full-attention group first (servelab models a hybrid "
                             "only with full-attention layers)")

    @property
    def has_mamba(self) -> bool:
        return any(g.kind == MAMBA for g in self.groups)

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens ever needs at once, every group together (the bound
        vLLM's ``max_memory_usage_bytes`` gives for a request of that length)."""
        bs = self.block_size
        total = 0
        for g in self.groups:
            full = -(-num_tokens // bs)
            if g.kind == FULL:
                total += full
            elif g.kind == SLIDING:
                total += min(full, -(-min(g.window - 1 + self.max_num_batched_tokens, num_tokens) // bs) + 1)
            elif g.kind == CHUNKED:
                total += min(full, -(-min(g.window + self.max_num_batched_tokens, num_tokens) // bs))
            else:
                total += (2 if self.mamba_mode == "align" else 1) + self.num_speculative_blocks
        return total


@dataclass
class _State:
    """One request's blocks in the groups other than group 0, by position (NULL where skipped), the blocks cached so
    far per group, and the Mamba align-mode bookkeeping."""

    blocks: list[list[int]]
    num_cached: list[int]
    allocated: list[bool]  # align mode: the group has allocated its running state (vLLM _allocated_block_reqs)
    last_state: list[int] = field(default_factory=list)  # align mode: the state block of the step before, per group


class GroupHits(list):
    """A hybrid prefix hit: the hit blocks of every group flattened (what a scheduler passes on and counts), with
    each group's list (NULL for skipped positions) in :attr:`groups` for :meth:`HybridKV.allocate_slots`."""

    groups: list[list[int]]


class HybridKV:
    """vLLM's hybrid KV cache manager for one instance (see the module docstring); every method takes the owning
    :class:`lab.core.kv_cache.KVCacheManager` (its pool, block size, ``max_model_len``, prefix-caching switch)."""

    def __init__(self, spec: KVGroupSpec, use_eagle: bool = False) -> None:
        self.spec = spec
        self.groups = spec.groups
        self.use_eagle = use_eagle  # EAGLE / MTP drafting: the aligned split caches the state one block earlier
        self._state: dict[int, _State] = {}

    # ---- bookkeeping ----
    def state(self, request: Request) -> _State:
        st = self._state.get(id(request))
        if st is None:
            n = len(self.groups)
            st = self._state[id(request)] = _State([[] for _ in range(n)], [0] * n, [False] * n, [-1] * n)
        return st

    def blocks_of(self, request: Request, g: int) -> list[int]:
        """Group ``g``'s blocks of a request by position (NULL where none is held)."""
        if g == 0:
            return request.blocks
        st = self._state.get(id(request))
        return st.blocks[g] if st is not None else []

    def held_blocks(self, request: Request) -> int:
        """Real blocks a request holds, every group together."""
        st = self._state.get(id(request))
        n = len(request.blocks)
        if st is not None:
            n += sum(1 for g in st.blocks[1:] for b in g if b != NULL)
        return n

    @staticmethod
    def _key(h: int, g: int) -> int:
        return h if g == 0 else hash((h, g))

    def _skipped(self, g: KVGroup, computed: int) -> int:
        """Tokens a group no longer needs once ``computed`` tokens are computed (vLLM ``get_num_skipped_tokens``)."""
        if g.kind == SLIDING:
            return max(0, computed - g.window + 1)
        if g.kind == CHUNKED:
            return computed // g.window * g.window
        if g.kind == MAMBA and self.spec.mamba_mode == "align":
            return max(0, computed - 1)
        return 0

    # ---- freeing blocks that left the window ----
    def remove_skipped(self, kv: Any, request: Request, computed: int) -> None:
        """Free, in every windowed group, the blocks whose tokens all lie before the window of the next token
        (replaced by NULL; freed blocks keep their hashes and go to the free queue's tail), and in align mode the
        Mamba state block of two steps ago (vLLM ``remove_skipped_blocks``)."""
        st = self._state.get(id(request))
        if st is None:
            return
        bs = self.spec.block_size
        pool = kv.pool
        for gi in range(1, len(self.groups)):
            g = self.groups[gi]
            if g.kind == FULL or (g.kind == MAMBA and self.spec.mamba_mode != "align"):
                continue
            blocks = st.blocks[gi]
            nb = min(self._skipped(g, computed) // bs, len(blocks))
            freed = []
            for i in range(nb - 1, -1, -1):
                b = blocks[i]
                if b == NULL:
                    break
                freed.append(b)
                blocks[i] = NULL
            if g.kind == MAMBA:
                last = st.last_state[gi]
                if 0 <= last < -(-computed // bs) - 1 and last < len(blocks) and blocks[last] != NULL:
                    freed.append(blocks[last])
                    blocks[last] = NULL
            if freed:
                pool.free_blocks(freed)

    # ---- prefix caching ----
    def get_computed_blocks(self, kv: Any, request: Request) -> tuple[list[int], int]:
        """The longest prefix every group can serve (vLLM ``HybridKVCacheCoordinator.find_longest_cache_hit``): full
        attention from the left (each full group must hold every block), then, within that, each other kind from
        the right — a sliding window needs ``ceil((w - 1) / block_size)`` contiguous cached blocks ending at the hit
        (or a run from the start), chunked attention the blocks of the last chunk, Mamba a cached state block at the
        hit's last block; repeated until the kinds agree. At most ``num_tokens - 1`` tokens; with
        ``drop_last_hit_block`` (EAGLE) one block less. Returns (:class:`GroupHits`, hit tokens)."""
        if not kv.enable_prefix_caching:
            return GroupHits(), 0
        bs = self.spec.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks <= 0:
            return GroupHits(), 0
        hashes = request.ensure_block_hashes(max_blocks, bs)
        lookup = kv.pool.lookup
        key = self._key
        groups = self.groups
        full = [gi for gi, g in enumerate(groups) if g.kind == FULL]
        eagle = kv.drop_last_hit_block
        length = 0
        for i in range(max_blocks):
            h = hashes[i]
            if any(lookup(key(h, gi)) is None for gi in full):
                break
            length += 1
        if eagle and length:
            length -= 1
        kinds = {g.kind for g in groups if g.kind != FULL}
        changed = True
        first = True
        while changed and length:  # (one pass for full + one other kind, vLLM's case; more kinds until they agree)
            changed = False
            for kind in sorted(kinds):
                ids = [gi for gi, g in enumerate(groups) if g.kind == kind]
                new = self._other_hit(kind, ids, hashes, length, lookup, eagle and first)
                if new < length:
                    length = new
                    changed = len(kinds) > 1
            first = False
        if not length:
            return GroupHits(), 0
        per_group: list[list[int]] = []
        for gi, g in enumerate(groups):
            blocks: list[int] = []
            for i in range(length):
                b = lookup(key(hashes[i], gi))
                blocks.append(NULL if b is None else b)
            if g.kind == SLIDING or g.kind == CHUNKED or g.kind == MAMBA:
                keep = self._hit_positions(g, length)
                blocks = [NULL] * (length - keep) + blocks[length - keep:]
            per_group.append(blocks)
        out = GroupHits(b for blocks in per_group for b in blocks if b != NULL)
        out.groups = per_group
        return out, length * bs

    def _other_hit(self, kind: str, ids: list[int], hashes: list[int], length: int, lookup, eagle: bool) -> int:
        """The hit length (blocks, <= ``length``) the groups ``ids`` of one non-full ``kind`` can serve."""
        bs = self.spec.block_size
        key = self._key

        def cached(i: int) -> bool:
            h = hashes[i]
            return all(lookup(key(h, gi)) is not None for gi in ids)

        if kind == MAMBA:
            if self.spec.mamba_mode == "none":
                return 0
            for i in range(length - 1, -1, -1):
                if cached(i):
                    return i + 1
            return 0
        g = self.groups[ids[0]]
        if kind == CHUNKED:
            start = length * bs // g.window * g.window // bs
            n = start
            while n < length and cached(n):
                n += 1
            return n
        need = -(-(g.window - 1) // bs) + (1 if eagle else 0)
        run = 0
        for i in range(length - 1, -1, -1):
            if cached(i):
                run += 1
                if run >= need:
                    return i + run - (1 if eagle else 0)
            else:
                run = 0
        return run

    def _hit_positions(self, g: KVGroup, length: int) -> int:
        """How many of a hit's last blocks a non-full group keeps (the rest are NULL, skipped)."""
        bs = self.spec.block_size
        if g.kind == MAMBA:
            return 1
        skipped = self._skipped(g, length * bs) // bs
        return length - skipped

    # ---- allocation ----
    def admission_cap(self, g: KVGroup) -> int:
        """The most blocks a windowed group reserves for one request at admission (vLLM
        ``max_admission_blocks_per_request``, the bound ``remove_skipped_blocks`` keeps it under: sliding window
        ``ceil((w - 1 + max_num_batched_tokens) / bs) + 1``, chunked ``ceil((a + max_num_batched_tokens) / bs)``);
        0 for other groups (no cap)."""
        bs = self.spec.block_size
        mbt = self.spec.max_num_batched_tokens
        if g.kind == SLIDING:
            return -(-(g.window - 1 + mbt) // bs) + 1
        if g.kind == CHUNKED:
            return -(-(g.window + mbt) // bs)
        return 0

    def _need(self, pool: Any, request: Request, st: _State | None, total: int, main: int, skip_at: int,
              hits: list[list[int]] | None, admission: bool = False) -> tuple[int, int]:
        """(new blocks to take from the free queue, evictable hit blocks) over every group (vLLM
        ``get_num_blocks_to_allocate``) for ``total`` token slots (``main``: without lookahead, what an align-mode
        Mamba group counts), windowed groups skipping what lies before the window at ``skip_at`` computed tokens and,
        for the ``admission`` gate (the whole sequence), capped at :meth:`admission_cap` (vLLM
        ``apply_admission_cap``); nothing changes."""
        bs = self.spec.block_size
        spec_blocks = self.spec.num_speculative_blocks
        rc = pool.ref_cnt
        new = 0
        evictable = 0
        for gi, g in enumerate(self.groups):
            held = request.blocks if gi == 0 else (st.blocks[gi] if st is not None else [])
            hit = hits[gi] if hits else []
            if g.kind == MAMBA and self.spec.mamba_mode != "align":
                n = 1 + spec_blocks - len(held) - len(hit)
            elif g.kind == MAMBA:
                n = -(-main // bs) + spec_blocks - len(hit) - len(held)
                if n > 0:
                    n = 1 if (st is not None and st.allocated[gi]) else 1 + spec_blocks
            elif g.kind == FULL:
                n = -(-total // bs) - len(held) - len(hit)
            else:
                required = -(-total // bs)
                if admission:
                    required = min(required, self.admission_cap(g))
                if held and not hit:
                    n = required - len(held)
                else:  # a windowed group's first allocation: positions before the window are not allocated
                    n = required - max(self._skipped(g, skip_at) // bs, len(hit) + len(held))
            if n > 0:
                new += n
            for b in hit:
                if b != NULL and rc[b] == 0:
                    evictable += 1
        return new, evictable

    def allocate_slots(self, kv: Any, request: Request, num_new_tokens: int, new_computed_blocks: list | None,
                       num_new_computed_tokens: int, num_lookahead_tokens: int, full_sequence_must_fit: bool,
                       reserved_blocks: int, num_reserved_tokens: int, delay_cache_blocks: bool) -> bool:
        """:meth:`KVCacheManager.allocate_slots` for a hybrid model (vLLM ``KVCacheManager.allocate_slots`` over the
        coordinator): free what left the windows, count every group's need, fail with nothing changed if the free
        blocks (less ``reserved_blocks``) do not cover it, else take the hits and the new blocks and register the
        full blocks of every group."""
        computed = request.num_computed_tokens + num_new_computed_tokens
        total = computed + num_new_tokens + num_lookahead_tokens + num_reserved_tokens
        hits: list[list[int]] | None = getattr(new_computed_blocks, "groups", None) if new_computed_blocks else None
        end = computed + num_new_tokens
        cache_upto = -1 if delay_cache_blocks or not kv.enable_prefix_caching else min(end, request.num_tokens)
        full_seq = request.num_tokens if full_sequence_must_fit else 0
        return self._allocate(kv, request, computed, total, end, computed, hits, full_seq, reserved_blocks,
                              cache_upto)

    def _allocate(self, kv: Any, request: Request, computed: int, total: int, main: int, skip_at: int,
                  hits: list[list[int]] | None, full_seq: int, reserved_blocks: int, cache_upto: int) -> bool:
        pool = kv.pool
        bs = self.spec.block_size
        max_len = kv.max_model_len
        if total > max_len:
            total = max_len
        if main > max_len:
            main = max_len
        st = self._state.get(id(request))
        if st is not None or request.blocks:
            self.remove_skipped(kv, request, computed)
        need, evictable = self._need(pool, request, st, total, main, skip_at, hits)
        free = len(pool.free_queue) - reserved_blocks
        if need + evictable > free:
            return False
        if full_seq and full_seq > total:
            whole = min(full_seq, max_len)
            if self._need(pool, request, st, whole, whole, skip_at, hits, admission=True)[0] + evictable > free:
                return False
        st = self.state(request)
        if hits:
            for gi, blocks in enumerate(hits):
                real = [b for b in blocks if b != NULL]
                if real:
                    pool.touch(real)
                if gi == 0:
                    request.blocks.extend(blocks)
                    request.num_cached_blocks = len(request.blocks)
                else:
                    st.blocks[gi].extend(blocks)
                    st.num_cached[gi] = len(st.blocks[gi])
                    if self.groups[gi].kind == MAMBA and blocks:
                        st.last_state[gi] = len(blocks) - 1
        self._allocate_new(pool, request, st, total, main, skip_at)
        if cache_upto >= 0:
            self.cache_blocks(kv, request, cache_upto // bs)
        return True

    def _allocate_new(self, pool: Any, request: Request, st: _State, total: int, main: int, skip_at: int) -> None:
        """Take each group's new blocks (vLLM ``allocate_new_blocks``; NULL where a windowed group skips)."""
        bs = self.spec.block_size
        spec_blocks = self.spec.num_speculative_blocks
        for gi, g in enumerate(self.groups):
            blocks = request.blocks if gi == 0 else st.blocks[gi]
            if g.kind == MAMBA and self.spec.mamba_mode != "align":
                n = 1 + spec_blocks - len(blocks)
                if n > 0:
                    blocks.extend(pool.get_new_blocks(n))
                continue
            if g.kind == MAMBA:
                required = -(-main // bs) + spec_blocks
                prev = len(blocks)
                if required <= prev:
                    continue
                if st.allocated[gi]:
                    st.last_state[gi] = prev - 1 - spec_blocks
                elif prev > 0:
                    st.last_state[gi] = prev - 1
                skipped = required - spec_blocks - 1
                if prev < skipped:
                    blocks.extend([NULL] * (skipped - prev))
                if st.allocated[gi]:  # the speculative blocks move up with the running state
                    for i in range(prev - spec_blocks, prev):
                        if i < skipped:
                            blocks.append(blocks[i])
                            blocks[i] = NULL
                n = required - len(blocks)
                if n > 0:
                    blocks.extend(pool.get_new_blocks(n))
                st.allocated[gi] = True
                continue
            required = -(-total // bs)
            if g.kind != FULL and len(blocks) < required:
                skipped = self._skipped(g, skip_at) // bs
                if len(blocks) < skipped:
                    blocks.extend([NULL] * (skipped - len(blocks)))
            n = required - len(blocks)
            if n > 0:
                blocks.extend(pool.get_new_blocks(n))

    def allocate_running(self, kv: Any, requests: list[Request], num_new_tokens: list[int],
                         num_lookahead_tokens: int) -> int:
        """:meth:`KVCacheManager.allocate_running`: each running request's slots in order, stopping at the first
        that does not fit; returns its index (``len(requests)`` when all fit)."""
        i = 0
        for r, n in zip(requests, num_new_tokens):
            if not self.allocate_slots(kv, r, n, None, 0, num_lookahead_tokens, False, 0, 0, False):
                return i
            i += 1
        return i

    def cache_blocks(self, kv: Any, request: Request, num_full: int) -> None:
        """Register every group's full blocks up to ``num_full`` (vLLM ``cache_blocks``; NULL positions are
        skipped). A Mamba state block registers under the hash of the tokens before its boundary: the state it holds
        after them (align mode)."""
        if num_full <= 0:
            return
        pool = kv.pool
        bs = self.spec.block_size
        hashes = request.ensure_block_hashes(num_full, bs)
        key = self._key
        st = self.state(request)
        for gi, g in enumerate(self.groups):
            blocks = request.blocks if gi == 0 else st.blocks[gi]
            start = request.num_cached_blocks if gi == 0 else st.num_cached[gi]
            if g.kind == MAMBA and self.spec.mamba_mode != "align":
                continue
            stop = min(num_full, len(blocks))
            for i in range(start, stop):
                b = blocks[i]
                if b == NULL:
                    continue
                pool.cache_block(b, key(hashes[i], gi))
            if gi == 0:
                request.num_cached_blocks = max(start, stop)
            else:
                st.num_cached[gi] = max(start, stop)

    def aligned_chunk(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        """A prefill chunk cut to end on a block boundary (vLLM ``_mamba_block_aligned_split``, align mode): while
        the request is in its prompt (or recomputing), a chunk that stops short of the last boundary before the end
        is floored to whole blocks (kept whole when that leaves nothing), and one that crosses it ends on it (a
        block earlier under EAGLE / MTP, whose hits give up their last block)."""
        if not self.spec.aligned_split:
            return num_new_tokens
        c = request.num_computed_tokens + num_hit_tokens
        ntok = request.num_tokens
        if c >= max(request.prompt_len, ntok - 1):
            return num_new_tokens
        bs = self.spec.block_size
        last = ntok - ntok % bs
        if self.use_eagle:  # a hit gives up its last block: cache the state a block before
            last = max(last - bs, 0)
        end = c + num_new_tokens
        if end < last:
            n = num_new_tokens // bs * bs
            return n if n > 0 else num_new_tokens
        if c < last < end:
            return last - c
        return num_new_tokens

    # ---- releasing ----
    def free(self, kv: Any, request: Request, finished: bool) -> None:
        """Release every group's blocks, group by group, last block first (vLLM ``coordinator.free``)."""
        pool = kv.pool
        st = self._state.pop(id(request), None)
        if request.blocks:
            pool.free_blocks(reversed([b for b in request.blocks if b != NULL]))
        if st is not None:
            for blocks in st.blocks[1:]:
                real = [b for b in blocks if b != NULL]
                if real:
                    pool.free_blocks(reversed(real))
        request.blocks = []
        request.num_cached_blocks = 0
        request.prev_blocks = None
        if finished:
            request.block_hashes = []

    def detach(self, kv: Any, request: Request) -> PinnedBlocks:
        """Every group's blocks taken out of the request unfreed (a prefill instance pins them for the decode side's
        read; :meth:`KVCacheManager.free_pinned` frees them)."""
        st = self._state.pop(id(request), None)
        blocks = [b for b in request.blocks if b != NULL]
        if st is not None:
            for g in st.blocks[1:]:
                blocks += [b for b in g if b != NULL]
        pinned = PinnedBlocks(blocks, 0, False)
        request.blocks = []
        request.num_cached_blocks = 0
        request.prev_blocks = None
        return pinned

    def allocate_for_remote(self, kv: Any, request: Request, num_tokens: int) -> tuple[bool, int]:
        """Blocks for a request whose first ``num_tokens`` tokens' KV another instance sends (the decode side, vLLM
        with the hybrid manager and a connector that supports it): local prefix hits touched; the rest allocated
        as for ``num_tokens`` computed tokens, so a sliding window gets only the blocks of its window and a Mamba
        group one state; nothing registered until the KV has arrived. Returns (allocated, local hit tokens)."""
        hits, num_hit = self.get_computed_blocks(kv, request)
        groups = getattr(hits, "groups", None) if num_hit else None
        if self._allocate(kv, request, num_hit, num_tokens, num_tokens, num_tokens, groups, 0, 0, -1):
            return True, num_hit
        return False, 0

    def bytes_to_send(self, num_tokens: int, attention_bytes_per_layer_token: float, state_bytes: float) -> float:
        """Bytes a prefill instance sends for ``num_tokens`` prompt tokens: every full-attention layer's KV of all
        of them, a sliding-window or chunked layer's KV of the blocks still in its window (what the decode side
        allocates), and one recurrent state per Mamba / linear-attention layer (``state_bytes``: per layer)."""
        bs = self.spec.block_size
        total = 0.0
        for g in self.groups:
            if g.kind == FULL:
                tokens = num_tokens
            elif g.kind == MAMBA:
                total += g.num_layers * state_bytes
                continue
            else:
                tokens = min(num_tokens, (-(-num_tokens // bs) - self._skipped(g, num_tokens) // bs) * bs)
            total += g.num_layers * tokens * attention_bytes_per_layer_token
        return total
