"""Model architecture facts (from the project's catalog or a Hugging Face config.json) and what follows from them:
parameter counts, per-layer GEMM shapes, KV-cache bytes per token.

Formulas: a GQA/MHA layer holds q (h x H·d), k and v (h x Hkv·d each) and o (H·d x h) projections; an MLA layer
(DeepSeek-V2/V3) holds q_a (h x r_q), q_b (r_q x H·(d_nope+d_rope)), kv_a (h x (r_kv+d_rope)), kv_b
(r_kv x H·(d_nope+d_v)) and o (H·d_v x h); a gated MLP holds gate+up (h x 2i) and down (i x h); a MoE layer holds E
routed experts and S shared experts of the gated form with width i_moe, plus a router (h x E). KV per token per
layer: 2·Hkv·d elements (GQA) or r_kv + d_rope elements (MLA latent cache, shared by all heads).

Hybrid models (docs/hybrid_models.md) list a mixer per layer in ``layer_types``: ``full_attention``,
``sliding_attention`` (``sliding_window`` tokens), ``chunked_attention`` (``attention_chunk_size``),
``linear_attention`` (Gated DeltaNet: ``linear_*`` fields) or ``mamba`` (Mamba-2: ``mamba_*`` fields). Only the
attention layers keep per-token KV; a linear-attention or Mamba layer keeps one recurrent state per request (a
short-convolution state and an SSM state, :meth:`ModelArch.mamba_state_shapes`). A GDN layer holds in_proj_qkvz
(h x (2·nk·dk + 2·nv·dv)), in_proj_ba (h x 2·nv), a depthwise conv over 2·nk·dk + nv·dv channels and out_proj
(nv·dv x h); a Mamba-2 layer in_proj (h x (2·d_inner + 2·g·N + H)), a conv over d_inner + 2·g·N channels and
out_proj (d_inner x h) (vLLM gdn_linear_attn.py / mamba_mixer2.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from lab.costmodel.catalog import read_catalog
from lab.costmodel.parallel import Parallelism

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "int8": 1, "fp32": 4,
               "auto": 2}
DTYPE_BYTES["float32"] = 4

# Bytes per weight of a block-scaled 4-bit format: MXFP4 (OCP microscaling: 32 FP4 values share one 8-bit scale,
# 4.25 bits a weight), the format of gpt-oss's MoE experts (HF quantization_config.quant_method "mxfp4").
MXFP4_BYTES = 17 / 32

# The mixer kinds a layer may have (``ModelArch.layer_types``); the first three keep per-token KV.
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
STATE_KINDS = ("linear_attention", "mamba")
LAYER_KINDS = ATTENTION_KINDS + STATE_KINDS


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name.

    Raises:
        ValueError: for an unknown dtype name.
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def resolve_kv_dtype(model_dtype: str, kv_cache_dtype: str) -> str:
    """The KV-cache dtype a deployment actually stores: ``kv_cache_dtype``, or the model's dtype when it is
    ``"auto"`` (vLLM's ``--kv-cache-dtype auto``: the cache takes the model's dtype).

    Args:
        model_dtype: the model's (weight) dtype as configured, e.g. "bf16" or "fp8".
        kv_cache_dtype: the configured KV-cache dtype: "auto" or an explicit dtype name.

    Example: ``resolve_kv_dtype("fp8", "auto") == "fp8"``; ``resolve_kv_dtype("fp8", "bf16") == "bf16"``.
    """
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


@dataclass(frozen=True)
class ModelArch:
    """Architecture of a decoder-only transformer, in Hugging Face config names.

    Attributes are element counts (not bytes). ``is_mla`` is true when ``kv_lora_rank`` is set; ``is_moe`` when
    the model has routed experts.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_layers: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_mtp_layers: int = 0
    weight_dtype: str = "bf16"
    qk_norm: bool = False
    # ---- hybrid models (empty layer_types: every layer full attention) ----
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    attention_chunk_size: int = 0
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also produces a sigmoid gate on the attention output
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head (no KV, no cache)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_num_groups: int = 0
    mamba_conv_kernel: int = 0
    mamba_intermediate_size: int = 0
    mamba_chunk_size: int = 0
    mamba_ssm_dtype: str = ""  # "" = the model's dtype (vLLM mamba_ssm_cache_dtype "auto")
    moe_weight_dtype: str = ""  # "mxfp4": the routed experts' format; "" = weight_dtype

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_hybrid(self) -> bool:
        """Some layer is not full attention (sliding window, chunked, linear attention or Mamba)."""
        return any(t != "full_attention" for t in self.layer_types)

    def layer_kinds(self) -> tuple[str, ...]:
        """Every layer's mixer kind (``full_attention`` throughout for a model without ``layer_types``)."""
        return self.layer_types or ("full_attention",) * self.num_layers

    def count_layers(self, *kinds: str) -> int:
        """Layers whose mixer is one of ``kinds``."""
        if not self.layer_types:
            return self.num_layers if "full_attention" in kinds else 0
        return sum(1 for t in self.layer_types if t in kinds)

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep per-token KV (full, sliding-window and chunked attention)."""
        return self.count_layers(*ATTENTION_KINDS)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a GDN layer's short convolution (q, k and v): 2·nk·dk + nv·dv."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def mamba_state_shapes(self, kind: str, tp: int = 1, num_spec: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, SSM state shape) of one ``kind`` layer on one TP rank, as vLLM's
        ``MambaStateShapeCalculator`` sizes them (vllm/model_executor/layers/mamba/mamba_utils.py):

        - ``mamba`` (Mamba-2): conv (d_conv - 1, (d_inner + 2·g'·N) / tp), SSM (H / tp, P, N), where g' is the
          groups rounded up so every rank holds the groups of its heads (g + tp - g when tp does not divide g);
        - ``linear_attention`` (Gated DeltaNet): conv ((2·nk·dk + nv·dv) / tp, kernel - 1 + num_spec), SSM
          (nv / tp, dk, dv); speculative decoding widens the conv state by its draft tokens.
        """
        if kind == "mamba":
            g = self.mamba_num_groups
            g += 0 if g % tp == 0 else tp - g
            conv_dim = self.mamba_intermediate_size + 2 * g * self.mamba_state_size
            return ((self.mamba_conv_kernel - 1, conv_dim // tp),
                    (max(1, self.mamba_num_heads // tp), self.mamba_head_dim, self.mamba_state_size))
        if kind == "linear_attention":
            return ((self.linear_conv_dim // tp, self.linear_conv_kernel_dim - 1 + num_spec),
                    (max(1, self.linear_num_value_heads // tp), self.linear_key_head_dim, self.linear_value_head_dim))
        raise ValueError(f"{kind!r} layers keep no recurrent state")

    def state_bytes_per_layer(self, kind: str, tp: int = 1, conv_dtype: str = "bf16", num_spec: int = 0) -> int:
        """Bytes of one request's recurrent state in one ``kind`` layer on one rank (vLLM ``MambaSpec``'s unpadded
        page): the conv state in ``conv_dtype`` (the model's dtype) plus the SSM state in ``mamba_ssm_dtype``
        (the model's dtype unless the config names one, e.g. float32 for Qwen3.5)."""
        conv, ssm = self.mamba_state_shapes(kind, tp, num_spec)
        cb = dtype_bytes(conv_dtype)
        sb = dtype_bytes(self.mamba_ssm_dtype) if self.mamba_ssm_dtype else cb
        n_conv = 1
        for x in conv:
            n_conv *= x
        n_ssm = 1
        for x in ssm:
            n_ssm *= x
        return n_conv * cb + n_ssm * sb

    def mixer_params(self, kind: str) -> int:
        """Weights of one layer's mixer (attention or recurrent), whole model (no TP split)."""
        h = self.hidden_size
        if kind in ATTENTION_KINDS:
            gate = h * self.num_heads * self.head_dim if self.attn_output_gate else 0
            return self.attention_params_per_layer() + gate
        if kind == "linear_attention":
            nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
            dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
            return (h * (2 * nk * dk + 2 * nv * dv) + h * 2 * nv + self.linear_conv_dim * self.linear_conv_kernel_dim
                    + nv * dv * h)
        if kind == "mamba":
            di, n = self.mamba_intermediate_size, self.mamba_state_size
            g, nh = self.mamba_num_groups, self.mamba_num_heads
            return h * (2 * di + 2 * g * n + nh) + (di + 2 * g * n) * self.mamba_conv_kernel + di * h
        raise ValueError(f"unknown layer kind {kind!r}")

    def mixer_params_per_rank(self, kind: str, tp: int = 1) -> int:
        """One layer's mixer weights on one TP rank (attention: :meth:`attention_params_per_rank`; recurrent
        layers split their heads and channels over TP)."""
        if kind in ATTENTION_KINDS:
            gate = self.hidden_size * max(1, self.num_heads // tp) * self.head_dim if self.attn_output_gate else 0
            return self.attention_params_per_rank(tp) + gate
        return self.mixer_params(kind) // tp

    def moe_weight_bytes(self, dtype: str | None = None) -> float:
        """Bytes per routed-expert weight: MXFP4's 17/32 when the experts are stored so, else ``dtype``'s."""
        if self.moe_weight_dtype == "mxfp4":
            return MXFP4_BYTES
        return float(dtype_bytes(self.moe_weight_dtype or dtype or self.weight_dtype))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_layers if self.is_moe else 0

    # ---- parameter counts (elements) ----
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk) if self.q_lora_rank else h * self.num_heads * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * self.num_heads * (
                self.qk_nope_head_dim + self.v_head_dim)
            o = self.num_heads * self.v_head_dim * h
            return q + kv + o
        q = h * self.num_heads * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * h
        return q + kv + o

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def params_total(self) -> int:
        """All weights (embedding, layers, head); norms and biases ignored."""
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        attn = self._mixers_total()
        dense_layers = self.num_layers - self.num_moe_layers
        mlp = dense_layers * self.dense_mlp_params()
        if self.is_moe:
            per_moe = (self.num_experts + self.num_shared_experts) * self.expert_params() + self.hidden_size * self.num_experts
            mlp += self.num_moe_layers * per_moe
        return emb + head + attn + mlp

    def params_active(self) -> int:
        """Weights touched per token (top-k routed experts plus shared experts)."""
        if not self.is_moe:
            return self.params_total()
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        attn = self._mixers_total()
        dense_layers = self.num_layers - self.num_moe_layers
        per_moe = (self.experts_per_token + self.num_shared_experts) * self.expert_params() + self.hidden_size * self.num_experts
        return emb + head + attn + dense_layers * self.dense_mlp_params() + self.num_moe_layers * per_moe

    def _mixers_total(self) -> int:
        """Every layer's mixer weights (attention for all of them unless ``layer_types`` says otherwise)."""
        if not self.layer_types:
            return self.attention_params_per_layer() * self.num_layers
        return sum(self.mixer_params(t) for t in self.layer_types)

    def mtp_params(self) -> int:
        """Weights of the multi-token-prediction modules (DeepSeek-V3 ``num_nextn_predict_layers``), embedding and
        head excluded (they are shared with the main model): per module an ``eh_proj`` (2h x h) and one decoder
        layer of the MoE kind. DeepSeek-V3: 11.6 B (its README_WEIGHTS: 11.5 B unique MTP parameters)."""
        if not self.num_mtp_layers:
            return 0
        h = self.hidden_size
        mlp = ((self.num_experts + self.num_shared_experts) * self.expert_params() + h * self.num_experts
               if self.is_moe else self.dense_mlp_params())
        return self.num_mtp_layers * (2 * h * h + self.attention_params_per_layer() + mlp)

    # ---- per-rank shares (vLLM sharding; see lab/costmodel/parallel.py) ----
    def attention_params_per_rank(self, tp: int = 1) -> int:
        """Attention weights of one layer held by one TP rank.

        GQA/MHA: q and o split by heads; k and v split by KV heads, replicated when there are fewer KV heads than
        ranks (each rank keeps max(1, Hkv/tp) heads). MLA (vLLM DeepseekV2MLAAttention): the fused q_a/kv_a
        projection (h x (r_q + r_kv + d_rope)) is replicated, q_b, kv_b and o are split by heads.
        """
        h = self.hidden_size
        heads = max(1, self.num_heads // tp)
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            a = h * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim) if self.q_lora_rank else \
                h * (self.kv_lora_rank + self.qk_rope_head_dim)
            qb = (self.q_lora_rank or h) * heads * qk
            kvb = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return a + qb + kvb + heads * self.v_head_dim * h
        kv_heads = max(1, self.num_kv_heads // tp)
        return h * (heads + 2 * kv_heads) * self.head_dim + heads * self.head_dim * h

    def weight_bytes_per_rank(self, dtype: str | None = None, tp: int = 1, pp: int = 1, ep: int = 1,
                              dp: int = 1, include_mtp: bool = False) -> int:
        """Weight bytes on the most loaded GPU of an instance split ``tp x pp`` (experts over ``ep``).

        Linear layers are stored in ``dtype``; the embedding, LM head and MoE router stay 16-bit (FP8 checkpoints
        and vLLM's FP8 quantization leave them unquantized). Embedding and head are vocab-parallel over TP and live
        on the first and last pipeline stage. Dense MLPs and shared experts split over TP; routed experts split
        their width over TP without EP, and whole experts over the ``ep`` GPUs with EP. Norm weights and biases are
        ignored (< 0.01 %). With ``include_mtp`` the MTP modules sit on the last stage.
        """
        par = Parallelism(tp, pp, ep, dp)
        wb = dtype_bytes(dtype or self.weight_dtype)
        h = self.hidden_size
        attn = self.attention_params_per_rank(tp)
        dense_mlp = self.dense_mlp_params() // tp
        moe_lin = 0
        router = 0
        if self.is_moe:
            experts_local = self.num_experts // ep if ep > 1 else self.num_experts
            moe_lin = experts_local * self.expert_params() // par.moe_tp + self.num_shared_experts * self.expert_params() // tp
            router = h * self.num_experts
        emb = self.vocab_size * h // tp
        first_dense = self.first_k_dense_layers if self.is_moe else self.num_layers
        worst = 0
        start = 0
        stages = par.stage_layers(self.num_layers)
        kinds = self.layer_types
        moe_b = self.moe_weight_bytes(dtype) if self.moe_weight_dtype else wb
        for s, n in enumerate(stages):
            layers = range(start, start + n)
            start += n
            n_dense = sum(1 for i in layers if i < first_dense)
            n_moe = n - n_dense
            mixers = n * attn if not kinds else sum(self.mixer_params_per_rank(kinds[i], tp) for i in layers)
            lin = mixers + n_dense * dense_mlp + (0 if self.moe_weight_dtype else n_moe * moe_lin)
            b16 = n_moe * router
            if s == 0:
                b16 += emb
            if s == len(stages) - 1:
                b16 += 0 if (self.tie_word_embeddings and len(stages) == 1) else emb
                if include_mtp and self.num_mtp_layers:
                    mtp_lin = self.num_mtp_layers * (2 * h * h + attn + (moe_lin if self.is_moe else dense_mlp))
                    lin += mtp_lin
                    b16 += self.num_mtp_layers * router
            total = lin * wb + b16 * 2
            if self.moe_weight_dtype:  # experts in their own format (MXFP4: 4.25 bits a weight)
                total += int(n_moe * moe_lin * moe_b)
            worst = max(worst, total)
        return worst

    # ---- KV cache ----
    def kv_elements_per_token_per_layer(self) -> int:
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token_per_layer(self, kv_dtype: str = "bf16", tp: int = 1) -> int:
        """KV-cache bytes one token takes in one layer on one TP rank (see :meth:`kv_bytes_per_token`)."""
        b = dtype_bytes(kv_dtype)
        if self.is_mla:
            return self.kv_elements_per_token_per_layer() * b
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * b

    def kv_bytes_per_token(self, kv_dtype: str = "bf16", tp: int = 1, pp: int = 1) -> int:
        """KV-cache bytes per token summed over the layers of one rank (the largest pipeline stage).

        GQA heads are split over TP ranks (at least one KV head per rank); the MLA latent cache is replicated on
        every rank. Example: DeepSeek-V3 bf16 = (512 + 64) · 61 · 2 = 70,272 B; fp8 (vLLM ``fp8_e4m3``) 35,136 B.
        """
        if self.layer_types:  # hybrid: the attention layers' KV, sliding and chunked ones counted as full
            kinds = self.layer_types
            start = 0
            layers = 0
            for n in _split(self.num_layers, pp):
                layers = max(layers, sum(1 for t in kinds[start:start + n] if t in ATTENTION_KINDS))
                start += n
        else:
            layers = max(_split(self.num_layers, pp))
        return self.kv_bytes_per_token_per_layer(kv_dtype, tp) * layers


def _split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if s < extra else 0) for s in range(parts)]


def _layer_types(cfg: dict[str, Any], num_layers: int, where: str) -> tuple[str, ...]:
    """Each layer's mixer kind from a Hugging Face config, as the models name it: ``layer_types`` (gpt-oss and
    Gemma 3 ``sliding_attention`` / ``full_attention``; Qwen3-Next and Qwen3.5 ``linear_attention``; Granite-4.0-H
    ``mamba`` / ``attention``), else Qwen3-Next's ``full_attention_interval`` (every n-th layer full, the others
    Gated DeltaNet), Gemma 3's ``sliding_window_pattern`` (every n-th layer global) or Llama 4's
    ``attention_chunk_size`` with ``no_rope_layers`` (the RoPE layers attend within their chunk). ``()`` for a
    model with full attention only.

    Raises:
        ValueError: a kind the model description does not know, a list of the wrong length, or Nemotron-H's
            ``hybrid_override_pattern`` (its MLP-only and mixer-only layers are not modelled).
    """
    aliases = {"full_attention": "full_attention", "attention": "full_attention", "global": "full_attention",
               "sliding_attention": "sliding_attention", "sliding_window": "sliding_attention",
               "local": "sliding_attention", "chunked_attention": "chunked_attention",
               "linear_attention": "linear_attention", "mamba": "mamba", "mamba2": "mamba"}
    if cfg.get("hybrid_override_pattern"):
        raise ValueError(f"{where}: hybrid_override_pattern (Nemotron-H: layers that are only an MLP or only a mixer) "
                         "is not modelled; a hybrid whose every layer has a mixer and an MLP (Granite-4.0-H, "
                         "Qwen3-Next, gpt-oss, Gemma 3) is")
    raw = cfg.get("layer_types")
    if raw:
        if len(raw) != num_layers:
            raise ValueError(f"{where}: layer_types lists {len(raw)} layers, num_hidden_layers is {num_layers}")
        out = []
        for t in raw:
            k = aliases.get(str(t))
            if k is None:
                raise ValueError(f"{where}: layer_types: unknown layer type {t!r}; expected one of "
                                 f"{', '.join(sorted(set(aliases)))}")
            out.append(k)
        kinds = tuple(out)
    elif cfg.get("full_attention_interval") and cfg.get("linear_num_value_heads"):
        n = int(cfg["full_attention_interval"])
        kinds = tuple("full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(num_layers))
    elif cfg.get("sliding_window_pattern") and cfg.get("sliding_window"):
        n = int(cfg["sliding_window_pattern"])
        kinds = tuple("full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(num_layers))
    elif cfg.get("attention_chunk_size") and cfg.get("no_rope_layers"):
        rope = cfg["no_rope_layers"]
        kinds = tuple("chunked_attention" if rope[i] else "full_attention" for i in range(num_layers))
    else:
        return ()
    if all(k == "full_attention" for k in kinds):
        return ()
    if "sliding_attention" in kinds and not cfg.get("sliding_window"):
        raise ValueError(f"{where}: sliding_attention layers need sliding_window (tokens)")
    return kinds


def _from_hf(name: str, cfg: dict[str, Any], where: str) -> ModelArch:
    if cfg.get("hidden_size") is None and isinstance(cfg.get("text_config"), dict):
        # a multimodal wrapper (Gemma 3, Qwen3.5): the language model's fields are in text_config
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}

    def req(key: str, *alts: str) -> Any:
        for k in (key, *alts):
            if cfg.get(k) is not None:
                return positive(k, cfg[k])
        raise ValueError(f"{where}: model config lacks required field {key!r}")

    def positive(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
        return int(value)

    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts_per_tok",
                "kv_lora_rank"):
        if cfg.get(key) is not None and cfg.get(key) != 0:
            positive(key, cfg[key])
    heads = int(req("num_attention_heads", "n_head"))
    hidden = int(req("hidden_size", "n_embd"))
    num_experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    head_dim = int(cfg.get("head_dim") or (cfg.get("v_head_dim") if cfg.get("kv_lora_rank") else 0) or hidden // heads)
    moe_inter = int(cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size") if num_experts else 0) or 0)
    num_layers = int(req("num_hidden_layers", "n_layer"))
    kinds = _layer_types(cfg, num_layers, where)
    shared = int(cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or 0)
    shared_width = int(cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size") or 0)
    if num_experts and shared_width and not shared and moe_inter:
        # a shared expert of another width, as whole routed-expert equivalents (Qwen3-Next 512/512 = 1; Granite-4.0-H
        # 1536/768 = 2): the same weights and FLOPs
        if shared_width % moe_inter:
            raise ValueError(f"{where}: shared expert width {shared_width} is not a multiple of the expert width "
                             f"{moe_inter}")
        shared = shared_width // moe_inter
    hidden_v = hidden
    quant = cfg.get("quantization_config") or {}
    mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    mamba_heads = int(cfg.get("mamba_n_heads") or cfg.get("mamba_num_heads") or 0)
    mamba_head_dim = int(cfg.get("mamba_d_head") or cfg.get("mamba_head_dim") or 0)
    mamba_inter = mamba_heads * mamba_head_dim or int(cfg.get("mamba_expand") or cfg.get("expand") or 0) * hidden_v
    return ModelArch(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(req("intermediate_size")),
        vocab_size=int(req("vocab_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=num_experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=moe_inter,
        num_shared_experts=shared,
        first_k_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        weight_dtype=str(cfg.get("weight_dtype") or _checkpoint_dtype(cfg)),
        qk_norm=str(cfg.get("model_type", "")) in ("qwen3", "qwen3_moe", "qwen3_next"),
        layer_types=kinds,
        sliding_window=int(cfg.get("sliding_window") or 0) if "sliding_attention" in kinds else 0,
        attention_chunk_size=int(cfg.get("attention_chunk_size") or 0) if "chunked_attention" in kinds else 0,
        attn_output_gate=bool(cfg.get("attn_output_gate", str(cfg.get("model_type", "")) == "qwen3_next")),
        attention_sinks=str(cfg.get("model_type", "")) == "gpt_oss",
        linear_num_key_heads=int(cfg.get("linear_num_key_heads") or 0),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads") or 0),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim") or 0),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim") or 0),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim") or 0),
        mamba_num_heads=mamba_heads,
        mamba_head_dim=mamba_head_dim,
        mamba_state_size=int(cfg.get("mamba_d_state") or cfg.get("ssm_state_size") or 0),
        mamba_num_groups=int(cfg.get("mamba_n_groups") or cfg.get("n_groups") or 0),
        mamba_conv_kernel=int(cfg.get("mamba_d_conv") or cfg.get("conv_kernel") or 0),
        mamba_intermediate_size=mamba_inter if "mamba" in kinds else 0,
        mamba_chunk_size=int(cfg.get("mamba_chunk_size") or cfg.get("chunk_size") or 0) if "mamba" in kinds else 0,
        mamba_ssm_dtype=_dtype_name(cfg.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_cache_dtype")),
        moe_weight_dtype="mxfp4" if mxfp4 else "",
    )


def _dtype_name(value: Any) -> str:
    """A config's dtype string as :data:`DTYPE_BYTES` names it (``float32`` -> ``fp32``); '' for none/auto."""
    if not value or value == "auto":
        return ""
    v = str(value).replace("torch.", "")
    v = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(v, v)
    dtype_bytes(v)  # ValueError for an unknown name
    return v


def _checkpoint_dtype(cfg: dict[str, Any]) -> str:
    """"fp8" for a natively FP8 checkpoint (Hugging Face ``quantization_config.quant_method == 'fp8'``)."""
    q = cfg.get("quantization_config") or {}
    return "fp8" if isinstance(q, dict) and q.get("quant_method") == "fp8" else "bf16"


@lru_cache(maxsize=1)
def _catalog() -> dict[str, dict[str, Any]]:
    return read_catalog("models")


def model_names() -> list[str]:
    """Names of the models in the catalog."""
    return sorted(_catalog())


def hf_model_name(path: str | Path, cfg: dict[str, Any]) -> str:
    """The name a Hugging Face config.json gives its model, for reports and ``model_id``:

    1. its ``_name_or_path`` (as Transformers writes it): a hub id as written (``meta-llama/Llama-3.1-8B``), the
       last folder of a local path (``/models/Llama-3.1-8B/`` -> ``Llama-3.1-8B``);
    2. else, for a file named ``config.json``, its folder's name (the hub layout ``<model>/config.json``);
    3. else the file's name without its extension (``configs/qwen3_32b.json`` -> ``qwen3_32b``).
    """
    p = Path(path).expanduser().resolve()
    given = cfg.get("_name_or_path")
    if isinstance(given, str) and given.strip():
        given = given.strip().rstrip("/\\")
        local = given.startswith(("/", ".", "~")) or "\\" in given or given.count("/") > 1 or ":" in given
        last = given.replace("\\", "/").rsplit("/", 1)[-1]
        if (last if local else given).strip():
            return last if local else given
    if p.name == "config.json" and p.parent.name:
        return p.parent.name
    return p.stem or p.name


def load_model(name: str | None = None, hf_config: str | Path | None = None) -> ModelArch:
    """Look a model up by catalog name or alias, or read a Hugging Face ``config.json``.

    Args:
        name: a catalog name or alias; with ``hf_config``, only the model's label (None: :func:`hf_model_name`).
        hf_config: a Hugging Face config.json.

    Raises:
        ValueError: unknown name (the message lists the catalog), or a config file lacking a required field.
        FileNotFoundError: ``hf_config`` does not exist.
    """
    if hf_config is not None:
        path = Path(hf_config)
        if not path.is_file():
            raise FileNotFoundError(f"model.hf_config: {path} does not exist")
        cfg = json.loads(path.read_text())
        return _from_hf(name or hf_model_name(path, cfg), cfg, str(path))
    if name is None:
        raise ValueError("model: give a catalog name or hf_config")
    cat = _catalog()
    for key, entry in cat.items():
        if name == key or name in (entry.get("aliases") or []):
            return _from_hf(key, entry, f"catalog model {key}")
    raise ValueError(f"model {name!r} is not in the catalog; known: {', '.join(sorted(cat))} "
                     "(or set model.hf_config to a Hugging Face config.json)")
