"""Hybrid models (docs/hybrid_models.md): layer types from config.json and the catalog, vLLM's hybrid KV cache
manager (groups, page unification, block counts, the per-request need, the maximum concurrency and the start-up lines,
worked by hand from vLLM's rule), per-step block needs and window freeing, prefix-hit granularity, the hybrid
roofline, the support matrix's refusals, and composition runs with exact KV accounting after every step."""

from __future__ import annotations

import copy
import json
from math import ceil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lab.cli.main import app
from lab.core.batch import BatchShape
from lab.core.kv_cache import KVCacheManager
from lab.core.kv_groups import FULL, MAMBA, SLIDING, HybridKV, KVGroup, KVGroupSpec
from lab.core.request import Request
from lab.costmodel.hardware import load_hardware
from lab.costmodel.hybrid_cost import HybridRooflineCostModel, window_pairs
from lab.costmodel.hybrid_kv import kv_layout
from lab.costmodel.model_arch import load_model
from lab.experiment.config import ConfigError, parse_experiment
from lab.experiment.simulation import build_deployment, simulate
from tests.composition import Recorder, check_result, instrumented

REPO = Path(__file__).resolve().parent.parent
SHARED_PREFIX = REPO / "traces" / "generated" / "shared_prefix_300.jsonl"


# ---- the model description -------------------------------------------------------------------------------------

def test_catalog_hybrids_have_their_layer_types_and_sizes():
    oss = load_model("gpt-oss-120b")
    assert oss.layer_kinds().count("full_attention") == 18 and oss.layer_kinds().count("sliding_attention") == 18
    assert oss.sliding_window == 128 and oss.moe_weight_dtype == "mxfp4" and oss.attention_sinks
    assert abs(oss.params_total() / 116.83e9 - 1) < 0.01  # OpenAI's model card: 116.83 B
    gemma = load_model("Gemma-3-27B")  # sliding_window_pattern 6: layers 5, 11, ..., 59 global
    kinds = gemma.layer_kinds()
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == list(range(5, 62, 6))
    assert kinds.count("sliding_attention") == 52 and gemma.sliding_window == 1024
    nxt = load_model("Qwen3-Next-80B-A3B")  # full_attention_interval 4
    assert nxt.layer_kinds().count("full_attention") == 12 and nxt.layer_kinds()[3] == "full_attention"
    assert abs(nxt.params_total() / 79.67e9 - 1) < 0.01 and abs(nxt.params_active() / 3.87e9 - 1) < 0.02
    # GDN state per layer at TP 1: conv (3, 2·16·128 + 32·128 = 8192) + SSM (32, 128, 128), bf16
    assert nxt.state_bytes_per_layer("linear_attention") == 3 * 8192 * 2 + 32 * 128 * 128 * 2 == 1_097_728
    granite = load_model("Granite-4.0-H-Small")
    assert granite.layer_kinds().count("mamba") == 36 and granite.num_shared_experts == 2  # 1536 / 768
    # Mamba-2 state per layer: conv (3, 8192 + 2·1·128) + SSM (128, 64, 128), bf16
    assert granite.state_bytes_per_layer("mamba") == 3 * 8448 * 2 + 128 * 64 * 128 * 2 == 2_147_840
    assert abs(granite.params_total() / 32.19e9 - 1) < 0.01  # IBM: 32 B total, 9 B active
    # only the attention layers keep per-token KV
    assert granite.kv_bytes_per_token() == 4 * 2 * 8 * 128 * 2


def test_hf_config_layer_types_are_read_as_the_models_name_them(tmp_path):
    cfg = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 100}
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"text_config": {**cfg, "sliding_window": 32, "sliding_window_pattern": 2}}))
    m = load_model(hf_config=p)  # a multimodal wrapper: text_config read, every 2nd layer global
    assert m.layer_kinds() == ("sliding_attention", "full_attention") * 2 and m.sliding_window == 32
    p.write_text(json.dumps({**cfg, "layer_types": ["mamba", "attention", "mamba", "mamba"], "mamba_n_heads": 8,
                             "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4}))
    m = load_model(hf_config=p)
    assert m.layer_kinds() == ("mamba", "full_attention", "mamba", "mamba") and m.mamba_intermediate_size == 128
    p.write_text(json.dumps({**cfg, "hybrid_override_pattern": "M*M-"}))
    with pytest.raises(ValueError, match="Nemotron-H"):
        load_model(hf_config=p)
    p.write_text(json.dumps({**cfg, "layer_types": ["full_attention"] * 3}))
    with pytest.raises(ValueError, match="lists 3 layers"):
        load_model(hf_config=p)
    p.write_text(json.dumps(cfg))
    assert not load_model(hf_config=p).is_hybrid


# ---- vLLM's rule, worked by hand ---------------------------------------------------------------------------------

def _dep(model: str, gpu: str, tp: int, blocks: int | None, version: str = "0.33", **engine):
    exp = parse_experiment({"name": "k", "model": {"name": model}, "hardware": {"gpu": gpu, "tensor_parallel_size": tp},
                            "engine": {"max_model_len": 32768, "vllm_version": version, "num_gpu_blocks": blocks,
                                       **engine}})
    return build_deployment(exp)


def _lines(dep) -> list[str]:
    s = dep.scheduler_config
    return dep.kv_layout.startup_lines(dep.num_gpu_blocks, s.max_model_len, s.max_num_batched_tokens)


# Each case: max_model_len 32,768, max_num_batched_tokens 8,192 (vLLM's default on H100 and H200), block_size 16
# configured. Blocks per request (vLLM max_memory_usage_bytes / page): full ceil(32768 / bs); sliding window w:
# ceil(min(w - 1 + 8192, 32768) / bs) + 1; Mamba: 1 (none) or 2 (align, vLLM 0.33's default with prefix caching).
# 0.33 prints one line, tokens = int(blocks / per_request · 32768); 0.19 two, tokens = blocks // groups · min bs.
HAND = [
    # gpt-oss-120b, 1 x H100: page 16·2·8·64·2 = 32,768 B; groups full 18 + sliding 18 -> 2 groups of 18 layers;
    # per request 2048 + (ceil(8319 / 16) + 1 = 521) = 2569; 18,078 / 2569 = 7.037 -> 230,587 tokens
    ("gpt-oss-120b", "H100", 1, 18078, 32768 * 18, 2569, [],
     ["GPU KV cache size: 230,587 tokens, Maximum concurrency for 32,768 tokens per request: 7.04x"],
     ["GPU KV cache size: 144,624 tokens", "Maximum concurrency for 32,768 tokens per request: 7.04x"]),  # 9039·16
    # gpt-oss-20b, 1 x H100: 12 + 12 layers, a block 12 pages; 157,888 / 2569 = 61.459
    ("gpt-oss-20b", "H100", 1, 157888, 32768 * 12, 2569, [],
     ["GPU KV cache size: 2,013,886 tokens, Maximum concurrency for 32,768 tokens per request: 61.46x"],
     ["GPU KV cache size: 1,263,104 tokens", "Maximum concurrency for 32,768 tokens per request: 61.46x"]),
    # Gemma-3-27B, 1 x H100: page 16·2·16·128·2 = 131,072 B; full 10, sliding 52 -> group size 10 (52 >= 1.5·10):
    # 1 full group + ceil(52 / 10) = 6 sliding groups (9, 9, 9, 9, 8, 8 layers); per request 2048 + 6 · (ceil(9215 /
    # 16) + 1 = 577) = 5510; 16,043 / 5510 = 2.912; 0.19: 16,043 // 7 · 16 = 36,656
    ("Gemma-3-27B", "H100", 1, 16043, 131072 * 10, 5510, ["Add 8 padding layers, may waste at most 15.38% KV cache "
                                                          "memory"],
     ["GPU KV cache size: 95,407 tokens, Maximum concurrency for 32,768 tokens per request: 2.91x"],
     ["GPU KV cache size: 36,656 tokens", "Maximum concurrency for 32,768 tokens per request: 2.91x"]),
    # Qwen3-Next-80B-A3B, 2 x H200 (TP 2): attention 2·1·256·2 = 1,024 B a token; GDN state per rank (3, 4096) bf16
    # + (16, 128, 128) bf16 = 548,864 B -> block 16·ceil(548864 / (16·1024)) = 544 tokens, page 557,056 B (state
    # padded by 1.49%); full 12 + linear 36 -> 1 + 3 groups of 12; per request ceil(32768 / 544) = 61 + 3 · 2 = 67
    # (align); 8,530 / 67 = 127.31
    ("Qwen3-Next-80B-A3B", "H200", 2, 8530, 557056 * 12, 67,
     ["Setting attention block size to 544 tokens to ensure that attention page size is >= mamba page size.",
      "Padding mamba page size by 1.49% to ensure that mamba page size and attention page size are exactly equal."],
     ["GPU KV cache size: 4,171,806 tokens, Maximum concurrency for 32,768 tokens per request: 127.31x"],
     # 0.19: prefix caching opt-in (off by default for hybrids): Mamba mode none, 61 + 3 = 64 blocks a request;
     # 8,530 // 4 · 544 = 1,159,808 tokens; 8,530 / 64 = 133.28
     ["GPU KV cache size: 1,159,808 tokens", "Maximum concurrency for 32,768 tokens per request: 133.28x"]),
    # Granite-4.0-H-Small, 1 x H100: attention 2·8·128·2 = 4,096 B a token; Mamba-2 state 2,147,840 B -> block
    # 16·ceil(2147840 / 65536) = 528 tokens, page 2,162,688 B (padded by 0.69%); full 4 + mamba 36 -> 1 + 9 groups
    # of 4; per request ceil(32768 / 528) = 63 + 9 · 2 = 81; 1,423 / 81 = 17.568
    ("Granite-4.0-H-Small", "H100", 1, 1423, 2162688 * 4, 81,
     ["Setting attention block size to 528 tokens to ensure that attention page size is >= mamba page size.",
      "Padding mamba page size by 0.69% to ensure that mamba page size and attention page size are exactly equal."],
     ["GPU KV cache size: 575,664 tokens, Maximum concurrency for 32,768 tokens per request: 17.57x"],
     # 0.19: 63 + 9 = 72 a request; 1,423 // 10 · 528 = 74,976; 1,423 / 72 = 19.76
     ["GPU KV cache size: 74,976 tokens", "Maximum concurrency for 32,768 tokens per request: 19.76x"]),
]


@pytest.mark.parametrize("model,gpu,tp,blocks,block_bytes,per_request,notes,v33,v19", HAND,
                         ids=[h[0] for h in HAND])
def test_startup_lines_are_vllms_worked_by_hand(model, gpu, tp, blocks, block_bytes, per_request, notes, v33, v19):
    dep = _dep(model, gpu, tp, blocks)
    layout = dep.kv_layout
    assert layout.bytes_per_block == block_bytes
    assert sum(layout.blocks_per_request(32768, 8192)) == per_request
    assert _lines(dep) == notes + v33
    old = _dep(model, gpu, tp, blocks, "0.19")
    assert _lines(old)[-2:] == v19


@pytest.mark.parametrize("model,gpu,tp", [(h[0], h[1], h[2]) for h in HAND], ids=[h[0] for h in HAND])
def test_derived_block_count_is_available_memory_over_page_and_group_size(model, gpu, tp):
    dep = _dep(model, gpu, tp, None)
    cap = dep.kv_capacity
    layout = dep.kv_layout
    assert dep.num_gpu_blocks == cap.available_bytes // layout.page_bytes // layout.group_size  # vLLM get_num_blocks
    assert cap.bytes_per_block == layout.page_bytes * layout.group_size
    assert cap.as_dict()["kv_cache_groups"]["group_size"] == layout.group_size


def test_sliding_window_model_holds_more_than_its_full_attention_twin_by_the_rules_ratio():
    hybrid = _dep("gpt-oss-120b", "H100", 1, None)
    twin = _dep("gpt-oss-120b", "H100", 1, None, disable_hybrid_kv_cache_manager=True)
    avail = hybrid.kv_capacity.available_bytes
    assert twin.kv_capacity.available_bytes == avail
    # twin: one group of all 36 layers, a block 16 tokens x 36 layers x 2,048 B; hybrid: 18 layers a block
    assert twin.num_gpu_blocks == avail // (16 * 36 * 2048)
    assert hybrid.num_gpu_blocks == avail // 32768 // 18
    assert abs(hybrid.num_gpu_blocks - 2 * twin.num_gpu_blocks) <= 1
    # maximum concurrency: hybrid blocks / (2048 + 521) against twin blocks / 2048, so the ratio is
    # (hybrid blocks / twin blocks) x 2048 / 2569 = 2 x 0.797 = 1.594 at 32k tokens
    conc_h = hybrid.kv_layout.max_concurrency(hybrid.num_gpu_blocks, 32768, 8192)
    twin_layout = kv_layout(twin.model, max_model_len=32768, hybrid_manager=False)
    conc_t = twin_layout.max_concurrency(twin.num_gpu_blocks, 32768, 8192)
    assert conc_h / conc_t == pytest.approx(hybrid.num_gpu_blocks / twin.num_gpu_blocks * 2048 / 2569)
    assert 1.59 < conc_h / conc_t < 1.60


def test_mamba_hybrid_without_the_hybrid_manager_cannot_be_configured():
    with pytest.raises(ValueError, match="cannot fold Mamba"):
        kv_layout(load_model("Granite-4.0-H-Small"), hybrid_manager=False)


def test_group_size_ratio_by_version():
    # gpt-oss-20b + EAGLE: 13 full (a drafter layer) + 12 sliding -> one group size of 13 (13 < 1.25 · 12)
    layout = kv_layout(load_model("gpt-oss-20b"), extra_full_layers=1)
    assert layout.group_size == 13 and [g.num_layers for g in layout.groups] == [13, 12]


# ---- per-step block needs and window freeing -----------------------------------------------------------------------

def _kv(groups, block_size=4, mode="none", blocks=64, caching=True, split=False):
    spec = KVGroupSpec(tuple(groups), block_size, mode, 0, 16, aligned_split=split)
    return KVCacheManager(blocks, block_size, 64, enable_prefix_caching=caching, hybrid=HybridKV(spec))


def _used(kv) -> int:
    return kv.pool.num_usable_blocks - kv.num_free_blocks


def _step(kv, r: Request, n: int) -> None:
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n
    if r.num_computed_tokens >= r.prompt_len + r.num_output_tokens:
        r.num_output_tokens += 1


def test_sliding_window_needs_the_window_plus_the_step_and_frees_blocks_that_leave_it():
    kv = _kv([KVGroup(FULL, 1), KVGroup(SLIDING, 1, window=8)], caching=False)
    r = Request(0, 0.0, 10, 20)
    _step(kv, r, 10)  # full ceil(10/4) = 3; sliding: nothing skipped yet (C = 0), 3
    assert _used(kv) == 6
    _step(kv, r, 1)  # C = 10: skipped max(0, 10 - 8 + 1) = 3 tokens -> 0 whole blocks; 11 tokens: 3 + 3
    assert _used(kv) == 6
    _step(kv, r, 1)  # C = 11: 4 tokens skipped -> block 0 of the window freed; 12 tokens: full 3, sliding 2
    assert _used(kv) == 5
    held = kv.hybrid.blocks_of(r, 1)
    assert held[0] == 0 and all(b for b in held[1:])  # the freed position holds the null block
    for _ in range(8):
        _step(kv, r, 1)  # C = 19 after: full ceil(20/4) = 5; sliding keeps the blocks of tokens 12..19
    assert len(r.blocks) == 5 and sum(1 for b in kv.hybrid.blocks_of(r, 1) if b) == 2
    kv.free(r, finished=True)
    assert _used(kv) == 0


def test_mamba_state_is_one_block_a_request_or_two_in_align_mode():
    kv = _kv([KVGroup(FULL, 1), KVGroup(MAMBA, 1)], caching=False)
    r = Request(0, 0.0, 30, 10)
    _step(kv, r, 30)
    assert _used(kv) == ceil(30 / 4) + 1
    _step(kv, r, 1)
    assert _used(kv) == ceil(31 / 4) + 1
    kv.free(r)
    kv = _kv([KVGroup(FULL, 1), KVGroup(MAMBA, 1)], mode="align")
    r = Request(0, 0.0, 30, 10)
    _step(kv, r, 28)  # the running state at block 6 (tokens 25..28); blocks 0..5 are null
    states = kv.hybrid.blocks_of(r, 1)
    assert sum(1 for b in states if b) == 1 and states[6]
    _step(kv, r, 2)  # crosses a boundary: a new state block at 7, the one at 6 kept one more step
    assert sum(1 for b in kv.hybrid.blocks_of(r, 1) if b) == 2
    _step(kv, r, 1)  # C = 30 now: the state of two steps ago is freed
    assert sum(1 for b in kv.hybrid.blocks_of(r, 1) if b) == 1


def test_a_request_that_needs_more_than_is_free_fails_with_nothing_changed():
    kv = _kv([KVGroup(FULL, 1), KVGroup(SLIDING, 1, window=8)], blocks=6, caching=False)  # 5 usable
    r = Request(0, 0.0, 12, 4)
    assert not kv.allocate_slots(r, 12)  # 3 + 3 blocks
    assert _used(kv) == 0 and r.blocks == []
    assert kv.blocks_for(12) == 6 and kv.blocks_for(64) == 16 + 7  # full 16; sliding min(16, ceil(23/4) + 1)


# ---- prefix hits --------------------------------------------------------------------------------------------------

def _ids(prompt: list[int], i: int, out: int = 4) -> Request:
    return Request(i, 0.0, len(prompt), out, prompt_token_ids=prompt, output_token_ids=[1000 + i] * out)


def test_sliding_window_hit_needs_the_window_before_the_hit_cached():
    kv = _kv([KVGroup(FULL, 1), KVGroup(SLIDING, 1, window=8)])
    a = _ids(list(range(20)), 0)
    _step(kv, a, 20)
    kv.free(a, finished=True)
    b = _ids(list(range(13)) + [500 + i for i in range(7)], 1)
    hits, n = kv.get_computed_blocks(b)
    assert n == 12  # whole blocks only: tokens 0..11; the sliding group holds blocks 1 and 2 (ceil(7/4) = 2 needed)
    assert kv.hybrid is not None and hits.groups[1][0] == 0 and all(hits.groups[1][1:])


def test_mamba_hit_only_where_a_state_was_cached_at_a_block_boundary():
    groups = [KVGroup(FULL, 1), KVGroup(MAMBA, 1)]
    kv = _kv(groups, mode="align", split=True)
    a = _ids(list(range(14)), 0)
    n = kv.hybrid.aligned_chunk(a, 14)
    assert n == 12  # vLLM's aligned split: the chunk ends on the last boundary before the prompt's end
    _step(kv, a, n)
    _step(kv, a, 2)
    kv.free(a, finished=True)
    b = _ids(list(range(13)) + [600, 601, 602], 1)
    assert kv.get_computed_blocks(b)[1] == 12  # the state after 12 tokens was cached
    kv2 = _kv(groups, mode="align", split=False)
    a = _ids(list(range(14)), 0)
    _step(kv2, a, 14)  # one chunk past the boundary: no state at a boundary inside the shared prefix
    kv2.free(a, finished=True)
    assert kv2.get_computed_blocks(_ids(list(range(13)) + [600, 601, 602], 1))[1] == 0


def _run(data: dict):
    data = copy.deepcopy(data)
    data.setdefault("name", "h")
    data.setdefault("simulation", {})["progress"] = False
    rec = Recorder()
    with instrumented(rec):
        exp = parse_experiment(data, base_dir=REPO)
        res = simulate(exp)
        check_result(res, rec, exp)  # exact KV accounting after every step, every request accounted for
    return res


def test_shared_prefix_hits_are_multiples_of_each_models_block():
    base = {"workload": {"source": "mooncake", "path": str(SHARED_PREFIX), "max_requests": 24},
            "engine": {"max_model_len": 32768}}
    oss = _run({**base, "model": {"name": "gpt-oss-20b"}, "engine": {**base["engine"], "num_gpu_blocks": 3000}})
    hits = [r.prefix_hit_tokens for r in oss.requests]
    assert max(hits) == 4096 and all(h % 16 == 0 for h in hits)  # the 8 shared 512-token blocks, 16-token blocks
    nxt = _run({**base, "model": {"name": "Qwen3-Next-80B-A3B"},
                "hardware": {"gpu": "H200", "tensor_parallel_size": 2}, "engine": {**base["engine"],
                                                                                   "num_gpu_blocks": 400}})
    hits = [r.prefix_hit_tokens for r in nxt.requests]
    assert max(hits) == 7 * 544 and all(h % 544 == 0 for h in hits)  # 4096 floored to 544-token blocks: 3808
    off = _run({**base, "model": {"name": "Qwen3-Next-80B-A3B"}, "hardware": {"gpu": "H200", "tensor_parallel_size": 2},
                "engine": {**base["engine"], "num_gpu_blocks": 400, "vllm_version": "0.19"}})
    assert sum(r.prefix_hit_tokens for r in off.requests) == 0  # 0.19: opt-in for Mamba hybrids
    assert not off.instances[0].kv.enable_prefix_caching


# ---- the roofline -----------------------------------------------------------------------------------------------

def test_window_pairs_and_sliding_decode_stay_flat_past_the_window():
    assert window_pairs(0, 4, 8) == 1 + 2 + 3 + 4
    assert window_pairs(10, 3, 8) == 3 * 8
    assert window_pairs(5, 5, 8) == 6 + 7 + 8 + 8 + 8
    m = HybridRooflineCostModel(load_model("gpt-oss-120b"), load_hardware("H100"))

    def decode(ctx: int) -> float:
        return m._attention(BatchShape(num_tokens=8, num_seqs=8, decode_context=[ctx] * 8, num_decodes=8,
                                       decode_sum=8 * ctx, decode_max=ctx, decode_min=ctx), "sliding_attention")

    assert decode(1000) == decode(30000)
    assert m._attention(BatchShape(num_tokens=8, num_seqs=8, decode_context=[30000] * 8, num_decodes=8,
                                   decode_sum=240000, decode_max=30000, decode_min=30000), "full_attention") > 20 * \
        decode(30000)


def test_recurrent_decode_is_bound_by_the_state():
    m = HybridRooflineCostModel(load_model("Qwen3-Next-80B-A3B"), load_hardware("H200"))
    one = BatchShape(num_tokens=64, num_seqs=64, decode_context=[1000] * 64, num_decodes=64, decode_sum=64000,
                     decode_max=1000, decode_min=1000)
    far = BatchShape(num_tokens=64, num_seqs=64, decode_context=[100000] * 64, num_decodes=64, decode_sum=6400000,
                     decode_max=100000, decode_min=100000)
    assert m._gdn(one) == m._gdn(far)  # a state, whatever the context
    # 64 requests x (state 32·128·128·2 B read and written) over 4.8 TB/s x 0.8
    assert m._gdn(one) > 64 * 2 * 32 * 128 * 128 * 2 / (4.8e12 * 0.8)
    assert m.step_time(far) > m.step_time(one)  # the 12 full-attention layers still read their KV


AIC = Path(__file__).resolve().parents[2] / "shared" / "data" / "calibration" / "aiconfigurator" / "perf_db" / \
    "h100_sxm" / "attention" / "vllm" / "0.19.0" / "context_attention_perf.parquet"


@pytest.mark.skipif(not AIC.is_file(), reason="AIConfigurator tables not found")
def test_windowed_prefill_roofline_against_aiconfigurators_window_128_table():
    import pandas as pd

    t = pd.read_parquet(AIC)
    t = t[(t.window_size == 128) & (t.head_dim == 64) & (t.num_heads == 64) & (t.num_key_value_heads == 8)
          & (t.kv_cache_dtype == "bfloat16") & (t.isl >= 2048)]
    m = HybridRooflineCostModel(load_model("gpt-oss-120b"), load_hardware("H100"))
    ratios = []
    for (b, isl), g in t.groupby(["batch_size", "isl"]):
        shape = BatchShape(num_tokens=b * isl, num_seqs=b, prefill_new=[int(isl)] * b, prefill_context=[0] * b)
        ratios.append(g.latency.mean() * 1e-3 / m._attention(shape, "sliding_attention"))
    ratios.sort()
    assert len(ratios) > 20 and 0.9 < ratios[len(ratios) // 2] < 1.1 and ratios[0] > 0.8 and ratios[-1] < 1.25


# ---- composition -------------------------------------------------------------------------------------------------

SMALL = {"workload": {"num_requests": 24, "rate": 8, "prompt_tokens": {"kind": "lognormal", "median": 900,
                                                                      "sigma": 0.6, "max": 6000},
                      "output_tokens": {"kind": "lognormal", "median": 60, "sigma": 0.5, "max": 300}},
         "engine": {"max_model_len": 16384, "max_num_batched_tokens": 1024}}
MODELS = [("gpt-oss-20b", {"gpu": "H100"}, 300), ("Qwen3-Next-80B-A3B", {"gpu": "H200", "tensor_parallel_size": 2}, 60),
          ("Granite-4.0-H-Small", {"gpu": "H100"}, 60)]
FEATURES = {
    "chunked_preemption": {"workload": {"output_tokens": {"kind": "lognormal", "median": 400, "sigma": 0.3,
                                                          "max": 1000}}},
    "no_chunking": {"engine": {"enable_chunked_prefill": False, "max_num_batched_tokens": None}},
    "prefix_caching": {"workload": {"source": "mooncake", "path": str(SHARED_PREFIX), "max_requests": 24}},
    "pd": {"deployment": {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}},
    "eagle": {"speculative": {"method": "eagle", "num_speculative_tokens": 2}},
    "ngram": {"speculative": {"method": "ngram", "num_speculative_tokens": 2}},
    "sarathi": {"policy": "sarathi"},
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("model,hw,blocks", MODELS, ids=[m[0] for m in MODELS])
def test_hybrids_compose_with_exact_kv_accounting(model, hw, blocks, feature):
    data = copy.deepcopy(SMALL)
    data["model"] = {"name": model}
    data["hardware"] = hw
    data["engine"]["num_gpu_blocks"] = blocks if feature != "prefix_caching" else blocks * 4
    extra = copy.deepcopy(FEATURES[feature])
    for k, v in extra.items():
        merge = isinstance(v, dict) and isinstance(data.get(k), dict) and "source" not in v
        data[k] = {**data[k], **v} if merge else v
    data["engine"] = {k: v for k, v in data["engine"].items() if v is not None}
    res = _run(data)
    assert all(r.status.name in ("FINISHED", "REJECTED") for r in res.requests)
    assert any(r.status.name == "FINISHED" for r in res.requests)
    assert all(not i.jump.enabled for i in res.instances)  # hybrids go step by step
    if feature == "chunked_preemption":
        assert sum(r.num_preemptions for r in res.requests) > 0


REFUSED = [
    ({"policy": {"preemption": {"mode": "swap"}}}, "swap preemption is vLLM V0's", "vLLM 0.33"),
    ({"hardware": {"gpu": "H100", "pipeline_parallel_size": 2}}, "pipeline_parallel_size > 1 with a hybrid",
     "[servelab]"),
    ({"cost_model": {"kind": "operator"}}, "priced by the roofline only", "[servelab]"),
]


@pytest.mark.parametrize("sections,fragment,rule", REFUSED, ids=["swap", "pp", "operator"])
def test_refused_up_front_with_the_reason(sections, fragment, rule):
    exp = parse_experiment({"name": "r", "model": {"name": "gpt-oss-20b"}, **sections}, source="x.yaml")
    with pytest.raises(ConfigError) as e:
        simulate(exp)
    assert fragment in str(e.value) and rule in str(e.value)


def test_mamba_hybrid_refusals_name_the_engine_rule():
    base = {"name": "r", "model": {"name": "Granite-4.0-H-Small"}}
    pd = {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}
    exp = parse_experiment({**base, "deployment": pd, "engine": {"vllm_version": "0.19"}}, source="x.yaml")
    with pytest.raises(ConfigError, match="before vLLM 0.33.*vLLM 0.19"):
        simulate(exp)
    with pytest.raises(ConfigError, match="MambaRadixCache"):
        simulate(parse_experiment({**base, "policy": "sglang"}, source="x.yaml"))
    with pytest.raises(ConfigError, match="unify_hybrid_kv_cache_specs"):
        simulate(parse_experiment({**base, "engine": {"disable_hybrid_kv_cache_manager": True}}, source="x.yaml"))


def test_pd_sends_each_groups_blocks_and_turns_the_manager_off_before_0_33():
    pd = {"mode": "disaggregated", "prefill": {"count": 1}, "decode": {"count": 1}}
    base = {"model": {"name": "gpt-oss-20b"}, "deployment": pd,
            "workload": {"num_requests": 6, "rate": 2, "prompt_tokens": {"kind": "constant", "value": 4000},
                         "output_tokens": {"kind": "constant", "value": 8}},
            "engine": {"num_gpu_blocks": 3000, "enable_prefix_caching": False}}
    new = _run(base)
    old = _run({**base, "engine": {**base["engine"], "vllm_version": "0.19"}})
    assert new.pools[0][1].kv_layout.hybrid_manager and not old.pools[0][1].kv_layout.hybrid_manager
    # 0.33: 12 full layers x 4000 tokens + 12 sliding layers x their window's blocks; 0.19: 24 layers x 4000 tokens
    per_layer = 2 * 8 * 64 * 2
    window = (ceil(4000 / 16) - (4000 - 128 + 1) // 16) * 16
    assert new.cluster.bytes_transferred == pytest.approx(6 * (12 * 4000 + 12 * window) * per_layer)
    assert old.cluster.bytes_transferred == pytest.approx(6 * 24 * 4000 * per_layer)


def test_servelab_kv_prints_vllms_lines():
    res = CliRunner().invoke(app, ["kv", "--model", "Granite-4.0-H-Small", "--gpu", "H100", "--max-model-len",
                                   "32768", "--set", "engine.num_gpu_blocks=1423"])
    assert res.exit_code == 0, res.output
    assert "Setting attention block size to 528 tokens" in res.output
    assert "GPU KV cache size: 575,664 tokens, Maximum concurrency for 32,768 tokens per request: 17.57x" in res.output
    res = CliRunner().invoke(app, ["kv", "--model", "Llama-3.1-8B", "--gpu", "H100", "--vllm-version", "0.19",
                                   "--max-model-len", "8192", "--set", "engine.num_gpu_blocks=1000"])
    assert res.exit_code == 0, res.output
    assert "GPU KV cache size: 16,000 tokens" in res.output and "per request: 1.95x" in res.output  # 1000 / 512


# ---- the experiments -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,runs", [("hybrid_long_context", 12), ("hybrid_prefix", 6)])
def test_the_hybrid_experiments_parse_and_a_short_run_of_each_composes(name, runs):
    from lab.report.compare import load_comparison

    _, found = load_comparison(REPO / "experiments" / f"{name}.yaml")
    assert len(found) == runs
    assert (REPO / "experiments" / f"{name}.md").is_file()
    run = found[0]
    data = copy.deepcopy(run.data)
    data["workload"]["max_requests"] = 4
    if data["workload"].get("source") == "synthetic":
        data["workload"]["prompt_tokens"] = {"kind": "constant", "value": 2048, "max": 2048}
        data["workload"]["output_tokens"] = {"kind": "constant", "value": 16, "max": 16}
    data["name"] = "short"
    res = simulate(parse_experiment(data, base_dir=Path(run.base_dir)))
    assert all(r.status.name == "FINISHED" for r in res.requests)
