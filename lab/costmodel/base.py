"""What every cost model takes and returns: a batch shape in, a step time (seconds) out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class BatchShape:
    """The shape of one engine step, as the attention and GEMM kernels see it.

    A request scheduled with more than one token is a prefill chunk (its ``num_new_tokens`` go to
    ``prefill_new``, the tokens it had already computed to ``prefill_context``); a request scheduled with exactly
    one token is a decode (its already computed tokens go to ``decode_context``). This is how the varlen
    attention kernel and LLMServingSim's profiles classify a batch.

    Attributes:
        num_tokens: Σ tokens computed this step (T).
        num_seqs: requests in the batch (logits are computed for one position of each).
        prefill_new: per prefill chunk, its new tokens.
        prefill_context: per prefill chunk, tokens already in its KV cache (prefix hits and earlier chunks).
        decode_context: per decode, tokens already in its KV cache.
    """

    num_tokens: int = 0
    num_seqs: int = 0
    prefill_new: list[int] = field(default_factory=list)
    prefill_context: list[int] = field(default_factory=list)
    decode_context: list[int] = field(default_factory=list)

    @classmethod
    def from_requests(cls, new_tokens: list[int], computed_before: list[int]) -> "BatchShape":
        """Build a shape from parallel lists of per-request new tokens and tokens computed before the step."""
        shape = cls(num_tokens=sum(new_tokens), num_seqs=len(new_tokens))
        for n, c in zip(new_tokens, computed_before):
            if n > 1:
                shape.prefill_new.append(n)
                shape.prefill_context.append(c)
            else:
                shape.decode_context.append(c)
        return shape

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_new)


class CostModel(Protocol):
    """Maps a batch shape to the time of one step on one instance.

    ``step_time`` is the hot path. ``breakdown`` returns the same total split by component (seconds), for
    reports and ``servelab cost``; the values sum to ``step_time``.
    """

    name: str

    def step_time(self, shape: BatchShape) -> float: ...

    def breakdown(self, shape: BatchShape) -> dict[str, float]: ...
