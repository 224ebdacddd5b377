"""vLLM's KV cache configuration for any model, hybrid ones included: KV cache groups, the unified page size, the
block count, the per-request block need, the maximum concurrency and the start-up lines vLLM prints.

The rule, as vLLM applies it (read in vllm/v1/core/kv_cache_utils.py ``get_kv_cache_groups``,
``unify_kv_cache_spec_page_size``, ``_get_kv_cache_groups_uniform_page_size``, ``get_kv_cache_config_from_groups``,
``get_num_blocks``, ``get_max_concurrency_for_kv_cache_config``, ``_report_kv_cache_config``;
vllm/v1/kv_cache_interface.py ``max_memory_usage_bytes`` per spec; vllm/model_executor/models/config.py
``HybridAttentionMambaModelConfig``; docs/design/hybrid_kv_cache_manager.md), per rank:

1. **Per-layer specs.** An attention layer's page is ``block_size · 2·Hkv/tp·d · dtype`` bytes (per token per layer:
   :meth:`ModelArch.kv_bytes_per_token_per_layer`); a Mamba / Gated-DeltaNet layer's page is its state (conv +
   SSM, :meth:`ModelArch.state_bytes_per_layer`), whatever the length.
2. **Mamba hybrids: one page size.** The attention block size is raised to ``16 · ceil(state / (16 · page of one
   token))`` tokens when the configured one is smaller ("Setting attention block size to N tokens to ensure that
   attention page size is >= mamba page size"), and the state is padded to that page ("Padding mamba page size by
   X%"). Without prefix caching a Mamba layer's block covers ``max_model_len`` tokens (one state); in ``align``
   mode (prefix caching) it covers ``block_size`` tokens.
3. **With the hybrid manager off** (``--disable-hybrid-kv-cache-manager``, or before vLLM 0.33 a KV connector such
   as PD's NIXL): sliding-window and chunked layers count as full attention (one group); a Mamba model cannot be
   unified and vLLM refuses to start.
4. **Groups.** Layers are grouped by spec; the group size is the smallest type's layer count, or the largest when
   it is below ``ratio`` x the smallest (ratio 1.25 before vLLM 0.33, 1.5 in 0.33); each type is split into
   ``ceil(n / group size)`` groups (``layers[i::k]``), the missing layers being padding.
5. **Pool.** ``group size`` tensors, each shared by one layer of every group: ``num_blocks = available // page //
   group size``, so a block costs ``page · group size`` bytes whichever group holds it.
6. **Per request** (``max_memory_usage_bytes`` / page, per group): full ``ceil(max_model_len / bs)``; sliding window
   ``ceil(min(w - 1 + max_num_batched_tokens, max_model_len) / bs) + 1``; chunked ``ceil(min(chunk +
   max_num_batched_tokens, max_model_len) / bs)``; Mamba ``1 + spec`` (``2 + spec`` in align mode). Maximum
   concurrency = ``num_blocks / Σ groups``.
7. **The lines vLLM prints**, whose token count changed meaning: up to vLLM 0.19 ``GPU KV cache size: {num_blocks //
   num_groups · min block size} tokens`` and, on its own line, ``Maximum concurrency for {max_model_len} tokens per
   request: {x:.2f}x`` (the token count assumes the blocks split evenly over the groups, which a hybrid's are not:
   vLLM issue #40691); in 0.33 one line ``GPU KV cache size: {int(x · max_model_len)} tokens, Maximum concurrency
   for ...`` (``get_kv_cache_capacity`` / ``update_kv_cache_capacity``: the concurrency in token units).

A model with full attention only is one group of all its layers and gives exactly the block count
lab/costmodel/kv_capacity.py always derived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd

from lab.core.kv_groups import CHUNKED, FULL, MAMBA, SLIDING, KVGroup, KVGroupSpec
from lab.costmodel.model_arch import ModelArch

KIND_OF = {"full_attention": FULL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED,
           "linear_attention": MAMBA, "mamba": MAMBA}

# vLLM version era -> (group-size ratio, start-up line style, Mamba prefix caching: off / opt-in / default on,
# hybrid manager kept with a KV connector)
VERSION_RULES = {
    "0.11": {"ratio": 1.25, "lines": "two", "mamba_prefix": "off", "hma_with_connector": False},
    "0.19": {"ratio": 1.25, "lines": "two", "mamba_prefix": "opt-in", "hma_with_connector": False},
    "0.33": {"ratio": 1.5, "lines": "one", "mamba_prefix": "default", "hma_with_connector": True},
}

KERNEL_BLOCK_ALIGNMENT = 16  # FlashAttention / FlashInfer block sizes are multiples of 16 (config.py)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group: its kind, its real layers, the window (sliding / chunked) and the tokens one of its
    blocks covers (the attention block size; ``max_model_len`` for a Mamba group without prefix caching)."""

    kind: str
    num_layers: int
    window: int
    block_tokens: int
    layer_kind: str


@dataclass(frozen=True)
class KVLayout:
    """A model's KV cache configuration on one rank, as vLLM builds it (see the module docstring).

    Attributes:
        groups: the KV cache groups, full attention first.
        block_size: tokens per attention block (raised for a Mamba hybrid).
        configured_block_size: ``engine.block_size`` as given.
        page_bytes: one layer's page (vLLM ``page_size_bytes``; the Mamba state padded to it).
        group_size: layers per group, padding included = KV tensors on the rank; a block costs
            ``page_bytes · group_size``.
        mamba_state_bytes: one Mamba layer's unpadded state (0 without Mamba layers).
        mamba_mode: ``none`` or ``align`` (Mamba prefix caching).
        hybrid_manager: vLLM's hybrid KV cache manager is on (off: windowed layers kept as full attention).
        version: the vLLM era whose rules applied.
        notes: what vLLM logs while building it (block size raised, state padded, padding layers).
    """

    groups: tuple[GroupLayout, ...]
    block_size: int
    configured_block_size: int
    page_bytes: int
    group_size: int
    mamba_state_bytes: int = 0
    mamba_mode: str = "none"
    hybrid_manager: bool = True
    version: str = "0.33"
    num_speculative_blocks: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of the pool on this rank (``page · group size``)."""
        return self.page_bytes * self.group_size

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        return any(g.kind != FULL for g in self.groups)

    def num_blocks(self, available_bytes: int) -> int:
        """vLLM ``get_num_blocks``: ``available // page // group size``."""
        return max(0, available_bytes // self.page_bytes // self.group_size)

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> list[int]:
        """Each group's blocks for one request of ``max_model_len`` tokens (``max_memory_usage_bytes`` / page)."""
        out = []
        for g in self.groups:
            bs = g.block_tokens
            if g.kind == FULL:
                out.append(cdiv(max_model_len, bs))
            elif g.kind == SLIDING:
                out.append(cdiv(min(g.window - 1 + max_num_batched_tokens, max_model_len), bs) + 1)
            elif g.kind == CHUNKED:
                out.append(cdiv(min(g.window + max_num_batched_tokens, max_model_len), bs))
            else:
                out.append((2 if self.mamba_mode == "align" else 1) + self.num_speculative_blocks)
        return out

    def max_concurrency(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int) -> float:
        """vLLM ``get_max_concurrency_for_kv_cache_config``: ``num_blocks / Σ blocks per request``."""
        return num_blocks / sum(self.blocks_per_request(max_model_len, max_num_batched_tokens))

    def kv_cache_size_tokens(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The token count of vLLM's "GPU KV cache size" line in this era (see the module docstring)."""
        if VERSION_RULES[self.version]["lines"] == "one":
            return int(self.max_concurrency(num_blocks, max_model_len, max_num_batched_tokens) * max_model_len)
        return num_blocks // self.num_groups * min(g.block_tokens for g in self.groups)

    def startup_lines(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int) -> list[str]:
        """The start-up lines vLLM of this era prints for ``num_blocks`` blocks (the block-size and padding notes
        first, when it logs them)."""
        tokens = self.kv_cache_size_tokens(num_blocks, max_model_len, max_num_batched_tokens)
        conc = self.max_concurrency(num_blocks, max_model_len, max_num_batched_tokens)
        size = f"GPU KV cache size: {tokens:,} tokens"
        maxc = f"Maximum concurrency for {max_model_len:,} tokens per request: {conc:.2f}x"
        lines = list(self.notes)
        if VERSION_RULES[self.version]["lines"] == "one":
            lines.append(f"{size}, {maxc}")
        else:
            lines += [size, maxc]
        return lines

    def runtime_spec(self, max_num_batched_tokens: int) -> KVGroupSpec:
        """The run-time group spec (lab/core/kv_groups.py) of this layout."""
        return KVGroupSpec(tuple(KVGroup(g.kind, g.num_layers, g.window, g.layer_kind) for g in self.groups),
                           self.block_size, self.mamba_mode, self.num_speculative_blocks, max_num_batched_tokens,
                           aligned_split=self.mamba_mode == "align")

    def describe(self) -> dict:
        """The layout as plain values (for summaries and ``servelab kv``)."""
        return {"block_size": self.block_size, "page_bytes": self.page_bytes, "group_size": self.group_size,
                "bytes_per_block": self.bytes_per_block, "mamba_mode": self.mamba_mode,
                "hybrid_manager": self.hybrid_manager,
                "groups": [{"kind": g.kind, "layers": g.num_layers, "window": g.window, "block_tokens": g.block_tokens,
                            "layer_kind": g.layer_kind} for g in self.groups]}


def mamba_prefix_caching(version: str, enable_prefix_caching: bool, explicitly_set: bool) -> bool:
    """Whether vLLM of ``version`` caches a Mamba hybrid's prefixes: never before Mamba prefix caching (0.11:
    "Hybrid or mamba-based model detected: disabling prefix caching since it is not yet supported"), opt-in in 0.19
    (``enable_prefix_caching`` set explicitly; hybrids kept it off by default, vllm/engine/arg_utils.py), on by
    default in 0.33 (vLLM PR #50991: on, in ``align`` mode)."""
    rule = VERSION_RULES[version]["mamba_prefix"]
    if rule == "off":
        return False
    if rule == "opt-in":
        return enable_prefix_caching and explicitly_set
    return enable_prefix_caching


def kv_layout(model: ModelArch, *, kv_dtype: str = "bf16", tp: int = 1, block_size: int = 16,
              max_model_len: int | None = None, version: str = "0.33", prefix_caching: bool = False,
              hybrid_manager: bool = True, extra_full_layers: int = 0, num_speculative_tokens: int = 0,
              model_dtype: str = "bf16") -> KVLayout:
    """vLLM's KV cache layout of ``model`` on one TP rank (see the module docstring).

    Args:
        kv_dtype: the attention KV dtype; ``model_dtype``: the Mamba conv state's (and SSM's unless the model
            names one).
        block_size: ``engine.block_size`` (raised for a Mamba hybrid when smaller than the state needs).
        max_model_len: tokens one request may reach (a Mamba group's block without prefix caching).
        prefix_caching: Mamba state cached (``align`` mode); see :func:`mamba_prefix_caching`.
        hybrid_manager: off = ``--disable-hybrid-kv-cache-manager``.
        extra_full_layers: a drafter's full-attention layers sharing the cache (EAGLE, EAGLE-3: 1; MTP: its modules).
        num_speculative_tokens: speculative tokens (each adds a state block per Mamba group).

    Raises:
        ValueError: a Mamba hybrid with the hybrid manager off (vLLM cannot unify the specs), a model without any
            full-attention layer (not modelled), or a version servelab does not know.
    """
    if version not in VERSION_RULES:
        raise ValueError(f"unknown vLLM version {version!r}; expected one of {', '.join(VERSION_RULES)}")
    mml = max_model_len or model.max_position_embeddings
    per_token = model.kv_bytes_per_token_per_layer(kv_dtype, tp)
    kinds = list(model.layer_kinds()) + ["full_attention"] * extra_full_layers
    counts: dict[tuple[str, int, str], int] = {}
    for k in kinds:
        kind = KIND_OF[k]
        window = model.sliding_window if kind == SLIDING else model.attention_chunk_size if kind == CHUNKED else 0
        if not hybrid_manager and kind in (SLIDING, CHUNKED):
            kind, window, k = FULL, 0, "full_attention"
        key = (kind, window, k if kind == MAMBA else ("full_attention" if kind == FULL else k))
        counts[key] = counts.get(key, 0) + 1
    has_mamba = any(kind == MAMBA for kind, _, _ in counts)
    if has_mamba and not hybrid_manager:
        raise ValueError(f"{model.name}: the hybrid KV cache manager is off, and vLLM cannot fold Mamba / linear-"
                         "attention state into full-attention blocks (kv_cache_utils.py unify_hybrid_kv_cache_specs: "
                         "'Hybrid KV cache manager is disabled but failed to convert the KV cache specs to one "
                         "unified type')")
    if not any(kind == FULL for kind, _, _ in counts):
        raise ValueError(f"{model.name}: no full-attention layer; servelab models hybrids with full attention only")
    notes: list[str] = []
    bs = block_size
    mode = "align" if (has_mamba and prefix_caching) else "none"
    num_spec = num_speculative_tokens if has_mamba else 0
    state = 0
    if has_mamba:
        states = {model.state_bytes_per_layer(k, tp, model_dtype, num_spec if k == "linear_attention" else 0)
                  for kind, _, k in counts if kind == MAMBA}
        state = max(states)
        align = KERNEL_BLOCK_ALIGNMENT
        attn_block = align * cdiv(state, align * per_token)
        if bs < attn_block:
            bs = attn_block
            notes.append(f"Setting attention block size to {bs} tokens to ensure that attention page size is >= "
                         "mamba page size.")
        page = bs * per_token
        if page > state:
            notes.append(f"Padding mamba page size by {100 * (page - state) / state:.2f}% to ensure that mamba page "
                         "size and attention page size are exactly equal.")
    page = bs * per_token
    ratio = VERSION_RULES[version]["ratio"]
    nmin, nmax = min(counts.values()), max(counts.values())
    group_size = nmax if nmax < nmin * ratio else nmin
    groups: list[GroupLayout] = []
    for (kind, window, k), n in sorted(counts.items(), key=lambda kv: (kv[0][0] != FULL, kv[0][0], kv[0][1])):
        pad = group_size - n % group_size
        if pad != group_size and len(counts) > 1:
            notes.append(f"Add {pad} padding layers, may waste at most {pad / n * 100:.2f}% KV cache memory")
        ngroups = cdiv(n, group_size)
        per = [len(range(i, n, ngroups)) for i in range(ngroups)]
        block_tokens = bs if kind != MAMBA else (bs if mode == "align" else mml)
        groups += [GroupLayout(kind, m, window, block_tokens, k) for m in per]
    tensors = max(g.num_layers for g in groups)
    return KVLayout(tuple(groups), bs, block_size, page, tensors, state, mode, hybrid_manager, version,
                    num_spec, tuple(notes))


def layout_lcm_block(layout: KVLayout) -> int:
    """The prefix-hit granularity in tokens: hits are whole attention blocks (lcm of the groups' block sizes that
    can hit, i.e. the attention block size)."""
    out = layout.block_size
    for g in layout.groups:
        if g.kind != MAMBA:
            out = out * g.block_tokens // gcd(out, g.block_tokens)
    return out
