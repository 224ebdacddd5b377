"""What both schedulers are fed: engine settings, a trace of requests, and the fabricated model outputs.

Nothing here imports vLLM. A trace gives every request its prompt token ids, the output token ids the fabricated
model samples (so output blocks hash alike on both sides), the scheduler step before which it arrives and its
priority. Accepted drafts and n-gram proposals are counter-based draws (lab/core/speculation.py ``uniform``): the
vLLM side keeps its own counters per request and draws the same numbers servelab's ``Speculator`` draws, so the
two sides agree on every model output for as long as they agree on the schedule.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from lab.core.speculation import uniform

#: the vLLM release the parity harness is pinned to (pyproject.toml ``parity`` extra, parity/requirements.txt)
VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class Settings:
    """One engine configuration, given to both sides.

    ``spec``: None, "ngram" (no lookahead slots; a proposal only with probability ``hit_probability``) or "eagle"
    (``k`` lookahead slots, a proposal every step). ``async_scheduling``: vLLM's ``AsyncScheduler`` and two steps
    in flight (servelab ``EngineOptions.async_scheduling``)."""

    num_blocks: int = 32
    block_size: int = 4
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 32
    max_model_len: int = 256
    prefix_caching: bool = True
    async_scheduling: bool = False
    spec: str | None = None
    k: int = 0
    rates: tuple[float, ...] = (0.7,)
    hit_probability: float = 1.0
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    seed: int = 0

    def describe(self) -> str:
        d = asdict(self)
        return " ".join(f"{k}={v}" for k, v in d.items())


@dataclass(frozen=True)
class TraceRequest:
    """A request: it arrives before scheduler call ``arrival`` (0-based) of the run."""

    index: int
    arrival: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]  # the tokens the model samples, in order (longer than max_tokens: drafts past the end)
    max_tokens: int
    priority: int = 0

    @property
    def request_id(self) -> str:
        return str(self.index)


@dataclass
class Trace:
    settings: Settings
    requests: list[TraceRequest] = field(default_factory=list)


class FabricatedModel:
    """The model outputs both sides agree on: which drafts the target accepts, whether the drafter proposes.

    Per request a draw counter, as ``Request.spec_draws`` in servelab: a proposal with ``hit_probability < 1``
    takes one draw, a verification of d drafts takes one draw per accepted draft plus the first rejected one."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        k = max(settings.k, 1)
        rates = list(settings.rates)
        self.rates = (rates + [rates[-1]] * k)[:k]
        self.draws: dict[int, int] = {}

    def propose(self, index: int) -> int:
        s = self.s
        if s.hit_probability >= 1.0:
            return s.k
        d = self.draws.get(index, 0)
        self.draws[index] = d + 1
        return s.k if uniform(s.seed, index, d) < s.hit_probability else 0

    def num_accepted(self, index: int, num_drafts: int) -> int:
        d = self.draws.get(index, 0)
        accepted = 0
        while accepted < num_drafts:
            u = uniform(self.s.seed, index, d)
            d += 1
            if u >= self.rates[accepted]:
                break
            accepted += 1
        self.draws[index] = d
        return accepted


def peak_tokens(s: Settings, prompt_len: int, max_tokens: int) -> int:
    """The most KV slots a request can hold (servelab ``Instance.peak_kv_tokens``): its last step's tokens, drafts
    (twice under async scheduling) and lookahead slots, capped at ``max_model_len``."""
    k = s.k * (2 if s.async_scheduling else 1)
    lookahead = s.k if s.spec == "eagle" else 0
    return min(prompt_len + max_tokens - 1 + k + lookahead, s.max_model_len)


def random_settings(rng: random.Random) -> Settings:
    """Small engines that preempt often: few blocks, small budgets, prefix caching, async scheduling, drafts."""
    block_size = rng.choice([2, 4, 8])
    max_num_seqs = rng.randint(1, 6)
    spec = rng.choice([None, None, "ngram", "eagle"])
    async_ = rng.random() < 0.4
    if async_ and spec == "ngram":  # vLLM runs n-gram drafting synchronously (§6: async_scheduling)
        spec = "eagle"
    k = rng.randint(1, 3) if spec else 0
    return Settings(
        num_blocks=rng.randint(12, 48), block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_seqs, rng.choice([8, 12, 16, 24, 32, 64])),
        max_model_len=rng.choice([64, 128, 256]), prefix_caching=rng.random() < 0.75, async_scheduling=async_,
        spec=spec, k=k, rates=tuple(round(rng.uniform(0.2, 0.95), 2) for _ in range(rng.randint(1, 3))),
        hit_probability=1.0 if spec != "ngram" else round(rng.uniform(0.3, 1.0), 2),
        long_prefill_token_threshold=rng.choice([0, 0, 0, 4, 8, 16]),
        policy=rng.choice(["fcfs", "fcfs", "priority"]), seed=rng.randrange(1 << 30))


def random_trace(rng: random.Random, settings: Settings, num_requests: int | None = None) -> Trace:
    """Requests with shared prefixes (so the prefix cache hits), arrivals spread over the first schedules, and
    lengths that fit an empty cache (servelab rejects a request that never fits; vLLM would preempt it forever)."""
    s = settings
    n = num_requests if num_requests is not None else rng.randint(1, 10)
    usable = (s.num_blocks - 1) * s.block_size
    prefixes = [tuple(rng.randrange(3, 40) for _ in range(rng.randint(1, 3) * s.block_size)) for _ in range(3)]
    reqs = []
    arrival = 0
    for i in range(n):
        for _ in range(100):
            prompt_len = rng.randint(1, 40)
            max_tokens = rng.randint(1, 16)
            if (prompt_len + max_tokens <= s.max_model_len
                    and peak_tokens(s, prompt_len, max_tokens) <= usable):
                break
        else:
            prompt_len, max_tokens = 1, 1
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.6 else []
        prompt = (prompt + [rng.randrange(3, 40) for _ in range(prompt_len)])[:prompt_len]
        output = tuple(rng.randrange(3, 40) for _ in range(max_tokens + 2 * s.k + 2))
        if rng.random() < 0.5:
            arrival += rng.randint(0, 4)
        reqs.append(TraceRequest(i, arrival, tuple(prompt), output, max_tokens,
                                 rng.randint(0, 2) if s.policy == "priority" else 0))
    return Trace(s, reqs)
