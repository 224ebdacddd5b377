"""Speculative decoding's random part: whether a drafter proposes, and how many of its drafts the target accepts.

vLLM's rejection sampler (vllm/v1/sample/rejection_sampler.py) keeps draft i only if drafts 1..i-1 were kept, so
the model here is a vector of *conditional* acceptance probabilities p_1..p_K: draft i is accepted with
probability p_i given that 1..i-1 were (shared/specs/vllm-v1-scheduling.md §3). A request may carry its own
i.i.d. rate (``Request.acceptance_rate``: from the trace, or drawn per request), which then replaces the vector.
n-gram prompt lookup proposes only when it finds a match: ``hit_probability`` is the chance that it finds one at a
step (no match = no drafts that step, as vLLM's ``NgramProposer`` returns none).

Every draw is a counter-based uniform of (seed, request index, draw number), so a request's acceptance stream is
the same whatever else runs beside it, on any instance and in any process (common random numbers across the
configurations a sweep compares), and a run is reproducible for a given seed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lab.core.request import Request

_MASK = (1 << 64) - 1
# SplitMix64's multipliers (Steele, Lea and Flood 2014): the finaliser's two, also the weights of index and counter
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = np.uint64
# A request's uniforms are computed this many at a time (numpy, 64-bit words) and kept for at most this many
# requests, the oldest dropped first (a dropped block is computed again when needed: the same values).
STREAM_BLOCK = 128
MAX_STREAM_BLOCKS = 2048


def uniform(seed: int, index: int, counter: int) -> float:
    """A uniform number in [0, 1) from (seed, request index, draw number): SplitMix64's finaliser over a mix of
    the three (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014)."""
    return stream_uniform(stream_base(seed, index), counter)


def stream_base(seed: int, index: int) -> int:
    """The part of :func:`uniform`'s mix that depends on (seed, request index) only, reduced mod 2**64: a request's
    draws then cost one multiplication less each (:func:`stream_uniform`; the mix is a sum mod 2**64, so the values
    are the same)."""
    return (seed * 0x9E3779B97F4A7C15 + index * _MIX1 + 0x632BE59BD9B4E019) & _MASK


def stream_uniform(base: int, counter: int) -> float:
    """:func:`uniform` of draw number ``counter`` of the stream whose :func:`stream_base` is ``base``."""
    z = (base + counter * _MIX2) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


def stream_uniforms(base: int, first: int, count: int) -> list[float]:
    """:func:`stream_uniform` of draws ``first`` .. ``first + count - 1`` of the stream whose :func:`stream_base` is
    ``base``, computed together in numpy's 64-bit words, whose arithmetic wraps mod 2**64 as the masks above do:
    the same floats."""
    z = _U64(base) + np.arange(first, first + count, dtype=_U64) * _U64(_MIX2)
    z = (z ^ (z >> _U64(30))) * _U64(_MIX1)
    z = (z ^ (z >> _U64(27))) * _U64(_MIX2)
    z ^= z >> _U64(31)
    uniforms: list[float] = ((z >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))).tolist()
    return uniforms


class Speculator:
    """Proposes drafts and decides their acceptance for one instance; keeps vLLM's spec-decode counters.

    Args:
        num_speculative_tokens: k, drafts proposed per step (vLLM ``num_speculative_tokens``).
        acceptance_rates: conditional acceptance probability of draft 1, 2, ... (each in [0, 1]); positions past
            the end of the list take its last value.
        seed: the experiment's seed.
        hit_probability: chance that the drafter has a proposal at a step (n-gram lookup; 1 for model drafters).

    Attributes (vLLM ``SpecDecodingStats``, v1/spec_decode/metrics.py): ``num_drafts`` (verifications with at least
    one real draft), ``num_draft_tokens``, ``num_accepted_tokens`` and ``accepted_per_pos[i]`` (verifications whose
    draft i+1 was accepted).

    Raises:
        ValueError: k < 1, an empty or out-of-range rate vector, or a hit probability outside [0, 1].
    """

    def __init__(self, num_speculative_tokens: int, acceptance_rates: Sequence[float], seed: int = 0,
                 hit_probability: float = 1.0) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        rates = [float(p) for p in acceptance_rates]
        if not rates or not all(0.0 <= p <= 1.0 for p in rates):
            raise ValueError(f"acceptance rates must be a non-empty list of probabilities in [0, 1], got {rates}")
        if not 0.0 <= hit_probability <= 1.0:
            raise ValueError(f"hit_probability must be in [0, 1], got {hit_probability}")
        k = num_speculative_tokens
        self.num_speculative_tokens = k
        self.rates = (rates + [rates[-1]] * k)[:k]
        self.seed = int(seed)
        self.hit_probability = float(hit_probability)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k
        # request index -> (its first draw number there, its next STREAM_BLOCK uniforms from it)
        self._blocks: dict[int, tuple[int, list[float]]] = {}

    def propose(self, request: Request) -> int:
        """Drafts the drafter proposes for ``request``'s next step: k, or 0 when an n-gram lookup misses."""
        if self.hit_probability >= 1.0:
            return self.num_speculative_tokens
        draw = request.spec_draws
        request.spec_draws = draw + 1
        hit = uniform(self.seed, request.index, draw) < self.hit_probability
        return self.num_speculative_tokens if hit else 0

    def num_accepted(self, request: Request, num_draft_tokens: int) -> int:
        """Accepted drafts of one verification (0..num_draft_tokens); updates the request's and the run's
        counters. Draft i is drawn against the request's own rate if it has one, else against ``rates[i]``; the
        uniforms come from the request's block of its stream (:meth:`_uniforms_from`)."""
        own = request.acceptance_rate
        rates = self.rates
        draw = request.spec_draws
        first, uniforms = self._uniforms_from(request.index, draw, num_draft_tokens)
        accepted = 0
        while accepted < num_draft_tokens:
            p = own if own is not None else rates[accepted]
            u = uniforms[draw - first]
            draw += 1
            if u >= p:
                break
            accepted += 1
        request.spec_draws = draw
        request.num_drafts += 1
        request.num_draft_tokens += num_draft_tokens
        request.num_accepted_tokens += accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accepted
        per_pos = self.accepted_per_pos
        for i in range(accepted):
            per_pos[i] += 1
        return accepted

    def _uniforms_from(self, index: int, draw: int, count: int) -> tuple[int, list[float]]:
        """(first, uniforms): a block of request ``index``'s stream holding its draws ``draw`` .. ``draw + count -
        1`` (uniforms[d - first] is draw d), kept from an earlier verification or computed now. With this module
        compiled, a verification of 3 drafts then costs 0.55 us against 2.29 us drawing each in Python's big
        integers (timeit, 32 requests)."""
        blocks = self._blocks
        block = blocks.get(index)
        if block is None or draw < block[0] or draw + count > block[0] + len(block[1]):
            block = (draw, stream_uniforms(stream_base(self.seed, index), draw, max(STREAM_BLOCK, count)))
            if index not in blocks and len(blocks) >= MAX_STREAM_BLOCKS:
                del blocks[next(iter(blocks))]
            blocks[index] = block
        return block

    def expected_accepted(self, num_draft_tokens: int) -> float:
        """Mean accepted drafts of a verification of ``num_draft_tokens`` under ``rates``: Σ_i Π_{j<=i} p_j."""
        total = run = 0.0
        run = 1.0
        for p in self.rates[:num_draft_tokens]:
            run *= p
            total += run
        return total
