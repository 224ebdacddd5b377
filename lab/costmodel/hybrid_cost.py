"""Roofline step time of a hybrid model: sliding-window and chunked attention priced over their window, Gated
DeltaNet and Mamba-2 layers priced as a chunked scan (prefill) and a state update (decode), MXFP4 experts read at
4.25 bits a weight.

It wraps the analytic roofline (lab/costmodel/roofline.py, :class:`RooflineCostModel`) for everything that does not
depend on the layer kind — the dense GEMMs of every layer, the MoE block, norms, all-reduces, LM head, sampler,
step overhead — and corrects and adds what does:

**Projections.** A full / sliding / chunked attention layer has the roofline's q, k, v and o GEMMs (plus q's output
gate for Qwen3-Next's gated attention: one more h x H·d/tp GEMM). A Gated DeltaNet layer has in_proj_qkvz
(h x (2·nk·dk + 2·nv·dv)/tp), in_proj_ba (h x 2·nv/tp) and out_proj (nv·dv/tp x h); a Mamba-2 layer in_proj
(h x (2·d_inner + 2·g·N + H)/tp) and out_proj (d_inner/tp x h) (vLLM gdn_linear_attn.py, mamba_mixer2.py).

**Attention** (per layer, every prefill chunk as one kernel, every decode as another, verify queries a third, as
the roofline prices full attention): a query at position p attends ``p + 1`` keys under full attention,
``min(p + 1, w)`` under a sliding window ``w`` (a decode; a prefill computes whole 128-query tiles, so
``min(p + 1, w + 127)``), and ``p - floor(p / a)·a + 1`` under chunked attention with chunk ``a``; 4·H·d FLOPs per
query/key pair (QKᵀ and PV); the KV read is the keys the kernel can reach (for a window:
``min(c, w - 1) + q`` tokens of a chunk of ``q`` after ``c``, ``min(c + 1, w)`` for a decode), the
FlashAttention-with-window kernel vLLM uses (gpt-oss's learned sinks add one logit per head: nothing to price).

**Gated DeltaNet** (per layer, H = nv/tp value heads of dk x dv state; FLA's chunked kernels, chunk C = 64):
prefill ``2·C·(2·dk + dv) + 4·dk·dv`` FLOPs per token and head (intra-chunk attention-like products, the
inter-chunk state read and update), bytes: q, k, v in, o out, and the state written once per chunk; decode (fused recurrent
update) ``6·dk·dv`` FLOPs per head, the state read and written once (the decode is bound by it), plus the conv state.

**Mamba-2** (per layer, H = heads/tp of P x N state, SSD chunk C = ``mamba_chunk_size``): prefill ``2·C·P + 4·P·N``
FLOPs per token and head plus ``2·C·N`` per token and group (C·Bᵀ), bytes: x, B, C, dt in, y out, the state written
once per chunk; decode (``selective_state_update``) ``6·P·N`` FLOPs per head, the state and conv state read and
written once.

**MXFP4 experts** (gpt-oss): the routed experts' weights are read at 17/32 byte a weight and multiplied at the bf16
rate (Hopper has no FP4 tensor cores: vLLM's Marlin / Triton MoE kernels dequantize in registers).

All of this is a documented roofline; the project has no measured table for the recurrent kernels. AIConfigurator's
H100 tables (vLLM 0.19) measure window-128 attention with gpt-oss's shape (64 heads, 8 KV heads, head_dim 64):
decode stays flat past the window as here; windowed prefill, priced by tiles, measures 1.9x this roofline's
compute (:data:`WINDOW_PREFILL_SLOWDOWN`, applied; tests/test_hybrid_models.py checks the fit); both tables sit ~8 µs
above any roofline for a lone small kernel.
Efficiencies are the roofline's (``cost_model.efficiency``).
"""

from __future__ import annotations

from lab.core.batch import BatchShape
from lab.costmodel import comm
from lab.costmodel.base import CostModelBase
from lab.costmodel.hardware import Hardware
from lab.costmodel.model_arch import ATTENTION_KINDS, ModelArch, dtype_bytes
from lab.costmodel.roofline import Efficiency, RooflineCostModel

GDN_CHUNK = 64  # FLA's chunk length for Gated DeltaNet's chunked prefill
# FlashAttention computes whole tiles of 128 queries (FA3 on Hopper, kBlockM): under a sliding window each tile reads
# the keys its first query still sees through those its last query sees, w + 127 keys for most of its queries
ATTENTION_TILE = 128
# Windowed prefill runs slower than full attention's efficiency per pair computed (masked tiles, more per-tile
# overhead): the median ratio of AIConfigurator's measured window-128 prefill attention to this roofline on H100
# (vLLM 0.19.0 context_attention_perf, gpt-oss's shape: 64 heads, 8 KV heads, head_dim 64, bf16; prompts of 1k-16k
# tokens, batches 1-128: 1.85-2.35, median 1.9), applied to the compute roof of windowed prefill
WINDOW_PREFILL_SLOWDOWN = 1.9
GDN_PREFILL_KERNELS = 6  # cumsum, K·Kᵀ, triangular solve, W/U, state pass, output
MAMBA_PREFILL_KERNELS = 5  # conv1d, chunk cumsum, chunk state, state passing, chunk scan
STATE_DECODE_KERNELS = 2  # conv1d update, state update


def window_pairs(c: int, q: int, w: int) -> float:
    """Query/key pairs of a causal chunk of ``q`` tokens after ``c`` under a sliding window ``w``:
    ``Σ_{x = c+1}^{c+q} min(x, w)``."""
    a, b = c + 1, c + q
    if b <= w:
        return (a + b) * q / 2.0
    if a >= w:
        return float(q * w)
    return (a + w) * (w - a + 1) / 2.0 + (b - w) * w


def chunked_pairs(c: int, q: int, a: int) -> float:
    """Query/key pairs of a chunk of ``q`` tokens after ``c`` under chunked local attention (chunk ``a``): position
    p attends ``p - floor(p / a)·a + 1`` keys."""
    total = 0.0
    p = c
    end = c + q
    while p < end:
        start = p // a * a
        stop = min(end, start + a)
        lo, hi = p - start + 1, stop - start  # keys of the first and last position in this segment
        total += (lo + hi) * (hi - lo + 1) / 2.0
        p = stop
    return total


class HybridRooflineCostModel(CostModelBase):
    """Roofline step time of a hybrid model on one TP rank (see the module docstring).

    Args: as :class:`RooflineCostModel` (``model``, ``hardware``, ``tp``, ``weight_dtype``, ``kv_dtype``,
    ``efficiency``, ``link``).
    """

    name = "roofline"

    def __init__(self, model: ModelArch, hardware: Hardware, tp: int = 1, weight_dtype: str = "bf16",
                 kv_dtype: str = "bf16", efficiency: Efficiency | None = None,
                 link: comm.LinkSpec | None = None) -> None:
        self.inner = RooflineCostModel(model, hardware, tp, weight_dtype, kv_dtype, efficiency, link)
        self.model = m = model
        self.hw = hardware
        self.tp = tp
        self.eff = e = self.inner.eff
        kinds = m.layer_kinds()
        self.n_full = kinds.count("full_attention")
        self.n_sliding = kinds.count("sliding_attention")
        self.n_chunked = kinds.count("chunked_attention")
        self.n_gdn = kinds.count("linear_attention")
        self.n_mamba = kinds.count("mamba")
        self.n_attn = self.n_full + self.n_sliding + self.n_chunked
        self.heads = max(1, m.num_heads // tp)
        self.kv_bytes = float(m.kv_bytes_per_token_per_layer(kv_dtype, tp))
        self.pair = 4.0 * self.heads * m.head_dim
        self.attn_flops = hardware.bf16_flops * e.attention_compute
        self.bandwidth = hardware.memory_bandwidth * e.attention_memory
        self.launch = e.kernel_launch_s
        self.ssm_bytes = dtype_bytes(m.mamba_ssm_dtype) if m.mamba_ssm_dtype else 2
        h = m.hidden_size
        self.state_gemms: list[tuple[int, int, int]] = []  # (count, k, n)
        if self.n_gdn:
            nk, nv, dk, dv = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, \
                m.linear_value_head_dim
            self.state_gemms += [(self.n_gdn, h, (2 * nk * dk + 2 * nv * dv) // tp), (self.n_gdn, h, 2 * nv // tp),
                                 (self.n_gdn, nv * dv // tp, h)]
        if self.n_mamba:
            di, g, n, nh = m.mamba_intermediate_size, m.mamba_num_groups, m.mamba_state_size, m.mamba_num_heads
            self.state_gemms += [(self.n_mamba, h, (2 * di + 2 * g * n + nh) // tp), (self.n_mamba, di // tp, h)]
        self._cache: dict[tuple[int, int], dict[str, float]] = {}

    # ---- token terms ----
    def _terms(self, T: int, S: int) -> dict[str, float]:
        key = (T, S)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        inner = self.inner
        m = self.model
        out = {k: v for k, v in inner._token_terms(T, S).items() if k != "_sum"}
        attn_gemm = 0.0
        for k, n in inner.attn_gemms:
            attn_gemm += inner._gemm(T, k, n)
        gemm = out["gemm"] - attn_gemm * (self.n_gdn + self.n_mamba)
        if m.attn_output_gate:
            gemm += inner._gemm(T, m.hidden_size, self.heads * m.head_dim) * self.n_attn
        for count, k, n in self.state_gemms:
            gemm += inner._gemm(T, k, n) * count
        out["gemm"] = gemm
        if m.moe_weight_dtype and m.num_moe_layers:
            out["moe"] = self._moe(T) * m.num_moe_layers
        out["_sum"] = sum(out.values())
        self._cache[key] = out
        return out

    def _moe(self, tokens: int) -> float:
        """The MoE block with the routed experts read in their own format (MXFP4: 17/32 byte a weight)."""
        m = self.model
        inner = self.inner
        e = self.eff
        k = m.experts_per_token
        experts = m.num_experts
        ie = m.moe_intermediate_size // self.tp
        wb = m.moe_weight_bytes()
        active = experts * (1.0 - (1.0 - k / experts) ** tokens)
        flops_rate = self.hw.bf16_flops * e.gemm_compute
        bw = self.hw.memory_bandwidth * e.gemm_memory
        t = 0.0
        for kin, nout in ((m.hidden_size, 2 * ie), (ie, m.hidden_size)):
            flops = 2.0 * tokens * k * kin * nout
            byts = active * kin * nout * wb + tokens * k * (kin + nout) * 2
            t += max(flops / flops_rate, byts / bw) + e.kernel_launch_s
        for kin, nout in ((m.hidden_size, 2 * ie), (ie, m.hidden_size)):
            if m.num_shared_experts:
                t += inner._gemm(tokens, kin, nout * m.num_shared_experts)
        t += inner._gemm(tokens, m.hidden_size, experts)  # router
        return t

    # ---- mixers ----
    def _attention(self, shape: BatchShape, kind: str) -> float:
        """One attention layer of ``kind`` over the step (prefill chunks, verify queries, decodes)."""
        m = self.model
        w = m.sliding_window if kind == "sliding_attention" else 0
        a = m.attention_chunk_size if kind == "chunked_attention" else 0
        pair, flops, bw, kvb, launch = self.pair, self.attn_flops, self.bandwidth, self.kv_bytes, self.launch
        t = 0.0
        for news, ctxs, is_verify in ((shape.prefill_new, shape.prefill_context, False),
                                      (shape.verify_new, shape.verify_context, True)):
            if not news:
                continue
            pairs = 0.0
            kv_tokens = 0
            new_tokens = 0
            for q, c in zip(news, ctxs):
                if w:
                    pairs += window_pairs(c, q, w if is_verify else w + ATTENTION_TILE - 1)
                    kv_tokens += min(c, w - 1) + q
                elif a:
                    pairs += chunked_pairs(c, q, a)
                    kv_tokens += c - c // a * a + q
                else:
                    pairs += q * (c + (q + 1) / 2.0)
                    kv_tokens += c + q
                new_tokens += q
            byts = kv_tokens * kvb + (0 if is_verify else 2 * new_tokens * self.heads * m.head_dim * 2)
            compute = pairs * pair / flops
            if w and not is_verify:
                compute *= WINDOW_PREFILL_SLOWDOWN
            t += max(compute, byts / bw) + launch
        if shape.num_decodes:
            if w:
                ctx = sum(min(c + 1, w) for c in shape.decode_context)
            elif a:
                ctx = sum(c - c // a * a + 1 for c in shape.decode_context)
            else:
                ctx = shape.decode_sum + shape.num_decodes
            t += max(ctx * pair / flops, ctx * kvb / bw) + launch
        return t

    def _gdn(self, shape: BatchShape) -> float:
        """One Gated DeltaNet layer over the step."""
        m = self.model
        H = max(1, m.linear_num_value_heads // self.tp)
        dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
        state = H * dk * dv * self.ssm_bytes
        conv = (m.linear_conv_dim // self.tp) * (m.linear_conv_kernel_dim - 1) * 2
        io_per_token = (2 * m.linear_num_key_heads * dk + 2 * m.linear_num_value_heads * dv) // self.tp * 2
        return self._scan(shape, H, 2.0 * GDN_CHUNK * (2 * dk + dv) + 4.0 * dk * dv, GDN_CHUNK, state, conv,
                          io_per_token, 6.0 * dk * dv, GDN_PREFILL_KERNELS)

    def _mamba(self, shape: BatchShape) -> float:
        """One Mamba-2 layer over the step."""
        m = self.model
        H = max(1, m.mamba_num_heads // self.tp)
        P, N, G = m.mamba_head_dim, m.mamba_state_size, m.mamba_num_groups
        C = m.mamba_chunk_size or 256
        state = H * P * N * self.ssm_bytes
        conv_dim = (m.mamba_intermediate_size + 2 * G * N) // self.tp
        conv = conv_dim * (m.mamba_conv_kernel - 1) * 2
        io_per_token = (2 * m.mamba_intermediate_size // self.tp + 2 * G * N + H) * 2
        per_token_head = 2.0 * C * P + 4.0 * P * N + 2.0 * C * N * G / H
        return self._scan(shape, H, per_token_head, C, state, conv, io_per_token, 6.0 * P * N, MAMBA_PREFILL_KERNELS)

    def _scan(self, shape: BatchShape, heads: int, prefill_flops_per_token_head: float, chunk: int,
              state_bytes: float, conv_bytes: float, io_per_token: float, decode_flops_per_head: float,
              prefill_kernels: int) -> float:
        """A recurrent layer: a chunked scan over every prefill (and verify) token, a state update per decode."""
        flops_rate, bw, launch = self.attn_flops, self.bandwidth, self.launch
        t = 0.0
        news = list(shape.prefill_new) + list(shape.verify_new)
        if news:
            tokens = sum(news)
            chunks = sum(-(-q // chunk) for q in news)
            flops = tokens * heads * prefill_flops_per_token_head
            byts = tokens * io_per_token + chunks * state_bytes + len(news) * (state_bytes + 2 * conv_bytes)
            t += max(flops / flops_rate, byts / bw) + prefill_kernels * launch
        if shape.num_decodes:
            d = shape.num_decodes
            flops = d * heads * decode_flops_per_head
            byts = d * (2 * state_bytes + 2 * conv_bytes + io_per_token)
            t += max(flops / flops_rate, byts / bw) + STATE_DECODE_KERNELS * launch
        return t

    def _mixers(self, shape: BatchShape) -> tuple[float, float]:
        """(attention seconds, recurrent-layer seconds) of the step, every layer."""
        attn = 0.0
        if self.n_full:
            attn += self._attention(shape, "full_attention") * self.n_full
        if self.n_sliding:
            attn += self._attention(shape, "sliding_attention") * self.n_sliding
        if self.n_chunked:
            attn += self._attention(shape, "chunked_attention") * self.n_chunked
        rec = 0.0
        if self.n_gdn:
            rec += self._gdn(shape) * self.n_gdn
        if self.n_mamba:
            rec += self._mamba(shape) * self.n_mamba
        return attn, rec

    # ---- CostModel ----
    def step_time(self, shape: BatchShape) -> float:
        if shape.num_tokens == 0:
            return self.eff.step_overhead_s
        attn, rec = self._mixers(shape)
        return self._terms(shape.dense_tokens, shape.num_logits)["_sum"] + attn + rec

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """Step time split into gemm, moe, elementwise, communication, head, overhead, attention (full, sliding and
        chunked layers) and recurrent (Gated DeltaNet / Mamba layers); the parts sum to :meth:`step_time`."""
        if shape.num_tokens == 0:
            return {"overhead": self.eff.step_overhead_s}
        out = {k: v for k, v in self._terms(shape.dense_tokens, shape.num_logits).items() if k != "_sum"}
        out["attention"], out["recurrent"] = self._mixers(shape)
        return out


def attention_kinds_present(model: ModelArch) -> list[str]:
    """The attention kinds among the model's layers (for reports)."""
    return [k for k in ATTENTION_KINDS if model.count_layers(k)]
