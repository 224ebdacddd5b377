"""The speculative step's host constants, fitted on public measurements, and the verify-step cost report.

``python -m lab.costmodel.spec_fit [data_dir]`` (default ``$SERVELAB_DATA_DIR``, else ../shared/data) refits :data:`lab.costmodel.spec_step.HOST_PASS_S` and
``HOST_STEP_S`` and prints the check against the other public figures.

What is fitted on what: vLLM PR #16035 (shared validation/spec_decode/spec_decode_measurements.csv) measured
Llama-3-8B-Instruct with the sglang EAGLE head, offline at ``max_num_seqs=1`` on MT-Bench: 128.64 tok/s without
speculation, 175.49 tok/s at k = 2 (mean acceptance length 1.89) and 165.65 at k = 4 (2.08). One speculative step
lasts AL / throughput: 10.770 ms and 12.557 ms against 7.774 ms for a plain decode step. The V1 runner of that date
scheduled synchronously and drafted on the host after the verify (the serial proposer), so the steps are modelled
with ``vllm_version`` 0.11-style sync scheduling and ``disable_padded_drafter_batch``; the GPU is not stated
(H100 assumed: servelab's plain batch-1 step of Llama-3.1-8B on H100 from AIConfigurator's tables, 8.45 ms with the
engine's 0.93 ms of CPU time added as sync scheduling adds it, is 8.6 % above the measured 7.774 ms; an A100's
would be far slower). The fit uses differences between steps, not their levels. With the passes host-bound, the
extra time of a step over the plain step is

    verify's extra GPU time + rejection sampler + host_step_s + k · host_pass_s + last pass's GPU time

so the two measured steps determine the two constants exactly (no degree of freedom left: the fit is checked on
the other figures, not on these).
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path

from lab.core.batch import BatchShape
from lab.costmodel.hardware import load_hardware
from lab.costmodel.model_arch import load_model
from lab.costmodel.operator import OperatorCostModel, load_curves
from lab.costmodel.parallel import Parallelism
from lab.costmodel.spec_step import HOST_PASS_S, HOST_STEP_S, SpecDecodeCostModel, spec_capture_sizes
from lab.costmodel.speculative import make_drafter
from lab.costmodel.tables import TableSet, load_tables

CSV = "validation/spec_decode/spec_decode_measurements.csv"
PR_16035 = "https://github.com/vllm-project/vllm/pull/16035"
CONTEXT = 256  # MT-Bench: prompts of ~100 tokens and answers of up to 256 (mean context of a decode step)


def default_capture(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default capture sizes up to min(2 · max_num_seqs, 512) (lab/experiment/resolve.py)."""
    top = min(2 * max_num_seqs, 512)
    return tuple(x for x in [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16)) if x <= top)


@dataclass
class SpecSetup:
    """The target and drafter cost models of one (model, GPU, method) for step-level studies."""

    target: OperatorCostModel
    drafter: OperatorCostModel | None
    method: str
    projections: tuple
    hidden: int
    vocab: int
    hw: object

    def model(self, k: int, serial: bool, async_scheduling: bool, batch: int, host_pass_s: float = HOST_PASS_S,
              host_step_s: float = HOST_STEP_S, max_num_seqs: int | None = None) -> SpecDecodeCostModel:
        seqs = max_num_seqs or max(batch, 1)
        sizes = spec_capture_sizes(default_capture(seqs), k, seqs, 8192)
        every, first = self.projections, ()
        if self.method == "eagle3":
            first = tuple(p for p in self.projections if p[0] == 3 * self.hidden)
            every = tuple(p for p in self.projections if p[0] != 3 * self.hidden)
        return SpecDecodeCostModel(self.target, self.drafter, self.method, k, self.hw, self.hidden, self.vocab,
                                   "bf16" if self.target.wdtype == "bf16" else "fp8", sizes, serial=serial,
                                   async_scheduling=async_scheduling, host_pass_s=host_pass_s,
                                   host_step_s=host_step_s, projections_every_pass=every,
                                   projections_first_pass=first)


def setup(model: str, gpu: str, method: str, tables: list[str] | None, tp: int = 1, ep: int = 1, dp: int = 1,
          dtype: str = "bf16", attention_backend: str | None = None, moe_backend: str | None = None) -> SpecSetup:
    """Target and drafter operator cost models (``tables``: AIConfigurator folders of the GPU)."""
    arch = load_model(model)
    hw = load_hardware(gpu)
    ts = TableSet(load_tables(tables), hw.name) if tables else None
    curves = load_curves()
    par = Parallelism(tp, 1, ep, dp)
    kv = "bf16"
    target = OperatorCostModel(arch, hw, par, weight_dtype=dtype, kv_dtype=kv, tables=ts, curves=curves,
                               attention_backend=attention_backend, moe_backend=moe_backend)
    d = make_drafter(method, arch, kv, dtype, tp)
    dpar = Parallelism(tp, 1, ep if d.arch is not None and d.arch.is_moe else 1, dp if d.arch is not None and d.arch.is_moe else 1)
    drafter = OperatorCostModel(d.arch, hw, dpar, weight_dtype=dtype, kv_dtype=kv, tables=ts, curves=curves,
                                attention_backend=attention_backend, moe_backend=moe_backend) if d.arch else None
    return SpecSetup(target, drafter, method, d.projections, arch.hidden_size, arch.vocab_size, hw)


def decode_shape(batch: int, ctx: int, sizes: tuple[int, ...] = ()) -> BatchShape:
    from lab.core.batch import padded_size

    s = BatchShape.from_requests([1] * batch, [ctx] * batch)
    s.padded_tokens = padded_size(sizes, batch) if sizes else 0
    return s


def verify_shape(batch: int, ctx: int, k: int, sizes: tuple[int, ...] = ()) -> BatchShape:
    from lab.core.batch import padded_size

    s = BatchShape.from_requests([1 + k] * batch, [ctx] * batch, [k] * batch)
    s.padded_tokens = padded_size(sizes, s.num_tokens) if sizes else 0
    return s


def step_pair(su: SpecSetup, k: int, batch: int, ctx: int, serial: bool, async_scheduling: bool,
              cpu_s: float, **host) -> tuple[float, float]:
    """(plain decode step, speculative step) seconds at one batch size: the engine's CPU term added in sync mode,
    max(GPU, CPU) in async mode (steady state: the CPU work of a step overlaps the step before)."""
    sm = su.model(k, serial, async_scheduling, batch, **host)
    plain_sizes = default_capture(max(batch, 1))
    plain = su.target.step_time(decode_shape(batch, ctx, plain_sizes))
    spec = sm.step_time(verify_shape(batch, ctx, k, sm.cudagraph_sizes))
    if async_scheduling:
        host_extra = sm.host_time(verify_shape(batch, ctx, k, sm.cudagraph_sizes))
        return max(plain, cpu_s), max(spec, cpu_s + host_extra)
    return plain + cpu_s, spec + cpu_s


def pr16035(data_dir: Path) -> dict:
    """PR #16035's rows: {'base': plain step s, k: (step s, acceptance length)}."""
    rows = [r for r in csv.DictReader(open(Path(data_dir) / CSV)) if r["source_url"] == PR_16035]
    if not rows:
        raise ValueError(f"{Path(data_dir) / CSV}: no rows of {PR_16035}")
    out: dict = {"base": 1.0 / float(rows[0]["baseline_value"])}
    for r in rows:
        al = float(r["mean_acceptance_length"])
        out[int(r["num_spec_tokens"])] = (al / float(r["spec_value"]), al)
    return out


ENGINE_CPU_S = 8.9e-4 + 3.75e-5  # engine.cpu_overhead defaults at one sequence (Vidur fit, docs/fidelity.md)


def fit(data_dir: Path, tables: list[str] | None = None) -> tuple[float, float, dict]:
    """(host_pass_s, host_step_s, details) fitted on PR #16035 (module docstring)."""
    meas = pr16035(data_dir)
    tables = tables or [str(Path(data_dir) / "calibration/aiconfigurator/perf_db/h100_sxm")]
    su = setup("Llama-3.1-8B", "H100-SXM5-80GB", "eagle", tables)
    ks = sorted(k for k in meas if k != "base")
    d_meas = {k: meas[k][0] - meas["base"] for k in ks}

    def d_model(k, h, hs):
        base, spec = step_pair(su, k, 1, CONTEXT, True, False, ENGINE_CPU_S, host_pass_s=h, host_step_s=hs)
        return spec - base

    k0, k1 = ks[0], ks[-1]
    # the slope between the two k fixes host_pass_s (host-bound passes: linear in it), then host_step_s the level
    lo, hi = 0.0, 5e-3
    for _ in range(60):
        h = (lo + hi) / 2
        slope = d_model(k1, h, 0.0) - d_model(k0, h, 0.0)
        if slope < d_meas[k1] - d_meas[k0]:
            lo = h
        else:
            hi = h
    h = (lo + hi) / 2
    hs = d_meas[k0] - d_model(k0, h, 0.0)
    base, _ = step_pair(su, k0, 1, CONTEXT, True, False, ENGINE_CPU_S)
    details = {"measured_plain_ms": meas["base"] * 1e3, "model_plain_ms": base * 1e3,
               "steps": {k: {"measured_ms": meas[k][0] * 1e3, "acceptance_length": meas[k][1],
                             "model_ms": (base + d_model(k, h, hs)) * 1e3} for k in ks}}
    return h, hs, details


def main(argv: list[str]) -> None:
    import os

    dd = Path(argv[0] if argv else os.environ.get("SERVELAB_DATA_DIR", Path(__file__).resolve().parents[3] / "shared" / "data"))
    h, hs, det = fit(dd)
    print(f"host_pass_s = {h * 1e3:.3f} ms, host_step_s = {hs * 1e3:.3f} ms (fitted on {PR_16035})")
    print(f"plain step: measured {det['measured_plain_ms']:.3f} ms, model {det['model_plain_ms']:.3f} ms")
    for k, r in det["steps"].items():
        print(f"k = {k}: measured {r['measured_ms']:.3f} ms (AL {r['acceptance_length']}), model {r['model_ms']:.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
