"""Digest of one simulation's results, to check that a speed change leaves them unchanged (before / after).

    python bench/digest.py bench/azure_conv.yaml [--overrides JSON] [--data-dir DIR]

Prints one JSON line: SHA-256 prefixes of every request's timeline (arrival, first scheduled, first token and
finish times, outputs, preemptions, last token time, lifecycle events), of every step row (the step log's frames)
and of the ITL samples as a multiset (each distinct value with its total weight, so samples added in another order
or grouping give the same digest), the busy time per instance, and the fast-forward counters (jumps, steps jumped,
steps), which may change without any result changing. Run it on both versions with the same arguments and compare
every field but the counters.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np

from lab.experiment.config import load_experiment
from lab.experiment.simulation import build_requests, simulate


def digest(experiment: str, data_dir: str | None = None, overrides: dict | None = None) -> dict:
    """Simulate ``experiment`` (a YAML path, with ``overrides`` applied) and return its digests (see the module
    docstring): hex strings, the busy seconds per instance and the fast-forward counters."""
    exp = load_experiment(experiment, data_dir, overrides)
    requests = build_requests(exp)
    result = simulate(exp, requests)
    timelines = hashlib.sha256()
    for r in requests:
        timelines.update(repr((r.request_id, r.arrival_time, r.first_scheduled_time, r.first_token_time,
                               r.finish_time, r.num_output_tokens, r.num_preemptions, r.last_token_time,
                               r.events)).encode())
    steps = hashlib.sha256()
    itl = hashlib.sha256()
    for inst in result.instances:
        for frame in inst.steps.frames():
            steps.update(np.ascontiguousarray(frame.to_numpy()).tobytes())
        values, weights = inst.itl.arrays()
        distinct, where = np.unique(values, return_inverse=True)
        itl.update(distinct.tobytes())
        itl.update(np.bincount(where, weights=weights, minlength=len(distinct)).tobytes())
    return {"requests": timelines.hexdigest()[:16], "steps": steps.hexdigest()[:16], "itl": itl.hexdigest()[:16],
            "busy_s": [inst.busy_time for inst in result.instances],
            "jumps": sum(inst.jump.num_jumps for inst in result.instances),
            "steps_jumped": sum(inst.jump.jumped_steps for inst in result.instances),
            "num_steps": sum(len(inst.steps) for inst in result.instances)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="digest of one simulation's results (before / after a speed change)")
    ap.add_argument("experiment")
    ap.add_argument("--overrides", help="JSON object of field overrides")
    ap.add_argument("--data-dir")
    a = ap.parse_args()
    print(json.dumps(digest(a.experiment, a.data_dir, json.loads(a.overrides) if a.overrides else None)))
