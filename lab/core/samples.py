"""Weighted samples: a compact, exact store for metrics with many repeated values (inter-token latencies).

Every request decoding in the same step produces the same ITL sample (the step's duration), so one
(value, weight) pair stands for the whole batch. Statistics are exact: the percentiles equal numpy's default
(linear interpolation) percentiles of the expanded sample list.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np


# Beyond this many stored pairs, values are rounded to RESOLUTION seconds and equal values merged, so memory stays
# bounded on long runs (percentiles then carry at most RESOLUTION/2 of rounding). The next compaction waits until
# the store has doubled, so a run whose distinct values are many does not sort them again every few steps.
COMPACT_AT = 2_000_000
RESOLUTION = 1e-7


class WeightedSamples:
    """A multiset of float samples stored as (value, weight) pairs; exact until ``COMPACT_AT`` pairs, then kept at
    ``RESOLUTION`` (0.1 µs).

    Pairs added one at a time go to two growing arrays; pairs added in bulk (numpy arrays) are kept as chunks, in
    the order added, and joined only when read: one array of tens of millions of pairs grown step by step is
    reallocated and copied each time it outgrows its allocation (a million-request run spent ~4 % of its time so).
    """

    __slots__ = ("_values", "_weights", "_chunks", "_stored", "_compact_at", "compacted")

    def __init__(self) -> None:
        self._values = array("d")  # pairs added one at a time since the last chunk
        self._weights = array("d")
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []  # (values, weights), float64, in the order added
        self._stored = 0  # pairs in the chunks
        self._compact_at = COMPACT_AT
        self.compacted = False

    def __len__(self) -> int:
        """Stored (value, weight) pairs (not the samples they stand for: :attr:`count`)."""
        return self._stored + len(self._values)

    def add(self, value: float, weight: float = 1.0) -> None:
        self._values.append(value)
        self._weights.append(weight)
        if self._stored + len(self._values) > self._compact_at:
            self.compact()

    def extend(self, values, weight: float) -> None:
        """Add each of ``values`` with the same ``weight``."""
        self._values.extend(values)
        self._weights.extend([weight] * len(values))
        if self._stored + len(self._values) > self._compact_at:
            self.compact()

    def extend_pairs(self, values, weights) -> None:
        """Add ``values[i]`` with weight ``weights[i]`` (sequences, or numpy arrays: copied as float64)."""
        if not isinstance(values, np.ndarray):
            self._values.extend(values)
            self._weights.extend(weights)
        elif len(values):
            self._flush()
            self._chunks.append((np.array(values, dtype=np.float64), np.array(weights, dtype=np.float64)))
            self._stored += len(values)
        if self._stored + len(self._values) > self._compact_at:
            self.compact()

    def _flush(self) -> None:
        """Move the pairs added one at a time into a chunk (keeping the order pairs were added in)."""
        if len(self._values):
            self._chunks.append((np.array(self._values, dtype=np.float64), np.array(self._weights, dtype=np.float64)))
            self._stored += len(self._values)
            self._values = array("d")
            self._weights = array("d")

    def clear(self) -> None:
        """Drop every sample (a closed-loop run's warm-up ends)."""
        self.__init__()

    def compact(self) -> None:
        """Round values to ``RESOLUTION`` and merge equal ones (weights add)."""
        v, w = self.arrays()
        keys, inv = np.unique(np.round(v / RESOLUTION).astype(np.int64), return_inverse=True)
        weights = np.bincount(inv, weights=w)
        self._chunks = [(keys * RESOLUTION, weights)]
        self._stored = len(keys)
        self._compact_at = max(COMPACT_AT, 2 * len(keys))
        self.compacted = True

    def merge(self, other: "WeightedSamples") -> None:
        self.extend_pairs(*other.arrays())

    @property
    def count(self) -> int:
        """Number of samples represented (Σ weights)."""
        return int(round(float(np.sum(self.arrays()[1])))) if len(self) else 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, weights) of every stored pair, in the order added (float64 arrays; joined once, then kept)."""
        self._flush()
        chunks = self._chunks
        if not chunks:
            return np.array([], float), np.array([], float)
        if len(chunks) > 1:
            chunks[:] = [(np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]))]
        return chunks[0]

    def expand(self) -> np.ndarray:
        """The samples one by one (for plots and tests); memory grows with the count."""
        v, w = self.arrays()
        return np.repeat(v, w.astype(np.int64))

    def describe(self, percentiles: Sequence[float]) -> dict[str, float | int | None]:
        """count, mean, median, std and percentiles, equal to numpy's on the expanded samples."""
        v, w = self.arrays()
        keep = w > 0
        v, w = v[keep], w[keep]
        out: dict[str, float | int | None] = {"count": int(round(w.sum())) if w.size else 0}
        if v.size == 0:
            out.update({"mean": None, "median": None, "std": None, **{f"p{p:g}": None for p in percentiles}})
            return out
        # merge equal values first (np.unique sorts; whole-number weights add exactly), so the sums below do not
        # depend on the order samples were added in: a bulk (value, 3) and three single samples give the same bits
        v, inv = np.unique(v, return_inverse=True)
        w = np.bincount(inv, weights=w)
        n = w.sum()
        mean = float(np.dot(v, w) / n)
        out["mean"] = mean
        out["std"] = float(np.sqrt(np.dot(w, (v - mean) ** 2) / n))
        cum = np.cumsum(w)

        def at(idx: float) -> float:
            # value of the idx-th (0-based) sample of the sorted expansion
            return float(v[np.searchsorted(cum, idx, side="right")])

        def pct(p: float) -> float:
            h = (n - 1) * p / 100.0
            lo = np.floor(h)
            a = at(lo)
            return a if h == lo else a + (h - lo) * (at(lo + 1) - a)

        out["median"] = pct(50)
        for p in percentiles:
            out[f"p{p:g}"] = pct(p)
        return out
