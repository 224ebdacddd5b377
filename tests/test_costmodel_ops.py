"""Operator FLOP and byte counts, per-rank weights and KV bytes, pinned against hand-computed values."""

import pytest

from lab.costmodel import ops
from lab.costmodel.hardware import load_hardware
from lab.costmodel.kv_capacity import bytes_per_block, derive_num_gpu_blocks
from lab.costmodel.model_arch import load_model
from lab.costmodel.parallel import Parallelism


def test_gemm_qkv_of_llama8b_at_16_tokens():
    # m=16 tokens, n=(32 + 2*8) heads * 128, k=4096, bf16 weights and activations
    flops, byts = ops.gemm(16, 6144, 4096)
    assert flops == 2 * 16 * 6144 * 4096 == 805_306_368
    assert byts == 6144 * 4096 * 2 + 16 * 4096 * 2 + 16 * 6144 * 2 == 50_659_328
    # W8A8 fp8: weights and input activations 1 byte, output bf16
    assert ops.gemm(16, 6144, 4096, 1, 1)[1] == 6144 * 4096 + 16 * 4096 + 16 * 6144 * 2


def test_prefill_attention_counts_causal_pairs_and_history():
    # one chunk of 16 new tokens, no history, Llama-3.1-8B layer (32 q heads, 8 KV heads, d=128, bf16 KV)
    kv_tok = 2 * 8 * 128 * 2
    flops, byts = ops.attention_prefill(16, 0, 32, 8, 128, 128, kv_tok)
    assert ops.prefill_pairs(16, 0) == 16 * 17 / 2 == 136
    assert flops == 2 * 32 * (128 + 128) * 136 == 2_228_224
    assert byts == 16 * 32 * 256 * 2 + 16 * kv_tok + 16 * kv_tok == 393_216
    # 16 new tokens after 100 cached: 16*100 + 136 pairs, and the 100 cached tokens' KV is read
    f2, b2 = ops.attention_prefill(16, 100, 32, 8, 128, 128, kv_tok)
    assert f2 == 2 * 32 * 256 * (1600 + 136)
    assert b2 == byts + 100 * kv_tok


def test_decode_attention_reads_every_cached_token_once():
    kv_tok = 4096
    flops, byts = ops.attention_decode(4, 4000, 32, 128, 128, kv_tok)
    assert flops == 2 * 32 * 256 * 4004 == 65_601_536
    assert byts == 4004 * kv_tok + 4 * 32 * 256 * 2 + 4 * kv_tok == 16_482_304


def test_mla_decode_is_absorbed_latent_attention():
    # DeepSeek-V3 at TP8: 16 heads per GPU, latent 512 + rope 64, bf16 latent cache 1152 B per token per layer
    flops, byts = ops.mla_decode(2, 1000, 16, 512, 64, 1152)
    assert flops == (2 * 16 * 576 + 2 * 16 * 512) * 1002 == 34_885_632
    assert byts == 1002 * 1152 + 2 * 16 * (1024 + 64) * 2 + 2 * 1152 == 1_226_240


def test_moe_experts_on_one_of_eight_ep_gpus():
    # DeepSeek-V3 routed experts, EP8, fp8 weights: 64 tokens x top-8 / 8 GPUs = 64 rows on 32 local experts
    flops, byts = ops.moe_experts(64, 7168, 2048, 8, 256, ep=8, w_bytes=1, a_bytes=1)
    assert flops == 6 * 64 * 7168 * 2048 == 5_637_144_576
    assert byts == 32 * 3 * 7168 * 2048 + 64 * (7168 + 3 * 2048 * 2 + 7168 * 2) == 1_411_448_832
    # 2 tokens touch only 2 x 8 / 8 = 2 expert weights (balanced routing)
    assert ops.moe_experts(2, 7168, 2048, 8, 256, ep=8, w_bytes=1)[1] < 3 * 3 * 7168 * 2048


def test_collective_volumes():
    assert ops.allreduce_bytes(16 * 4096 * 2, 8) == 2 * 7 / 8 * 131072 == 229_376
    assert ops.allreduce_bytes(1000, 1) == 0
    assert ops.expected_remote_ranks(8, 1) == 0
    assert ops.expected_remote_ranks(8, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8) * 7 / 8)


def test_kv_bytes_per_token_for_each_attention_and_dtype():
    ds = load_model("DeepSeek-V3")
    assert ds.kv_bytes_per_token("bf16") == 70_272 == (512 + 64) * 61 * 2
    assert ds.kv_bytes_per_token("fp8") == 35_136
    assert ds.kv_bytes_per_token("bf16", tp=8) == 70_272  # the latent cache is replicated over TP
    l70 = load_model("Llama-3.1-70B")
    assert l70.kv_bytes_per_token("bf16", tp=8) == 2 * 1 * 128 * 80 * 2  # one KV head per rank
    assert l70.kv_bytes_per_token("bf16", tp=16) == 2 * 1 * 128 * 80 * 2  # replicated below one head
    assert l70.kv_bytes_per_token("bf16", pp=4) == 2 * 8 * 128 * 20 * 2  # a quarter of the layers per stage
    assert bytes_per_block(ds, 16) == 70_272 * 16


def test_weights_per_rank_follow_tp_ep_pp_and_fp8():
    q = load_model("Qwen3-32B")
    attn = 5120 * (32 + 2 * 4) * 128 + 32 * 128 * 5120
    mlp = 3 * 5120 * 25600 // 2
    emb = 151936 * 5120 // 2
    assert q.weight_bytes_per_rank("bf16", tp=2) == ((attn + mlp) * 64 + 2 * emb) * 2 == 32_761_446_400
    ds = load_model("DeepSeek-V3")
    h = 7168
    attn_r = ds.attention_params_per_rank(1)
    expert = 3 * h * 2048
    # EP8 over DP8: 32 whole experts + the shared expert per GPU, attention replicated, fp8 linear, bf16 emb/head/router
    lin = 61 * attn_r + 3 * 3 * h * 18432 + 58 * (32 * expert + expert)
    b16 = 58 * h * 256 + 2 * 129280 * h
    assert ds.weight_bytes_per_rank("fp8", tp=1, ep=8, dp=8) == lin + 2 * b16
    tp8 = ds.weight_bytes_per_rank("fp8", tp=8)
    assert 80e9 < tp8 < 90e9  # ~671 B params / 8 in fp8 plus 16-bit embeddings
    assert ds.mtp_params() / 1e9 == pytest.approx(11.6, abs=0.1)
    l8 = load_model("Llama-3.1-8B")
    assert l8.weight_bytes_per_rank("bf16") == l8.params_total() * 2
    assert l8.weight_bytes_per_rank("bf16", pp=2) < 0.6 * l8.params_total() * 2


def test_parallelism_rules():
    with pytest.raises(ValueError, match="expert_parallel_size"):
        Parallelism(tp=2, ep=8, dp=2)
    assert Parallelism(tp=1, ep=8, dp=8).moe_tp == 1
    assert Parallelism(tp=4).moe_tp == 4
    assert Parallelism(pp=3).stage_layers(10) == [4, 3, 3]
    with pytest.raises(ValueError, match="exceeds"):
        Parallelism(pp=100).stage_layers(61)


def test_kv_capacity_uses_per_rank_weights_and_kv():
    ds, h200 = load_model("DeepSeek-V3"), load_hardware("H200")
    tp8 = derive_num_gpu_blocks(ds, h200, gpu_memory_utilization=0.9, tp=8, weight_dtype="fp8", kv_dtype="bf16")
    assert tp8.bytes_per_block == 70_272 * 16
    ep8 = derive_num_gpu_blocks(ds, h200, gpu_memory_utilization=0.9, tp=1, ep=8, dp=8, weight_dtype="fp8",
                                kv_dtype="bf16")
    assert ep8.weight_bytes > tp8.weight_bytes  # attention replicated on every DP rank
    fp8kv = derive_num_gpu_blocks(ds, h200, gpu_memory_utilization=0.9, tp=8, weight_dtype="fp8", kv_dtype="fp8")
    assert fp8kv.num_gpu_blocks == pytest.approx(2 * tp8.num_gpu_blocks, abs=2)
    with pytest.raises(ValueError, match="does not fit"):
        derive_num_gpu_blocks(ds, h200, tp=8, weight_dtype="bf16")
