"""vLLM's side: the real ``vllm.v1.core.sched.scheduler.Scheduler`` (``AsyncScheduler`` under async scheduling) with
a ``KVCacheConfig`` of the same block count and size, on the CPU, fed fabricated ``ModelRunnerOutput``s.

It needs the ``parity`` install (parity/requirements.txt, ``make parity``): vLLM's wheel without its GPU
dependencies, the CPU build of PyTorch and the packages vLLM's config and scheduler import. No model weights, no
tokenizer, no network: the model is a ``config.json`` written to a temporary folder (its architecture is inspected,
never loaded), and ``VLLM_TARGET_DEVICE=cpu`` selects vLLM's CPU platform.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig,  # noqa: E402
                         SpeculativeConfig, VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from parity.trace import FabricatedModel, Settings, TraceRequest  # noqa: E402

logging.getLogger("vllm").setLevel(logging.ERROR)  # its CPU platform warns once per engine about block sizes

_MODEL_DIR: str | None = None
_TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
               "vocab_size": 1000, "max_position_embeddings": 4096, "torch_dtype": "float16", "rms_norm_eps": 1e-5,
               "bos_token_id": 1, "eos_token_id": 2}


def model_dir() -> str:
    """A folder holding only a tiny Llama ``config.json`` (ModelConfig inspects the architecture, loads nothing)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        d = tempfile.mkdtemp(prefix="servelab-parity-model-")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(_TINY_LLAMA, f)
        _MODEL_DIR = d
    return _MODEL_DIR


def vllm_version() -> str:
    import vllm
    return vllm.__version__


def _live(status: RequestStatus) -> bool:
    return status in (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED)


class VLLMEngine:
    """vLLM's scheduler, stepped on demand the way ``EngineCore`` steps it (schedule; execute; update_from_output;
    under sync scheduling with drafts, ``update_draft_token_ids`` after each step: ``EngineCore.post_step``)."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float16", max_model_len=s.max_model_len,
                            seed=0)
        sched = SchedulerConfig(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                                max_model_len=s.max_model_len, enable_chunked_prefill=True,
                                is_encoder_decoder=False, async_scheduling=s.async_scheduling, policy=s.policy,
                                long_prefill_token_threshold=s.long_prefill_token_threshold)
        cache = CacheConfig(block_size=s.block_size, enable_prefix_caching=s.prefix_caching)
        spec = None
        if s.spec == "ngram":
            spec = SpeculativeConfig(method="ngram", num_speculative_tokens=s.k, prompt_lookup_min=1,
                                     prompt_lookup_max=2, target_model_config=model,
                                     target_parallel_config=ParallelConfig())
        elif s.spec == "eagle":
            # servelab models EAGLE's prefix caching with the trailing-block drop (known.py: lookahead-hashes)
            spec = SpeculativeConfig(method="eagle", model=model_dir(), num_speculative_tokens=s.k,
                                     target_model_config=model, target_parallel_config=ParallelConfig(),
                                     disable_lookahead_block_hashes=True)
        self.vllm_config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                                      device_config=DeviceConfig(device="cpu"), speculative_config=spec)
        kv_config = KVCacheConfig(num_blocks=s.num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=s.block_size, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32))])
        cache.num_gpu_blocks = s.num_blocks
        cls = AsyncScheduler if s.async_scheduling else Scheduler
        self.sched = cls(vllm_config=self.vllm_config, kv_cache_config=kv_config,
                         structured_output_manager=StructuredOutputManager(self.vllm_config),
                         block_size=s.block_size, log_stats=True)
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)  # as EngineCore builds the block hasher
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(s.block_size, hash_fn, self.vllm_config.num_hash_lookahead_tokens)
        self.model = FabricatedModel(s)
        self.trace: dict[str, TraceRequest] = {}
        self.requests: dict[str, Request] = {}
        self.prefix_hit: dict[str, int] = {}
        self.clock = 0.0

    def add(self, t: TraceRequest) -> None:
        params = SamplingParams(max_tokens=t.max_tokens, ignore_eos=True)
        r = Request(request_id=t.request_id, prompt_token_ids=list(t.prompt), sampling_params=params,
                    pooling_params=None, arrival_time=self.clock + t.index * 1e-6, priority=t.priority,
                    block_hasher=self.hasher if self.s.prefix_caching else None)
        self.trace[t.request_id] = t
        self.requests[t.request_id] = r
        self.sched.add_request(r)

    def schedule(self):
        """One ``schedule()``; returns (its SchedulerOutput with what the fabricated model needs, or None when
        it scheduled nothing, and its record)."""
        before = {rid: r.num_preemptions for rid, r in self.requests.items()}
        running_before = {r.request_id for r in self.sched.running}
        one_short = [r.request_id for r in self.sched.running if r.is_prefill_chunk and r.num_output_tokens
                     and not r.num_output_placeholders and r.num_computed_tokens == r.num_tokens - 1]
        out = self.sched.schedule()
        preempted = sorted(rid for rid, r in self.requests.items() if r.num_preemptions > before[rid])
        for rid in preempted:  # known.py "stale-output": vLLM's drop mode for output in flight at a preemption
            self.requests[rid].drop_stale_output = True
        tokens = dict(out.num_scheduled_tokens)
        rec: dict = {"preempted": preempted, "tokens": tokens, "one_short": [rid for rid in one_short if rid in tokens],
                     "spec": {rid: len(v) for rid, v in out.scheduled_spec_decode_tokens.items() if v}}
        for rid, n in tokens.items():
            r = self.requests[rid]
            if rid not in running_before and rid not in self.prefix_hit:
                self.prefix_hit[rid] = r.num_computed_tokens - n
        rec.update(self.state())
        if not tokens:
            return None, rec
        # what the model will sample: whether each request samples (its C reached num_tokens), and which drafts
        # are 0.33's placeholder padding of a newly admitted one-token request (never accepted)
        samples = {rid: not self.requests[rid].is_prefill_chunk for rid in tokens}
        padded = {rid for rid in out.scheduled_spec_decode_tokens if rid not in running_before}
        return (out, samples, padded), rec

    def apply(self, batch) -> dict:
        """Fabricate the ModelRunnerOutput of ``batch`` and hand it to ``update_from_output``."""
        out, samples, padded = batch
        self.clock += 1.0
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            r = self.requests[rid]
            if not samples[rid] or r.is_finished() or r.num_stale_output_tokens:  # (stale: dropped, no draws)
                sampled.append([])
                continue
            drafts = out.scheduled_spec_decode_tokens.get(rid) or []
            t = self.trace[rid]
            accepted = 0 if not drafts or rid in padded else self.model.num_accepted(t.index, len(drafts))
            pos = len(r.output_token_ids)
            sampled.append(list(t.output[pos:pos + 1 + accepted]))
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        self.sched.update_from_output(out, mro)
        if self.s.spec and not self.s.async_scheduling:  # EngineCore.post_step: the drafter's proposals
            drafts = []
            for rid, toks in zip(req_ids, sampled):
                r = self.requests[rid]
                if toks and r.status == RequestStatus.RUNNING:
                    k = self.model.propose(self.trace[rid].index)
                    drafts.append([5] * k)
                else:  # a non-final chunk's drafts (vLLM drops them), or a finished request's
                    drafts.append([5] * self.s.k)
            self.sched.update_draft_token_ids(DraftTokenIds(req_ids=req_ids, draft_token_ids=drafts))
        rec = {"finished": sorted(rid for rid in req_ids if self.requests[rid].is_finished()
                                  and self.requests[rid].status != RequestStatus.FINISHED_ABORTED)}
        rec.update(self.state())
        return rec

    def state(self) -> dict:
        sched = self.sched
        kv = sched.kv_cache_manager
        live = [r for r in self.requests.values() if _live(r.status)]
        blocks = {}
        for r in live:
            held = r.request_id in kv.coordinator.single_type_managers[0].req_to_blocks
            ids = kv.get_block_ids(r.request_id)[0] if held else []
            if ids:
                blocks[r.request_id] = list(ids)
        return {
            "running": [r.request_id for r in sched.running],
            "waiting": [r.request_id for r in sched.kv_holding_waiting] + [r.request_id for r in sched.waiting],
            "computed": {r.request_id: r.num_computed_tokens for r in live},
            "outputs": {rid: len(r.output_token_ids) for rid, r in self.requests.items()},
            "blocks": blocks,
            "free_blocks": kv.block_pool.get_num_free_blocks(),
            "num_preemptions": {rid: r.num_preemptions for rid, r in self.requests.items()},
            "prefix_hit": dict(self.prefix_hit),
        }

    def unfinished(self) -> int:
        return sum(1 for r in self.requests.values() if not r.is_finished())
