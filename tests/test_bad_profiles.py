"""A corpus of bad measured-profile tables, generated in tmp_path: every profile reader rejects each with a one-line
ProfileError naming the file, the row and the column; `servelab run` turns a bad table into exit status 2."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from lab.costmodel.llmservingsim import LLMServingSimProfileCostModel
from lab.costmodel.model_arch import load_model
from lab.costmodel.profiles import ProfileError, read_profiles
from lab.costmodel.tables import load_tables
from tests.conftest import DATA_DIR

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ CSV editing
def csv(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def _rows(text: str) -> list[list[str]]:
    return [ln.split(",") for ln in text.splitlines()]


def _join(rows: list[list[str]]) -> str:
    return "\n".join(",".join(r) for r in rows) + "\n"


def cell(text: str, row: int, column: str, value: str) -> str:
    """``text`` with data row ``row`` (1 = the first, file row 2) of ``column`` set to ``value``."""
    rows = _rows(text)
    rows[row][rows[0].index(column)] = value
    return _join(rows)


def drop(text: str, column: str) -> str:
    """``text`` without ``column``."""
    rows = _rows(text)
    j = rows[0].index(column)
    return _join([r[:j] + r[j + 1:] for r in rows])


def header_only(text: str) -> str:
    return text.splitlines()[0] + "\n"


def cut(text: str, row: int) -> str:
    """``text`` with data row ``row`` missing its last field (a truncated row)."""
    rows = _rows(text)
    rows[row] = rows[row][:-1]
    return _join(rows)


def extra(text: str, row: int) -> str:
    """``text`` with data row ``row`` holding one field too many."""
    rows = _rows(text)
    rows[row] = rows[row] + ["9"]
    return _join(rows)


# ------------------------------------------------------------------------------------------------ good templates
OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "input_layernorm",
       "post_attention_layernorm", "attn_rope", "mlp_act", "add", "emb")
MLP = csv("n_embd,n_head,n_kv_head,num_tensor_parallel_workers,n_expanded_embd,use_gated_mlp,num_tokens,"
          + ",".join(f"time_stats.{op}.median" for op in OPS),
          "4096,32,32,1,11008,True,1," + ",".join(["0.05"] * len(OPS)),
          "4096,32,32,1,11008,True,64," + ",".join(["0.08"] * len(OPS)))
VATTN = csv("time_stats.attn_prefill.median,time_stats.attn_decode.median,n_embd,n_q_head,n_kv_head,"
            "num_tensor_parallel_workers,batch_size,prefill_chunk_size,kv_cache_size,is_prefill",
            "0.005,,4096,32,8,1,1,32,0,True",      # a prefill row: no decode time, as in Vidur's files
            ",0.015,4096,32,8,1,2,0,64,False",     # a decode row: no prefill time
            "0.009,,4096,32,8,1,1,64,32,True")
ALLREDUCE = csv(",time_stats.all_reduce.median,num_workers,size,devices_per_node",
                "0,0.03,8,2048,8", "1,0.04,8,10240,8",
                "2,,16,2048,8")                    # a multi-node row (not read): its time may be missing
SENDRECV = csv(",time_stats.send_recv.median,num_workers,size,devices_per_node", "0,0.024,2,2048,2",
               "1,0.03,2,10240,2")
LAYERS = csv("layer_name,input,kv_cache,tp_size,latency(ns)", "embedding,1,0,1,2915", "q_proj,1,0,1,5000",
             "attn,16,0,1,9000")
DENSE = csv("layer,tokens,time_us", "qkv_proj,1,10.5", "o_proj,1,6.25", "layernorm,1,2.0")
BATTN = csv("prefill_chunk,kv_prefill,n_decode,kv_decode,time_us", "16,0,0,0,20.5", "0,0,1,16,9.3")
PERSEQ = csv("layer,sequences,time_us", "lm_head,1,1096.93", "sampler,1,50.0")
SL_META = "format: servelab-profile\nversion: 1\ngpu: H100\n"
SL_GEMM = csv("dtype,m,n,k,time_us", "bf16,1,6144,4096,10.0", "bf16,16,6144,4096,11.0", "bf16,64,6144,4096,20.0")
SL_DECODE = csv("kv_dtype,batch,kv_len,heads,kv_heads,head_dim,time_us", "bf16,1,0,32,8,128,5.0",
                "bf16,8,1024,32,8,128,12.0")
SL_ALLREDUCE = csv("gpus,bytes,backend,time_us", "2,4096,nccl,8.0", "2,65536,nccl,12.0")
LSS_META = "gpu: NVIDIA GeForce RTX 4090\nhardware: RTX4090\nmodel: meta-llama/Llama-3.1-8B\n"

DEVICE = "NVIDIA H100 80GB HBM3"
ATTN_COLS = dict(batch_size=[1, 4], num_heads=32, num_key_value_heads=8, head_dim=128, kv_cache_dtype="bfloat16")


AIC_TABLES = ("gemm_perf.parquet", "context_attention_perf.parquet", "generation_attention_perf.parquet",
              "mla_context_module_perf.parquet", "moe_perf.parquet", "custom_allreduce_perf.parquet")


def aic(name: str) -> pd.DataFrame:
    """A small, valid AIConfigurator table."""
    base = {"framework": "VLLM", "device": DEVICE, "latency": [0.01, 0.02]}
    cols = {
        "gemm_perf.parquet": dict(op_name="gemm", gemm_dtype="bfloat16", m=[1, 16], n=4096, k=4096),
        "context_attention_perf.parquet": dict(op_name="context_attention", isl=[128, 256], step=0, window_size=0,
                                               **ATTN_COLS),
        "generation_attention_perf.parquet": dict(op_name="generation_attention", isl=1, step=[1, 16],
                                                  window_size=0, **ATTN_COLS),
        "mla_context_module_perf.parquet": dict(model="deepseek-ai/DeepSeek-V3", gemm_type="bfloat16",
                                                kv_cache_dtype="bfloat16", num_heads=128, batch_size=[1, 2],
                                                isl=[16, 32]),
        "moe_perf.parquet": dict(moe_dtype="bfloat16", num_tokens=[1, 2], hidden_size=4096, inter_size=14336,
                                 topk=2, num_experts=8, moe_tp_size=1, moe_ep_size=1, distribution="balanced"),
        "custom_allreduce_perf.parquet": dict(num_gpus=2, message_size=[128, 256], backend="vllm_graph"),
    }[name]
    return pd.DataFrame({**base, **cols})


def aic_set(name: str, row: int, column: str, value) -> pd.DataFrame:
    df = aic(name)
    df[column] = df[column].astype(object if value is None or isinstance(value, str) else float)
    df.loc[row, column] = value
    return df


# Each format: its folder under tmp_path and its good files (relative path -> content).
FORMATS = {
    "servelab": ("sl", {"meta.yaml": SL_META, "gemm.csv": SL_GEMM, "attn_decode.csv": SL_DECODE,
                        "allreduce.csv": SL_ALLREDUCE}),
    "vidur-mlp": ("vidur/h100/Llama-2-7b-hf", {"mlp.csv": MLP}),
    "vidur-attention": ("vidur/h100", {"attention.csv": VATTN}),
    "vidur-network": ("vidur/network/h100_dgx", {"all_reduce.csv": ALLREDUCE, "send_recv.csv": SENDRECV}),
    "lss-layers": ("lss/H100/meta-llama/Llama-3.1-8B/tp1", {"layers.csv": LAYERS}),
    "lss-bundle": ("bundle/RTX4090/meta-llama/Llama-3.1-8B/bf16", {"meta.yaml": LSS_META, "tp1/dense.csv": DENSE,
                                                                  "tp1/attention.csv": BATTN,
                                                                  "tp1/per_sequence.csv": PERSEQ}),
    "aic": ("aic/h100_sxm", {name: aic(name) for name in AIC_TABLES}),
}


def _write(path: Path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, pd.DataFrame):
        content.to_parquet(path, index=False)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


def build(tmp_path: Path, fmt: str, bad: dict | None = None) -> tuple[Path, dict[str, Path]]:
    """The format's folder with its good files, ``bad`` (relative path -> content) replacing some."""
    folder, files = FORMATS[fmt]
    root = tmp_path / folder
    paths = {}
    for rel, content in {**files, **(bad or {})}.items():
        paths[rel] = root / rel
        _write(paths[rel], content)
    return root, paths


def _parquet_bytes(df: pd.DataFrame, tmp_path: Path) -> bytes:
    p = tmp_path / "scratch.parquet"
    df.to_parquet(p, index=False)
    return p.read_bytes()


TRUNCATED_PARQUET = "truncated"  # a marker: the good gemm table cut in half (built in the test)

# case -> (format, the bad file (relative), its content, fragments the message must hold)
CASES = {
    # --- servelab profile folder
    "servelab-nan-time": ("servelab", "gemm.csv", cell(SL_GEMM, 2, "time_us", "nan"), ["row 3", "time_us", "> 0"]),
    "servelab-negative-time": ("servelab", "gemm.csv", cell(SL_GEMM, 1, "time_us", "-4"), ["row 2", "time_us", "-4"]),
    "servelab-zero-time": ("servelab", "gemm.csv", cell(SL_GEMM, 3, "time_us", "0"), ["row 4", "time_us"]),
    "servelab-infinite-time": ("servelab", "gemm.csv", cell(SL_GEMM, 1, "time_us", "inf"), ["row 2", "time_us"]),
    "servelab-text-time": ("servelab", "gemm.csv", cell(SL_GEMM, 2, "time_us", "fast"), ["row 3", "'fast'"]),
    "servelab-empty-time": ("servelab", "gemm.csv", cell(SL_GEMM, 2, "time_us", ""), ["row 3", "time_us"]),
    "servelab-fractional-m": ("servelab", "gemm.csv", cell(SL_GEMM, 1, "m", "12.5"), ["row 2", "m must be an integer"]),
    "servelab-zero-m": ("servelab", "gemm.csv", cell(SL_GEMM, 2, "m", "0"), ["row 3", "m must be an integer >= 1"]),
    "servelab-text-n": ("servelab", "gemm.csv", cell(SL_GEMM, 1, "n", "wide"), ["row 2", "n must be", "'wide'"]),
    "servelab-empty-dtype": ("servelab", "gemm.csv", cell(SL_GEMM, 3, "dtype", ""), ["row 4", "dtype"]),
    "servelab-missing-column": ("servelab", "gemm.csv", drop(SL_GEMM, "k"), ["missing column", "'k'"]),
    "servelab-header-only": ("servelab", "gemm.csv", header_only(SL_GEMM), ["no measurements", "header"]),
    "servelab-empty-file": ("servelab", "gemm.csv", "", ["empty"]),
    "servelab-truncated-row": ("servelab", "gemm.csv", cut(SL_GEMM, 2), ["row 3", "time_us"]),
    "servelab-row-with-extra-field": ("servelab", "gemm.csv", extra(SL_GEMM, 1), ["not a well-formed CSV", "line 2"]),
    "servelab-row-after-blank-line": ("servelab", "gemm.csv", SL_GEMM + "\nbf16,128,6144,4096,-1\n",
                                      ["row 6", "time_us"]),
    "servelab-non-utf8": ("servelab", "gemm.csv", SL_GEMM.encode() + b"bf16,\xff,1,1,1\n", ["UTF-8", "0xff"]),
    "servelab-negative-kv-len": ("servelab", "attn_decode.csv", cell(SL_DECODE, 2, "kv_len", "-1"),
                                 ["row 3", "kv_len", ">= 0"]),
    "servelab-boolean-heads": ("servelab", "attn_decode.csv", cell(cell(SL_DECODE, 1, "heads", "True"), 2, "heads",
                                                                   "False"), ["row 2", "heads", "True"]),
    "servelab-zero-bytes": ("servelab", "allreduce.csv", cell(SL_ALLREDUCE, 1, "bytes", "0"), ["row 2", "bytes"]),
    "servelab-empty-backend": ("servelab", "allreduce.csv", cell(SL_ALLREDUCE, 2, "backend", " "),
                               ["row 3", "backend"]),
    "servelab-meta-invalid-yaml": ("servelab", "meta.yaml", "format: servelab-profile\ngpu: [H100\n",
                                   ["not valid YAML"]),
    "servelab-meta-missing-gpu": ("servelab", "meta.yaml", "format: servelab-profile\nversion: 1\n",
                                  ["missing key 'gpu'"]),
    "servelab-meta-unknown-gpu": ("servelab", "meta.yaml", "format: servelab-profile\ngpu: Z9000\n",
                                  ["'Z9000'", "hardware catalog"]),
    "servelab-meta-not-a-mapping": ("servelab", "meta.yaml", "- format: servelab-profile\n", ["mapping"]),
    # --- Vidur mlp.csv
    "vidur-mlp-nan-time": ("vidur-mlp", "mlp.csv", cell(MLP, 2, "time_stats.attn_pre_proj.median", "nan"),
                           ["row 3", "time_stats.attn_pre_proj.median"]),
    "vidur-mlp-negative-time": ("vidur-mlp", "mlp.csv", cell(MLP, 1, "time_stats.mlp_act.median", "-0.1"),
                                ["row 2", "time_stats.mlp_act.median", "> 0"]),
    "vidur-mlp-missing-time-column": ("vidur-mlp", "mlp.csv", drop(MLP, "time_stats.emb.median"),
                                      ["missing column", "time_stats.emb.median"]),
    "vidur-mlp-bad-flag": ("vidur-mlp", "mlp.csv", cell(MLP, 2, "use_gated_mlp", "maybe"),
                           ["row 3", "use_gated_mlp", "True or False"]),
    "vidur-mlp-empty-flag": ("vidur-mlp", "mlp.csv", cell(MLP, 1, "use_gated_mlp", ""), ["row 2", "use_gated_mlp"]),
    "vidur-mlp-fractional-tokens": ("vidur-mlp", "mlp.csv", cell(MLP, 1, "num_tokens", "1.5"),
                                    ["row 2", "num_tokens", "integer"]),
    "vidur-mlp-zero-heads": ("vidur-mlp", "mlp.csv", cell(MLP, 2, "n_head", "0"), ["row 3", "n_head"]),
    "vidur-mlp-header-only": ("vidur-mlp", "mlp.csv", header_only(MLP), ["no measurements"]),
    "vidur-mlp-empty-file": ("vidur-mlp", "mlp.csv", "", ["empty"]),
    # --- Vidur attention.csv
    "vidur-attn-nan-prefill-time": ("vidur-attention", "attention.csv",
                                    cell(VATTN, 3, "time_stats.attn_prefill.median", "nan"),
                                    ["row 4", "time_stats.attn_prefill.median"]),
    "vidur-attn-negative-decode-time": ("vidur-attention", "attention.csv",
                                        cell(VATTN, 2, "time_stats.attn_decode.median", "-0.01"),
                                        ["row 3", "time_stats.attn_decode.median"]),
    "vidur-attn-missing-decode-time": ("vidur-attention", "attention.csv",
                                       cell(VATTN, 2, "time_stats.attn_decode.median", ""),
                                       ["row 3", "time_stats.attn_decode.median"]),
    "vidur-attn-empty-flag": ("vidur-attention", "attention.csv", cell(VATTN, 1, "is_prefill", ""),
                              ["row 2", "is_prefill"]),
    "vidur-attn-negative-kv": ("vidur-attention", "attention.csv", cell(VATTN, 2, "kv_cache_size", "-64"),
                               ["row 3", "kv_cache_size", ">= 0"]),
    "vidur-attn-missing-column": ("vidur-attention", "attention.csv", drop(VATTN, "is_prefill"),
                                  ["missing column", "is_prefill"]),
    "vidur-attn-header-only": ("vidur-attention", "attention.csv", header_only(VATTN), ["no measurements"]),
    # --- Vidur all_reduce.csv / send_recv.csv
    "vidur-allreduce-nan-time": ("vidur-network", "all_reduce.csv",
                                 cell(ALLREDUCE, 2, "time_stats.all_reduce.median", "nan"),
                                 ["row 3", "time_stats.all_reduce.median"]),
    "vidur-allreduce-zero-size": ("vidur-network", "all_reduce.csv", cell(ALLREDUCE, 1, "size", "0"),
                                  ["row 2", "size", "> 0"]),
    "vidur-allreduce-text-workers": ("vidur-network", "all_reduce.csv", cell(ALLREDUCE, 1, "num_workers", "two"),
                                     ["row 2", "num_workers", "'two'"]),
    "vidur-allreduce-missing-column": ("vidur-network", "all_reduce.csv", drop(ALLREDUCE, "devices_per_node"),
                                       ["missing column", "devices_per_node"]),
    "vidur-allreduce-empty-file": ("vidur-network", "all_reduce.csv", "", ["empty"]),
    "vidur-sendrecv-negative-time": ("vidur-network", "send_recv.csv",
                                     cell(SENDRECV, 2, "time_stats.send_recv.median", "-1"),
                                     ["row 3", "time_stats.send_recv.median"]),
    "vidur-sendrecv-header-only": ("vidur-network", "send_recv.csv", header_only(SENDRECV), ["no measurements"]),
    # --- LLMServingSim v1 layers.csv
    "lss-layers-nan-latency": ("lss-layers", "layers.csv", cell(LAYERS, 2, "latency(ns)", "NaN"),
                               ["row 3", "latency(ns)"]),
    "lss-layers-negative-latency": ("lss-layers", "layers.csv", cell(LAYERS, 3, "latency(ns)", "-9000"),
                                    ["row 4", "latency(ns)", "-9000"]),
    "lss-layers-zero-input": ("lss-layers", "layers.csv", cell(LAYERS, 1, "input", "0"), ["row 2", "input", ">= 1"]),
    "lss-layers-empty-name": ("lss-layers", "layers.csv", cell(LAYERS, 2, "layer_name", ""), ["row 3", "layer_name"]),
    "lss-layers-negative-kv": ("lss-layers", "layers.csv", cell(LAYERS, 3, "kv_cache", "-1"), ["row 4", "kv_cache"]),
    "lss-layers-missing-column": ("lss-layers", "layers.csv", drop(LAYERS, "latency(ns)"),
                                  ["missing column", "latency(ns)"]),
    "lss-layers-header-only": ("lss-layers", "layers.csv", header_only(LAYERS), ["no measurements"]),
    "lss-layers-truncated-row": ("lss-layers", "layers.csv", cut(LAYERS, 1), ["row 2", "latency(ns)"]),
    "lss-layers-non-utf8": ("lss-layers", "layers.csv", LAYERS.encode() + b"rope\xe9,1,0,1,5\n", ["UTF-8"]),
    # --- LLMServingSim profiler bundle
    "bundle-dense-nan-time": ("lss-bundle", "tp1/dense.csv", cell(DENSE, 2, "time_us", "nan"), ["row 3", "time_us"]),
    "bundle-dense-fractional-tokens": ("lss-bundle", "tp1/dense.csv", cell(DENSE, 1, "tokens", "2.5"),
                                       ["row 2", "tokens", "integer"]),
    "bundle-dense-missing-column": ("lss-bundle", "tp1/dense.csv", drop(DENSE, "layer"), ["missing column", "layer"]),
    "bundle-dense-header-only": ("lss-bundle", "tp1/dense.csv", header_only(DENSE), ["no measurements"]),
    "bundle-dense-empty-file": ("lss-bundle", "tp1/dense.csv", "", ["empty"]),
    "bundle-attention-negative-time": ("lss-bundle", "tp1/attention.csv", cell(BATTN, 2, "time_us", "-9.3"),
                                       ["row 3", "time_us"]),
    "bundle-attention-text-count": ("lss-bundle", "tp1/attention.csv", cell(BATTN, 2, "n_decode", "x"),
                                    ["row 3", "n_decode", "'x'"]),
    "bundle-attention-header-only": ("lss-bundle", "tp1/attention.csv", header_only(BATTN), ["no measurements"]),
    "bundle-per-sequence-zero-sequences": ("lss-bundle", "tp1/per_sequence.csv", cell(PERSEQ, 1, "sequences", "0"),
                                           ["row 2", "sequences"]),
    "bundle-per-sequence-truncated-row": ("lss-bundle", "tp1/per_sequence.csv", cut(PERSEQ, 2),
                                          ["row 3", "time_us"]),
    "bundle-meta-invalid-yaml": ("lss-bundle", "meta.yaml", "gpu: NVIDIA GeForce RTX 4090\nmodel: [x\n",
                                 ["not valid YAML"]),
    # --- AIConfigurator parquet tables (rows count from 1)
    "aic-gemm-nan-latency": ("aic", "gemm_perf.parquet", aic_set("gemm_perf.parquet", 1, "latency", math.nan),
                             ["row 2", "latency", "> 0"]),
    "aic-gemm-negative-latency": ("aic", "gemm_perf.parquet", aic_set("gemm_perf.parquet", 0, "latency", -0.5),
                                  ["row 1", "latency", "-0.5"]),
    "aic-gemm-zero-m": ("aic", "gemm_perf.parquet", aic_set("gemm_perf.parquet", 1, "m", 0), ["row 2", "m"]),
    "aic-gemm-fractional-k": ("aic", "gemm_perf.parquet", aic_set("gemm_perf.parquet", 0, "k", 4096.5),
                              ["row 1", "k", "integer"]),
    "aic-gemm-missing-column": ("aic", "gemm_perf.parquet", aic("gemm_perf.parquet").drop(columns=["latency"]),
                                ["missing column", "latency"]),
    "aic-gemm-no-rows": ("aic", "gemm_perf.parquet", aic("gemm_perf.parquet").iloc[:0], ["no measurements"]),
    "aic-gemm-corrupt-file": ("aic", "gemm_perf.parquet", b"PAR1 this is not really parquet PAR1",
                              ["not a readable parquet file"]),
    "aic-gemm-truncated-file": ("aic", "gemm_perf.parquet", TRUNCATED_PARQUET, ["not a readable parquet file"]),
    "aic-gemm-unknown-device": ("aic", "gemm_perf.parquet", aic_set("gemm_perf.parquet", 0, "device", "NVIDIA Z9000"),
                                ["'NVIDIA Z9000'", "hardware catalog"]),
    "aic-context-nan-heads": ("aic", "context_attention_perf.parquet",
                              aic_set("context_attention_perf.parquet", 1, "num_heads", math.nan),
                              ["row 2", "num_heads"]),
    "aic-generation-negative-step": ("aic", "generation_attention_perf.parquet",
                                     aic_set("generation_attention_perf.parquet", 1, "step", -1),
                                     ["row 2", "step", ">= 0"]),
    "aic-generation-missing-step": ("aic", "generation_attention_perf.parquet",
                                    aic("generation_attention_perf.parquet").drop(columns=["step"]),
                                    ["missing column", "step"]),
    "aic-mla-empty-model": ("aic", "mla_context_module_perf.parquet",
                            aic_set("mla_context_module_perf.parquet", 0, "model", ""), ["row 1", "model"]),
    "aic-moe-missing-distribution": ("aic", "moe_perf.parquet", aic_set("moe_perf.parquet", 1, "distribution", None),
                                     ["row 2", "distribution"]),
    "aic-allreduce-zero-size": ("aic", "custom_allreduce_perf.parquet",
                                aic_set("custom_allreduce_perf.parquet", 0, "message_size", 0),
                                ["row 1", "message_size"]),
}


def assert_one_line(err: BaseException, path: Path, fragments: list[str]) -> None:
    """The message is one line, names the file and holds every fragment (the row, the column)."""
    msg = str(err)
    assert "\n" not in msg and msg.strip() == msg, msg
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)


def build_case(tmp_path: Path, case: str) -> tuple[Path, Path]:
    """(the format's folder, the bad file) of a case."""
    fmt, rel, content, _ = CASES[case]
    if content is TRUNCATED_PARQUET:
        data = _parquet_bytes(aic("gemm_perf.parquet"), tmp_path)
        content = data[: len(data) // 2]
    root, paths = build(tmp_path, fmt, {rel: content})
    return root, paths[rel]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_profile_is_rejected_with_a_one_line_error(tmp_path, case):
    root, bad = build_case(tmp_path, case)
    with pytest.raises(ProfileError) as e:
        read_profiles([root])
    assert type(e.value) is ProfileError
    assert_one_line(e.value, bad, CASES[case][3])


@pytest.mark.parametrize("case", ["servelab-nan-time", "vidur-attn-header-only", "aic-gemm-nan-latency"])
def test_load_tables_reports_the_same_error(tmp_path, case):
    root, bad = build_case(tmp_path, case)
    with pytest.raises(ProfileError) as e:
        load_tables([root])
    assert_one_line(e.value, bad, CASES[case][3])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_templates_the_bad_cases_spoil_read(tmp_path, fmt):
    root, _ = build(tmp_path, fmt)
    obs = read_profiles([root])
    assert obs.tables and all(len(df) and np.all(df["time_s"] > 0) for df in obs.tables.values())


def test_unused_cells_may_be_empty(tmp_path):
    """Vidur leaves the other phase's time empty, and multi-node collective rows are not read: both load."""
    obs = read_profiles([build(tmp_path, "vidur-attention")[0], build(tmp_path, "vidur-network")[0]])
    assert len(obs.get("attn_prefill")) == 2 and len(obs.get("attn_decode")) == 1
    assert len(obs.get("allreduce")) == 2


# --- the command line: exit status 2 and the one line, no traceback ------------------------------------------------
EXPERIMENT = """name: bad_profile
workload: {{source: synthetic, num_requests: 4, rate: 1.0}}
hardware: {{gpu: H100-SXM5-80GB}}
cost_model: {{kind: operator, tables: ["{tables}"]}}
simulation: {{progress: false}}
"""


@pytest.mark.parametrize("case", ["servelab-nan-time", "vidur-mlp-header-only"])
def test_servelab_run_on_a_bad_profile_exits_2_with_one_line(tmp_path, case):
    root, bad = build_case(tmp_path, case)
    exp = tmp_path / "exp.yaml"
    exp.write_text(EXPERIMENT.format(tables=root))
    res = subprocess.run([sys.executable, "-m", "lab", "run", str(exp), "--out", str(tmp_path / "out"), "-q",
                          "--no-plots"], capture_output=True, text=True, cwd=REPO, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    for f in [str(bad), *CASES[case][3]]:
        assert f in lines[0], (f, lines[0])


# --- the llmservingsim_profile cost model: real profile folders copied into tmp_path, then spoiled ----------------
def _lss_dir(gpu: str) -> Path:
    return DATA_DIR / "validation" / "llmservingsim" / "profiles" / gpu / "meta-llama" / "Llama-3.1-8B" / "bf16"


RTX4090 = _lss_dir("RTX4090")          # no skew correction (meta.yaml: skew_fit.enabled false)
RTXPRO6000 = _lss_dir("RTXPRO6000")    # with skew_fit.csv and its bucket axes in meta.yaml
needs_lss = pytest.mark.skipif(not (RTX4090.is_dir() and RTXPRO6000.is_dir()),
                               reason=f"shared data not found: {RTX4090}, {RTXPRO6000}")


def lss_copy(tmp_path: Path, src: Path = RTX4090) -> Path:
    """The ``tp1`` folder of a copy of the real profile folder ``src`` (meta.yaml and the tp1 CSVs)."""
    dst = tmp_path / "Llama-3.1-8B" / "bf16"
    (dst / "tp1").mkdir(parents=True)
    shutil.copyfile(src / "meta.yaml", dst / "meta.yaml")
    for f in (src / "tp1").glob("*.csv"):
        shutil.copyfile(f, dst / "tp1" / f.name)
    return dst / "tp1"


def spoil(path: Path, edit) -> None:
    """Rewrite ``path`` as ``edit(its text)`` (a string, or bytes; an edit may ignore the text)."""
    new = edit(path.read_text())
    if isinstance(new, bytes):
        path.write_bytes(new)
    else:
        path.write_text(new)


def set_yaml(key_path: list, value) -> object:
    """An edit of a meta.yaml setting the value at ``key_path``."""
    def edit(text: str) -> str:
        data = yaml.safe_load(text)
        node = data
        for k in key_path[:-1]:
            node = node[k]
        node[key_path[-1]] = value
        return yaml.safe_dump(data, sort_keys=False)
    return edit


def duplicate(row: int):
    """An edit appending a copy of data row ``row`` (1 = the first, file row 2) at the end."""
    return lambda text: text + text.splitlines()[row] + "\n"


def without_layer(name: str):
    """An edit dropping every row of layer ``name``."""
    return lambda text: "".join(ln + "\n" for ln in text.splitlines() if not ln.startswith(name + ","))


# case: (source folder, file under the copied tp1 folder, edit, fragments the one-line message holds)
LSS_CASES = {
    "dense-negative-time": (RTX4090, "dense.csv", lambda t: cell(t, 5, "time_us", "-3.1"),
                            ["row 6", "time_us", "a number > 0", "-3.1"]),
    "dense-nan-time": (RTX4090, "dense.csv", lambda t: cell(t, 2, "time_us", "NaN"), ["row 3", "time_us", "> 0"]),
    "dense-infinite-time": (RTX4090, "dense.csv", lambda t: cell(t, 7, "time_us", "inf"), ["row 8", "time_us"]),
    "dense-zero-time": (RTX4090, "dense.csv", lambda t: cell(t, 1, "time_us", "0"), ["row 2", "time_us", "> 0"]),
    "dense-non-numeric-time": (RTX4090, "dense.csv", lambda t: cell(t, 3, "time_us", "fast"),
                               ["row 4", "time_us", "'fast'"]),
    "dense-missing-time": (RTX4090, "dense.csv", lambda t: cell(t, 4, "time_us", ""), ["row 5", "time_us"]),
    "dense-fractional-tokens": (RTX4090, "dense.csv", lambda t: cell(t, 1, "tokens", "1.5"),
                                ["row 2", "tokens", "an integer >= 1"]),
    "dense-zero-tokens": (RTX4090, "dense.csv", lambda t: cell(t, 2, "tokens", "0"), ["row 3", "tokens", ">= 1"]),
    "dense-empty-layer": (RTX4090, "dense.csv", lambda t: cell(t, 2, "layer", ""), ["row 3", "layer"]),
    "dense-duplicate-point": (RTX4090, "dense.csv", duplicate(1),
                              ["row 1370", "layer=act_fn, tokens=1 repeats row 2", "one row per (layer, tokens)"]),
    "dense-missing-column": (RTX4090, "dense.csv", lambda t: drop(t, "time_us"), ["missing column", "'time_us'"]),
    "dense-empty-file": (RTX4090, "dense.csv", lambda t: "", ["the file is empty"]),
    "dense-header-only": (RTX4090, "dense.csv", header_only, ["no measurements", "header"]),
    "dense-non-utf8": (RTX4090, "dense.csv", lambda t: t.encode() + b"act_fn,\xff,1\n", ["UTF-8", "0xff"]),
    "attention-header-only": (RTX4090, "attention.csv", header_only, ["no measurements", "header"]),
    "attention-negative-time": (RTX4090, "attention.csv", lambda t: cell(t, 2, "time_us", "-9.3"),
                                ["row 3", "time_us", "> 0", "-9.3"]),
    "attention-nan-time": (RTX4090, "attention.csv", lambda t: cell(t, 10, "time_us", "nan"), ["row 11", "time_us"]),
    "attention-text-count": (RTX4090, "attention.csv", lambda t: cell(t, 2, "n_decode", "x"),
                             ["row 3", "n_decode", "'x'"]),
    "attention-negative-kv": (RTX4090, "attention.csv", lambda t: cell(t, 3, "kv_decode", "-16"),
                              ["row 4", "kv_decode", "an integer >= 0"]),
    "attention-duplicate-point": (RTX4090, "attention.csv", duplicate(1),
                                  ["row 8645", "prefill_chunk=0, kv_prefill=0, n_decode=1, kv_decode=16 repeats row 2"]),
    "attention-missing-column": (RTX4090, "attention.csv", lambda t: drop(t, "kv_prefill"),
                                 ["missing column", "'kv_prefill'"]),
    "per-sequence-zero-sequences": (RTX4090, "per_sequence.csv", lambda t: cell(t, 1, "sequences", "0"),
                                    ["row 2", "sequences", ">= 1"]),
    "per-sequence-negative-time": (RTX4090, "per_sequence.csv", lambda t: cell(t, 3, "time_us", "-1"),
                                   ["row 4", "time_us", "> 0"]),
    "per-sequence-no-sampler": (RTX4090, "per_sequence.csv", without_layer("sampler"),
                                ["no rows for layer 'sampler'"]),
    "skew-nan-alpha": (RTXPRO6000, "skew_fit.csv", lambda t: cell(t, 2, "alpha", "nan"),
                       ["row 3", "alpha", "a finite number"]),
    "skew-empty-label": (RTXPRO6000, "skew_fit.csv", lambda t: cell(t, 1, "n_label", ""), ["row 2", "n_label"]),
    "skew-duplicate-bucket": (RTXPRO6000, "skew_fit.csv", duplicate(1),
                              ["row 3984", "pc=0, n_label=", "repeats row 2"]),
    "meta-bins-not-increasing": (RTXPRO6000, "../meta.yaml",
                                 set_yaml(["skew_fit", "bucket_axes", "n_bins"],
                                          [0, 2, 8, 4, 16, 32, 64, 128, 256, 10**6]),
                                 ["skew_fit.bucket_axes.n_bins[3]", "increasing order", "got 4 after 8"]),
    "meta-labels-one-short": (RTXPRO6000, "../meta.yaml",
                              set_yaml(["skew_fit", "bucket_axes", "kp_labels"], ["kp=0", "kp>0"]),
                              ["skew_fit.bucket_axes.kp_labels", "expected 7 labels"]),
    "meta-text-alpha-default": (RTXPRO6000, "../meta.yaml",
                                set_yaml(["skew_fit", "per_tp", 1, "alpha_default"], "high"),
                                ["skew_fit.per_tp.1.alpha_default", "a finite number", "'high'"]),
    "meta-invalid-yaml": (RTXPRO6000, "../meta.yaml", lambda t: t + "skew_fit: [x\n", ["not valid YAML"]),
}


def lss_case(tmp_path: Path, case: str) -> tuple[Path, Path]:
    """(the copied tp1 folder, the spoiled file) of an LLMServingSim cost-model case."""
    src, rel, edit, _ = LSS_CASES[case]
    folder = lss_copy(tmp_path, src)
    bad = Path(os.path.normpath(folder / rel))
    spoil(bad, edit)
    return folder, bad


@needs_lss
def test_the_copied_real_profiles_load(tmp_path):
    """The unspoiled copies load and price a step: the cases below fail only for the edit they make."""
    from lab.core.batch import BatchShape

    for i, src in enumerate((RTX4090, RTXPRO6000)):
        cm = LLMServingSimProfileCostModel(lss_copy(tmp_path / str(i), src), load_model("Llama-3.1-8B"))
        shape = BatchShape(num_tokens=9, num_seqs=2, prefill_new=[8], prefill_context=[0], decode_context=[100],
                           num_decodes=1, decode_sum=100, decode_max=100, decode_min=100)
        assert 0 < cm.step_time(shape) < 1


@needs_lss
@pytest.mark.parametrize("case", list(LSS_CASES))
def test_llmservingsim_cost_model_rejects_a_bad_table_with_one_line(tmp_path, case):
    folder, bad = lss_case(tmp_path, case)
    with pytest.raises(ProfileError) as e:
        LLMServingSimProfileCostModel(folder, load_model("Llama-3.1-8B"))
    assert_one_line(e.value, bad, LSS_CASES[case][3])


LSS_EXPERIMENT = """name: bad_llmservingsim_profile
workload: {{source: synthetic, num_requests: 4, rate: 1.0}}
model: {{name: Llama-3.1-8B}}
hardware: {{gpu: RTX4090}}
cost_model: {{kind: llmservingsim_profile, profile_dir: "{profile_dir}"}}
simulation: {{progress: false}}
"""


@needs_lss
@pytest.mark.parametrize("case", ["dense-negative-time", "dense-nan-time", "attention-header-only",
                                  "dense-empty-file", "dense-non-numeric-time"])
def test_servelab_run_on_a_bad_llmservingsim_profile_exits_2_with_one_line(tmp_path, case):
    folder, bad = lss_case(tmp_path, case)
    exp = tmp_path / "exp.yaml"
    exp.write_text(LSS_EXPERIMENT.format(profile_dir=folder))
    res = subprocess.run([sys.executable, "-m", "lab", "run", str(exp), "--out", str(tmp_path / "out"), "-q",
                          "--no-plots"], capture_output=True, text=True, cwd=REPO, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    for f in [str(bad), *LSS_CASES[case][3]]:
        assert f in lines[0], (f, lines[0])
    assert not (tmp_path / "out" / "requests.csv").exists()
