"""Property test: vLLM 0.33.0's own scheduler and servelab's ``vllm_v1`` policy agree step for step on random small
traces and engine settings (parity/, docs/vllm_parity.md).

It needs the parity environment (``make parity`` builds .venv-parity and runs this file there); in servelab's own
environment vLLM is absent and the whole module skips (under ``PARITY_REQUIRED=1``, which ``make parity`` sets, a
missing or broken vLLM fails it instead). ``PARITY_EXAMPLES`` sets the number of hypothesis examples
(default 25; ``make parity`` runs 100). The examples are derandomized, so CI sees the same ones every run; the
harness's ``python -m parity --traces N --seed S`` explores further seeds.
"""

from __future__ import annotations

import os
import random

import pytest

if os.environ.get("PARITY_REQUIRED") == "1":  # make parity: a broken install fails here instead of skipping
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="needs vLLM 0.33.0: `make parity` builds .venv-parity and runs this file there")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from parity import known  # noqa: E402
from parity.harness import run  # noqa: E402
from parity.trace import VLLM_VERSION, Settings, random_trace  # noqa: E402

EXAMPLES = int(os.environ.get("PARITY_EXAMPLES", "25"))


@st.composite
def engine_settings(draw) -> Settings:
    """Small engines that preempt often: few blocks, small budgets, prefix caching, async scheduling, drafts
    (as ``parity.trace.random_settings``, drawn by hypothesis so that a failure shrinks)."""
    max_num_seqs = draw(st.integers(1, 6))
    spec = draw(st.sampled_from([None, "ngram", "eagle"]))
    async_ = draw(st.booleans())
    if async_ and spec == "ngram":  # vLLM runs n-gram drafting synchronously
        spec = "eagle"
    k = draw(st.integers(1, 3)) if spec else 0
    rates = tuple(draw(st.lists(st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]), min_size=1, max_size=3)))
    return Settings(
        num_blocks=draw(st.integers(12, 48)), block_size=draw(st.sampled_from([2, 4, 8])), max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_seqs, draw(st.sampled_from([8, 12, 16, 24, 32, 64]))),
        max_model_len=draw(st.sampled_from([64, 128, 256])), prefix_caching=draw(st.booleans()),
        async_scheduling=async_, spec=spec, k=k, rates=rates,
        hit_probability=draw(st.sampled_from([0.5, 1.0])) if spec == "ngram" else 1.0,
        long_prefill_token_threshold=draw(st.sampled_from([0, 4, 8, 16])),
        policy=draw(st.sampled_from(["fcfs", "priority"])), seed=draw(st.integers(0, (1 << 30) - 1)))


def test_the_parity_environment_runs_the_pinned_vllm():
    import vllm

    assert vllm.__version__ == VLLM_VERSION


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(engine_settings(), st.integers(0, (1 << 32) - 1), st.integers(1, 10))
def test_vllm_and_servelab_schedule_alike(s: Settings, trace_seed: int, num_requests: int):
    trace = random_trace(random.Random(trace_seed), s, num_requests)
    if known.excluded(trace):
        return
    res = run(trace)
    assert not res.stalled, f"{s.describe()}: nothing scheduled, nothing in flight, requests left"
    assert res.divergence is None, f"{s.describe()}\n{res.divergence}"


def test_each_recorded_difference_still_differs_and_its_fix_agrees():
    for name, ok, detail in known.check_all():
        assert ok, f"{name}: {detail}"
