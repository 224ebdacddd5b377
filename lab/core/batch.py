"""The shape of one engine step as the kernels see it, and CUDA-graph padding (written once, used by the engine
loop and the fast-forward alike)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import compress
from operator import not_

import numpy as np

_ONE = 1


@dataclass(slots=True)
class BatchShape:
    """The shape of one engine step, as the attention and GEMM kernels see it.

    Three kinds of request share a step:

    - a **prefill chunk**: more than one new token and no drafts; its new tokens go to ``prefill_new`` and the
      tokens it had already computed (prefix hits, earlier chunks) to ``prefill_context``;
    - a **decode**: exactly one new token against its KV (``decode_context``);
    - a **verify query** (speculative decoding): the last sampled token plus k draft tokens, k + 1 query positions
      against the request's KV (``verify_new``, ``verify_context``); the target scores every position
      (shared/specs/vllm-v1-scheduling.md §3).

    Decodes are described by aggregates, which is all a cost model needs on the hot path (Σ KV read, count, the
    spread for skew corrections), plus the per-request list for models that want the distribution.

    Attributes:
        num_tokens: Σ tokens computed this step (T).
        num_seqs: requests in the batch.
        prefill_new, prefill_context: per prefill chunk, new tokens and tokens already in its KV cache.
        decode_context: per decode, tokens already in its KV cache.
        num_decodes: number of decodes.
        decode_sum: Σ decode context tokens.
        decode_max, decode_min: largest and smallest decode context (0 when there are no decodes).
        verify_new, verify_context: per verify query, its query tokens (1 + drafts) and tokens already in its KV.
        padded_tokens: when > num_tokens, the token count the dense layers (GEMMs, norms) run at because the step
            replays a CUDA graph captured for that batch size; 0 = no padding. Attention and the LM head see only the
            real requests.
        group_tokens: in a lock-step group (attention DP with expert parallelism), every rank's token count this
            step as the MoE collectives see it (vLLM's ``num_tokens_across_dp``: the group's padded maximum under
            CUDA graphs, each rank's own count in eager mode, 1 for an idle rank's dummy batch), rank order; empty
            otherwise. The operator cost model prices the routed experts and the EP dispatch/combine from it.
    """

    num_tokens: int = 0
    num_seqs: int = 0
    prefill_new: list[int] = field(default_factory=list)
    prefill_context: list[int] = field(default_factory=list)
    decode_context: list[int] = field(default_factory=list)
    num_decodes: int = 0
    decode_sum: int = 0
    decode_max: int = 0
    decode_min: int = 0
    padded_tokens: int = 0
    verify_new: list[int] = field(default_factory=list)
    verify_context: list[int] = field(default_factory=list)
    group_tokens: tuple[int, ...] = ()

    @property
    def dense_tokens(self) -> int:
        """Tokens the token-parallel layers compute: ``padded_tokens`` if set, else ``num_tokens``."""
        return self.padded_tokens or self.num_tokens

    @classmethod
    def from_requests(cls, new_tokens: list[int], computed_before: list[int],
                      spec_tokens: list[int] | None = None) -> "BatchShape":
        """Build a shape from parallel lists of per-request new tokens, tokens computed before the step and
        (optionally) scheduled draft tokens; a request with drafts is a verify query, whatever its count."""
        pn: list[int] = []
        pc: list[int] = []
        dc: list[int]
        vn: list[int] = []
        vc: list[int] = []
        if spec_tokens is None:
            if new_tokens.count(1) == len(new_tokens):  # a pure decode step
                dc = list(computed_before[:len(new_tokens)])
            else:  # split in C: is_prefill[i] = new_tokens[i] > 1
                is_prefill = list(map(_ONE.__lt__, new_tokens))
                pn = list(compress(new_tokens, is_prefill))
                pc = list(compress(computed_before, is_prefill))
                dc = list(compress(computed_before, map(not_, is_prefill)))
        else:
            dc = []
            for n, c, k in zip(new_tokens, computed_before, spec_tokens):
                if k:
                    vn.append(n)
                    vc.append(c)
                elif n > 1:
                    pn.append(n)
                    pc.append(c)
                else:
                    dc.append(c)
        nd = len(dc)
        return cls(sum(new_tokens), len(new_tokens), pn, pc, dc, nd, sum(dc),
                   max(dc) if nd else 0, min(dc) if nd else 0, 0, vn, vc)

    @classmethod
    def decodes_and_prefills(cls, decode_context: list[int], prefill_new: list[int],
                             prefill_context: list[int]) -> "BatchShape":
        """The shape :meth:`from_requests` gives for decodes (their contexts) followed by prefill chunks of more than
        one new token each (new tokens, contexts), without classifying each request (fast-forward admissions)."""
        nd = len(decode_context)
        return cls(nd + sum(prefill_new), nd + len(prefill_new), prefill_new, prefill_context, decode_context, nd,
                   sum(decode_context), max(decode_context) if nd else 0, min(decode_context) if nd else 0)

    @classmethod
    def decode_only(cls, decode_context: list[int], decode_sum: int, decode_max: int,
                    decode_min: int) -> "BatchShape":
        """A pure decode step over ``decode_context`` with its aggregates already known (fast-forward)."""
        n = len(decode_context)
        return cls(n, n, [], [], decode_context, n, decode_sum, decode_max, decode_min)

    @property
    def num_logits(self) -> int:
        """Positions the LM head and sampler score: one per request, plus every draft of a verify query (the
        target scores all 1 + k positions; vLLM's ``logits_indices``)."""
        vn = self.verify_new
        return self.num_seqs + sum(vn) - len(vn) if vn else self.num_seqs

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of prefill chunks and verify queries (everything but decodes)."""
        return self.num_tokens - self.num_decodes

    def query_chunks(self) -> list[tuple[int, int]]:
        """(query tokens, context tokens) of every multi-token query: prefill chunks, then verify queries. A cost
        model without a verify kernel of its own prices a verify query as the varlen attention kernel runs it."""
        pairs = list(zip(self.prefill_new, self.prefill_context))
        if self.verify_new:
            pairs += zip(self.verify_new, self.verify_context)
        return pairs


def padded_size(cudagraph_sizes: tuple[int, ...], num_tokens: int) -> int:
    """The CUDA-graph size a step of ``num_tokens`` tokens replays: the smallest captured size >= it, or 0 (no
    padding) when the step is larger than every captured size or no graphs are captured (vLLM pads the batch up to
    the next ``cudagraph_capture_sizes`` entry; vllm/config/compilation.py)."""
    if not cudagraph_sizes or num_tokens > cudagraph_sizes[-1]:
        return 0
    return cudagraph_sizes[bisect_left(cudagraph_sizes, num_tokens)]


def padded_size_table(cudagraph_sizes: tuple[int, ...], top: int) -> np.ndarray:
    """``padded_size`` for every token count 0..top, as an int64 array (fast-forward looks it up by batch size)."""
    table = np.zeros(top + 1, dtype=np.int64)
    if cudagraph_sizes:
        counts = np.arange(top + 1)
        sizes = np.asarray(cudagraph_sizes)
        fitted = sizes[np.minimum(np.searchsorted(sizes, counts), len(sizes) - 1)]
        table = np.where(counts <= cudagraph_sizes[-1], fitted, 0)
    return table
