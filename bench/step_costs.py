"""Where a run's time goes, per call: the engine's hot functions timed one call at a time, and every real step
sorted by kind.

Profilers that sample or trace lines (pyinstrument, line_profiler) inflate the cheapest, most frequent lines;
this script instead wraps each function below in a ``time.perf_counter`` pair and reports calls, total seconds
and microseconds per call. The wrapper itself adds about 1 us per call, so the totals run ~10 % above an untimed
run; compare figures from this script with each other, not with a plain run.

It also sorts every real schedule (one the fast-forward did not absorb) by what it did: ``admit`` (a request
entered the running batch), ``chunk`` (a running request's prompt continued), ``decode`` (decodes only),
``preempt`` (it preempted), combined as ``admit+chunk`` and so on; by whether the step before was a jump or a real
step; and by whether requests were waiting. Fast-forward plans that came back empty are counted by a reason told
from the instance's state (:func:`_plan_outcome`; the check in lab/engine/jump/ that refused is not
recorded, so the reasons are the likely ones).

Usage::

    .venv/bin/python bench/step_costs.py bench/azure_conv.yaml
    .venv/bin/python bench/step_costs.py bench/million_16x.yaml --set workload.num_requests=50000
    .venv/bin/python bench/step_costs.py bench/azure_conv.yaml --overrides '{"policy": {"scheduler": "sarathi"}}'

Prints Markdown tables. The run is the experiment's, with its seed: the same command gives the same counts (the
times vary with the machine).
"""

from __future__ import annotations

import argparse
import os
import collections
import json
import sys
import time
from contextlib import contextmanager
from itertools import repeat
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# It wraps hot-core functions to count and time them; the compiled core calls its own functions directly, past
# the wrappers, so this script runs the pure-Python sources (lab/core/native.py).
os.environ["SERVELAB_PURE_PYTHON"] = "1"
from lab.cluster.cluster import RouterError  # noqa: E402
from lab.core import kv_cache, step_log  # noqa: E402
from lab.core.sched_api import SchedulerContractError  # noqa: E402
from lab.engine import instance, jump, jump_context  # noqa: E402
from lab.engine.jump import applying, arrivals, core, pricing  # noqa: E402
from lab.experiment.config import ConfigError, deep_merge, load_experiment, parse_set_option  # noqa: E402
from lab.experiment.simulation import build_requests, simulate  # noqa: E402
from lab.workload.loaders import WorkloadError  # noqa: E402
from policies import PolicyError  # noqa: E402

# (owner, attribute, label): the functions timed, in the order the table lists them
TIMED = [
    (jump, "apply", "jump.apply (a jump's bookkeeping)"),
    (applying, "effects", "  jump.applying.effects (first tokens and completions of a stretch)"),
    (instance.Instance, "complete", "  Instance.complete (a completion in a jump)"),
    (kv_cache.BlockPool, "free_unique", "  BlockPool.free_unique (a finished request's blocks)"),
    (applying, "admit_planned", "  jump.applying.admit_planned (an admission in a jump)"),
    (applying, "write_rows", "  jump.applying.write_rows (a jump's step-log rows and ITL samples)"),
    (jump, "plan", "jump.plan"),
    (pricing, "decode_times", "  jump.pricing.decode_times (the plan's step times)"),
    (core, "plan_bound", "  jump.blocks.plan_bound (KV and admission bound)"),
    (core, "through_arrivals", "  jump.arrivals.through_arrivals (planned admissions)"),
    (arrivals, "decode_stretch", "    jump.admitting.decode_stretch (the decodes after an admission)"),
    (core, "through_queue", "  jump.queue_walk.through_queue (admissions of the queue's heads)"),
    (core, "block_events", "  jump.blocks.block_events"),
    (instance.Instance, "schedule_step", "Instance.schedule_step (a real schedule)"),
    (instance.Instance, "price_step", "Instance.price_step (a real step's cost)"),
    (instance.Instance, "finish_step", "Instance.finish_step (a real step's outputs)"),
    (instance.Instance, "add_request", "Instance.add_request (an arrival)"),
    (step_log.StepLog, "flush", "StepLog.flush (spill of held rows)"),
]


class Timers:
    """Calls and seconds per wrapped function."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, label: str) -> None:
        """Replace ``owner.name`` by a timed wrapper (:func:`patched` puts the original back)."""
        fn = getattr(owner, name)
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += clock() - t
                calls[label] += 1

        setattr(owner, name, timed)


def _classify(step, before: set[int], after_jump: bool, waiting: bool) -> tuple[str, str, str]:
    """(kind, what came before, queue) of one real schedule. A chunk is a prompt chunk of a request that was
    already running: more than one new token and no drafts (lab/core/batch.py ``BatchShape.from_requests``; a
    request with drafts is a decode verifying them)."""
    admitted = any(id(r) not in before for r in step.requests)
    drafts = step.num_spec_tokens or repeat(0)
    chunk = any(id(r) in before and n > 1 and not k for r, n, k in zip(step.requests, step.num_new_tokens, drafts))
    parts = [p for p, on in (("preempt", step.num_preempted), ("admit", admitted), ("chunk", chunk)) if on]
    return "+".join(parts) or "decode", "after a jump" if after_jump else "after a real step", \
        "waiting" if waiting else "none waiting"


def _plan_outcome(inst, result) -> str:
    """Why a plan came back empty, told from the instance's state (or "planned")."""
    if result is not None:
        return "planned"
    if inst.async_scheduling:
        first = inst.window.oldest if inst.window.steps else None
        if first is None or first.requests != inst.running or not all(first.samples):
            return "the step in flight does not run every request, or one does not sample"
    elif any(r.last_token_time != inst.now for r in inst.running):
        return "a running request's last token was not sampled now (sync)"
    return "cut below two steps (KV, admission, the next arrival or the horizon)"


@contextmanager
def patched(timers: Timers, kinds: collections.Counter, outcomes: collections.Counter):
    """Within the block, time the TIMED functions into ``timers``, count real schedules by kind into ``kinds`` and
    plans by outcome into ``outcomes``; the original functions are back after it."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in TIMED]
    inst, ctx = instance.Instance, jump_context.JumpContext
    saved += [(inst, "schedule_step", inst.__dict__["schedule_step"])]
    saved += [(ctx, name, ctx.__dict__[name]) for name in ("run", "plan")]
    try:
        for owner, name, label in TIMED:
            timers.wrap(owner, name, label)
        last_was_jump: dict[int, bool] = {}
        schedule, run_jump, plan = inst.schedule_step, ctx.run, ctx.plan

        def classified(self):
            before = {id(r) for r in self.running}
            waiting = bool(self.waiting)
            step = schedule(self)
            if step is not None:
                kinds[_classify(step, before, last_was_jump.get(id(self), False), waiting)] += 1
            last_was_jump[id(self)] = False
            return step

        def jumping(self, *args):
            last_was_jump[id(self.inst)] = True
            return (yield from run_jump(self, *args))

        def planning(self):
            result = plan(self)
            outcomes[_plan_outcome(self.inst, result)] += 1
            return result

        inst.schedule_step, ctx.run, ctx.plan = classified, jumping, planning
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", help="experiment YAML file")
    ap.add_argument("--data-dir", default=None, help="shared data directory (default: the experiment's)")
    ap.add_argument("--overrides", default=None, help="JSON object merged over the file")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=VALUE",
                    help="override a field, as servelab run --set (repeatable)")
    a = ap.parse_args(argv)
    try:
        given = json.loads(a.overrides) if a.overrides else {}
    except json.JSONDecodeError as e:
        ap.error(f"--overrides: not valid JSON ({e})")
    if not isinstance(given, dict):
        ap.error(f"--overrides: expected a JSON object, got {type(given).__name__}")
    try:
        exp = load_experiment(a.experiment, a.data_dir, deep_merge(given, parse_set_option(a.set)) or None)
        reqs = build_requests(exp)
    except (ConfigError, WorkloadError, ValueError) as e:
        ap.error(str(e))

    timers = Timers()
    kinds: collections.Counter = collections.Counter()
    outcomes: collections.Counter = collections.Counter()
    with patched(timers, kinds, outcomes):
        t0 = time.perf_counter()
        try:
            res = simulate(exp, reqs)
        except (PolicyError, FileNotFoundError, ValueError, SchedulerContractError, RouterError) as e:
            ap.error(f"{a.experiment}: {e}")
        wall = time.perf_counter() - t0
    steps = sum(len(i.steps) for i in res.instances)
    jumped = sum(i.jump.jumped_steps for i in res.instances)
    planned = sum(i.jump.num_planned_admissions for i in res.instances)
    print(f"{a.experiment}: {len(reqs):,} request{'s' if len(reqs) != 1 else ''}, {steps:,} steps, {jumped:,} "
          f"fast-forwarded ({jumped / max(steps, 1):.0%}), {planned:,} admissions inside jumps, "
          f"{wall:.2f} s of simulation with the timers\n")
    print("| function | calls | seconds | us per call |\n|---|---:|---:|---:|")
    for _, _, label in TIMED:
        n = timers.calls[label]
        s = timers.seconds[label]
        print(f"| {label} | {n:,} | {s:.3f} | {1e6 * s / n if n else 0:.1f} |")
    print("\n| real schedule | before it | queue | count |\n|---|---|---|---:|")
    for (kind, before, queue), n in kinds.most_common():
        print(f"| {kind} | {before} | {queue} | {n:,} |")
    # a jump cut short by an arrival (a router that reads state, a hand-off) turns the step under way into an
    # ordinary one: it is logged and finished like a real step but was never scheduled outside the plan
    cut = steps - jumped - sum(kinds.values())
    if cut:
        print(f"| (under way when a jump was cut short: finished, not scheduled here) | | | {cut:,} |")
    print("\n| fast-forward plan | count |\n|---|---:|")
    for outcome, n in outcomes.most_common():
        print(f"| {outcome} | {n:,} |")
    if not outcomes:
        print("| (none tried: fast-forward is off, or this setup never qualifies) | 0 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
