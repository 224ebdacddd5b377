"""The fused routed experts of a MoE layer under vLLM's MoE kernel back-ends (``--moe-backend``;
lab/costmodel/backends.py names them and picks the default).

Every back-end computes the same two grouped GEMMs per expert (gate_up: rows x 2i x h, down: rows x h x i, on the
expert-parallel / tensor-parallel shard of this GPU) with the activation between; they differ in kernel efficiency
and in how they pad each expert's rows:

- ``triton`` (vLLM's fused_moe Triton kernel): AIConfigurator's measured tables (``kernel_source`` vllm_fused_moe,
  vLLM 0.19, balanced routing), else the fitted MoE curve, else the roofline. ``moe_align_block_size`` pads every
  expert's rows to ``BLOCK_SIZE_M`` (vllm/model_executor/layers/fused_moe/fused_moe.py ``get_default_config``: 16
  while the tokens do not exceed the experts, 64 above); the tables and curves measured that padding, so only the
  roofline adds it.
- ``deep_gemm`` (DeepGEMM's grouped fp8 GEMMs, contiguous layout): vLLM uses it only where
  vllm/model_executor/layers/fused_moe/deep_gemm_moe.py ``_valid_deep_gemm`` allows (block-scaled fp8 weights, at
  least 128 tokens entering the layer, the intermediate shard N > 512 and N, K multiples of 128); below that it
  runs ``triton``. The contiguous layout aligns each expert's rows to 128 (``get_m_alignment_for_contiguous_layout``;
  vLLM sizes the buffer M·top-k + E·127, ``compute_aligned_M``), so an expert with r rows computes ceil(r/128)·128.
  Efficiency from DeepGEMM's published H800 tables (its README, 2025-04-09; shared
  calibration/published_benchmarks/deepgemm_h800_fp8_gemm.csv): fraction of the fp8 peak by rows per group,
  :data:`DEEPGEMM_COMPUTE` (the grouped contiguous and masked rows of DeepSeek-V3's expert shapes, averaged over the
  two GEMMs; 128 rows from its dense table), 61 % of HBM bandwidth where memory-bound (the masked 256-row rows).
  Plus the permute, activation-quantisation and unpermute-reduce passes over the padded rows.
- ``cutlass``, ``flashinfer_cutlass``, ``flashinfer_trtllm`` (CUTLASS grouped GEMMs; FlashInfer's wrap CUTLASS and
  TRT-LLM kernels): no per-expert alignment (the grouped GEMM takes each expert's row count), at DeepGEMM's
  efficiency divided by its published speed-up over CUTLASS 3.6 on the same grouped shapes (1.2-1.3x,
  :data:`CUTLASS_SLOWDOWN`); no public measurement separates the FlashInfer wrappers from plain CUTLASS, so they
  are priced the same.

Routing is balanced (as the operator model assumes everywhere): R = T·k/ep rows on this GPU spread over
min(E/ep, R) touched experts.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from lab.costmodel import ops

# DeepGEMM README (2025-04-09) on H800: TFLOPS / 1978.9 dense fp8 peak by rows per group; 128: dense GEMMs at
# m = 128 (the grouped tables start at 256), 256-1024: masked layout, 4096-8192: contiguous layout; each point the
# mean of the gate_up (N 4096, K 7168) and down (N 7168, K 2048) shapes (4096 x 7168 and 7168 x 2048 for 128).
DEEPGEMM_COMPUTE = ((128, (533.0 + 510.0) / 2 / 1978.9), (256, (932.0 + 815.0) / 2 / 1978.9),
                    (512, (1040.0 + 916.0) / 2 / 1978.9), (1024, (1233.0 + 925.0) / 2 / 1978.9),
                    (4096, (1346.0 + 1214.0) / 2 / 1978.9), (8192, (1346.0 + 1214.0) / 2 / 1978.9))
DEEPGEMM_MEMORY = (2064.0 + 2047.0) / 2 / 3350.0  # masked layout, 256 rows per group: 2047-2064 of 3350 GB/s
DEEPGEMM_ALIGN = 128
# the operator model (lab/costmodel/operator.py OperatorCostModel), which imports this module: not imported back
OperatorModel = Any
# DeepGEMM over CUTLASS 3.6 on the grouped shapes of the same README table (contiguous 1.2-1.3x, masked 1.1-1.2x)
CUTLASS_SLOWDOWN = 1.2


def deepgemm_compute_eff(rows_per_group: float) -> float:
    """DeepGEMM's fraction of the fp8 peak at ``rows_per_group`` rows per expert (log-linear between the
    published points, flat outside them)."""
    pts = DEEPGEMM_COMPUTE
    if rows_per_group <= pts[0][0]:
        return pts[0][1]
    for (m0, e0), (m1, e1) in zip(pts, pts[1:]):
        if rows_per_group <= m1:
            t = (math.log2(rows_per_group) - math.log2(m0)) / (math.log2(m1) - math.log2(m0))
            return e0 + t * (e1 - e0)
    return pts[-1][1]


def triton_block_m(tokens: float, experts: int) -> int:
    """vLLM's default fused_moe ``BLOCK_SIZE_M``: 16 while the tokens do not exceed the experts, else 64."""
    return 16 if tokens <= experts else 64


class MoEExperts:
    """Seconds of one MoE layer's fused routed experts on this GPU for T tokens entering the layer (all DP ranks'
    tokens with expert parallelism), and where they come from."""

    def __init__(self, om: OperatorModel, name: str) -> None:
        self.om = om
        self.name = name
        m, p = om.model, om.par
        self.h, self.E, self.k = m.hidden_size, m.num_experts, m.experts_per_token
        self.i_full = m.moe_intermediate_size
        self.i_r = self.i_full // p.moe_tp
        self.ep = p.ep
        self.E_local = self.E / p.ep
        self.source = ""

    def rows(self, T: float) -> tuple[float, float]:
        """(rows on this GPU, experts they touch) under balanced routing."""
        R = T * self.k / self.ep
        return R, min(self.E_local, R) if R > 0 else 0.0

    def time(self, T: float) -> float:
        raise NotImplementedError


class TritonMoE(MoEExperts):
    """vLLM's fused_moe Triton kernel: measured table, fitted curve or roofline (module docstring)."""

    def __init__(self, om: OperatorModel, name: str = "triton") -> None:
        super().__init__(om, name)
        p = om.par
        h, E, k, i_r, i_full = self.h, self.E, self.k, self.i_r, self.i_full
        variant = om.gemm_variant if om.wdtype == "fp8" else "bf16"
        wb = 1.0 if om.wdtype == "fp8" else 2.0
        self.fn: Callable[[float], float] | None = None
        if om.tables is not None:
            f, s = om.tables.moe(variant, h, i_full, k, E, p.moe_tp, p.ep)
            if f is None and variant == "fp8_block":
                f, s = om.tables.moe("fp8", h, i_full, k, E, p.moe_tp, p.ep)
            if f is not None:
                self.fn, self.source = f, f"table:{s}"
        if self.fn is None:
            c, s = om._curve("moe", variant)
            if c is not None:
                def fc(T: float, c=c) -> float:
                    F, B = ops.moe_experts(T, h, i_r, k, E, p.ep, wb, wb)
                    rows = T * k / p.ep
                    return c.time(F, B, {"rows_per_expert": max(rows / (E / p.ep), 1e-3), "rows": max(rows, 1e-3),
                                         "inter": i_r, "hidden": h, "topk": k, "tokens": T, "bytes": B,
                                         "experts_local": E / p.ep})
                self.fn, self.source = fc, s
            else:
                e = om.eff
                peak = om.hw.peak_flops(om.wdtype)

                def fr(T: float) -> float:
                    F, B = ops.moe_experts(T, h, i_r, k, E, p.ep, wb, wb)
                    R, touched = self.rows(T)
                    if touched > 0:  # moe_align_block_size pads every touched expert to BLOCK_SIZE_M rows
                        bm = triton_block_m(T, E)
                        F *= touched * math.ceil(R / touched / bm) * bm / R
                    return om._roof(F, B, e.gemm_compute, e.gemm_memory, peak) + 4 * e.kernel_launch_s
                self.fn, self.source = fr, "roofline (BLOCK_SIZE_M padding per expert)"

    def time(self, T: float) -> float:
        return self.fn(T) if T > 0 else 0.0  # type: ignore[misc]


class GroupedGemmMoE(MoEExperts):
    """DeepGEMM (``deep_gemm``) or CUTLASS grouped GEMMs (``cutlass``, ``flashinfer_cutlass``,
    ``flashinfer_trtllm``), with the Triton kernel where vLLM falls back to it (module docstring)."""

    def __init__(self, om: OperatorModel, name: str) -> None:
        super().__init__(om, name)
        self.fallback = TritonMoE(om)
        self.align = DEEPGEMM_ALIGN if name == "deep_gemm" else 1
        self.slowdown = 1.0 if name == "deep_gemm" else CUTLASS_SLOWDOWN
        self.peak = om.hw.peak_flops("fp8")
        self.bw = om.hw.memory_bandwidth
        self.act, _ = om._elem_fn("act")
        if name == "deep_gemm" and self.uses_fallback(float("inf")):  # the shard never passes _valid_deep_gemm
            self.source = f"{self.fallback.source} [deep_gemm: vLLM runs Triton, expert shard N = {self.i_r}]"
            return
        kernel = "DeepGEMM grouped contiguous" if name == "deep_gemm" else "CUTLASS grouped GEMM"
        self.source = (f"{kernel}: DeepGEMM README efficiency" + (f" / {CUTLASS_SLOWDOWN}" if self.slowdown > 1 else "")
                       + (f", experts padded to {self.align} rows" if self.align > 1 else "")
                       + (f"; below 128 tokens or N <= 512: {self.fallback.source}" if name == "deep_gemm" else ""))

    def uses_fallback(self, T: float) -> bool:
        """vLLM runs Triton instead (``_valid_deep_gemm``): fewer than 128 tokens, or an intermediate shard of 512
        or less, or N / K not multiples of 128."""
        if self.name != "deep_gemm":
            return False
        a = DEEPGEMM_ALIGN
        return T < a or self.i_r <= 512 or self.i_r % a or self.h % a

    def time(self, T: float) -> float:
        if T <= 0:
            return 0.0
        if self.uses_fallback(T):
            return self.fallback.time(T)
        R, touched = self.rows(T)
        per = R / touched
        padded = touched * math.ceil(per / self.align) * self.align
        rows_per_group = padded / touched
        ec = deepgemm_compute_eff(rows_per_group) / self.slowdown
        me = DEEPGEMM_MEMORY / self.slowdown
        h, i = self.h, self.i_r
        launch = self.om.eff.kernel_launch_s
        t = 0.0
        for n, k in ((2 * i, h), (h, i)):
            F = 2.0 * padded * n * k
            B = touched * n * k * 1.0 + padded * (n + k) * 2.0  # fp8 weights of the touched experts, activations
            t += max(F / (self.peak * ec), B / (self.bw * me)) + launch
        # permute to expert order, SiLU-and-mul with fp8 re-quantisation, unpermute and weighted reduce
        t += self.act(padded * h * 4.0) + self.act(padded * 2 * i * 3.0) + self.act(padded * h * 4.0)
        return t


def make_moe_experts(om: OperatorModel, backend: str) -> MoEExperts:
    """The routed-experts strategy of a back-end (module docstring)."""
    if backend == "triton":
        return TritonMoE(om)
    return GroupedGemmMoE(om, backend)
