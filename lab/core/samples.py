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
# bounded on long runs (percentiles then carry at most RESOLUTION/2 of rounding).
COMPACT_AT = 2_000_000
RESOLUTION = 1e-7


class WeightedSamples:
    """A multiset of float samples stored as (value, weight) pairs; exact until ``COMPACT_AT`` pairs, then kept at
    ``RESOLUTION`` (0.1 µs)."""

    __slots__ = ("values", "weights", "compacted")

    def __init__(self) -> None:
        self.values = array("d")
        self.weights = array("d")
        self.compacted = False

    def add(self, value: float, weight: float = 1.0) -> None:
        self.values.append(value)
        self.weights.append(weight)
        if len(self.values) > COMPACT_AT:
            self.compact()

    def extend(self, values, weight: float) -> None:
        """Add each of ``values`` with the same ``weight``."""
        self.values.extend(values)
        self.weights.extend([weight] * len(values))
        if len(self.values) > COMPACT_AT:
            self.compact()

    def extend_pairs(self, values, weights) -> None:
        """Add ``values[i]`` with weight ``weights[i]`` (sequences, or numpy arrays: copied as raw float64 bytes)."""
        for store, new in ((self.values, values), (self.weights, weights)):
            if isinstance(new, np.ndarray):
                store.frombytes(new.astype(np.float64).tobytes())
            else:
                store.extend(new)
        if len(self.values) > COMPACT_AT:
            self.compact()

    def clear(self) -> None:
        """Drop every sample (a closed-loop run's warm-up ends)."""
        self.values = array("d")
        self.weights = array("d")
        self.compacted = False

    def compact(self) -> None:
        """Round values to ``RESOLUTION`` and merge equal ones (weights add)."""
        v, w = self.arrays()
        keys, inv = np.unique(np.round(v / RESOLUTION).astype(np.int64), return_inverse=True)
        weights = np.bincount(inv, weights=w)
        self.values = array("d", (keys * RESOLUTION).tolist())
        self.weights = array("d", weights.tolist())
        self.compacted = True

    def merge(self, other: "WeightedSamples") -> None:
        self.values.extend(other.values)
        self.weights.extend(other.weights)

    @property
    def count(self) -> int:
        """Number of samples represented (Σ weights)."""
        return int(round(float(np.sum(np.frombuffer(self.weights, dtype=float))))) if len(self.weights) else 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not len(self.values):
            return np.array([], float), np.array([], float)
        return np.frombuffer(self.values, dtype=float), np.frombuffer(self.weights, dtype=float)

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
