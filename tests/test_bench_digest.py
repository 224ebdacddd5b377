"""bench/digest.py: one run's results as digests, for before/after checks of a speed change."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _digest_module():
    spec = importlib.util.spec_from_file_location("bench_digest", ROOT / "bench" / "digest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_digest_is_the_same_for_the_same_run_and_differs_when_a_result_does():
    digest = _digest_module().digest
    small = {"workload": {"num_requests": 60}}
    a = digest(str(ROOT / "experiments" / "demo.yaml"), overrides=small)
    assert a == digest(str(ROOT / "experiments" / "demo.yaml"), overrides=small)
    # with fewer sequences a step the queue builds: timelines, steps and ITL samples all change
    b = digest(str(ROOT / "experiments" / "demo.yaml"), overrides={**small, "engine": {"max_num_seqs": 2}})
    assert a["requests"] != b["requests"] and a["steps"] != b["steps"] and a["itl"] != b["itl"]
    # the same results without fast-forward: only the counters differ
    c = digest(str(ROOT / "experiments" / "demo.yaml"), overrides={**small, "simulation": {"fast_forward": False}})
    assert {k: c[k] for k in ("requests", "steps", "itl", "busy_s")} == {k: a[k] for k in ("requests", "steps", "itl",
                                                                                          "busy_s")}
    assert c["jumps"] == 0 < a["jumps"]
