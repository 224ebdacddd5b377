"""What every cost model takes and returns: a batch shape in, a step time (seconds) out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class BatchShape:
    """The shape of one engine step, as the attention and GEMM kernels see it.

    A request scheduled with more than one token is a prefill chunk (its ``num_new_tokens`` go to
    ``prefill_new``, the tokens it had already computed to ``prefill_context``); a request scheduled with exactly
    one token is a decode. This is how the varlen attention kernel and LLMServingSim's profiles classify a batch.

    Decodes are described by aggregates, which is all a cost model needs on the hot path (Σ KV read, count, the
    spread for skew corrections), plus the per-request list for models that want the distribution. The list is
    stored as a base plus ``decode_offset`` (every decode's context is ``decode_context[i] + decode_offset``) so a
    run of decode steps can reuse one list; the aggregates already include the offset.

    Attributes:
        num_tokens: Σ tokens computed this step (T).
        num_seqs: requests in the batch (logits are computed for one position of each).
        prefill_new: per prefill chunk, its new tokens.
        prefill_context: per prefill chunk, tokens already in its KV cache (prefix hits and earlier chunks).
        decode_context: per decode, tokens already in its KV cache, before adding ``decode_offset``.
        decode_offset: added to every entry of ``decode_context``.
        num_decodes: number of decodes.
        decode_sum: Σ decode context tokens (offset included).
        decode_max, decode_min: largest and smallest decode context (0 when there are no decodes).
        padded_tokens: when > num_tokens, the token count the dense layers (GEMMs, norms) run at because the step
            replays a CUDA graph captured for that batch size; 0 = no padding. Attention and the LM head see only the
            real requests.
    """

    num_tokens: int = 0
    num_seqs: int = 0
    prefill_new: list[int] = field(default_factory=list)
    prefill_context: list[int] = field(default_factory=list)
    decode_context: list[int] = field(default_factory=list)
    decode_offset: int = 0
    num_decodes: int = 0
    decode_sum: int = 0
    decode_max: int = 0
    decode_min: int = 0
    padded_tokens: int = 0

    @property
    def dense_tokens(self) -> int:
        """Tokens the token-parallel layers compute: ``padded_tokens`` if set, else ``num_tokens``."""
        return self.padded_tokens or self.num_tokens

    @classmethod
    def from_requests(cls, new_tokens: list[int], computed_before: list[int]) -> "BatchShape":
        """Build a shape from parallel lists of per-request new tokens and tokens computed before the step."""
        pn: list[int] = []
        pc: list[int] = []
        dc: list[int] = []
        for n, c in zip(new_tokens, computed_before):
            if n > 1:
                pn.append(n)
                pc.append(c)
            else:
                dc.append(c)
        nd = len(dc)
        return cls(sum(new_tokens), len(new_tokens), pn, pc, dc, 0, nd, sum(dc),
                   max(dc) if nd else 0, min(dc) if nd else 0)

    @classmethod
    def decode_only(cls, decode_context: list[int], offset: int, base_sum: int, base_max: int,
                    base_min: int) -> "BatchShape":
        """A pure decode step over ``decode_context`` advanced by ``offset`` tokens (fast-forward)."""
        n = len(decode_context)
        return cls(n, n, [], [], decode_context, offset, n, base_sum + n * offset, base_max + offset,
                   base_min + offset)

    def decode_lengths(self) -> list[int]:
        """Per-decode context lengths with the offset applied."""
        off = self.decode_offset
        return [c + off for c in self.decode_context] if off else list(self.decode_context)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes


class CostModel(Protocol):
    """Maps a batch shape to the time of one step on one instance.

    ``step_time`` is the hot path (called once per simulated step): implementations cache what depends only on
    (num_tokens, num_seqs) and read decodes through the aggregates. ``breakdown`` returns the same total split by
    component (seconds), for reports and ``servelab cost``; the values sum to ``step_time``.
    """

    name: str

    def step_time(self, shape: BatchShape) -> float: ...

    def breakdown(self, shape: BatchShape) -> dict[str, float]: ...
