"""KV block accounting, prefix caching and eviction against shared/specs/vllm-v1-scheduling.md §2."""


import pytest

from lab.core.kv_cache import BlockPool, KVCacheManager
from lab.core.request import Request


def test_block_zero_is_reserved_and_usage_counts_usable_blocks():
    kv = KVCacheManager(num_gpu_blocks=11, block_size=16, max_model_len=4096)
    assert kv.num_free_blocks == 10
    r = Request(0, 0.0, 40, 5)
    assert kv.allocate_slots(r, 40)
    assert len(r.blocks) == 3  # ceil(40 / 16)
    assert all(b != 0 for b in r.blocks)
    assert kv.num_free_blocks == 7
    assert kv.usage() == pytest.approx(0.3)
    kv.free(r)
    assert kv.num_free_blocks == 10 and r.blocks == []


def test_allocation_grows_only_at_block_boundaries():
    kv = KVCacheManager(11, 16, 4096)
    r = Request(0, 0.0, 16, 5)
    assert kv.allocate_slots(r, 16)
    r.num_computed_tokens = 16
    r.num_output_tokens = 1  # num_tokens 17: the next decode needs a 2nd block
    assert kv.allocate_slots(r, 1)
    assert len(r.blocks) == 2
    r.num_computed_tokens = 17
    r.num_output_tokens = 2
    assert kv.allocate_slots(r, 1)
    assert len(r.blocks) == 2


def test_allocation_fails_without_side_effects_when_blocks_run_out():
    kv = KVCacheManager(4, 16, 4096)  # 3 usable blocks
    r = Request(0, 0.0, 64, 5)
    assert not kv.allocate_slots(r, 64)
    assert r.blocks == [] and kv.num_free_blocks == 3


def test_allocation_caps_at_max_model_len():
    kv = KVCacheManager(20, 16, max_model_len=40)
    r = Request(0, 0.0, 32, 8)
    assert kv.allocate_slots(r, 32, num_lookahead_tokens=30)
    assert len(r.blocks) == 3  # min(62, 40) tokens -> 3 blocks


def test_prefix_hit_is_capped_so_the_last_block_is_recomputed():
    # spec example: N = 32, bs = 16 -> hit 16, compute 16
    kv = KVCacheManager(20, 16, 4096)
    ids = list(range(100, 132))
    a = Request(0, 0.0, 32, 4, prompt_token_ids=ids)
    hits, n = kv.get_computed_blocks(a)
    assert n == 0
    assert kv.allocate_slots(a, 32)
    b = Request(1, 0.0, 32, 4, prompt_token_ids=list(ids))
    hits, n = kv.get_computed_blocks(b)
    assert n == 16 and hits == [a.blocks[0]]
    c = Request(2, 0.0, 33, 4, prompt_token_ids=ids + [7])
    hits, n = kv.get_computed_blocks(c)
    assert n == 32  # 33 tokens: both full blocks hit, the 33rd token is computed


def test_prefix_hit_needs_the_whole_chain():
    kv = KVCacheManager(20, 4, 4096)
    a = Request(0, 0.0, 12, 2, prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert kv.allocate_slots(a, 12)
    # same second block, different first block: no hit (hashes chain the prefix)
    b = Request(1, 0.0, 12, 2, prompt_token_ids=[0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert kv.get_computed_blocks(b)[1] == 0
    # same first block only
    c = Request(2, 0.0, 12, 2, prompt_token_ids=[1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12])
    assert kv.get_computed_blocks(c)[1] == 4


def test_hash_ids_give_prefix_hits_at_block_granularity():
    kv = KVCacheManager(200, 16, 100000)
    a = Request(0, 0.0, 1100, 2, hash_ids=[7, 8, 9])
    assert kv.allocate_slots(a, 1100)
    b = Request(1, 0.0, 1000, 2, hash_ids=[7, 8])
    _, n = kv.get_computed_blocks(b)
    assert n == 992  # (1000 - 1) // 16 full blocks = 62 blocks; all inside shared hash blocks 7 and 8
    c = Request(2, 0.0, 600, 2, hash_ids=[7, 5])
    assert kv.get_computed_blocks(c)[1] == 512


def test_requests_without_identity_never_share_blocks():
    kv = KVCacheManager(50, 16, 4096)
    a = Request(0, 0.0, 64, 2)
    assert kv.allocate_slots(a, 64)
    b = Request(1, 0.0, 64, 2)
    assert kv.get_computed_blocks(b)[1] == 0


def test_freed_blocks_keep_hashes_until_reused_and_lru_evicts_oldest_first():
    kv = KVCacheManager(5, 4, 4096)  # 4 usable blocks
    a = Request(0, 0.0, 8, 2, prompt_token_ids=[1] * 8)
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    b = Request(1, 0.0, 9, 2, prompt_token_ids=[1] * 8 + [2])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8  # a's blocks are free but still cached
    # filling the cache with new content evicts them, oldest (head of the free queue) first
    c = Request(2, 0.0, 16, 2, prompt_token_ids=[3] * 16)
    assert kv.allocate_slots(c, 16)
    assert kv.get_computed_blocks(b)[1] == 0


def test_free_order_puts_a_requests_tail_block_closest_to_eviction():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 1000 + i)
    pool.free_blocks(list(reversed(blocks)))  # vLLM frees in reverse order
    # the tail block of the request (1002) was freed first, so it sits closest to the head among the three
    order = pool.free_queue.blocks()
    assert order[-3:] == [blocks[2], blocks[1], blocks[0]]


def test_unhashed_freed_blocks_are_reused_first_in_current_vllm_but_not_legacy():
    for prepend, expect_head in ((True, True), (False, False)):
        pool = BlockPool(6, prepend_unhashed=prepend)
        (b,) = pool.get_new_blocks(1)
        pool.free_blocks([b])
        head = pool.free_queue.blocks()[0]
        assert (head == b) == expect_head


def test_touching_a_free_cached_block_counts_against_free_blocks():
    kv = KVCacheManager(4, 4, 4096)  # 3 usable
    a = Request(0, 0.0, 8, 2, prompt_token_ids=list(range(8)))
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    b = Request(1, 0.0, 13, 2, prompt_token_ids=list(range(8)) + [9] * 5)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # needs 2 hit blocks (free, evictable) + 2 new blocks = 4 > 3 free
    assert not kv.allocate_slots(b, 5, hits, n)
    b2 = Request(2, 0.0, 12, 2, prompt_token_ids=list(range(8)) + [9] * 4)
    hits, n = kv.get_computed_blocks(b2)
    assert kv.allocate_slots(b2, 4, hits, n)
    assert len(b2.blocks) == 3 and b2.blocks[:2] == hits and all(kv.pool.ref_cnt[h] == 1 for h in hits)


def test_full_sequence_gate_checks_the_whole_prompt_not_just_the_chunk():
    kv = KVCacheManager(5, 4, 4096)  # 4 usable
    r = Request(0, 0.0, 20, 2)  # 5 blocks for the whole prompt
    assert not kv.allocate_slots(r, 4, full_sequence_must_fit=True)
    assert kv.allocate_slots(r, 4, full_sequence_must_fit=False)


def test_watermark_reserves_blocks():
    kv = KVCacheManager(5, 4, 4096)
    r = Request(0, 0.0, 12, 2)
    assert not kv.allocate_slots(r, 12, reserved_blocks=2)
    assert kv.allocate_slots(r, 12, reserved_blocks=1)


def test_a_preempted_request_without_identity_hits_its_own_blocks_until_they_are_reused():
    kv = KVCacheManager(12, 4, 4096)  # 11 usable blocks
    a = Request(0, 0.0, 18, 5)  # no token ids: content unique to it
    assert kv.allocate_slots(a, 18)  # 5 blocks, 4 full
    a.num_computed_tokens = 18
    kv.free(a)  # preempted (not finished): its blocks stay cached
    a.num_computed_tokens = 0
    hits, n = kv.get_computed_blocks(a)
    assert n == 16 and len(hits) == 4
    # the full blocks went to the tail and the partial one to the head: a new request takes the head first
    b = Request(1, 0.0, 4, 2)
    assert kv.allocate_slots(b, 4)
    assert kv.get_computed_blocks(a)[1] == 16
    # allocating the rest of the free queue reuses a's blocks: no hit any more
    c = Request(2, 0.0, 40, 2)
    assert kv.allocate_slots(c, 40)
    assert kv.get_computed_blocks(a)[1] == 0
    d = Request(3, 0.0, 18, 5)
    assert kv.get_computed_blocks(d)[1] == 0  # nobody else ever hits them


def test_handing_out_a_block_forgets_its_hash_and_keeps_other_blocks_with_the_same_hash():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 7)
    pool.cache_block(b, 7)  # same content computed twice: both blocks are mapped under 7
    pool.cache_block(c, 8)
    pool.free_blocks([c, a, b])  # free queue: 4, 5, c, a, b
    assert pool.get_new_blocks(2) == [4, 5]
    assert pool.get_new_block() == c and pool.block_hash[c] is None and not pool.in_map[c] and 8 not in pool.cached
    pool.touch([b])  # a prefix hit takes b out of the middle of the queue: a stale entry is left behind
    assert pool.get_new_blocks(1) == [a] and pool.block_hash[a] is None
    assert pool.cached[7] == b and pool.lookup(7) == b  # back to a plain entry with the one block left
    assert pool.free_queue.stale == 1 and pool.num_free_blocks == 0


@pytest.mark.instruments_core  # subclasses FreeBlockQueue to count its regaps
def test_free_queue_matches_a_plain_list_through_prepends_takes_and_lazy_removals():
    # The queue keeps a gap in front for prepends and drops taken entries now and then; whatever it does inside,
    # its blocks from head to tail must be those of a plain list put through the same operations.
    import random

    from lab.core.kv_cache import FreeBlockQueue

    rng = random.Random(7)
    num_blocks = 12000
    free_seq = [-1] * num_blocks
    regaps = []

    class Counting(FreeBlockQueue):
        __slots__ = ()

        def _regap(self) -> None:
            regaps.append(self.head)  # 0: a prepend found no room; > 0: taken entries dropped
            super()._regap()

    fq = Counting(free_seq, range(1, 1001))
    model = list(range(1, 1001))
    held = list(range(1001, num_blocks))  # blocks outside the queue
    for _ in range(20000):
        op = rng.random()
        if op < 0.3 and held:
            b = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.5:
                fq.appendleft(b)
                model.insert(0, b)
            else:
                fq.append(b)
                model.append(b)
        elif op < 0.45 and model:
            b = model.pop(rng.randrange(len(model)))  # a prefix hit takes it out of the middle
            fq.remove(b)
            held.append(b)
        elif op < 0.75 and model:
            n = rng.randint(1, min(5, len(model)))
            got = fq.take(n) if not fq.stale else [fq.popleft() for _ in range(n)]
            assert got == model[:n]
            del model[:n]
            held += got
        elif model:
            b = model.pop(0)
            assert fq.popleft() == b
            held.append(b)
    for b in held[:6000]:  # more prepends in a row than the room in front of the head
        fq.appendleft(b)
        model.insert(0, b)
    assert fq.blocks() == model and len(fq) == len(model)
    assert 0 in regaps and max(regaps) > 0  # both ways of restoring the gap were taken


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(blocks=st.integers(8, 60), bs=st.sampled_from([1, 4, 16]), caching=st.booleans(),
       prompt=st.integers(1, 300), computed_before=st.integers(0, 300), others=st.lists(st.integers(1, 200), max_size=4),
       lookahead=st.integers(0, 5), gate=st.booleans(), reserve=st.integers(0, 4), preempted=st.booleans(),
       chunk=st.integers(1, 300))
def test_blocks_to_admit_is_exactly_what_allocate_slots_needs(blocks, bs, caching, prompt, computed_before, others,
                                                             lookahead, gate, reserve, preempted, chunk):
    # The fast-forward asks blocks_to_admit whether a waiting head would be admitted (head_stays_blocked); it must
    # agree with allocate_slots on every state, including a head whose own freed blocks may still hit (and may have
    # been handed out since, in part) and a pool shared with other requests.
    kv = KVCacheManager(blocks, bs, 4096, enable_prefix_caching=caching)
    head = Request(0, 0.0, prompt, 8)
    if preempted and kv.allocate_slots(head, min(prompt, max(1, computed_before))):
        head.num_computed_tokens = min(prompt, max(1, computed_before))
        kv.free(head)  # preempted by recompute: its full blocks stay cached for it while untouched
        head.num_computed_tokens = 0
    for i, n in enumerate(others):
        r = Request(i + 1, 0.0, n, 8)
        kv.allocate_slots(r, n)  # may take some of the head's freed blocks, or fail
    hits, num_hit = kv.get_computed_blocks(head)
    n = head.num_tokens - num_hit  # its whole sequence, as hits leave it
    if head.prev_blocks is None:
        n = min(n, chunk)  # no hits possible: any chunk (a budget or threshold cap) is known exactly
    asked = head.num_tokens if head.prev_blocks is not None else n
    need = kv.blocks_to_admit(head, asked, lookahead, gate)
    assert need is not None  # unique content: the count never depends on what its hits turn out to be
    fits = need <= kv.num_free_blocks - reserve
    assert kv.allocate_slots(head, n, hits, num_hit, lookahead, full_sequence_must_fit=gate,
                             reserved_blocks=reserve) == fits
    if caching and head.prev_blocks is not None:
        assert kv.blocks_to_admit(head, head.num_tokens - 1, lookahead, gate) is None  # a chunk would depend on hits
