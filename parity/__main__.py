"""``python -m parity``: random traces through vLLM's scheduler and servelab's ``vllm_v1`` in lock step.

    python -m parity --traces 200 --seed 1        # 200 random engines and traces; exit 1 at the first divergence
    python -m parity --traces 50 --only async     # only async scheduling (also: sync, spec, nospec, priority)
    python -m parity --known                      # also run the recorded known differences (docs/vllm_parity.md)

Needs the parity environment (``make parity`` builds .venv-parity). Prints one line per trace with a problem and a
summary: traces, engine steps and operations compared, preemptions, prefix-hit tokens and draft tokens seen.
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=int, default=100, help="random traces to run (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first trace (trace i uses seed + i)")
    ap.add_argument("--only", choices=["sync", "async", "spec", "nospec", "priority"], default=None)
    ap.add_argument("--keep-going", action="store_true", help="run every trace, counting divergences")
    ap.add_argument("--known", action="store_true", help="also run the known differences' reproducers")
    args = ap.parse_args(argv)

    from parity import known
    from parity.harness import run
    from parity.trace import random_settings, random_trace
    from parity.vllm_side import vllm_version

    t0 = time.perf_counter()
    print(f"vLLM {vllm_version()} scheduler vs servelab vllm_v1", flush=True)
    totals = {"traces": 0, "steps": 0, "ops": 0, "preemptions": 0, "hits": 0, "drafts": 0, "skipped": 0,
              "stopped": 0}
    reached: dict[str, int] = {}  # traces stopped at each recorded difference
    failed = 0
    i = 0
    while totals["traces"] < args.traces:
        seed = args.seed + i
        i += 1
        rng = random.Random(seed)
        s = random_settings(rng)
        if args.only == "sync" and s.async_scheduling or args.only == "async" and not s.async_scheduling:
            continue
        if args.only == "spec" and not s.spec or args.only == "nospec" and s.spec:
            continue
        if args.only == "priority" and s.policy != "priority":
            continue
        trace = random_trace(rng, s)
        reason = known.excluded(trace)
        if reason:
            totals["skipped"] += 1
            continue
        res = run(trace)
        totals["traces"] += 1
        totals["steps"] += res.schedules
        totals["ops"] += res.operations
        totals["preemptions"] += res.preemptions
        totals["hits"] += res.prefix_hit_tokens
        totals["drafts"] += res.draft_tokens
        if res.known is not None:
            totals["stopped"] += 1
            reached[res.known] = reached.get(res.known, 0) + 1
        if not res.ok:
            failed += 1
            print(f"\ntrace seed {seed}: {s.describe()}")
            print(f"  {len(trace.requests)} requests: "
                  + ", ".join(f"#{t.index} t{t.arrival} p{len(t.prompt)} o{t.max_tokens}"
                              + (f" prio{t.priority}" if t.priority else "") for t in trace.requests))
            print("  stalled: nothing scheduled, nothing in flight, requests left" if res.stalled else
                  "  " + str(res.divergence).replace("\n", "\n  "))
            if not args.keep_going:
                break
    if args.known:
        for name, ok, detail in known.check_all():
            print(f"known difference {name}: {'still differs (recorded)' if ok else 'CHANGED: ' + detail}")
            failed += 0 if ok else 1
    dt = time.perf_counter() - t0
    print(f"\n{totals['traces']} traces, {totals['steps']} engine steps ({totals['ops']} operations) compared, "
          f"{totals['preemptions']} preemptions, {totals['hits']} prefix-hit tokens, {totals['drafts']} draft tokens; "
          f"{totals['skipped']} traces drawn into known differences skipped, {totals['stopped']} stopped where they "
          f"reached one ({', '.join(f'{k} {v}' for k, v in sorted(reached.items())) or 'none'}); {failed} failed; "
          f"{dt:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
