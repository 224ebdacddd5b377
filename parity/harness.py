"""The lock-step driver: the same trace into vLLM's scheduler and servelab's, one operation at a time, comparing
after every operation.

The operations are those of vLLM's engine loop (``EngineCore.step`` / ``step_with_batch_queue``) and servelab's
(``Instance._loop``): arrivals join before a schedule; while fewer than ``depth`` steps are in flight (1 sync, 2
async) each side schedules once; then the oldest step's outputs are applied. After a schedule the sides must agree
on the requests scheduled and their token counts, the draft tokens scheduled, the requests preempted, the running
and waiting queues in order, every live request's computed tokens and KV block ids, the free blocks and each
request's prefix hit at its first admission; after an output, on the requests finished and every request's output
tokens as well. The first disagreement ends the run with both records.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from parity.trace import Trace

#: what a schedule's records are compared on; an output's add "finished"
SCHEDULE_KEYS = ("tokens", "spec", "preempted", "running", "waiting", "computed", "blocks", "free_blocks",
                 "num_preemptions", "prefix_hit", "outputs")
OUTPUT_KEYS = ("finished", "running", "waiting", "computed", "outputs", "blocks", "free_blocks", "num_preemptions")


@dataclass
class Divergence:
    op: int  # the operation index
    kind: str  # "schedule" or "output"
    key: str
    vllm: object
    servelab: object
    history: list = field(default_factory=list)  # the last operations' (kind, vllm record) before it

    def __str__(self) -> str:
        lines = [f"operation {self.op} ({self.kind}): '{self.key}' differs",
                 f"  vllm:     {self.vllm}", f"  servelab: {self.servelab}"]
        if self.history:
            lines.append("  the operations before it (vLLM's records):")
            lines += [f"    {h}" for h in self.history]
        return "\n".join(lines)


@dataclass
class Result:
    trace: Trace
    schedules: int = 0  # non-empty schedules compared (engine steps)
    operations: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    draft_tokens: int = 0
    divergence: Divergence | None = None
    stalled: bool = False
    known: str | None = None  # the recorded difference the trace reached, where the comparison stopped

    @property
    def ok(self) -> bool:
        return self.divergence is None and not self.stalled


def _diff(a: dict, b: dict, keys) -> tuple[str, object, object] | None:
    for k in keys:
        if a.get(k) != b.get(k):
            va, vb = a.get(k), b.get(k)
            if isinstance(va, dict) and isinstance(vb, dict):  # only the entries that differ
                ks = sorted(set(va) | set(vb), key=lambda x: (len(str(x)), str(x)))
                ks = [x for x in ks if va.get(x) != vb.get(x)]
                va, vb = {x: va.get(x) for x in ks}, {x: vb.get(x) for x in ks}
            return k, va, vb
    return None


def run(trace: Trace, max_ops: int = 20000, history: int = 6, patched: bool = True):
    """Run ``trace`` through both schedulers in lock step; returns a :class:`Result`. ``patched``: with the
    fixes parity/known.py proposes for servelab applied (else with servelab as it is)."""
    from parity import known
    from parity.servelab_side import ServelabEngine
    from parity.vllm_side import VLLMEngine

    if patched:
        known.apply_patches()  # the fixes proposed for servelab's core, on its pure-Python sources
    else:
        known.revert_patches()

    s = trace.settings
    vl = VLLMEngine(s)
    sl = ServelabEngine(s)
    res = Result(trace)
    pending = deque(sorted(trace.requests, key=lambda t: (t.arrival, t.index)))
    depth = 2 if s.async_scheduling else 1
    in_flight: deque = deque()
    log: deque = deque(maxlen=history)
    calls = 0  # schedule() calls so far

    def check(kind: str, a: dict, b: dict, keys) -> bool:
        d = _diff(a, b, keys)
        if d is not None:
            res.divergence = Divergence(res.operations, kind, d[0], d[1], d[2], list(log))
            return False
        log.append((res.operations, kind, {k: a[k] for k in ("tokens", "spec", "preempted", "finished") if a.get(k)}))
        return True

    while res.operations < max_ops:
        while pending and pending[0].arrival <= calls:
            t = pending.popleft()
            vl.add(t)
            sl.add(t)
        scheduled = False
        va = {"preempted": []}
        if len(in_flight) < depth and (vl.unfinished() or sl.unfinished()):
            vb, va = vl.schedule()
            sb, sa = sl.schedule()
            calls += 1
            res.operations += 1
            res.preemptions += len(va["preempted"])
            if s.spec and va["one_short"]:  # (before the comparison: this schedule's padding may differ)
                res.known = "resumed-one-short"
                break
            if not check("schedule", va, sa, SCHEDULE_KEYS):
                return res
            reached = known.reached(va["preempted"], [b[0] for b in in_flight])
            if reached:
                res.known = reached
                break
            if vb is not None:
                res.schedules += 1
                res.draft_tokens += sum(va["spec"].values())
                in_flight.append((vb, sb))
                scheduled = True
        if scheduled and len(in_flight) < depth:
            continue
        if not in_flight:
            if va["preempted"]:  # a schedule that only preempted made room: schedule again
                continue
            if pending:  # idle until the next arrival
                calls = max(calls, pending[0].arrival)
                continue
            if vl.unfinished() or sl.unfinished():
                res.stalled = True
            break
        vb, sb = in_flight.popleft()
        va = vl.apply(vb)
        sa = sl.apply(sb)
        res.operations += 1
        if not check("output", va, sa, OUTPUT_KEYS):
            return res
    res.prefix_hit_tokens = sum(vl.prefix_hit.values())
    return res
