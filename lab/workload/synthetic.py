"""Seeded synthetic workloads: Poisson (or Gamma-burst) arrivals with length distributions.

Length distributions (tokens, rounded and clipped to [min, max]):
``constant`` (value), ``uniform`` (low, high), ``lognormal`` (median, sigma: the log-space standard deviation),
``normal`` (mean, std), ``exponential`` (mean). Arrivals: exponential inter-arrival times at ``rate`` req/s
(``cv`` = 1, Poisson) or Gamma inter-arrivals with coefficient of variation ``cv`` (bursty when > 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lab.core.request import Request


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution; see the module docstring for the kinds and their parameters."""

    kind: str = "lognormal"
    value: float = 0.0
    low: float = 1.0
    high: float = 1.0
    median: float = 512.0
    sigma: float = 0.8
    mean: float = 512.0
    std: float = 128.0
    min: int = 1
    max: int = 32768

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` lengths.

        Raises:
            ValueError: unknown kind.
        """
        k = self.kind
        if k == "constant":
            x = np.full(n, self.value)
        elif k == "uniform":
            x = rng.uniform(self.low, self.high + 1, n)
        elif k == "lognormal":
            x = rng.lognormal(np.log(self.median), self.sigma, n)
        elif k == "normal":
            x = rng.normal(self.mean, self.std, n)
        elif k == "exponential":
            x = rng.exponential(self.mean, n)
        else:
            raise ValueError(f"unknown length distribution {k!r}; expected constant, uniform, lognormal, normal or "
                             "exponential")
        return np.clip(np.floor(x), max(1, self.min), self.max).astype(np.int64)


def generate(num_requests: int, rate: float, prompt: LengthDist, output: LengthDist, seed: int = 0,
             cv: float = 1.0, num_priorities: int = 1) -> list[Request]:
    """Generate ``num_requests`` requests arriving at ``rate`` req/s, the first at t = 0.

    Args:
        num_requests: how many requests (>= 1).
        rate: mean arrival rate, requests per second (> 0).
        prompt, output: length distributions.
        seed: RNG seed; the same seed gives the same trace.
        cv: coefficient of variation of inter-arrival times (1 = Poisson).
        num_priorities: priorities drawn uniformly from 0..num_priorities-1 (1 = all 0).

    Raises:
        ValueError: non-positive count, rate or cv.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    rng = np.random.default_rng(seed)
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, num_requests)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), num_requests)
    gaps[0] = 0.0
    t = np.cumsum(gaps)
    p = prompt.sample(rng, num_requests)
    o = output.sample(rng, num_requests)
    prio = rng.integers(0, num_priorities, num_requests) if num_priorities > 1 else np.zeros(num_requests, int)
    return [Request(i, float(t[i]), int(p[i]), int(o[i]), priority=int(prio[i])) for i in range(num_requests)]
