"""What every cost model takes and returns: a batch shape (lab/core/batch.py) in, a step time (seconds) out.

:class:`CostModel` is the interface the engine relies on; :class:`CostModelBase` gives the two derived
capabilities (vectorised decode stretches for the fast-forward, per-stage times for pipeline parallelism) a
default built on ``step_time``, so a cost model only has to price one step.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from lab.core.batch import BatchShape


class CostModel(Protocol):
    """Maps a batch shape to the time of one step on one instance.

    ``step_time`` is the hot path (called once per simulated step): implementations cache what depends only on
    (num_tokens, num_seqs) and read decodes through the aggregates. ``breakdown`` returns the same total split by
    component (seconds), for reports and ``servelab cost``; the values sum to ``step_time``.
    """

    name: str
    uses_decode_range: bool
    uses_decode_list: bool

    def step_time(self, shape: BatchShape) -> float: ...

    def breakdown(self, shape: BatchShape) -> dict[str, float]: ...

    def decode_times(self, num_decodes: np.ndarray, decode_sum: np.ndarray, decode_max: np.ndarray,
                     decode_min: np.ndarray, padded: np.ndarray) -> np.ndarray | None: ...

    def steady_decode_times(self, num_decodes: int, decode_sum: int, decode_max: int, decode_min: int, padded: int,
                            num_steps: int) -> list[float] | None: ...

    def stage_times(self, shape: BatchShape, stage_layers: Sequence[int]) -> list[float]: ...

    def host_time(self, shape: BatchShape) -> float: ...


class CostModelBase:
    """Defaults for a cost model that implements ``step_time`` (and optionally ``breakdown``)."""

    name = "cost model"
    # whether decode_times reads decode_max / decode_min (the fast-forward skips them when not)
    uses_decode_range = True
    # whether step_time reads decodes one by one (BatchShape.decode_context), not only through their count, Σ and
    # (with uses_decode_range) range: when not, the fast-forward prices planned steps from the aggregates alone
    uses_decode_list = True

    def step_time(self, shape: BatchShape) -> float:  # pragma: no cover - every cost model overrides it
        raise NotImplementedError

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """One component, ``step``, holding the whole step time."""
        return {"step": self.step_time(shape)}

    def decode_times(self, num_decodes: np.ndarray, decode_sum: np.ndarray, decode_max: np.ndarray,
                     decode_min: np.ndarray, padded: np.ndarray) -> np.ndarray | None:
        """Times (seconds) of a run of pure-decode steps given per step: decodes, Σ context tokens, largest and
        smallest context, CUDA-graph padded tokens (0 = none); each value must equal ``step_time`` of that step bit
        for bit. None = no vectorised form: the fast-forward then prices each step with ``step_time``."""
        return None

    def steady_decode_times(self, num_decodes: int, decode_sum: int, decode_max: int, decode_min: int, padded: int,
                            num_steps: int) -> list[float] | None:
        """Times (seconds) of ``num_steps`` consecutive pure-decode steps of one unchanged batch: step t has
        ``num_decodes`` decodes, Σ contexts ``decode_sum + t · num_decodes``, range ``decode_min + t`` ..
        ``decode_max + t`` and ``padded`` tokens (0 = none); each value equal to ``step_time`` bit for bit. The
        scalar form of :meth:`decode_times` for a fast-forward between two arrivals (tens of steps, where numpy's
        cost per call outweighs its work). None = not offered (the fast-forward then uses ``decode_times``)."""
        return None

    def host_time(self, shape: BatchShape) -> float:
        """CPU seconds the step adds to the engine's per-step CPU work beyond ``EngineOptions``' terms (under async
        scheduling the engine overlaps them with the step in flight; lab/engine/instance.py ``step_cpu_time``).
        Default 0; a speculative step's proposer launches (lab/costmodel/spec_step.py)."""
        return 0.0

    def stage_times(self, shape: BatchShape, stage_layers: Sequence[int]) -> list[float]:
        """Seconds each pipeline stage spends on this micro-batch, stage order; they sum to ``step_time``.

        The default splits the step in proportion to each stage's layers (``stage_layers``, from
        lab/costmodel/parallel.py ``Parallelism.stage_layers``): per-layer work dominates, and a cost model that
        prices PP send/recv in ``step_time`` spreads it over the stages. One stage returns the step time itself.
        """
        total = self.step_time(shape)
        if len(stage_layers) == 1:
            return [total]
        layers = sum(stage_layers)
        return [total * n / layers for n in stage_layers]
