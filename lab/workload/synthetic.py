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

    def check(self) -> None:
        """Raises:
            ValueError: a parameter that is not a finite number, ``min`` < 1, ``min`` > ``max`` or ``low`` > ``high``.
        """
        for name in ("value", "low", "high", "median", "sigma", "mean", "std", "min", "max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(v):
                raise ValueError(f"length distribution {self.kind}: {name} must be a finite number, got {v!r}")
        if self.min < 1 or self.min > self.max:
            raise ValueError(f"length distribution {self.kind}: need 1 <= min <= max, got min {self.min}, "
                             f"max {self.max}")
        if self.kind == "uniform" and self.low > self.high:
            raise ValueError(f"length distribution uniform: low {self.low} > high {self.high}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` lengths.

        Raises:
            ValueError: unknown kind or a bad parameter (see :meth:`check`).
        """
        self.check()
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


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_args(num_requests, rate, cv, num_priorities) -> None:
    """Raises:
        ValueError: the first bad generator argument (see :func:`generate`).
    """
    if not _is_int(num_requests) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    for name, v, unit in (("rate", rate, " requests/s"), ("cv", cv, "")):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not (np.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0{unit}, got {v!r}")
    if not _is_int(num_priorities) or num_priorities < 1:
        raise ValueError(f"num_priorities must be an integer >= 1, got {num_priorities!r}")


def _arrival_times(rng: np.random.Generator, n: int, rate: float, cv: float) -> np.ndarray:
    """``n`` arrival times (seconds), the first at 0: exponential gaps at ``rate`` per second (Poisson), or Gamma
    gaps with coefficient of variation ``cv``."""
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, n)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


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
        ValueError: a count that is not an integer >= 1, a rate or cv that is not a finite number > 0, a
        num_priorities below 1, or a bad length distribution.
    """
    _check_args(num_requests, rate, cv, num_priorities)
    rng = np.random.default_rng(seed)
    t = _arrival_times(rng, num_requests, rate, cv)
    p = prompt.sample(rng, num_requests)
    o = output.sample(rng, num_requests)
    prio = rng.integers(0, num_priorities, num_requests) if num_priorities > 1 else np.zeros(num_requests, int)
    # numpy scalars converted once, column by column (tolist), not one element at a time; the arguments passed by
    # position (the compiled constructor parses keywords ~1 us slower a call: ~1 s in a million requests)
    return list(map(Request, range(num_requests), np.asarray(t, dtype=float).tolist(), np.asarray(p).tolist(),
                    np.asarray(o).tolist(), np.asarray(prio).tolist()))


def generate_sessions(num_sessions: int, rate: float, turns: LengthDist, first_prompt: LengthDist,
                      turn_tokens: LengthDist, output: LengthDist, seed: int = 0,
                      cv: float = 1.0) -> tuple[list[list[Request]], list[float]]:
    """Generate multi-turn conversations: ``num_sessions`` sessions starting at ``rate`` sessions/s, each with a
    number of turns drawn from ``turns``. Turn 1's prompt has ``first_prompt`` tokens; turn i+1's prompt is the
    whole conversation so far (every earlier prompt and answer) plus ``turn_tokens`` new tokens, so the prefix cache
    sees the reuse: every token has an id, unique to its session, and answers carry their ids too.

    Returns:
        (the sessions, each a list of its turns' requests in order, indices running over all turns; the sessions'
        start times in seconds). A turn's ``arrival_time`` is its session's start until it is sent (closed loop).

    Raises:
        ValueError: as :func:`generate`, or a bad length distribution.
    """
    _check_args(num_sessions, rate, cv, 1)
    rng = np.random.default_rng([seed, 0x5E55])
    starts = _arrival_times(rng, num_sessions, rate, cv).tolist()
    n_turns = turns.sample(rng, num_sessions)
    sessions: list[list[Request]] = []
    next_id = 0
    index = 0
    for s in range(num_sessions):
        history: list[int] = []
        convo: list[Request] = []
        for k in range(int(n_turns[s])):
            new = int((first_prompt if k == 0 else turn_tokens).sample(rng, 1)[0])
            out = int(output.sample(rng, 1)[0])
            prompt_ids = history + list(range(next_id, next_id + new))
            out_ids = list(range(next_id + new, next_id + new + out))
            next_id += new + out
            r = Request(index, starts[s], len(prompt_ids), out, request_id=f"s{s}.t{k}",
                        prompt_token_ids=prompt_ids, output_token_ids=out_ids, session_id=f"s{s}")
            convo.append(r)
            history = prompt_ids + out_ids
            index += 1
        sessions.append(convo)
    return sessions, starts
