"""Hand-worked checks of the vLLM 0.33.0 rules the parity harness found servelab missing (docs/vllm_parity.md,
"Fixed in servelab"); they run without vLLM, in `make test`."""

from lab.core.kv_cache import KVCacheManager
from lab.core.request import Request
from lab.core.sched_api import SchedulerConfig
from policies.vllm_v1 import padded_drafts, was_prefill_chunk


def _free_head(kv: KVCacheManager, n: int) -> list[int]:
    return [kv.pool.free_queue.popleft() for _ in range(n)]


def test_freed_blocks_without_a_hash_are_reused_last_block_first():
    # no prefix caching: a request's 3 blocks [1, 2, 3] are freed last block first and go to the head of the free
    # queue as one group in that order (vLLM block_pool.py free_blocks -> prepend_n): 3 is handed out first
    kv = KVCacheManager(16, 4, 64, enable_prefix_caching=False)
    r = Request(0, 0.0, 10, 1)
    assert kv.allocate_slots(r, 10)
    assert r.blocks == [1, 2, 3]
    kv.free(r, finished=True)
    assert _free_head(kv, 4) == [3, 2, 1, 4]


def test_the_partial_blocks_of_unique_content_are_reused_last_block_first():
    # prefix caching on, content unique to the request (no token ids): 10 computed tokens in blocks of 4 register
    # 2 full blocks; the partial block 3 and the unused lookahead block 4 go to the head, 4 first; 1 and 2 to the tail
    kv = KVCacheManager(16, 4, 64, enable_prefix_caching=True)
    r = Request(0, 0.0, 10, 1)
    assert kv.allocate_slots(r, 10, num_lookahead_tokens=4)
    assert r.blocks == [1, 2, 3, 4]
    kv.free(r, finished=True)
    assert _free_head(kv, 3) == [4, 3, 5]


def _config(k: int = 2, max_model_len: int = 64) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=max_model_len,
                           num_speculative_tokens=k, num_lookahead_tokens=k, pad_new_one_token_requests=True)


def test_a_one_token_admission_is_padded_only_beside_a_scheduled_decode_or_after_a_hit():
    cfg = _config(k=2)
    # (num_computed, budget left, a running request scheduled, one of them a prefill chunk) -> drafts padded
    assert padded_drafts(cfg, 0, 10, False, False) == 0  # nothing running, nothing computed: 1 token alone
    assert padded_drafts(cfg, 0, 10, True, False) == 2  # beside a scheduled decode: 1 + k
    assert padded_drafts(cfg, 8, 10, False, False) == 2  # after an 8-token prefix hit
    assert padded_drafts(cfg, 8, 10, True, True) == 0  # a running prefill chunk in the step: never padded
    assert padded_drafts(cfg, 8, 2, True, False) is None  # 1 + k over the budget left: admission stops there
    assert padded_drafts(_config(k=2, max_model_len=11), 8, 10, True, False) == 0  # 8 + 3 + 1 > 11: not padded


def test_a_running_request_one_prompt_token_short_is_a_prefill_chunk_a_decode_is_not():
    chunk = Request(0, 0.0, 10, 5)
    chunk.num_computed_tokens = 9  # its first chunk stopped one prompt token short
    decode = Request(1, 0.0, 10, 5)
    decode.num_computed_tokens, decode.num_output_tokens = 10, 1  # after its first output: one short too
    in_flight = Request(2, 0.0, 10, 5)
    in_flight.num_computed_tokens, in_flight.num_output_placeholders = 10, 1  # async: its sample still in flight
    mid = Request(3, 0.0, 10, 5)
    mid.num_computed_tokens = 4
    assert [was_prefill_chunk(r) for r in (chunk, decode, in_flight, mid)] == [True, False, False, True]


def test_an_output_registers_the_blocks_its_finished_steps_computed_before_a_finish_frees_them():
    # vLLM 0.33 update_from_output (scheduler.py:2402-2415): under async scheduling or drafts, full blocks up to the
    # computed tokens (less those in flight, trimmed to all but the last token) are cached after each output. A
    # request with 6 prompt tokens in blocks of 4 that finishes with 3 outputs computed 8 tokens: 2 full blocks,
    # while its last schedule (async: the last sample unknown then) registered only 1.
    from lab.core.outputs import StepOutputs
    from lab.core.samples import WeightedSamples
    from lab.core.request import RequestStatus

    def freed_order(async_scheduling: bool) -> list[int]:
        kv = KVCacheManager(16, 4, 64, enable_prefix_caching=True)
        r = Request(0, 0.0, 6, 3, prompt_token_ids=list(range(6)), output_token_ids=[100, 101, 102])
        assert kv.allocate_slots(r, 8)
        r.status = RequestStatus.RUNNING
        kv.register_full_blocks(r, 1)  # what the last schedule registered
        r.num_computed_tokens, r.num_output_tokens = 8, 2
        r.num_output_placeholders = 1 if async_scheduling else 0
        r.inflight_tokens = 1
        outputs = StepOutputs(kv, WeightedSamples(), None, async_scheduling)

        class Step:  # the step in flight that samples the third output
            requests, num_new_tokens, samples, start, num_spec_tokens, padded_drafts = [r], [1], [True], 0.0, None, None
        outputs.apply(Step, 1.0)
        assert r.status is RequestStatus.FINISHED
        return _free_head(kv, kv.num_free_blocks)

    # sync (no drafts): vLLM caches at allocation only; block 2 holds no hash and goes to the head
    assert freed_order(False)[:2] == [2, 3]
    # async: block 2 was registered by the output, so both go to the tail, last block first
    assert freed_order(True)[-2:] == [2, 1]
