"""servelab's side: an ``Instance`` with the ``vllm_v1`` policy and the paged KV cache, driven one operation at a
time (schedule a step, apply the oldest step's outputs) instead of by its SimPy loop.

The settings map onto servelab as lab/experiment/resolve.py and build.py map a vLLM 0.33 experiment: lookahead
slots and the last-hit-block drop for EAGLE, 0.33's padding of one-token admissions, free blocks without a hash to
the head of the free queue, ``scheduler_reserve_full_isl`` on, no watermark.
"""

from __future__ import annotations

import simpy

from lab.core.kv_cache import KVCacheManager
from lab.core.request import Request, RequestStatus
from lab.core.samples import WeightedSamples
from lab.core.sched_api import SchedulerConfig
from lab.core.speculation import Speculator
from lab.costmodel.base import CostModelBase
from lab.engine.instance import EngineOptions, Instance
from parity.trace import Settings, TraceRequest
from policies.vllm_v1 import VLLMV1Scheduler


class _UnitCost(CostModelBase):
    name = "unit"

    def step_time(self, shape) -> float:
        return 1.0

    def breakdown(self, shape) -> dict[str, float]:
        return {"step": 1.0}


class ServelabEngine:
    """Schedules and applies steps of one servelab instance on demand."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        eagle = s.spec == "eagle"
        config = SchedulerConfig(
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            max_model_len=s.max_model_len, enable_chunked_prefill=True,
            long_prefill_token_threshold=s.long_prefill_token_threshold, threshold_only_when_contended=True,
            scheduler_reserve_full_isl=True, watermark=0.0, queue_policy=s.policy,
            num_lookahead_tokens=s.k if eagle else 0, num_speculative_tokens=s.k,
            pad_new_one_token_requests=s.spec is not None)
        self.kv = KVCacheManager(s.num_blocks, s.block_size, s.max_model_len, enable_prefix_caching=s.prefix_caching,
                                 prepend_unhashed=True, drop_last_hit_block=eagle and s.prefix_caching)
        acceptance = (Speculator(s.k, s.rates, s.seed, s.hit_probability) if s.spec else None)
        self.env = simpy.Environment()
        self.inst = Instance(self.env, 0, config, VLLMV1Scheduler(), self.kv, _UnitCost(), WeightedSamples(),
                             options=EngineOptions(async_scheduling=s.async_scheduling, fast_forward=False),
                             acceptance=acceptance, start=False)
        self.requests: dict[str, Request] = {}
        self.clock = 0.0

    def add(self, t: TraceRequest) -> None:
        r = Request(t.index, self.clock, len(t.prompt), t.max_tokens, priority=t.priority,
                    prompt_token_ids=list(t.prompt), output_token_ids=list(t.output[:t.max_tokens]))
        self.requests[t.request_id] = r
        self.inst.add_request(r)
        if r.status == RequestStatus.REJECTED:
            raise ValueError(f"servelab rejected request {t.request_id}: {r.reason}")

    def schedule(self):
        """One schedule; returns (the step or None, its record)."""
        before = {rid: r.num_preemptions for rid, r in self.requests.items()}
        step = self.inst.schedule_step()
        preempted = sorted(rid for rid, r in self.requests.items() if r.num_preemptions > before[rid])
        rec: dict = {"preempted": preempted}
        if step is None:
            rec["tokens"] = {}
            rec["spec"] = {}
        else:
            self.inst.price_step(step)
            step.start = step.end = self.clock
            rec["tokens"] = {r.request_id: n for r, n in zip(step.requests, step.num_new_tokens)}
            spec = step.num_spec_tokens or [0] * len(step.requests)
            rec["spec"] = {r.request_id: k for r, k in zip(step.requests, spec) if k}
        rec.update(self.state())
        return step, rec

    def apply(self, step) -> dict:
        """Apply the outputs of ``step`` (the oldest in flight); returns the record after it."""
        self.clock += 1.0
        step.end = self.clock
        self.inst.finish_step(step)
        rec = {"finished": sorted(rid for rid in (r.request_id for r in step.requests)
                                  if self.requests[rid].status == RequestStatus.FINISHED)}
        rec.update(self.state())
        return rec

    def state(self) -> dict:
        inst = self.inst
        live = [r for r in self.requests.values() if r.status in (RequestStatus.RUNNING, RequestStatus.WAITING,
                                                                   RequestStatus.PREEMPTED)]
        return {
            "running": [r.request_id for r in inst.running],
            "waiting": [r.request_id for r in inst.waiting],
            "computed": {r.request_id: r.num_computed_tokens for r in live},
            "outputs": {r.request_id: r.num_output_tokens for r in self.requests.values()},
            "blocks": {r.request_id: list(r.blocks) for r in live if r.blocks},
            "free_blocks": self.kv.num_free_blocks,
            "num_preemptions": {r.request_id: r.num_preemptions for r in self.requests.values()},
            "prefix_hit": {r.request_id: r.prefix_hit_tokens for r in self.requests.values() if r.prefix_hit_recorded},
        }

    def unfinished(self) -> int:
        return sum(1 for r in self.requests.values()
                   if r.status not in (RequestStatus.FINISHED, RequestStatus.REJECTED))
