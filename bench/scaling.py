"""Scaling table: requests x instances -> whole-process time and peak memory.

Runs ``bench/million_16x.yaml`` (synthetic conversation-like requests on Llama-3.1-8B / H100 instances behind a
round-robin router, vLLM V1 scheduler, roofline cost model) for every pair of request count and instance count,
each in its own process (:func:`lab.report.bench.run_workload`: trace generated, simulation run, no report
written), with the arrival rate scaled to the instance count (``--rate-per-instance`` req/s each, 5 by default:
the million-request workload's 80 req/s over 16 instances), so every point has the same load per instance.

Usage::

    .venv/bin/python bench/scaling.py                                   # 10k, 100k, 1M x 1, 4, 16 instances
    .venv/bin/python bench/scaling.py --requests 10000,100000 --instances 1,16
    .venv/bin/python bench/scaling.py --json /tmp/scaling.jsonl         # also one JSON line per point

Prints a Markdown table: whole-process wall seconds, the simulation's wall seconds, microseconds of simulation
per request, engine steps and the share fast-forwarded, and peak resident memory (MB, the process's ru_maxrss).
The 1M x 16 point is ``servelab bench -w million_16x``. Timings depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab.report.bench import run_workload  # noqa: E402


def _ints(text: str) -> list[int]:
    """``"10000,100000"`` -> [10000, 100000]; raises argparse's error naming the bad item."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=_ints, default=[10_000, 100_000, 1_000_000], help="request counts")
    ap.add_argument("--instances", type=_ints, default=[1, 4, 16], help="instance counts")
    ap.add_argument("--rate-per-instance", type=float, default=5.0, help="arrival rate per instance, req/s")
    ap.add_argument("--data-dir", default=None, help="shared data directory (unused by the synthetic workload)")
    ap.add_argument("--json", default=None, help="append one JSON line per point to this file")
    a = ap.parse_args(argv)
    path = str(ROOT / "bench" / "million_16x.yaml")
    print("| requests | instances | rate req/s | process wall s | simulation s | us / request | steps | "
          "fast-forwarded | peak MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.requests:
        for k in a.instances:
            rate = a.rate_per_instance * k
            over = {"workload": {"num_requests": n, "rate": rate}, "cluster": {"num_instances": k}}
            r = run_workload(f"scaling_{n}x{k}", path, a.data_dir, over)
            print(f"| {n:,} | {k} | {rate:g} | {r.total_wall_s:.1f} | {r.sim_wall_s:.1f} | "
                  f"{1e6 * r.sim_wall_s / n:.0f} | {r.steps:,} | {r.jumped_share:.0%} | {r.peak_mb:,.0f} |",
                  flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps({"requests": n, "instances": k, "rate": rate, "wall_s": r.total_wall_s,
                                        "sim_wall_s": r.sim_wall_s, "steps": r.steps, "jumped": r.jumped_steps,
                                        "peak_mb": r.peak_mb, "user_cpu_s": r.user_cpu_s,
                                        "load_avg_1m": r.load_avg_1m}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
