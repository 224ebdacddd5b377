"""The operator cost model: a decoder step as the sum of per-operator costs, for any model architecture
(dense GQA/MHA/MQA, MLA, MoE) split over any TP x PP x EP (x attention DP), in bf16 or fp8.

For every operator the time comes from the first source that covers it:

1. a **measured table** of this GPU (lab/costmodel/tables.py), interpolated in its measured dimensions;
2. a **fitted efficiency curve** over the roofline for this GPU, operator class and dtype (lab/costmodel/fit.py,
   shipped in lab/data/costmodel_coefficients.json or given by ``coefficients``); a GPU without curves borrows
   those of its catalog ``fit_proxy`` (same silicon, e.g. H800 -> H100) with its own peaks;
3. the **plain roofline**, max(FLOPs / (peak x eff), bytes / (bandwidth x eff)) + launch latency, with the
   default efficiencies of lab/costmodel/roofline.py ``Efficiency``.

:meth:`OperatorCostModel.explain` says, for a batch shape, which source each operator used, with its FLOPs and
bytes (``servelab cost`` prints it).

One step on one GPU of the instance, L layers run one after the other (pipeline stages in sequence: the engine
runs one batch at a time, so PP adds stage-boundary transfers and divides memory, not time):

* per layer: input RMSNorm (fused residual add); attention projections (GQA: fused QKV and O; MLA: fused
  q_a/kv_a, q_b, O, with kv_b expanding the prefill context and the W_UK/W_UV absorption BMMs for decodes, or the
  measured MLA module); rotary (and Qwen3's q/k norm); attention for the batch's prefill chunks (with their
  history) and decodes; TP all-reduce; post-attention RMSNorm; then a gated MLP (gate_up, SiLU-and-mul, down) or,
  in MoE layers, the router GEMM, the fused routed experts (x ``moe_imbalance``), the shared experts and, with EP,
  the all-to-all dispatch and combine; TP all-reduce;
* per step: embedding, final norm, LM head over one position per sequence (plus a logits all-gather with TP),
  sampler, PP send/recv between stages, and a fixed CPU step overhead.

Mixed batches: prefill chunks are costed together as a uniform batch with the same number of chunks and the same
total query/key pairs (from a table of uniform batches), or chunk by chunk (from a table of chunks with history);
decodes from the mean KV length, bounded below by the longest decode alone (one long sequence cannot be spread
over the whole GPU), so the result depends on the spread and not only the mean.

With ``enforce_eager`` (no CUDA graphs) the host issues every kernel one by one: a kernel shorter than the host's
time to issue it (``cpu_launch_s``) waits for the host, so each call costs max(GPU time, kernels x cpu_launch_s).
Small kernels (norms, decode attention, the small GEMMs of a wide TP split) become host-bound first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

from lab.core.batch import BatchShape
from lab.costmodel import comm, ops
from lab.costmodel.attention import FLASHMLA_COMPUTE_EFF, FLASHMLA_MEMORY_EFF, Attention, make_attention  # noqa: F401
from lab.costmodel.backends import (check_attention_backend, check_moe_backend, default_attention_backend,
                                    default_moe_backend)
from lab.costmodel.base import CostModelBase
from lab.costmodel.features import gemm_features
from lab.costmodel.fit import Curve, CurveSet
from lab.costmodel.hardware import Hardware, fit_proxy
from lab.costmodel.model_arch import ModelArch, dtype_bytes, resolve_kv_dtype
from lab.costmodel.parallel import Parallelism
from lab.costmodel.profiles import ProfileError
from lab.costmodel.roofline import Efficiency
from lab.costmodel.tables import TableSet, load_tables


@dataclass
class OpRow:
    """One line of :meth:`OperatorCostModel.explain`: an operator's total over the step."""

    op: str
    group: str
    calls: int
    time_s: float
    source: str
    flops: float
    bytes: float


# Where an operator's calls run (``_TokOp.where``): ``(a, b, c)`` is a calls per decoder layer, b per dense-MLP layer
# and c per MoE layer; FIRST / LAST once per step on the first / last pipeline stage; BOUNDARY once per stage boundary,
# on the sending stage.
Where = tuple[int, int, int] | str
_LAYER: Where = (1, 0, 0)
_DENSE: Where = (0, 1, 0)
_MOE: Where = (0, 0, 1)
_FIRST, _LAST, _BOUNDARY = "first", "last", "boundary"


def _stage_calls(where: Where, counts: list[tuple[int, int, int]]) -> list[int]:
    """Calls of an operator placed ``where`` on each pipeline stage, given each stage's (layers, dense-MLP layers,
    MoE layers)."""
    last = len(counts) - 1
    if where == _FIRST:
        return [1] + [0] * last
    if where == _LAST:
        return [0] * last + [1]
    if where == _BOUNDARY:
        return [1] * last + [0]
    a, b, c = where
    return [a * n + b * nd + c * nm for n, nd, nm in counts]


class _TokOp:
    """An operator whose cost depends only on (tokens, sequences) of the step: ``calls`` per step in all, run
    ``where`` (see ``Where``). An expert-parallel operator (routed experts, EP all-to-all) also has ``group_fn``:
    its seconds from every DP rank's token count (``BatchShape.group_tokens``); ``fn`` is then ``group_fn`` with
    every rank at this rank's count."""

    __slots__ = ("name", "group", "calls", "fn", "work", "source", "kernels", "where", "group_fn")

    def __init__(self, name: str, group: str, calls: int, fn: Callable[[int, int], float],
                 work: Callable[[int, int], tuple[float, float]], source: str, kernels: int = 1,
                 where: Where = _LAYER, group_fn: Callable[[tuple[int, ...]], float] | None = None) -> None:
        self.name, self.group, self.calls, self.fn, self.work = name, group, calls, fn, work
        self.source, self.kernels, self.where, self.group_fn = source, kernels, where, group_fn

    def time(self, T: int, S: int, G: tuple[int, ...]) -> float:
        """Seconds of one call: from the group's per-rank tokens ``G`` when given and this op depends on them."""
        if G and self.group_fn is not None:
            return self.group_fn(G)
        return self.fn(T, S)


class OperatorCostModel(CostModelBase):
    """Per-operator step time of ``model`` on one ``hardware`` GPU with parallelism ``parallel``.

    Args:
        model: architecture.
        hardware: GPU.
        parallel: TP/PP/EP/DP split (lab/costmodel/parallel.py).
        weight_dtype: GEMM weight dtype, "bf16" or "fp8" (W8A8; block-scaled when the checkpoint is natively fp8).
        kv_dtype: KV-cache dtype, "bf16" or "fp8".
        tables: measured tables of this GPU, or None.
        curves: fitted curves (any GPUs), or None for none.
        efficiency: plain-roofline efficiencies and latencies (also ``step_overhead_s``).
        link_bandwidth: overrides the NCCL bus bandwidth of the links below, B/s (``hardware.link_gbps``).
        link_latency_s: overrides the NCCL latency of the links below, seconds (None: the link's own).
        links: (TP link, EP link, PP link) of lab/costmodel/comm.py; default: the catalog's link for the GPUs each
            group spans (``comm.group_link``: a group larger than a node runs on the inter-node link). Collectives
            without a measured table or fitted curve are priced by comm.py.
        all2all_backend: vLLM ``--all2all-backend`` for EP dispatch/combine, one of ``comm.EP_BACKENDS``
            (default vLLM's, "allgather_reducescatter"); priced by ``comm.ep_dispatch_combine``.
        moe_imbalance: multiplies the routed-expert time (busiest GPU / mean; 1 = balanced routing).
        enforce_eager: no CUDA graphs: each call costs at least ``kernels x cpu_launch_s``.
        cpu_launch_s: host time to issue one kernel in eager mode.
        attention_backend: vLLM's attention back-end (lab/costmodel/backends.py ``ATTENTION_BACKENDS``); None: the
            one vLLM 0.33 picks for this GPU and model. Priced by lab/costmodel/attention.py.
        moe_backend: vLLM's fused-MoE back-end (``backends.MOE_BACKENDS``); None: vLLM 0.33's choice. Priced by
            lab/costmodel/moe_backends.py.
    """

    name = "operator"

    def __init__(self, model: ModelArch, hardware: Hardware, parallel: Parallelism | None = None,
                 weight_dtype: str = "bf16", kv_dtype: str = "bf16", tables: TableSet | None = None,
                 curves: CurveSet | None = None, efficiency: Efficiency | None = None,
                 link_bandwidth: float | None = None, link_latency_s: float | None = None,
                 moe_imbalance: float = 1.0, enforce_eager: bool = False, cpu_launch_s: float = 6e-6,
                 links: tuple[comm.LinkSpec, comm.LinkSpec, comm.LinkSpec] | None = None,
                 all2all_backend: str = comm.DEFAULT_EP_BACKEND, attention_backend: str | None = None,
                 moe_backend: str | None = None) -> None:
        self.model = model
        self.hw = hardware
        self.par = parallel or Parallelism()
        self.par.stage_layers(model.num_layers)
        if weight_dtype not in ("bf16", "fp16", "fp8"):
            raise ValueError(f"weight dtype {weight_dtype!r}: expected bf16, fp16 or fp8")
        self.wdtype = "fp8" if weight_dtype == "fp8" else "bf16"
        self.kvdtype = "fp8" if kv_dtype.startswith("fp8") else "bf16"
        self.gemm_variant = ("fp8_block" if model.weight_dtype == "fp8" else "fp8") if self.wdtype == "fp8" else "bf16"
        self.wb = dtype_bytes(self.wdtype)
        self.tables = tables
        self.curves = curves
        self.eff = efficiency or Efficiency()
        p0 = self.par
        if links is None:
            links = (comm.group_link(hardware.name, p0.tp), comm.group_link(hardware.name, p0.ep),
                     comm.group_link(hardware.name, p0.tp * p0.pp))
        if link_bandwidth:
            links = tuple(lk.with_bandwidth(link_bandwidth) for lk in links)  # type: ignore[assignment]
        if link_latency_s is not None:
            links = tuple(lk.with_latency(link_latency_s) for lk in links)  # type: ignore[assignment]
        self.tp_link, self.ep_link, self.pp_link = links
        if all2all_backend not in comm.EP_BACKENDS:
            raise ValueError(f"all2all_backend {all2all_backend!r}: expected one of {', '.join(comm.EP_BACKENDS)}")
        self.all2all_backend = all2all_backend
        if moe_imbalance < 1.0:
            raise ValueError(f"moe_imbalance must be >= 1, got {moe_imbalance}")
        self.moe_imbalance = moe_imbalance
        self.enforce_eager = enforce_eager
        self.cpu_launch_s = cpu_launch_s
        self.attention_backend = attention_backend or default_attention_backend(model.is_mla, hardware)
        check_attention_backend(self.attention_backend, model.is_mla, hardware, model.name)
        self.moe_backend = moe_backend or default_moe_backend(self.gemm_variant, hardware)
        if model.is_moe:
            check_moe_backend(self.moe_backend, self.gemm_variant, hardware)
        self.proxy = fit_proxy(hardware.name)
        m, p = model, self.par
        self.L = m.num_layers
        self.L_moe = m.num_moe_layers
        self.L_dense = self.L - self.L_moe
        self.heads = max(1, m.num_heads // p.tp)
        self.kv_heads = max(1, m.num_kv_heads // p.tp)
        self.kv_tok = m.kv_bytes_per_token_per_layer(self.kvdtype, p.tp)
        self._cache: dict[tuple[int, int, tuple[int, ...]], tuple[float, float, dict[str, float]]] = {}
        self._stage_counts_cache: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
        self._stage_cache: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], list[float]] = {}
        # fitted attention-core curves; set by the attention strategy when no table covers the core
        self.pre_curve: Curve | None = None
        self.dec_curve: Curve | None = None
        self.attn: Attention
        self._build()

    # the attention strategy's facts, as the model exposed them before the strategies (tests, servelab cost)
    @property
    def mla_mode(self) -> str | None:
        """``module-table``, ``module-fit`` or ``decomposed`` for MLA; None for standard attention."""
        return self.attn.mla_mode

    @property
    def pre_src(self) -> str:
        return self.attn.pre_src

    @property
    def dec_src(self) -> str:
        return self.attn.dec_src

    # ------------------------------------------------------------------------------------------ sources
    def _curve(self, cls: str, variant: str) -> tuple[Curve | None, str]:
        if self.curves is None:
            return None, ""
        c = self.curves.get(self.hw.name, cls, variant)
        if c is not None:
            return c, f"fit:{self.hw.name}/{cls}/{variant}"
        if self.proxy:
            c = self.curves.get(self.proxy.name, cls, variant)
            if c is not None:
                scale_p = self.hw.link_bandwidth if cls in ("allreduce", "sendrecv") else self.hw.memory_bandwidth
                c = replace(c, peak_flops=c.peak_flops * self.hw.peak_flops(variant.split("/")[0]) /
                            self.proxy.peak_flops(variant.split("/")[0]) if c.peak_flops > 1 else c.peak_flops,
                            bandwidth=scale_p)
                return c, f"fit:{self.proxy.name}/{cls}/{variant} (proxy for {self.hw.name})"
        return None, ""

    def _roof(self, flops: float, byts: float, ce: float, me: float, peak: float | None = None) -> float:
        p = peak or self.hw.peak_flops(self.wdtype)
        return max(flops / (p * ce), byts / (self.hw.memory_bandwidth * me)) + self.eff.kernel_launch_s

    # ------------------------------------------------------------------------------------------ builders
    def _gemm_fn(self, n: int, k: int, dtype: str | None = None):
        """(fn(m) -> s, work(m) -> (F, B), source) for a weight GEMM with n outputs and k inputs."""
        variant = dtype or self.gemm_variant
        wb = 1.0 if variant.startswith("fp8") else 2.0

        def work(m: float) -> tuple[float, float]:
            return ops.gemm(m, n, k, wb, wb)

        if self.tables is not None:
            f, src = self.tables.gemm(variant, n, k)
            if f is not None:
                return (lambda m: f(m) if m > 0 else 0.0), work, f"table:{src}"
        c, src = self._curve("gemm", variant)
        if c is not None:
            sms = self.hw.num_sms

            def fc(m: float) -> float:
                if m <= 0:
                    return 0.0
                F, B = ops.gemm(m, n, k, wb, wb)
                return c.time(F, B, gemm_features(m, n, k, B, sms))
            return fc, work, src
        peak = self.hw.peak_flops(variant)
        e = self.eff

        def fr(m: float) -> float:
            if m <= 0:
                return 0.0
            F, B = ops.gemm(m, n, k, wb, wb)
            return self._roof(F, B, e.gemm_compute, e.gemm_memory, peak)
        return fr, work, "roofline"

    def _elem_fn(self, kind: str):
        """(fn(bytes) -> s, source) for an elementwise kernel of a kind (norm, rope, act, embedding, sampler)."""
        c, src = self._curve("elementwise", kind)
        if c is not None:
            return (lambda b: c.time(0.0, b, {"bytes": b}) if b > 0 else 0.0), src
        bw = self.hw.memory_bandwidth * self.eff.elementwise_memory
        launch = self.eff.kernel_launch_s
        return (lambda b: b / bw + launch if b > 0 else 0.0), "roofline"

    def _allreduce_fn(self, n: int):
        """(fn(bytes) -> s, source) for an all-reduce over n GPUs (bytes = the buffer)."""
        if n <= 1:
            return (lambda b: 0.0), "none"
        if self.tables is not None:
            f, src = self.tables.allreduce(n)
            if f is not None:
                return (lambda b: f(b) if b > 0 else 0.0), f"table:{src}"
        for backend in ("graph", "nccl"):
            c, src = self._curve("allreduce", f"{backend}/{n}")
            if c is not None:
                return (lambda b: c.time(0.0, ops.allreduce_bytes(b, n), {"bytes": b}) if b > 0 else 0.0), src
        link = self.tp_link
        return (lambda b: comm.allreduce(link, n, b)), f"comm:{link.name}"

    def _sendrecv_fn(self):
        if self.tables is not None:
            f, src = self.tables.sendrecv()
            if f is not None:
                return f, f"table:{src}"
        c, src = self._curve("sendrecv", "all")
        if c is not None:
            return (lambda b: c.time(0.0, b, {"bytes": b})), src
        link = self.pp_link
        return (lambda b: comm.sendrecv(link, b)), f"comm:{link.name}"

    def _stage_counts(self, stage_layers: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """(layers, dense-MLP layers, MoE layers) on each pipeline stage; the dense layers are the first ones
        (``first_k_dense_replace``), as in the checkpoint."""
        hit = self._stage_counts_cache.get(stage_layers)
        if hit is not None:
            return hit
        out, start = [], 0
        for n in stage_layers:
            nd = max(0, min(n, self.L_dense - start))
            out.append((n, nd, n - nd))
            start += n
        self._stage_counts_cache[stage_layers] = out
        return out

    def _calls(self, where: Where) -> int:
        """Calls per step of an operator placed ``where``: the sum of its calls on every stage."""
        return sum(_stage_calls(where, self._stage_counts(tuple(self.par.stage_layers(self.L)))))

    def _build(self) -> None:
        m, p = self.model, self.par
        h = m.hidden_size
        tok: list[_TokOp] = []
        self.tok_ops = tok

        def add_gemm(name: str, n: int, k: int, where: Where, group: str = "gemm", dtype: str | None = None,
                     m_of: Callable[[int, int], float] = lambda T, S: T) -> None:
            calls = self._calls(where)
            if calls <= 0 or n <= 0 or k <= 0:
                return
            fn, work, src = self._gemm_fn(n, k, dtype)
            tok.append(_TokOp(name, group, calls, lambda T, S, fn=fn: fn(m_of(T, S)),
                              lambda T, S, work=work: work(m_of(T, S)), src, where=where))

        def add_elem(name: str, kind: str, bytes_per_token: float, where: Where, per: str = "T") -> None:
            calls = self._calls(where)
            if calls <= 0 or bytes_per_token <= 0:
                return
            fn, src = self._elem_fn(kind)
            if per == "T":
                tok.append(_TokOp(name, "elementwise", calls, lambda T, S: fn(T * bytes_per_token),
                                  lambda T, S: (0.0, T * bytes_per_token), src, where=where))
            else:
                tok.append(_TokOp(name, "head", calls, lambda T, S: fn(S * bytes_per_token),
                                  lambda T, S: (0.0, S * bytes_per_token), src, where=where))

        # ---- attention block (per layer, token-dependent part)
        add_elem("norms", "norm", 8 * h, (2, 0, 0))  # input and post-attention fused add+RMSNorm
        self.attn_calls = self.L
        # the attention kind, source and back-end (lab/costmodel/attention.py), with its projection operators (none
        # for an MLA module measured whole)
        self.attn = make_attention(self, self.attention_backend, add_gemm, add_elem)
        ar, ar_src = self._allreduce_fn(p.tp)
        ar_where = (1, 1, 1 if p.ep == 1 else 0)  # after attention; after the MLP unless EP combines it
        if p.tp > 1:
            tok.append(_TokOp("allreduce", "communication", self._calls(ar_where), lambda T, S: ar(T * h * 2),
                              lambda T, S: (0.0, ops.allreduce_bytes(T * h * 2, p.tp)), ar_src, where=ar_where))
        # ---- dense MLP layers
        i_r = m.intermediate_size // p.tp
        add_gemm("gate_up_proj", 2 * i_r, h, _DENSE)
        add_elem("act", "act", 6 * i_r, _DENSE)
        add_gemm("down_proj", h, i_r, _DENSE)
        # ---- MoE layers
        if self.L_moe:
            self._setup_moe(add_gemm, add_elem)
        # ---- per step
        add_elem("embedding", "embedding", 4 * h, _FIRST)
        add_elem("final_norm", "norm", 4 * h, _LAST)
        vocab = m.vocab_size // p.tp
        add_gemm("lm_head", vocab, h, _LAST, group="head", dtype="bf16", m_of=lambda T, S: S)
        if p.tp > 1:
            tok.append(_TokOp("logits_gather", "communication", 1, lambda T, S: ar(S * m.vocab_size),
                              lambda T, S: (0.0, S * m.vocab_size * 2.0), ar_src, where=_LAST))
        add_elem("sampler", "sampler", m.vocab_size * 4 * 3, _LAST, per="S")
        if p.pp > 1:
            sr, sr_src = self._sendrecv_fn()
            tok.append(_TokOp("pp_sendrecv", "communication", self._calls(_BOUNDARY), lambda T, S: sr(T * h * 2),
                              lambda T, S: (0.0, T * h * 2.0), sr_src, where=_BOUNDARY))

    def _setup_moe(self, add_gemm, add_elem) -> None:
        m, p = self.model, self.par
        h, E, k = m.hidden_size, m.num_experts, m.experts_per_token
        i_full = m.moe_intermediate_size
        i_r = i_full // p.moe_tp
        dp = p.dp if p.ep > 1 else 1
        add_gemm("router", E, h, _MOE, group="moe", dtype="bf16")
        wb = 1.0 if self.wdtype == "fp8" else 2.0
        from lab.costmodel.moe_backends import make_moe_experts  # noqa: PLC0415 - the operator model's own layer

        self.moe = make_moe_experts(self, self.moe_backend)
        fn, src = self.moe.time, self.moe.source
        imb = self.moe_imbalance

        def experts_of_group(G: tuple[int, ...]) -> float:
            total = sum(G)  # every DP rank's tokens enter the EP group's MoE block
            return imb * fn(total) if total > 0 else 0.0
        self.tok_ops.append(_TokOp("moe_experts", "moe", self._calls(_MOE),
                                   lambda T, S: imb * fn(T * dp) if T > 0 else 0.0,
                                   lambda T, S: ops.moe_experts(T * dp, h, i_r, k, E, p.ep, wb, wb), src, kernels=6,
                                   where=_MOE, group_fn=experts_of_group if p.ep > 1 else None))
        if m.num_shared_experts:
            i_s = m.num_shared_experts * i_full // p.tp
            add_gemm("shared_gate_up", 2 * i_s, h, _MOE, group="moe")
            add_elem("shared_act", "act", 6 * i_s, _MOE)
            add_gemm("shared_down", h, i_s, _MOE, group="moe")
        if p.ep > 1:
            disp_b = 1.0 if self.wdtype == "fp8" else 2.0
            link, backend = self.ep_link, self.all2all_backend
            per_token = self._ep_rows_per_token(backend) * h * (disp_b + 2.0)

            def a2a_of_group(G: tuple[int, ...]) -> float:
                return comm.ep_dispatch_combine(link, self._ep_gpu_tokens(G), h, k, disp_b, backend)
            self.tok_ops.append(_TokOp("ep_alltoall", "communication", self._calls(_MOE),
                                       lambda T, S: a2a_of_group((T,) * p.dp),
                                       lambda T, S: (0.0, T * per_token),
                                       f"comm:{link.name} [{backend}]", kernels=2, where=_MOE,
                                       group_fn=a2a_of_group))

    def _ep_gpu_tokens(self, G: tuple[int, ...]) -> tuple[int, ...]:
        """Tokens on each GPU of the collective, from the DP ranks' counts ``G``: the all-gather backends run over
        the DP group (one GPU per rank and TP index, vLLM's ``get_dp_group()``); the dispatch-combine backends over
        all ``ep = tp x dp`` GPUs, each GPU of a DP rank carrying its rank's tokens (as after the TP all-reduce;
        vLLM's sequence-parallel MoE split is not modelled)."""
        if self.all2all_backend in ("allgather_reducescatter", "naive") or self.par.tp == 1:
            return G
        return tuple(g for g in G for _ in range(self.par.tp))

    def _ep_rows_per_token(self, backend: str) -> float:
        """Rows one of this GPU's tokens puts on the link per direction, every rank at the same count (for
        ``explain``'s bytes): the other DP ranks' copies for the all-gather backends, the expected remote GPUs
        (DeepEP high-throughput) or remote (token, expert) pairs (DeepEP low-latency)."""
        p, k = self.par, self.model.experts_per_token
        if backend in ("allgather_reducescatter", "naive"):
            return float(p.dp - 1)
        if backend == "deepep_high_throughput":
            return ops.expected_remote_ranks(k, p.ep)
        return k * (p.ep - 1) / p.ep

    # ------------------------------------------------------------------------------------------ attention
    def _attention_layer(self, shape: BatchShape) -> tuple[float, float]:
        """(prefill part, decode part) seconds of one layer's attention (with MLA module tables: the module)."""
        return self.attn.layer(shape)

    def _attention_work(self, shape: BatchShape) -> tuple[tuple[float, float], tuple[float, float]]:
        return self.attn.work(shape)

    def _decode(self, nd: int, ctx_sum: int, ctx_max: int) -> float:
        return self.attn.decode(nd, ctx_sum, ctx_max)

    # ------------------------------------------------------------------------------------------ step
    def _group(self, shape: BatchShape) -> tuple[int, ...]:
        """The DP ranks' token counts the EP operators are priced from: ``shape.group_tokens`` in a lock-step group
        with EP, () otherwise or when every rank runs this rank's count (the uniform case ``fn`` prices).

        Raises:
            ValueError: ``group_tokens`` does not hold one count per DP rank.
        """
        G = shape.group_tokens
        if not G or self.par.ep == 1:
            return ()
        if len(G) != self.par.dp:
            raise ValueError(f"group_tokens holds {len(G)} ranks' counts; this cost model's DP group has "
                             f"{self.par.dp} ranks (hardware.data_parallel_size)")
        T = shape.dense_tokens
        return () if all(g == T for g in G) else tuple(G)

    def _token_terms(self, T: int, S: int, G: tuple[int, ...] = ()) -> tuple[float, float, dict[str, float]]:
        """(GPU seconds, eager host-bound extra seconds, seconds per operator) of the token-only operators; ``G``:
        the DP ranks' token counts for the EP operators (() = every rank at ``T``)."""
        key = (T, S, G)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        parts: dict[str, float] = {}
        extra = 0.0
        floor = self.cpu_launch_s if self.enforce_eager else 0.0
        for op in self.tok_ops:
            t = op.time(T, S, G)
            if floor and t < op.kernels * floor:
                extra += (op.kernels * floor - t) * op.calls
            parts[op.name] = parts.get(op.name, 0.0) + t * op.calls
        out = (sum(parts.values()), extra, parts)
        self._cache[key] = out
        return out

    def _attn_extra(self, pre: float, dec: float) -> float:
        """Eager host-bound extra of one layer's attention kernels (one per part present)."""
        if not self.enforce_eager:
            return 0.0
        f = self.cpu_launch_s
        return (max(0.0, f - pre) if pre else 0.0) + (max(0.0, f - dec) if dec else 0.0)

    def step_time(self, shape: BatchShape) -> float:
        if shape.num_tokens == 0:
            return self.eff.step_overhead_s
        tok, extra, _ = self._token_terms(shape.dense_tokens, shape.num_logits, self._group(shape))
        pre, dec = self._attention_layer(shape)
        t = tok + (pre + dec) * self.attn_calls + self.eff.step_overhead_s
        if self.enforce_eager:
            t += extra + self._attn_extra(pre, dec) * self.attn_calls
        return t

    def _stage_token_terms(self, T: int, S: int, stage_layers: tuple[int, ...],
                           G: tuple[int, ...] = ()) -> list[float]:
        """Seconds of the token-only operators (with the eager host-bound extra) on each pipeline stage; cached."""
        key = (T, S, stage_layers, G)
        hit = self._stage_cache.get(key)
        if hit is not None:
            return hit
        counts = self._stage_counts(stage_layers)
        out = [0.0] * len(stage_layers)
        floor = self.cpu_launch_s if self.enforce_eager else 0.0
        for op in self.tok_ops:
            t = op.time(T, S, G)
            if floor and t < op.kernels * floor:
                t = op.kernels * floor
            for s, calls in enumerate(_stage_calls(op.where, counts)):
                if calls:
                    out[s] += t * calls
        self._stage_cache[key] = out
        return out

    def stage_times(self, shape: BatchShape, stage_layers: Sequence[int]) -> list[float]:
        """Seconds each pipeline stage spends on this micro-batch, stage order; they sum to :meth:`step_time` (up
        to float rounding).

        Every per-layer operator (norms, projections, attention, MLP or MoE, TP all-reduces) runs on the stage
        that holds its layer, dense-MLP and MoE layers counted apart (the dense ones come first); the embedding runs
        on the first stage, the final norm, LM head (and its logits gather) and sampler on the last; the PP
        send/recv runs once per stage boundary, on the sending stage; the fixed step overhead (CPU) is on the first
        stage, where the engine adds its own CPU time. One stage returns the step time itself.

        Raises:
            ValueError: ``stage_layers`` does not split this model's layers over its ``pp`` stages.
        """
        if len(stage_layers) == 1:
            return [self.step_time(shape)]
        layers = tuple(stage_layers)
        if len(layers) != self.par.pp or sum(layers) != self.L:
            raise ValueError(f"stage_times: stage layers {list(layers)} do not split {self.model.name}'s {self.L} "
                             f"layers over the {self.par.pp} pipeline stages this cost model was built for")
        if shape.num_tokens == 0:
            return [self.eff.step_overhead_s] + [0.0] * (len(layers) - 1)
        out = list(self._stage_token_terms(shape.dense_tokens, shape.num_logits, layers, self._group(shape)))
        pre, dec = self._attention_layer(shape)
        attn = pre + dec
        if self.enforce_eager:
            attn += self._attn_extra(pre, dec)
        for s, (n, _, _) in enumerate(self._stage_counts(layers)):
            out[s] += attn * n
        out[0] += self.eff.step_overhead_s
        return out

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """Seconds per operator over the whole step (all layers), plus ``overhead`` and, in eager mode,
        ``host_launch_bound`` (time kernels wait for the host to issue them); sums to :meth:`step_time`."""
        if shape.num_tokens == 0:
            return {"overhead": self.eff.step_overhead_s}
        tok, extra, parts = self._token_terms(shape.dense_tokens, shape.num_logits, self._group(shape))
        pre, dec = self._attention_layer(shape)
        out = dict(parts)
        key = self.attn.label
        out[f"{key}_prefill"] = pre * self.attn_calls
        out[f"{key}_decode"] = dec * self.attn_calls
        if self.enforce_eager:
            out["host_launch_bound"] = extra + self._attn_extra(pre, dec) * self.attn_calls
        out["overhead"] = self.eff.step_overhead_s
        return out

    def op_calls(self, shape: BatchShape) -> list[tuple[float, int, int]]:
        """(GPU seconds per call, calls, kernels per call) of every operator of the step, for fitting host
        overheads (lab/costmodel/checks.py)."""
        T, S, G = shape.dense_tokens, shape.num_logits, self._group(shape)
        rows = [(op.time(T, S, G), op.calls, op.kernels) for op in self.tok_ops]
        pre, dec = self._attention_layer(shape)
        if pre:
            rows.append((pre, self.attn_calls, 1))
        if dec:
            rows.append((dec, self.attn_calls, 1))
        return rows

    def explain(self, shape: BatchShape) -> list[OpRow]:
        """Every operator of the step with its calls, total time, source, FLOPs and bytes (summed over calls)."""
        T, S, G = shape.dense_tokens, shape.num_logits, self._group(shape)
        rows: list[OpRow] = []
        if T == 0:
            return [OpRow("overhead", "overhead", 1, self.eff.step_overhead_s, "config", 0.0, 0.0)]
        tok, extra, parts = self._token_terms(T, S, G)
        for op in self.tok_ops:
            f, b = op.work(T, S)
            rows.append(OpRow(op.name, op.group, op.calls, op.time(T, S, G) * op.calls, op.source, f * op.calls,
                              b * op.calls))
        pre, dec = self._attention_layer(shape)
        (Fp, Bp), (Fd, Bd) = self._attention_work(shape)
        name = self.attn.label
        n = self.attn_calls
        if shape.prefill_new or shape.verify_new:
            rows.append(OpRow(f"{name}_prefill", "attention", n, pre * n, str(self.pre_src), Fp * n, Bp * n))
        if shape.num_decodes:
            rows.append(OpRow(f"{name}_decode", "attention", n, dec * n, str(self.dec_src), Fd * n, Bd * n))
        if self.enforce_eager:
            rows.append(OpRow("host_launch_bound", "overhead", 1, extra + self._attn_extra(pre, dec) * self.attn_calls,
                              f"eager: {self.cpu_launch_s * 1e6:.1f} us per kernel launch", 0.0, 0.0))
        rows.append(OpRow("overhead", "overhead", 1, self.eff.step_overhead_s, "step_overhead_s", 0.0, 0.0))
        return rows


def load_curves(path=None) -> CurveSet:
    """The fitted coefficients: ``path`` or the file the project ships (lab/data/costmodel_coefficients.json).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a coefficients file.
    """
    if path is None:
        res = resources.files("lab").joinpath("data/costmodel_coefficients.json")
        if not res.is_file():
            return CurveSet()
        return CurveSet.from_json(json.loads(res.read_text()), "lab/data/costmodel_coefficients.json")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"cost_model.coefficients: {p} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"cost_model.coefficients: {p} is not JSON: {e}") from None
    return CurveSet.from_json(data, str(p))


def build_operator_cost_model(exp, model: ModelArch, hw: Hardware,
                              parallel: Parallelism | None = None) -> OperatorCostModel:
    """The operator cost model an experiment asks for (``cost_model.kind: operator``); ``parallel`` overrides the
    experiment's parallelism (a speculative drafter runs unsplit by PP).

    Raises:
        FileNotFoundError / ValueError: a missing table folder or coefficients file, or a bad parallelism.
    """
    c = exp.cost_model
    h = exp.hardware
    par = parallel or Parallelism(h.tensor_parallel_size, h.pipeline_parallel_size, h.expert_parallel_size,
                                  h.data_parallel_size)
    tables = None
    if c.tables:
        paths = [exp.path(t, f"cost_model.tables[{i}]") for i, t in enumerate(c.tables)]
        for p in paths:
            if not p.exists():
                raise FileNotFoundError(f"cost_model.tables: {p} does not exist")
        try:
            tables = TableSet(load_tables(paths), hw.name)
        except ProfileError as e:
            raise ValueError(f"cost_model.tables: {e}") from None
    curves = load_curves(exp.path(c.coefficients, "cost_model.coefficients") if c.coefficients else None)
    over = {k: v for k, v in c.efficiency.model_dump().items() if v is not None}
    kv_dtype = resolve_kv_dtype(exp.model.dtype, exp.model.kv_cache_dtype)
    link = (h.link_gbps * 1e9) if h.link_gbps else None
    latency = h.link_latency_us * 1e-6 if "link_latency_us" in h.model_fields_set else None
    attention, moe = kernel_backends(exp, model, hw)
    return OperatorCostModel(model, hw, par, weight_dtype=exp.model.dtype, kv_dtype=kv_dtype, tables=tables,
                             curves=curves, efficiency=Efficiency(**over), link_bandwidth=link,
                             link_latency_s=latency, moe_imbalance=c.moe_imbalance,
                             enforce_eager=not exp.engine.cudagraph, cpu_launch_s=c.cpu_launch_us * 1e-6,
                             all2all_backend=h.all2all_backend, attention_backend=attention, moe_backend=moe)


def weight_variant(model: ModelArch, weight_dtype: str) -> str:
    """The GEMM weight format: "bf16", "fp8" (per-tensor W8A8) or "fp8_block" (a natively fp8 checkpoint)."""
    if weight_dtype != "fp8":
        return "bf16"
    return "fp8_block" if model.weight_dtype == "fp8" else "fp8"


def kernel_backends(exp, model: ModelArch, hw: Hardware) -> tuple[str, str]:
    """(attention back-end, MoE back-end) of an experiment: ``engine.attention_backend`` / ``engine.moe_backend``,
    else what vLLM of ``engine.vllm_version`` picks for the GPU and model (lab/costmodel/backends.py).

    Raises:
        ValueError: a back-end vLLM refuses for this model or GPU (one line naming the field).
    """
    e = exp.engine
    version = e.vllm_version
    attention = e.attention_backend or default_attention_backend(model.is_mla, hw, version)
    variant = weight_variant(model, exp.model.dtype)
    moe = e.moe_backend or default_moe_backend(variant, hw, version)
    check_attention_backend(attention, model.is_mla, hw, model.name)
    if model.is_moe:
        check_moe_backend(moe, variant, hw)
    return attention, moe
