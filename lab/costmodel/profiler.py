"""``servelab profile``: measure operator tables on this machine with PyTorch, in the servelab profile format
(lab/costmodel/profiles.py), so ``servelab calibrate`` can fit curves for a GPU the project has no data for and
``cost_model.tables`` can interpolate them.

PyTorch is an optional dependency (``pip install 'servelab[profile]'``); nothing else in servelab imports it.
What is measured, per shape, as the median of ``repeats`` timed runs after warm-up (CUDA events on a GPU,
``time.perf_counter`` on the CPU, which is only good for a smoke test):

* ``gemm``: ``torch.nn.functional.linear`` (cuBLAS) of (m x k) by a (n x k) weight, for the model's per-GPU
  projection shapes (``--model``/``--tp``) or a generic grid, over a range of m;
* ``attn_prefill``: causal ``scaled_dot_product_attention`` over uniform batches without history;
* ``attn_decode``: one query token per sequence against a contiguous KV cache of each length (PyTorch has no paged
  kernel; vLLM's paged kernels are usually a little slower at small batch);
* ``elementwise``: RMSNorm, SiLU-and-mul, rotary and embedding gather written as PyTorch ops (unfused, so an upper
  bound on vLLM's fused kernels).

Collectives are not measured (one process); all-reduce falls back to the fitted curves of a similar GPU or the
link model.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import time
from pathlib import Path

import pandas as pd

from lab.costmodel.model_arch import load_model
from lab.costmodel.profiles import Observations, write_servelab


class ProfilerUnavailable(RuntimeError):
    """PyTorch or the requested device is missing."""


def _torch():
    """The ``torch`` module, or ProfilerUnavailable with the install command."""
    # Imported here, on use, and not at the top of the module: PyTorch is an optional extra (servelab[profile]) and
    # a heavy import, so importing this module (e.g. for the CLI) must work, and stay fast, without it.
    try:
        import torch  # noqa: PLC0415 - optional heavy dependency, see above
    except ImportError:
        raise ProfilerUnavailable("servelab profile needs PyTorch, which is an optional extra: "
                                  "pip install 'servelab[profile]' (or the torch build for your CUDA version)") from None
    return torch


def _timer(torch, device: str, repeats: int):
    cuda = device.startswith("cuda")

    def measure(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return measure


def _grids(quick: bool, model, tp: int) -> dict:
    if quick:
        g = {"m": [1, 16, 128], "nk": [(256, 256), (512, 256)], "batch": [1, 4], "q": [64, 128], "kv": [64, 256],
             "heads": [(4, 2, 64)], "tokens": [1, 64, 256], "hidden": 256, "inter": 512}
    else:
        g = {"m": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
             "nk": [(n, k) for n in (1024, 2048, 4096, 8192, 14336) for k in (1024, 2048, 4096, 8192)],
             "batch": [1, 2, 4, 8, 16, 32, 64, 128], "q": [16, 64, 256, 1024, 2048, 4096],
             "kv": [16, 128, 512, 1024, 2048, 4096, 8192], "heads": [(32, 8, 128), (64, 8, 128)],
             "tokens": [1, 16, 64, 256, 1024, 4096, 8192], "hidden": 4096, "inter": 14336}
    if model is not None:
        h, d = model.hidden_size, model.head_dim
        H, Hk = max(1, model.num_heads // tp), max(1, model.num_kv_heads // tp)
        i_r = (model.intermediate_size if not model.is_moe else model.moe_intermediate_size) // tp
        g["nk"] = [((H + 2 * Hk) * d, h), (h, H * d), (2 * i_r, h), (h, i_r)]
        g["heads"] = [(H, Hk, d)]
        g["hidden"], g["inter"] = h, i_r
    return g


def run_profile(out: Path, device: str = "cuda", dtype: str = "bf16", model: str | None = None, tp: int = 1,
                ops: list[str] | None = None, quick: bool = False, repeats: int = 20, gpu: str | None = None,
                log=print) -> list[Path]:
    """Measure the operator tables and write them under ``out``; returns the files written.

    Raises:
        ProfilerUnavailable: PyTorch missing, or a CUDA device asked for and absent.
        ValueError: an unknown op family, dtype or model.
    """
    torch = _torch()
    ops = ops or ["gemm", "attention", "elementwise"]
    bad = set(ops) - {"gemm", "attention", "elementwise"}
    if bad:
        raise ValueError(f"--ops: unknown {sorted(bad)}; expected gemm, attention, elementwise")
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"--dtype {dtype!r}: expected bf16 or fp16")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ProfilerUnavailable(f"--device {device}: PyTorch sees no CUDA device (use --device cpu for a smoke test)")
    arch = load_model(model) if model else None
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    dev = torch.device(device)
    name = gpu or (torch.cuda.get_device_name(dev) if device.startswith("cuda") else "cpu")
    measure = _timer(torch, device, repeats)
    g = _grids(quick, arch, tp)
    obs = Observations()
    src = str(out)
    torch.manual_seed(0)

    if "gemm" in ops:
        rows = []
        for n, k in g["nk"]:
            w = torch.randn(n, k, dtype=tdt, device=dev)
            for m in g["m"]:
                x = torch.randn(m, k, dtype=tdt, device=dev)
                t = measure(lambda: torch.nn.functional.linear(x, w))
                rows.append({"dtype": "bf16", "m": m, "n": n, "k": k, "time_s": t})
            log(f"gemm n={n} k={k}: {len(g['m'])} sizes")
        obs.add("gemm", pd.DataFrame(rows).assign(gpu=name, source=src))

    if "attention" in ops:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        pre, dec = [], []
        for H, Hk, d in g["heads"]:
            rep = H // Hk
            for b in g["batch"]:
                for q in g["q"]:
                    qq = torch.randn(b, H, q, d, dtype=tdt, device=dev)
                    kk = torch.randn(b, Hk, q, d, dtype=tdt, device=dev).repeat_interleave(rep, 1)
                    vv = torch.randn(b, Hk, q, d, dtype=tdt, device=dev).repeat_interleave(rep, 1)
                    t = measure(lambda: sdpa(qq, kk, vv, is_causal=True))
                    pre.append({"kv_dtype": "bf16", "batch": b, "q_len": q, "ctx_len": 0, "heads": H, "kv_heads": Hk,
                                "head_dim": d, "time_s": t})
                for L in g["kv"]:
                    qq = torch.randn(b, H, 1, d, dtype=tdt, device=dev)
                    kk = torch.randn(b, Hk, L, d, dtype=tdt, device=dev).repeat_interleave(rep, 1)
                    vv = torch.randn(b, Hk, L, d, dtype=tdt, device=dev).repeat_interleave(rep, 1)
                    t = measure(lambda: sdpa(qq, kk, vv))
                    dec.append({"kv_dtype": "bf16", "batch": b, "kv_len": L, "heads": H, "kv_heads": Hk,
                                "head_dim": d, "time_s": t})
            log(f"attention heads={H}/{Hk} d={d}: {len(pre)} prefill, {len(dec)} decode shapes")
        obs.add("attn_prefill", pd.DataFrame(pre).assign(gpu=name, source=src))
        obs.add("attn_decode", pd.DataFrame(dec).assign(gpu=name, source=src))

    if "elementwise" in ops:
        h, i = g["hidden"], g["inter"]
        rows = []
        table = torch.randn(32000, h, dtype=tdt, device=dev)
        for T in g["tokens"]:
            x = torch.randn(T, h, dtype=tdt, device=dev)
            wn = torch.ones(h, dtype=tdt, device=dev)

            def rms():
                xf = x.float()
                return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(tdt) * wn

            gu = torch.randn(T, 2 * i, dtype=tdt, device=dev)

            def act():
                a, b_ = gu.chunk(2, dim=-1)
                return torch.nn.functional.silu(a) * b_

            qk = torch.randn(T, h // 64, 64, dtype=tdt, device=dev)
            cos = torch.randn(T, 1, 32, dtype=tdt, device=dev)

            def rope():
                x1, x2 = qk[..., :32], qk[..., 32:]
                return torch.cat((x1 * cos - x2 * cos, x2 * cos + x1 * cos), dim=-1)

            ids = torch.randint(0, 32000, (T,), device=dev)
            for op, fn, byts in (("layernorm", rms, 4 * T * h), ("act_fn", act, 6 * T * i),
                                 ("rotary_emb", rope, 4 * T * h), ("embedding", lambda: table[ids], 4 * T * h)):
                rows.append({"op": op, "bytes": float(byts), "time_s": measure(fn)})
        log(f"elementwise: {len(rows)} shapes")
        obs.add("elementwise", pd.DataFrame(rows).assign(gpu=name, source=src))

    meta = {"gpu": name, "device": device, "torch": str(torch.__version__), "dtype": dtype, "model": model, "tp": tp,
            "quick": quick, "repeats": repeats, "date": _dt.date.today().isoformat(),
            "note": "PyTorch eager kernels (cuBLAS GEMM, SDPA attention, unfused elementwise); medians of timed runs"}
    return write_servelab(obs, out, meta)
