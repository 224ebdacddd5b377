"""The cheap paths of a real engine step give exactly what the one-request-at-a-time paths give.

``KVCacheManager.allocate_running`` must equal a loop of ``allocate_slots`` calls (same blocks, same free-queue
order, same registrations, same stopping point), and the schedulers that use it (vLLM V1's planned phase 1,
Sarathi's decode pass) must build the same steps as their per-request loops, preemptions included.
"""

import random

import pytest

from lab.core.kv_cache import KVCacheManager
from lab.core.request import Request, RequestStatus
from lab.engine.instance import EngineOptions
from policies.sarathi import SarathiScheduler
from policies.vllm_v1 import VLLMV1Scheduler
from tests.conftest import make_engine, submit


def _kv_state(kv: KVCacheManager, reqs: list[Request]) -> tuple:
    pool = kv.pool
    return ([list(r.blocks) for r in reqs], [r.num_cached_blocks for r in reqs],
            pool.free_queue.blocks(), sorted(pool.cached), len(pool.free_queue))


def _running_set(seed: int, caching: bool) -> tuple[KVCacheManager, list[Request], list[int]]:
    """A KV cache with requests that already hold ceil(C / block_size) blocks and the tokens each asks for next."""
    rng = random.Random(seed)
    kv = KVCacheManager(rng.randint(8, 40), 4, max_model_len=rng.choice([40, 1024]), enable_prefix_caching=caching)
    reqs, news = [], []
    for i in range(rng.randint(1, 10)):
        prompt = rng.randint(1, 30)
        ids = [rng.randint(0, 3) for _ in range(prompt)] if rng.random() < 0.5 else None
        r = Request(i, 0.0, prompt, 50, prompt_token_ids=ids)
        c = rng.randint(0, prompt - 1)
        if not kv.allocate_slots(r, c):
            break
        r.num_computed_tokens = c
        r.status = RequestStatus.RUNNING
        reqs.append(r)
        news.append(rng.randint(1, 6))
    return kv, reqs, news


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("lookahead", [0, 2])
def test_allocate_running_equals_allocate_slots_request_by_request(caching, lookahead):
    stopped_early = 0
    for seed in range(150):
        kv_a, reqs_a, news = _running_set(seed, caching)
        kv_b, reqs_b, _ = _running_set(seed, caching)
        expected = len(reqs_b)
        for i, (r, n) in enumerate(zip(reqs_b, news)):
            if not kv_b.allocate_slots(r, n, num_lookahead_tokens=lookahead):
                expected = i
                break
        done = kv_a.allocate_running(reqs_a, news, lookahead)
        assert done == expected, seed
        assert _kv_state(kv_a, reqs_a) == _kv_state(kv_b, reqs_b), seed
        stopped_early += done < len(reqs_a)
    assert stopped_early > 10  # the failure point is exercised, not only the all-fit case


class _OneByOneVLLM(VLLMV1Scheduler):
    """vLLM V1 with phase 1 built one request at a time (the reference for the planned phase 1)."""

    def schedule_running(self, engine, out, budget, threshold):
        return self._schedule_running_from(engine, out, list(engine.running), 0, budget, threshold)


class _OneByOneKV(KVCacheManager):
    """allocate_running as a loop of allocate_slots calls (the reference for Sarathi's decode pass)."""

    def allocate_running(self, requests, num_new_tokens, num_lookahead_tokens=0):
        for i, (r, n) in enumerate(zip(requests, num_new_tokens)):
            if not self.allocate_slots(r, n, num_lookahead_tokens=num_lookahead_tokens):
                return i
        return len(requests)


def _outcome(scheduler, async_scheduling: bool, kv_reference: bool = False) -> tuple:
    rng = random.Random(7)
    reqs = [Request(i, rng.uniform(0, 30), rng.randint(1, 40), rng.randint(1, 30),
                    prompt_token_ids=[rng.randint(0, 2) for _ in range(8)] + [i] * 40 if i % 3 else None)
            for i in range(60)]
    for r in reqs:
        if r.prompt_token_ids is not None:
            r.prompt_token_ids = r.prompt_token_ids[:r.prompt_len]
    env, inst, cost = make_engine(num_gpu_blocks=40, scheduler=scheduler, max_num_batched_tokens=24,
                                  max_num_seqs=12, options=EngineOptions(async_scheduling=async_scheduling,
                                                                         fast_forward=False))
    if kv_reference:
        kv = inst.kv
        ref = _OneByOneKV(kv.pool.num_gpu_blocks, kv.block_size, kv.max_model_len)
        inst.kv = inst.outputs.kv = ref
    submit(env, inst, reqs)
    env.run()
    assert inst.num_preemptions > 0  # the preempting path is exercised
    return ([(s.num_tokens, tuple(s.prefill_new), tuple(s.prefill_context), tuple(s.decode_context))
             for s in cost.shapes],
            [(r.first_token_time, r.finish_time, r.num_preemptions, r.prefix_hit_tokens) for r in reqs])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_vllm_v1_planned_phase_1_schedules_as_request_by_request(async_scheduling):
    assert _outcome(VLLMV1Scheduler(), async_scheduling) == _outcome(_OneByOneVLLM(), async_scheduling)


@pytest.mark.instruments_core  # its reference subclasses KVCacheManager
def test_sarathi_decode_pass_schedules_as_request_by_request():
    opts = SarathiScheduler.Options(chunk_size=24)
    assert _outcome(SarathiScheduler(opts), False) == _outcome(SarathiScheduler(opts), False, kv_reference=True)
