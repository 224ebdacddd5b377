"""Attention in the operator cost model: one small strategy class per attention kind and source, each aware of the
kernel back-end (lab/costmodel/backends.py) that runs it.

A strategy prices one layer's attention for a step: ``prefill`` (prompt chunks with their history), ``decode`` (one
query token per request) and ``verify`` (speculative-decoding queries of 1 + k tokens), and says which source each
part used. :func:`make_attention` picks the strategy from the model's attention kind, the back-end and what the
measured tables and fitted curves of the GPU cover, once, when the operator model is built; every fact that
depends on the attention kind (query heads per KV head, FLOPs per query/key pair, the core's work, the projection
operators) is a method of the kind's class, so nothing below asks the model which kind it has:

- :class:`GQAAttention` (standard attention, MHA/GQA/MQA): measured tables (AIConfigurator's are vLLM 0.19's
  ``FLASH_ATTN``), fitted curves, or the roofline, per part;
- :class:`LatentAttention`, the base of DeepSeek MLA's three strategies (all heads share one latent KV head):
- :class:`MLAModuleTable`: DeepSeek MLA from AIConfigurator's module tables (projections, latent attention and
  o_proj measured as one; vLLM 0.19 with its Hopper default, ``FLASH_ATTN_MLA``);
- :class:`MLAModuleFit`: the same module from fitted curves;
- :class:`MLADecomposed`: projections as GEMM operators and the latent-attention core on the roofline with the
  back-end's published efficiency.

Back-ends differ in three ways here, each documented in docs/costmodel.md ("Kernel back-ends"):

1. Which measured source applies: a table measured with one back-end prices only that back-end (plus the
   documented efficiency difference of the others).
2. The latent-attention core efficiency (MLA): FlashMLA's published 3000 of 3350 GB/s and 660 of 990 TFLOPS on
   H800 for ``FLASHMLA``, ``FLASH_ATTN_MLA``, ``CUTLASS_MLA`` and ``FLASHINFER_MLA`` (no public figure separates
   them); ``TRITON_MLA`` at 1/3.93 of that (SGLang PR #3550: its FlashInfer MLA back-end served 3.93x the
   throughput of its Triton MLA back-end, DeepSeek-V3 TP8, 32k-token prompts; vLLM's Triton MLA decode kernel is
   adapted from SGLang's).
3. How a verify query runs: the decode kernels pack the query tokens and the query heads of one KV head into
   thread-block tiles of ``tile_rows`` rows; a verify query of q tokens takes ceil(q·g / tile_rows) tiles per KV
   head (g query heads per KV head) where a decode takes ceil(g / tile_rows), and each tile reads the KV head again.
   So the verify core costs the decode core at context c + q - 1 times that ratio, bounded below by the compute
   roof of its q·c + q(q+1)/2 query/key pairs. DeepSeek-V3 at TP8 (16 heads a GPU, FlashMLA's 64-row tiles):
   k <= 3 verifies in one tile like a decode; with attention DP (128 heads a GPU) a k = 3 verify runs 8 tiles
   where a decode runs 2.
"""

from __future__ import annotations

import math
from typing import Any

from lab.core.batch import BatchShape
from lab.costmodel import ops
from lab.costmodel.backends import ATTENTION_BACKENDS, AttentionBackend
from lab.costmodel.features import mla_module_work
from lab.costmodel.model_arch import dtype_bytes

# FlashMLA on H800 (published_kernel_and_system_figures.csv): 3000 of 3350 GB/s memory-bound, 660 of 990 TFLOPS
# compute-bound. Used for the MLA decode core when no table or curve covers it.
FLASHMLA_MEMORY_EFF = 3000 / 3350
FLASHMLA_COMPUTE_EFF = 660 / 990
# SGLang PR #3550: FlashInfer MLA 3.93x the throughput of the Triton MLA back-end (DeepSeek-V3, 32k prompts)
TRITON_MLA_SLOWDOWN = 10526.88 / 2679.07

_LAYER = (1, 0, 0)
# the operator model (lab/costmodel/operator.py OperatorCostModel), which imports this module: not imported back
OperatorModel = Any


def mla_core_efficiency(backend: str) -> tuple[float, float]:
    """(compute, memory) efficiency of a back-end's latent-attention core (module docstring, point 2)."""
    if backend == "TRITON_MLA":
        return FLASHMLA_COMPUTE_EFF / TRITON_MLA_SLOWDOWN, FLASHMLA_MEMORY_EFF / TRITON_MLA_SLOWDOWN
    return FLASHMLA_COMPUTE_EFF, FLASHMLA_MEMORY_EFF


def tile_ratio(backend: AttentionBackend, q: int, group: int) -> int:
    """Tiles a verify query of ``q`` tokens takes per KV head over those of a decode (module docstring, point 3)."""
    t = backend.tile_rows
    return -(-(q * group) // t) // -(-group // t)


class Attention:
    """One layer's attention for a step, priced by one source and back-end (the module docstring).

    A subclass is one attention kind and source: it prices ``prefill`` and ``decode`` and states the kind's facts,
    ``group``, ``pair_flops`` and ``work``; ``verify`` and ``layer`` are built on them.

    Attributes:
        mode: the strategy's name (``gqa``, ``module-table``, ``module-fit``, ``decomposed``).
        mla_mode: ``mode`` for an MLA strategy, None for standard attention.
        label: the breakdown's name for the operator (``attention``, or ``mla_module`` when projections are inside).
        backend: the vLLM back-end that runs it.
        pre_src, dec_src: where the prefill and decode times come from (``servelab cost``).
    """

    mode = ""
    label = "attention"
    mla_mode: str | None = None

    def __init__(self, om: OperatorModel, backend: AttentionBackend) -> None:
        self.om = om
        self.backend = backend
        self.pre_src = self.dec_src = "roofline"

    # -- the three parts
    def prefill(self, qs: list[int], cs: list[int]) -> float:
        raise NotImplementedError

    def decode(self, nd: int, ctx_sum: int, ctx_max: int) -> float:
        raise NotImplementedError

    def core(self, nd: int, ctx_sum: int) -> float:
        """The decode kernel alone (no projections) for ``nd`` queries over ``ctx_sum`` cached tokens."""
        return self.decode(nd, ctx_sum, ctx_sum // max(nd, 1))

    @property
    def group(self) -> int:
        """Query heads that share one KV head on this GPU."""
        raise NotImplementedError

    def pair_flops(self) -> float:
        """FLOPs per query/key pair of one layer on this GPU."""
        raise NotImplementedError

    def verify(self, qs: list[int], cs: list[int]) -> float:
        """Verify queries as the decode kernel runs them: the decode at context c + q - 1 plus the extra tiles'
        cores, bounded below by the compute roof of the pairs (module docstring, point 3)."""
        om = self.om
        ctx = [c + q - 1 for q, c in zip(qs, cs)]
        t = self.decode(len(qs), sum(ctx), max(ctx))
        g = self.group
        extra = 0.0
        for q, c in zip(qs, cs):
            r = tile_ratio(self.backend, q, g)
            if r > 1:
                extra += (r - 1) * self.core(1, c + q - 1)
        pairs = sum(ops.prefill_pairs(q, c) for q, c in zip(qs, cs))
        e = om.eff
        compute = om._roof(pairs * self.pair_flops(), 0.0, e.attention_compute, e.attention_memory, om.hw.bf16_flops)
        return max(t + extra, compute)

    def work(self, shape: BatchShape) -> tuple[tuple[float, float], tuple[float, float]]:
        """((FLOPs, bytes) of the prefill part, (FLOPs, bytes) of the decode part) of one layer's attention core."""
        raise NotImplementedError

    def layer(self, shape: BatchShape) -> tuple[float, float]:
        """(prefill part, decode part) seconds of one layer (verify queries in the decode part)."""
        pre = dec = 0.0
        if shape.prefill_new:
            pre = self.prefill(shape.prefill_new, shape.prefill_context)
        nd = shape.num_decodes
        if nd:
            dec = self.decode(nd, shape.decode_sum, shape.decode_max)
        if shape.verify_new:
            dec += self.verify(shape.verify_new, shape.verify_context)
        return pre, dec

    # -- shared helpers
    def prefill_core(self, qs, cs, H, Hk, d_qk, d_v, kv_tok) -> float:
        """Attention over prefill chunks from the fitted prefill curve, else the roofline. A curve fitted on one
        head configuration (``Curve.heads``) prices a shape with more head work at that configuration, scaled
        by the FLOPs (attention runs its heads in parallel; the fitted shapes already fill the GPU), since the
        fit could not learn how its efficiency terms depend on heads (lab/costmodel/fit.py)."""
        om = self.om
        c_ = om.pre_curve
        if (c_ is not None and c_.heads and d_qk == d_v and (H, Hk, d_qk) != tuple(c_.heads)
                and H * d_qk > c_.heads[0] * c_.heads[2]):
            Hf, Hkf, df = c_.heads
            kv_f = kv_tok * (Hkf * df) / (Hk * d_qk)  # the same KV dtype at the fitted heads
            base = self._prefill_curve(c_, qs, cs, Hf, Hkf, df, df, kv_f)
            return base * (H * d_qk) / (Hf * df)
        if c_ is not None:
            return self._prefill_curve(c_, qs, cs, H, Hk, d_qk, d_v, kv_tok)
        F = B = 0.0
        for q, c in zip(qs, cs):
            f, b = ops.attention_prefill(q, c, H, Hk, d_qk, d_v, kv_tok)
            F += f
            B += b
        e = om.eff
        return om._roof(F, B, e.attention_compute, e.attention_memory, om.hw.bf16_flops)

    @staticmethod
    def _prefill_curve(c_, qs, cs, H, Hk, d_qk, d_v, kv_tok) -> float:
        F = B = 0.0
        for q, c in zip(qs, cs):
            f, b = ops.attention_prefill(q, c, H, Hk, d_qk, d_v, kv_tok)
            F += f
            B += b
        n = len(qs)
        sq = sum(qs)
        span = sq + sum(cs)
        return c_.time(F, B, {"q_len": sq / n, "span": span / n, "units": n * H, "head_dim": d_qk, "bytes": B})

    @staticmethod
    def equivalent(qs: list[int], cs: list[int]) -> tuple[int, float, float, float]:
        """(chunks, equivalent uniform length, Σ pairs, Σ new tokens) of prefill chunks."""
        n = len(qs)
        pairs = 0.0
        for q, c in zip(qs, cs):
            pairs += q * c + q * (q + 1) / 2.0
        isl = (-1.0 + math.sqrt(1.0 + 8.0 * pairs / n)) / 2.0
        return n, isl, pairs, float(sum(qs))


class GQAAttention(Attention):
    """Standard attention (MHA/GQA/MQA): per part, a measured table of this GPU, else a fitted curve, else the
    roofline. AIConfigurator's attention tables are ``FLASH_ATTN`` (``kernel_source`` vllm_flash_attn); no public
    kernel measurement separates ``FLASHINFER`` or ``TRITON_ATTN`` from it on these GPUs, so they are priced from the
    same sources and differ in how they run verify queries (``tile_rows``)."""

    mode = "gqa"

    def __init__(self, om: OperatorModel, backend: AttentionBackend, add_gemm, add_elem) -> None:
        super().__init__(om, backend)
        m = om.model
        H, Hk, d = om.heads, om.kv_heads, m.head_dim
        h = m.hidden_size
        add_gemm("qkv_proj", (H + 2 * Hk) * d, h, _LAYER)
        add_gemm("o_proj", h, H * d, _LAYER)
        add_elem("rope", "rope", 4 * (H + Hk) * d, _LAYER)
        if m.qk_norm:
            add_elem("qk_norm", "norm", 4 * (H + Hk) * d, _LAYER)
        self.pre_uniform = self.pre_hist = self.pre_hist0 = self.dec_grid = None
        pre_src = dec_src = None
        if om.tables is not None:
            u, hgrid, h0, src = om.tables.attn_prefill(om.kvdtype, H, Hk, d)
            if u is not None or hgrid is not None:
                self.pre_uniform, self.pre_hist, self.pre_hist0, pre_src = u, hgrid, h0, f"table:{src}"
            g, src = om.tables.attn_decode(om.kvdtype, H, Hk, d)
            if g is not None:
                self.dec_grid, dec_src = g, f"table:{src}"
        if pre_src is None:
            c, src = om._curve("attn_prefill", om.kvdtype)
            om.pre_curve, pre_src = c, (src or "roofline")
        if dec_src is None:
            c, src = om._curve("attn_decode", om.kvdtype)
            om.dec_curve, dec_src = c, (src or "roofline")
        self.pre_src, self.dec_src = pre_src, dec_src

    @property
    def group(self) -> int:
        om = self.om
        return max(1, om.heads // om.kv_heads)

    def pair_flops(self) -> float:
        return 4.0 * self.om.heads * self.om.model.head_dim

    def work(self, shape: BatchShape) -> tuple[tuple[float, float], tuple[float, float]]:
        om, m = self.om, self.om.model
        Fp = Bp = Fd = Bd = 0.0
        for q, c in shape.query_chunks():
            f, b = ops.attention_prefill(q, c, om.heads, om.kv_heads, m.head_dim, m.head_dim, om.kv_tok)
            Fp, Bp = Fp + f, Bp + b
        if shape.num_decodes:
            Fd, Bd = ops.attention_decode(shape.num_decodes, shape.decode_sum, om.heads, m.head_dim, m.head_dim,
                                          om.kv_tok)
        return (Fp, Bp), (Fd, Bd)

    def prefill(self, qs: list[int], cs: list[int]) -> float:
        om, m = self.om, self.om.model
        if self.pre_hist is not None:
            t = 0.0
            for q, c in zip(qs, cs):
                if c > 0:
                    t += self.pre_hist(c, q)
                elif self.pre_hist0 is not None:
                    t += self.pre_hist0(q)
                else:
                    t += self.pre_hist(1, q)
            return t
        if self.pre_uniform is not None:
            n, isl, _, _ = self.equivalent(qs, cs)
            return self.pre_uniform(n, isl)
        return self.prefill_core(qs, cs, om.heads, om.kv_heads, m.head_dim, m.head_dim, om.kv_tok)

    def decode(self, nd: int, ctx_sum: int, ctx_max: int) -> float:
        if self.dec_grid is not None:
            return max(self.dec_grid(nd, ctx_sum / nd + 1), self.dec_grid(1, ctx_max + 1))
        return max(self._dec(nd, ctx_sum), self._dec(1, ctx_max))

    def core(self, nd: int, ctx_sum: int) -> float:
        if self.dec_grid is not None:
            return self.dec_grid(nd, ctx_sum / nd + 1)
        return self._dec(nd, ctx_sum)

    def _dec(self, nd: int, ctx_sum: float) -> float:
        om, m = self.om, self.om.model
        F, B = ops.attention_decode(nd, ctx_sum, om.heads, m.head_dim, m.head_dim, om.kv_tok)
        c = om.dec_curve
        if c is not None:
            return c.time(F, B, {"units": nd * om.heads, "head_dim": m.head_dim, "kv_len": ctx_sum / nd + 1,
                                 "kv_units": nd * om.kv_heads, "bytes": B, "batch": nd})
        e = om.eff
        return om._roof(F, B, e.attention_compute, e.attention_memory, om.hw.bf16_flops)


class LatentAttention(Attention):
    """DeepSeek MLA: every query head of the GPU reads the one shared latent KV head (``kv_lora_rank`` +
    ``qk_rope_head_dim``); the base of its strategies."""

    @property
    def mla_mode(self) -> str:  # type: ignore[override]
        return self.mode

    @property
    def group(self) -> int:
        return self.om.heads

    def pair_flops(self) -> float:
        """FLOPs per absorbed latent query/key pair."""
        m = self.om.model
        return 2.0 * self.om.heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)

    def work(self, shape: BatchShape) -> tuple[tuple[float, float], tuple[float, float]]:
        """Prefill as expanded attention (d_qk = nope + rope, d_v), decode as the absorbed latent core."""
        om, m = self.om, self.om.model
        Fp = Bp = Fd = Bd = 0.0
        d_qk, d_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        for q, c in shape.query_chunks():
            f, b = ops.attention_prefill(q, c, om.heads, om.heads, d_qk, d_v, om.heads * (d_qk + d_v) * 2.0)
            Fp, Bp = Fp + f, Bp + b
        if shape.num_decodes:
            Fd, Bd = ops.mla_decode(shape.num_decodes, shape.decode_sum, om.heads, m.kv_lora_rank,
                                    m.qk_rope_head_dim, om.kv_tok)
        return (Fp, Bp), (Fd, Bd)


class MLADecomposed(LatentAttention):
    """DeepSeek MLA with its projections as GEMM operators (registered by the operator model) and the attention
    cores apart: prefill expands the latent KV of the whole context with kv_b and runs attention with d_qk 192,
    d_v 128 (fitted prefill curve or roofline); decode runs the absorbed latent attention (one shared latent head
    of r + d_rope) on the roofline with the back-end's core efficiency, plus the W_UK / W_UV BMMs."""

    mode = "decomposed"

    def __init__(self, om: OperatorModel, backend: AttentionBackend, add_gemm, add_elem) -> None:
        super().__init__(om, backend)
        m = om.model
        h, H = m.hidden_size, om.heads
        r, rope, nope, dv, rq = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.q_lora_rank
        add_gemm("qkv_a_proj", (rq + r + rope) if rq else (r + rope), h, _LAYER)
        if rq:
            add_gemm("q_b_proj", H * (nope + rope), rq, _LAYER)
            add_elem("q_kv_a_norms", "norm", 4 * (rq + r), _LAYER)
        else:
            add_gemm("q_proj", H * (nope + rope), h, _LAYER)
            add_elem("kv_a_norm", "norm", 4 * r, _LAYER)
        add_gemm("o_proj", h, H * dv, _LAYER)
        add_elem("rope", "rope", 4 * (H + 1) * rope, _LAYER)
        self.kvb_fn, _, self.kvb_src = om._gemm_fn(H * (nope + dv), r)
        self.uk_fn, _, _ = om._gemm_fn(H * r, nope, "bf16")
        self.uv_fn, _, _ = om._gemm_fn(H * dv, r, "bf16")
        c, src = om._curve("attn_prefill", om.kvdtype)
        om.pre_curve, self.pre_src = c, (src or "roofline")
        ce, me = mla_core_efficiency(backend.name)
        self.core_eff = (ce, me)
        self.dec_src = f"roofline ({backend.name}: {ce:.0%} of peak FLOPs, {me:.0%} of bandwidth; FlashMLA " \
                       f"published efficiency{'' if backend.name != 'TRITON_MLA' else ' / 3.93'})"

    def prefill(self, qs: list[int], cs: list[int]) -> float:
        om, m = self.om, self.om.model
        H = om.heads
        ctx = sum(q + c for q, c in zip(qs, cs))
        t = self.kvb_fn(ctx)
        d_qk, d_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        kv_tok = H * (d_qk + d_v) * 2.0  # expanded K and V per token
        return t + self.prefill_core(qs, cs, H, H, d_qk, d_v, kv_tok)

    def core(self, nd: int, ctx_sum: int) -> float:
        om, m = self.om, self.om.model
        ce, me = self.core_eff
        F, B = ops.mla_decode(nd, ctx_sum, om.heads, m.kv_lora_rank, m.qk_rope_head_dim, om.kv_tok)
        return om._roof(F, B, ce, me, om.hw.bf16_flops)

    def decode(self, nd: int, ctx_sum: int, ctx_max: int) -> float:
        core = max(self.core(nd, ctx_sum), self.core(1, ctx_max))
        return core + self.uk_fn(nd) + self.uv_fn(nd)


class _MLACoreDelta(LatentAttention):
    """For a module priced with its back-end's core inside (tables, curves), the core of another back-end: the
    module time plus (this back-end's core - the measured back-end's core), both on the latent-attention roofline
    with their efficiencies (module docstring, point 2)."""

    measured = "FLASH_ATTN_MLA"  # the back-end the module tables were measured with

    def _core_roof(self, nd: int, ctx_sum: float, backend: str) -> float:
        om, m = self.om, self.om.model
        ce, me = mla_core_efficiency(backend)
        F, B = ops.mla_decode(nd, ctx_sum, om.heads, m.kv_lora_rank, m.qk_rope_head_dim, om.kv_tok)
        return om._roof(F, B, ce, me, om.hw.bf16_flops)

    def _delta(self, nd: int, ctx_sum: float) -> float:
        b = self.backend.name
        if b == self.measured:
            return 0.0
        return self._core_roof(nd, ctx_sum, b) - self._core_roof(nd, ctx_sum, self.measured)


class MLAModuleTable(_MLACoreDelta):
    """DeepSeek MLA from AIConfigurator's module tables (projections, latent attention and o_proj measured as one
    layer, vLLM 0.19, the back-end it picks on Hopper: ``FLASH_ATTN_MLA``). Another back-end adds its core's
    difference (:class:`_MLACoreDelta`)."""

    mode = "module-table"
    label = "mla_module"

    def __init__(self, om: OperatorModel, backend: AttentionBackend, pre, dec, pre_src: str,
                 dec_src: str) -> None:
        super().__init__(om, backend)
        self.mla_pre, self.mla_dec = pre, dec
        self.pre_src, self.dec_src = pre_src, dec_src
        if backend.name != self.measured:
            self.dec_src += f" + {backend.name} core difference (roofline)"

    def prefill(self, qs: list[int], cs: list[int]) -> float:
        n, isl, _, _ = self.equivalent(qs, cs)
        return self.mla_pre(n, isl)

    def decode(self, nd: int, ctx_sum: int, ctx_max: int) -> float:
        mean = ctx_sum / nd
        t = max(self.mla_dec(nd, mean + 1), self.mla_dec(1, ctx_max + 1))
        return t + self._delta(nd, ctx_sum)

    def core(self, nd: int, ctx_sum: int) -> float:
        return self._core_roof(nd, ctx_sum, self.backend.name)


class MLAModuleFit(_MLACoreDelta):
    """The MLA module from curves fitted on module tables (another GPU's, or this GPU's elsewhere in the grid)."""

    mode = "module-fit"

    def __init__(self, om: OperatorModel, backend: AttentionBackend, cp, cd, pre_src: str,
                 dec_src: str) -> None:
        super().__init__(om, backend)
        self.mla_pre_curve, self.mla_dec_curve = cp, cd
        self.pre_src, self.dec_src = pre_src, dec_src

    def prefill(self, qs: list[int], cs: list[int]) -> float:
        om, m = self.om, self.om.model
        t = 0.0
        for q, c in zip(qs, cs):
            F, B = mla_module_work(m, om.heads, 1, q_len=q + c, w_bytes=om.wb, kv_bytes=dtype_bytes(om.kvdtype))
            frac = ops.prefill_pairs(q, c) / ops.prefill_pairs(q + c, 0)
            t += frac * self.mla_pre_curve.time(F, B, {"q_len": q + c, "batch": 1, "heads": om.heads, "bytes": B})
        return t

    def _fit(self, nd: int, mean: float) -> float:
        om = self.om
        F, B = mla_module_work(om.model, om.heads, nd, kv_len=mean, w_bytes=om.wb, kv_bytes=dtype_bytes(om.kvdtype))
        return self.mla_dec_curve.time(F, B, {"batch": nd, "heads": om.heads, "kv_len": mean + 1, "bytes": B})

    def decode(self, nd: int, ctx_sum: int, ctx_max: int) -> float:
        t = max(self._fit(nd, ctx_sum / nd), self._fit(1, ctx_max))
        return t + self._delta(nd, ctx_sum)

    def core(self, nd: int, ctx_sum: int) -> float:
        return self._core_roof(nd, ctx_sum, self.backend.name)


def make_attention(om: OperatorModel, backend_name: str, add_gemm, add_elem) -> Attention:
    """The strategy for the operator model's model, back-end and sources (module docstring), chosen once when the
    operator model is built. Standard attention and MLA's decomposed form register their projection operators
    through ``add_gemm`` / ``add_elem``; for MLA the module tables come first (projections inside), then module
    curves, then the decomposed form."""
    backend = ATTENTION_BACKENDS[backend_name]
    m = om.model
    if not m.is_mla:
        return GQAAttention(om, backend, add_gemm, add_elem)
    H = om.heads
    gv = om.gemm_variant if om.wdtype == "fp8" else "bf16"
    if om.tables is not None:
        mp, sp = om.tables.mla("prefill", m, gv, om.kvdtype, H)
        md, sd = om.tables.mla("decode", m, gv, om.kvdtype, H)
        if mp is not None and md is not None:
            return MLAModuleTable(om, backend, mp, md, f"table:{sp}", f"table:{sd}")
    var = f"{gv}/{om.kvdtype}"
    cp, sp = om._curve("mla_prefill", var)
    cd, sd = om._curve("mla_decode", var)
    if cp is not None and cd is not None:
        return MLAModuleFit(om, backend, cp, cd, sp, sd)
    return MLADecomposed(om, backend, add_gemm, add_elem)
