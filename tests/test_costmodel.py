"""Cost models: catalog facts, KV capacity, roofline behaviour, LLMServingSim profile lookups."""

import pytest

from lab.core.batch import BatchShape
from lab.costmodel.hardware import load_hardware
from lab.costmodel.kv_capacity import bytes_per_block, derive_num_gpu_blocks
from lab.costmodel.llmservingsim import LLMServingSimProfileCostModel, _interp
from lab.costmodel.model_arch import load_model
from lab.costmodel.roofline import RooflineCostModel
from tests.conftest import DATA_DIR, needs_data

PROFILE_4090 = ("validation", "llmservingsim", "profiles", "RTX4090", "meta-llama", "Llama-3.1-8B", "bf16", "tp1")


def test_kv_bytes_per_token_match_hand_computed_values():
    assert load_model("Llama-3.1-8B").kv_bytes_per_token("bf16") == 2 * 8 * 128 * 32 * 2 == 131072
    assert load_model("DeepSeek-V3").kv_bytes_per_token("bf16") == (512 + 64) * 61 * 2 == 70272
    assert load_model("Llama-3.1-70B").kv_bytes_per_token("fp8", tp=4) == 2 * 2 * 128 * 80 * 1
    assert bytes_per_block(load_model("Llama-3.1-8B"), 16) == 2 * 16 * 8 * 128 * 2 * 32


def test_parameter_counts_match_published_sizes():
    assert load_model("Llama-3.1-8B").params_total() / 1e9 == pytest.approx(8.03, abs=0.01)
    ds = load_model("deepseek-ai/DeepSeek-V3")
    assert ds.params_total() / 1e9 == pytest.approx(671.0, abs=0.5)
    assert ds.params_active() / 1e9 == pytest.approx(37.5, abs=0.5)
    assert load_model("Qwen3-30B-A3B").params_active() / 1e9 == pytest.approx(3.35, abs=0.05)


def test_unknown_model_and_gpu_list_the_catalog():
    with pytest.raises(ValueError, match="Llama-3.1-8B"):
        load_model("nope")
    with pytest.raises(ValueError, match="H100-SXM5-80GB"):
        load_hardware("nope")


def test_hf_config_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, '
                 '"num_key_value_heads": 2, "intermediate_size": 4096, "vocab_size": 1000}')
    m = load_model(hf_config=p)
    assert m.head_dim == 128 and m.kv_bytes_per_token() == 2 * 2 * 128 * 4 * 2
    (tmp_path / "bad.json").write_text('{"hidden_size": 1}')
    with pytest.raises(ValueError, match="lacks required field"):
        load_model(hf_config=tmp_path / "bad.json")


def test_kv_capacity_reproduces_the_measured_rtx4090_block_count():
    cap = derive_num_gpu_blocks(load_model("Llama-3.1-8B"), load_hardware("RTX4090"), block_size=16,
                                gpu_memory_utilization=0.9, max_num_batched_tokens=2048, max_num_seqs=256)
    assert cap.num_gpu_blocks == 2588


def test_kv_capacity_refuses_a_model_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        derive_num_gpu_blocks(load_model("Llama-3.1-70B"), load_hardware("RTX4090"))


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    cm = RooflineCostModel(load_model("Llama-3.1-8B"), load_hardware("H100-SXM5-80GB"))
    one = cm.step_time(BatchShape.from_requests([1], [1000]))
    sixty_four = cm.step_time(BatchShape.from_requests([1] * 64, [1000] * 64))
    assert 4e-3 < one < 12e-3  # ~16 GB of weights at ~3 TB/s
    assert sixty_four < 2 * one  # batching decodes is nearly free while memory-bound
    p1 = cm.step_time(BatchShape.from_requests([4096], [0]))
    p2 = cm.step_time(BatchShape.from_requests([8192], [0]))
    assert p2 > 1.8 * p1 - cm.eff.step_overhead_s  # compute-bound: time scales with tokens
    b = cm.breakdown(BatchShape.from_requests([512, 1, 1], [0, 100, 3000]))
    assert sum(b.values()) == pytest.approx(cm.step_time(BatchShape.from_requests([512, 1, 1], [0, 100, 3000])))


def test_roofline_tp_splits_work_and_adds_communication():
    m, h = load_model("Llama-3.1-70B"), load_hardware("H100-SXM5-80GB")
    shape = BatchShape.from_requests([1] * 32, [2000] * 32)
    t1 = RooflineCostModel(m, h, tp=1).breakdown(shape)
    t4 = RooflineCostModel(m, h, tp=4).breakdown(shape)
    assert t4["gemm"] < t1["gemm"] / 3
    assert t1["communication"] == 0 and t4["communication"] > 0


@needs_data(*PROFILE_4090)
def test_profile_model_reproduces_grid_points_and_interpolates_linearly():
    d = DATA_DIR.joinpath(*PROFILE_4090)
    cm = LLMServingSimProfileCostModel(d, load_model("Llama-3.1-8B"))
    # the attention grid point (pc=0, kp=0, nd=32, kvd=1024) is 181.391 us
    assert cm.attn.lookup_us(0, 0, 32, 1024) == pytest.approx(181.391)
    mid = cm.attn.lookup_us(0, 0, 32, 1536)
    assert mid == pytest.approx((181.391 + 325.006) / 2)
    # dense qkv_proj at 16 tokens is 56.4653 us; at 18 tokens halfway to the 20-token point (60.551)
    xs, ys = cm.dense["qkv_proj"]
    assert _interp(xs, ys, 18) == pytest.approx((56.4653 + 60.551) / 2)
    t = cm.step_time(BatchShape.from_requests([1] * 32, [1024] * 32))
    assert 0.015 < t < 0.05  # an 8B decode step on a 4090: ~20-30 ms


def test_missing_profile_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="dense.csv"):
        LLMServingSimProfileCostModel(tmp_path, load_model("Llama-3.1-8B"))


@pytest.mark.parametrize("model,tp", [("Llama-3.1-8B", 1), ("DeepSeek-V3", 8)])
def test_roofline_run_times_equal_step_time_bit_for_bit(model, tp):
    # the fast-forward prices decode runs with decode_times (numpy) or steady_decode_times (floats) and relies on
    # both equalling step_time of each step exactly (MLA's absorbed decode attention included)
    import numpy as np

    cost = RooflineCostModel(load_model(model), load_hardware("H100-SXM5-80GB"), tp=tp)
    n, ctx0, steps = 5, [900, 40, 3001, 7, 512], 30
    for padded in (0, 8):
        steady = cost.steady_decode_times(n, sum(ctx0), max(ctx0), min(ctx0), padded, steps)
        js = np.arange(steps)
        vector = cost.decode_times(np.full(steps, n), sum(ctx0) + n * js, max(ctx0) + js, min(ctx0) + js,
                                   np.full(steps, padded))
        for t in range(steps):
            ctx = [c + t for c in ctx0]
            shape = BatchShape.decode_only(ctx, sum(ctx), max(ctx), min(ctx))
            shape.padded_tokens = padded
            assert steady[t] == vector[t] == cost.step_time(shape), (padded, t)


def test_decodes_and_prefills_is_the_shape_from_requests_gives():
    for ctx, new, before in (([5, 90, 7], [300], [0]), ([], [64, 2], [0, 10]), ([1], [2], [0])):
        direct = BatchShape.decodes_and_prefills(list(ctx), list(new), list(before))
        assert direct == BatchShape.from_requests([1] * len(ctx) + new, list(ctx) + before)


def test_a_shape_made_with_defaults_owns_its_lists_and_takes_keywords():
    """BatchShape's __init__ is written out (compiled with the core): a list left out is a new one per shape, as
    the dataclass field factories gave, and keywords, equality and dataclasses.replace work as before."""
    import dataclasses

    a, b = BatchShape(), BatchShape()
    a.prefill_new.append(5)
    assert b.prefill_new == [] and b.verify_new == [] and b.decode_context == []
    shape = BatchShape(num_tokens=9, num_seqs=2, prefill_new=[8], prefill_context=[0], decode_context=[40],
                       num_decodes=1, decode_sum=40, decode_max=40, decode_min=40)
    assert shape == BatchShape(9, 2, [8], [0], [40], 1, 40, 40, 40)
    padded = dataclasses.replace(shape, padded_tokens=16)
    assert padded.padded_tokens == 16 and padded.prefill_new == [8] and shape.padded_tokens == 0


def test_roofline_all_reduce_remembered_by_size_equals_the_communication_model():
    """The roofline keeps each buffer size's all-reduce seconds; every size gives comm.allreduce's value, on the
    first call and the next."""
    from lab.costmodel import comm

    cm = RooflineCostModel(load_model("Llama-3.1-8B"), load_hardware("H100-SXM5-80GB"), tp=4)
    for byts in (8192, 8192.0, 3 * 4096 * 2, 64 << 20, 1 << 30, 8192):
        assert cm._allreduce(byts) == comm.allreduce(cm.link, 4, byts)
    assert RooflineCostModel(load_model("Llama-3.1-8B"), load_hardware("H100-SXM5-80GB"), tp=1)._allreduce(1e6) == 0.0
