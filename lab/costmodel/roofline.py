"""Analytic roofline cost model: every operator of a decoder step costs max(FLOPs / achievable FLOP/s,
bytes / achievable B/s) plus a launch latency, from hardware peaks and the model's shapes.

Operators per decoder layer, on one tensor-parallel rank (Megatron split: heads and MLP width divided by TP):
QKV, O, gate+up and down GEMMs (or MLA projections, or MoE experts), attention for prefill chunks (causal, with
their history) and decodes (reading their KV), norms/elementwise, and two all-reduces when TP > 1; then the
embedding, LM head (one position per sequence) and sampler. FLOP counts: a GEMM of m x k by k x n is 2mkn;
attention for a query attending c context tokens is 4·H·d·c (QKᵀ and PV), causal prefill of q tokens after a
history k attends k + (q+1)/2 tokens on average. A ring all-reduce moves 2(n-1)/n of the buffer per GPU.
The achievable fractions of peak (:class:`Efficiency`) are defaults taken from published measurements
(hardware catalog sources; FlashAttention-2 ~35-50 % of H100 peak, large GEMMs 70-86 %, HBM 80-90 %) until
`servelab calibrate` fits them per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lab.core.batch import BatchShape
from lab.costmodel import comm
from lab.costmodel.base import CostModelBase
from lab.costmodel.hardware import Hardware
from lab.costmodel.model_arch import ModelArch, dtype_bytes


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of peak and fixed latencies (seconds) used by the roofline."""

    gemm_compute: float = 0.72
    gemm_memory: float = 0.85
    attention_compute: float = 0.45
    attention_memory: float = 0.80
    elementwise_memory: float = 0.70
    link: float = 0.70
    kernel_launch_s: float = 2.0e-6
    allreduce_latency_s: float = 10.0e-6
    step_overhead_s: float = 1.0e-3


class RooflineCostModel(CostModelBase):
    """Roofline step time for ``model`` on ``hardware`` with tensor parallelism ``tp``.

    Args:
        model: architecture.
        hardware: GPU peaks.
        tp: tensor-parallel size (>= 1).
        weight_dtype: GEMM weight dtype ("bf16" or "fp8").
        kv_dtype: KV-cache dtype.
        efficiency: achievable fractions and latencies.
        link: the TP group's link (lab/costmodel/comm.py); default: the catalog's link for ``tp`` GPUs of this type
            (``comm.group_link``). The all-reduce is priced by the communication model.
    """

    name = "roofline"

    def __init__(self, model: ModelArch, hardware: Hardware, tp: int = 1, weight_dtype: str = "bf16",
                 kv_dtype: str = "bf16", efficiency: Efficiency | None = None,
                 link: comm.LinkSpec | None = None) -> None:
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        self.model = model
        self.hw = hardware
        self.tp = tp
        self.eff = efficiency or Efficiency()
        self.link = link or comm.group_link(hardware.name, tp)
        self.wbytes = dtype_bytes(weight_dtype)
        self.abytes = 2  # activations in bf16
        self.kv_layer_bytes = model.kv_bytes_per_token(kv_dtype, tp) / model.num_layers
        self.peak = hardware.peak_flops(weight_dtype)
        e = self.eff
        # a GEMM's achievable FLOP/s and B/s and the launch latency, the products _gemm divides by, formed once
        # (the same products each time, so the same bits; the efficiencies are fixed at construction)
        self._gemm_flops = self.peak * e.gemm_compute
        self._gemm_bandwidth = hardware.memory_bandwidth * e.gemm_memory
        self._launch_s = e.kernel_launch_s
        self._allreduce_s: dict[float, float] = {}  # all-reduce seconds by buffer bytes (link and TP fixed)
        self._cache: dict[tuple[int, int], dict[str, float]] = {}
        self._roof_cache: tuple[float, float, float, float, float] | None = None  # _decode_roof, once computed
        self._prefill_cache: tuple[float, float, float, float, float, int, int, int] | None = None  # _prefill_roof
        self.attn_peak = hardware.bf16_flops
        m = model
        h = m.hidden_size
        # (k_in, n_out) per rank of each dense GEMM in one layer
        if m.is_mla:
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            heads = max(1, m.num_heads // tp)
            attn_gemms = []
            if m.q_lora_rank:
                attn_gemms += [(h, m.q_lora_rank), (m.q_lora_rank, heads * qk)]
            else:
                attn_gemms += [(h, heads * qk)]
            attn_gemms += [(h, m.kv_lora_rank + m.qk_rope_head_dim),
                           (m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                           (heads * m.v_head_dim, h)]
        else:
            heads = max(1, m.num_heads // tp)
            kv_heads = max(1, m.num_kv_heads // tp)
            attn_gemms = [(h, (heads + 2 * kv_heads) * m.head_dim), (heads * m.head_dim, h)]
        self.heads = heads
        self.attn_gemms = attn_gemms
        i = m.intermediate_size // tp
        self.mlp_gemms = [(h, 2 * i), (i, h)]
        if m.is_moe:
            ie = m.moe_intermediate_size // tp
            self.expert_gemms = [(h, 2 * ie), (ie, h)]
        # the attention roofs' constants as plain attributes (the compiled build reads them natively; a tuple's
        # floats are boxed): _decode_roof's and _prefill_roof's values
        self._pair_decode, self._attn_flops, self._kv_bytes, self._attn_bandwidth, _ = self._decode_roof()
        self._pair_prefill = self._prefill_roof()[0]
        self._head_dim_max = max(m.head_dim, m.v_head_dim)

    # ---- operator costs ----
    def _gemm(self, m_tokens: int, k: int, n: int) -> float:
        flops = 2.0 * m_tokens * k * n
        byts = k * n * self.wbytes + m_tokens * (k + n) * self.abytes
        return max(flops / self._gemm_flops, byts / self._gemm_bandwidth) + self._launch_s

    def _attention(self, shape: BatchShape) -> float:
        # (_prefill_roof's values)
        pair_prefill, flops, kv_bytes = self._pair_prefill, self._attn_flops, self._kv_bytes
        bandwidth, launch = self._attn_bandwidth, self._launch_s
        heads, head_dim, abytes = self.heads, self._head_dim_max, self.abytes
        t = 0.0
        if shape.prefill_new:
            pairs = 0.0
            kv_tokens = 0
            new_tokens = 0
            for q, c in zip(shape.prefill_new, shape.prefill_context):
                pairs += q * (c + (q + 1) / 2.0)
                kv_tokens += c + q
                new_tokens += q
            byts = kv_tokens * kv_bytes + 2 * new_tokens * heads * head_dim * abytes
            t += max(pairs * pair_prefill / flops, byts / bandwidth) + launch
        if shape.verify_new:
            # verify queries (1 + k tokens each) run as decodes: KV read once, compute for every query (absorbed
            # pairs for MLA), one kernel with the decodes in vLLM, priced as its own roof here
            pairs = 0.0
            kv_tokens = 0
            for q, c in zip(shape.verify_new, shape.verify_context):
                pairs += q * (c + (q + 1) / 2.0)
                kv_tokens += c + q
            pair_decode = self._decode_roof()[0]
            t += max(pairs * pair_decode / flops, kv_tokens * kv_bytes / bandwidth) + launch
        if shape.num_decodes:
            t += self._decode_attention_one(shape.decode_sum + shape.num_decodes)
        return t

    def _decode_attention_one(self, ctx: int) -> float:
        """:meth:`_decode_attention` of one step (``ctx`` an int, ``maximum`` the builtin max), read from plain
        attributes: the same float operations, so the same bits."""
        compute = ctx * self._pair_decode / self._attn_flops
        memory = ctx * self._kv_bytes / self._attn_bandwidth
        return max(compute, memory) + self._launch_s

    def _decode_attention(self, ctx, maximum):
        """One layer's decode attention over ``ctx`` KV tokens (Σ contexts + decodes): an int, or an int array with
        ``maximum = np.maximum``; the same float operations either way (:meth:`_decode_roof`)."""
        pair_decode, flops, kv_bytes, bandwidth, launch = self._decode_roof()
        return maximum(ctx * pair_decode / flops, ctx * kv_bytes / bandwidth) + launch

    def _decode_roof(self) -> tuple[float, float, float, float, float]:
        """(FLOPs per query/context pair, achievable FLOP/s, KV bytes per token and layer, achievable B/s, kernel
        launch s) of decode attention: absorbed MLA pairs 2·H·(2·r_kv + d_rope), else 4·H·d. Computed once (the
        efficiencies are fixed at construction, as the ``_token_terms`` cache assumes)."""
        roof = self._roof_cache
        if roof is not None:
            return roof
        e = self.eff
        m = self.model
        if m.is_mla:
            pair_decode = 2.0 * self.heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
        else:
            pair_decode = 4.0 * self.heads * m.head_dim
        roof = (pair_decode, self.attn_peak * e.attention_compute, self.kv_layer_bytes,
                self.hw.memory_bandwidth * e.attention_memory, e.kernel_launch_s)
        self._roof_cache = roof
        return roof

    def _prefill_roof(self) -> tuple[float, float, float, float, float, int, int, int]:
        """(FLOPs per query/context pair of un-absorbed prefill attention (MLA: 2·H·(d_qk + d_v), else 4·H·d),
        achievable FLOP/s, KV bytes per token and layer, achievable B/s, kernel launch s, heads per rank, the larger
        of the q/k and v head dims, activation bytes) of prefill attention; computed once, as :meth:`_decode_roof`
        is."""
        roof = self._prefill_cache
        if roof is not None:
            return roof
        m = self.model
        if m.is_mla:
            pair_prefill = 2.0 * self.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        else:
            pair_prefill = 4.0 * self.heads * m.head_dim
        _, flops, kv_bytes, bandwidth, launch = self._decode_roof()
        roof = (pair_prefill, flops, kv_bytes, bandwidth, launch, self.heads, max(m.head_dim, m.v_head_dim),
                self.abytes)
        self._prefill_cache = roof
        return roof

    def _moe(self, tokens: int) -> float:
        m = self.model
        e = self.eff
        k = m.experts_per_token
        experts = m.num_experts
        # expected distinct experts touched by `tokens` tokens choosing k of E uniformly
        active = experts * (1.0 - (1.0 - k / experts) ** tokens)
        t = 0.0
        for (kin, nout) in self.expert_gemms:
            flops = 2.0 * tokens * k * kin * nout
            byts = active * kin * nout * self.wbytes + tokens * k * (kin + nout) * self.abytes
            t += max(flops / (self.peak * e.gemm_compute), byts / (self.hw.memory_bandwidth * e.gemm_memory)) + e.kernel_launch_s
        if m.num_shared_experts:
            for (kin, nout) in self.expert_gemms:
                t += self._gemm(tokens, kin, nout * m.num_shared_experts)
        t += self._gemm(tokens, m.hidden_size, experts)  # router
        return t

    def _allreduce(self, byts: float) -> float:
        """All-reduce seconds of a ``byts``-byte buffer over the TP group (``comm.allreduce``), remembered by size:
        a step's buffers take few distinct sizes (tokens x hidden, sequences x vocabulary)."""
        if self.tp == 1:
            return 0.0
        known = self._allreduce_s.get(byts)
        if known is None:
            known = self._allreduce_s[byts] = comm.allreduce(self.link, self.tp, byts)
        return known

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """Step time split into gemm, attention, moe, elementwise, communication, head and overhead (seconds)."""
        T = shape.num_tokens
        if T == 0:
            return {"overhead": self.eff.step_overhead_s}
        out = {k: v for k, v in self._token_terms(shape.dense_tokens, shape.num_logits).items() if k != "_sum"}
        out["attention"] = self._attention(shape) * self.model.num_layers
        return out

    def _token_terms(self, T: int, S: int) -> dict[str, float]:
        """Every term that depends only on (tokens, sequences); cached."""
        key = (T, S)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        m = self.model
        e = self.eff
        h = m.hidden_size
        L = m.num_layers
        attn_gemm = 0.0  # (summed in order from zero, as sum() does: the same bits)
        for k, n in self.attn_gemms:
            attn_gemm += self._gemm(T, k, n)
        dense_mlp = 0.0
        for k, n in self.mlp_gemms:
            dense_mlp += self._gemm(T, k, n)
        n_moe = m.num_moe_layers
        moe = self._moe(T) * n_moe if n_moe else 0.0
        gemm = attn_gemm * L + dense_mlp * (L - n_moe)
        bw = self.hw.memory_bandwidth * e.elementwise_memory
        # two RMSNorms, two residual adds, rotary on q/k: ~12 passes over T x h; activation reads 2i, writes i
        width = (m.intermediate_size if not n_moe else m.moe_intermediate_size * m.experts_per_token) / self.tp
        elem = L * (T * (12 * h + 3 * width) * self.abytes / bw + 6 * e.kernel_launch_s)
        comm = 2 * L * self._allreduce(T * h * self.abytes)
        vocab = m.vocab_size // self.tp
        head = self._gemm(S, h, vocab) + T * h * self.abytes / bw + S * m.vocab_size * 4 * 3 / bw + self._allreduce(S * m.vocab_size * 4 / self.tp)
        out = {"gemm": gemm, "moe": moe, "elementwise": elem, "communication": comm, "head": head,
               "overhead": e.step_overhead_s}
        out["_sum"] = sum(out.values())
        self._cache[key] = out
        return out

    uses_decode_range = False  # decode_times prices Σ contexts and counts only
    uses_decode_list = False  # so does step_time (_attention: num_decodes, decode_sum)

    def decode_times(self, num_decodes: np.ndarray, decode_sum: np.ndarray, decode_max: np.ndarray,
                     decode_min: np.ndarray, padded: np.ndarray) -> np.ndarray:
        """Times of pure-decode steps given per step: decodes, Σ context tokens, largest and smallest context,
        CUDA-graph padded token count (0 = none). The same float operations as :meth:`step_time`, so each value
        equals it bit for bit (the fast-forward relies on it)."""
        nd = np.asarray(num_decodes, dtype=np.int64)
        n = len(nd)
        base = np.empty(n)
        # the batch (hence its padded size) changes only when a request finishes: constant over runs of steps
        terms = self._token_terms
        if nd[0] == nd[-1]:  # one batch throughout
            b = int(nd[0])
            base.fill(terms(int(padded[0]) or b, b)["_sum"])
        else:
            lo = 0
            for hi in ((nd[1:] != nd[:-1]).nonzero()[0] + 1).tolist() + [n]:
                b = int(nd[lo])
                base[lo:hi] = terms(int(padded[lo]) or b, b)["_sum"]
                lo = hi
        att = self._decode_attention(np.asarray(decode_sum, dtype=np.int64) + nd, np.maximum)
        return base + att * self.model.num_layers

    def steady_decode_times(self, num_decodes: int, decode_sum: int, decode_max: int, decode_min: int, padded: int,
                            num_steps: int) -> list[float]:
        """:meth:`decode_times` of ``num_steps`` steps of one unchanged batch (CostModelBase.steady_decode_times),
        in plain floats: the same operations, so the same bits."""
        b = num_decodes
        base = self._token_terms(padded or b, b)["_sum"]
        layers = float(self.model.num_layers)  # (a float: the compiled build multiplies natively; the same bits)
        pair_decode, flops, kv_bytes, bandwidth, launch = self._decode_roof()
        ctx = decode_sum + b  # Σ contexts + decodes at the first step; b more each step
        # _decode_attention inlined (a call per step costs as much as numpy). Both roofs grow in proportion to the
        # context (>= 1), so one is the larger at every step unless their slopes are within rounding of each other:
        # otherwise only that one is computed (the value max() would pick, bit for bit).
        ratio = (pair_decode / flops) / (kv_bytes / bandwidth)
        times: list[float] = []
        if ratio > 1.0 + 1e-9:
            for _ in range(num_steps):
                times.append(base + (ctx * pair_decode / flops + launch) * layers)
                ctx += b
        elif ratio < 1.0 - 1e-9:
            for _ in range(num_steps):
                times.append(base + (ctx * kv_bytes / bandwidth + launch) * layers)
                ctx += b
        else:
            for _ in range(num_steps):
                compute = ctx * pair_decode / flops
                memory = ctx * kv_bytes / bandwidth
                times.append(base + ((compute if compute >= memory else memory) + launch) * layers)
                ctx += b
        return times

    def step_time(self, shape: BatchShape) -> float:
        T = shape.num_tokens
        if T == 0:
            return self.eff.step_overhead_s
        return self._token_terms(shape.dense_tokens, shape.num_logits)["_sum"] + self._attention(shape) * self.model.num_layers
