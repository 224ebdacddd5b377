"""Digests of a few fast-forward-heavy experiments, for comparing the compiled hot core with its sources.

Run as ``python -m tests.core_digest`` (tests/test_compiled_core.py runs it with and without
``SERVELAB_PURE_PYTHON=1``): prints one JSON object, the core in use and, per case, a SHA-256 of every request's
timeline (arrival, first token, finish, lifecycle events with times and reasons) and of every step row. The cases
are the embedded demo varied to reach the hot core's paths: an overloaded engine that runs out of KV blocks
(planned preemptions and resumptions, with and without prefix caching, vLLM 0.33 and 0.11 free-queue order, sync
and async), Sarathi's chunked prefill, and several instances behind a router.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from lab.experiment.config import load_experiment
from lab.experiment.simulation import build_requests, simulate
from lab.core.native import core_description

DEMO = Path(__file__).resolve().parents[1] / "experiments" / "demo.yaml"

# name -> overrides merged over experiments/demo.yaml
_OVERLOADED = {"workload": {"num_requests": 300, "rate": 60.0},
               "engine": {"num_gpu_blocks": 900, "max_num_seqs": 64}}
CASES: dict[str, dict] = {
    "demo": {},
    "overloaded_0.33_async": _OVERLOADED,
    "overloaded_0.33_sync_no_caching": {**_OVERLOADED, "engine": {**_OVERLOADED["engine"], "async_scheduling": False,
                                                                   "enable_prefix_caching": False}},
    "overloaded_0.11": {**_OVERLOADED, "engine": {**_OVERLOADED["engine"], "vllm_version": "0.11"}},
    "sarathi": {**_OVERLOADED, "policy": {"scheduler": "sarathi"}},
    "four_instances": {"workload": {"num_requests": 800, "rate": 40.0},
                       "cluster": {"num_instances": 4, "router": "round_robin"}},
}


def digest(overrides: dict) -> dict:
    """Run ``experiments/demo.yaml`` with ``overrides``; the hashes of its request timelines and step rows, and
    its counts of steps, jumped steps and preemptions."""
    exp = load_experiment(DEMO, None, overrides)
    requests = build_requests(exp)
    result = simulate(exp, requests)
    timeline = hashlib.sha256()
    for r in requests:
        timeline.update(repr((r.request_id, r.arrival_time, r.first_token_time, r.finish_time, r.status,
                              r.reason, r.events)).encode())
    steps = hashlib.sha256()
    for inst in result.instances:
        for frame in inst.steps.frames():
            steps.update(np.ascontiguousarray(frame.to_numpy(dtype=float)).tobytes())
    return {"requests": timeline.hexdigest(), "steps": steps.hexdigest(),
            "num_steps": sum(len(i.steps) for i in result.instances),
            "jumped_steps": sum(i.jump.jumped_steps for i in result.instances),
            "preemptions": sum(i.num_preemptions for i in result.instances)}


def main() -> None:
    print(json.dumps({"core": core_description(), "cases": {name: digest(o) for name, o in CASES.items()}}))


if __name__ == "__main__":
    main()
