"""vLLM V0's batch-expansion scoring of speculative drafts (``vllm/spec_decode/batch_expansion.py``
``BatchExpansionTop1Scorer``, vLLM 0.4-0.6; the MQA scorer replaced it as the default in later V0 releases, and V1
verifies as a k + 1-token query).

To score k drafts of a request with context c, V0 expands the request into k + 1 single-token sequences with
contexts c, c + 1, ..., c + k (the last sampled token and the drafts before each position) and runs them as one
decode batch through the target: every expanded sequence reads its KV context again, so a verify of B requests
reads about (k + 1) x the KV of a B-request decode, where a k + 1-token query reads it once. The token count, and so
the GEMMs, are the same either way.
"""

from __future__ import annotations

from typing import Sequence

from lab.core.batch import BatchShape
from lab.costmodel.base import CostModel, CostModelBase


def expanded(shape: BatchShape) -> BatchShape:
    """``shape`` with every verify query (q tokens over context c) replaced by q decodes over contexts c .. c + q - 1;
    the shape itself when it has no verify query."""
    if not shape.verify_new:
        return shape
    dc = list(shape.decode_context)
    for q, c in zip(shape.verify_new, shape.verify_context):
        dc.extend(range(c, c + q))
    nd = len(dc)
    num_seqs = shape.num_seqs - len(shape.verify_new) + sum(shape.verify_new)
    return BatchShape(shape.num_tokens, num_seqs, list(shape.prefill_new), list(shape.prefill_context), dc, nd,
                      sum(dc), max(dc), min(dc), shape.padded_tokens, [], [], shape.group_tokens)


class BatchExpansionCostModel(CostModelBase):
    """A target cost model whose verify queries are priced as V0's expanded decode batch (:func:`expanded`).

    Args:
        inner: the target model's cost model.
    """

    def __init__(self, inner: CostModel) -> None:
        self.inner = inner
        self.name = f"{inner.name} (V0 batch-expansion scoring)"
        self.uses_decode_range = inner.uses_decode_range
        self.uses_decode_list = inner.uses_decode_list

    def step_time(self, shape: BatchShape) -> float:
        return self.inner.step_time(expanded(shape))

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        return self.inner.breakdown(expanded(shape))

    def decode_times(self, *args, **kwargs):
        return self.inner.decode_times(*args, **kwargs)

    def steady_decode_times(self, *args, **kwargs):
        return self.inner.steady_decode_times(*args, **kwargs)

    def stage_times(self, shape: BatchShape, stage_layers: Sequence[int]) -> list[float]:
        return self.inner.stage_times(expanded(shape), stage_layers)
