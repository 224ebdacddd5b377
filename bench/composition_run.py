"""Draw N feature combinations, run each (fast-forward on and off) against the composition invariants, and print
a table of outcomes: ran OK, refused up front (by reason), failed (by class), with one reproducer YAML per failure
class (tests/composition.py describes the draws and the invariants).

    .venv/bin/python bench/composition_run.py 200                     # draws 0..199 of seed 0, one worker
    .venv/bin/python bench/composition_run.py 5000 --seed 1 --jobs 2   # what `make composition` runs
    .venv/bin/python bench/composition_run.py --replay /tmp/composition_failures/<class>.yaml

Each draw runs in a worker process under a time limit (``--timeout``, 60 s by default; a worker that does not
come back within the limit plus 30 s is killed and replaced), so a livelock is reported as the failure class
``timeout`` instead of hanging the run. For each failure class the smallest failing draw is shrunk (features
removed while it still fails the same way, ``--shrink`` reruns at most) and written to ``--out``
(default /tmp/composition_failures) as ``<class>.yaml``, a ``servelab run`` experiment with the failure in its
header comments. Exit status: 0 when no draw failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import composition as comp  # noqa: E402


def _worker(conn, timeout: float) -> None:
    """Worker process: receive (index, Draw) pairs, send back (index, Outcome); None stops it."""
    import gc  # noqa: PLC0415

    while True:
        job = conn.recv()
        if job is None:
            return
        index, draw, mode = job
        try:
            if mode == "shrink":
                key, budget = draw[1], draw[2]
                small = comp.shrink(draw[0], key, budget, timeout)
                out = comp.run_draw(small, timeout)
                conn.send((index, (small, out)))
            else:
                conn.send((index, comp.run_draw(draw, timeout)))
        except BaseException as e:  # noqa: BLE001 - report and go on
            conn.send((index, comp.Outcome("failed", f"worker: {type(e).__name__}", str(e),
                                           traceback.format_exc())))
        gc.collect()


class Pool:
    """Worker processes with a hard per-job limit: a job not back in time is a ``timeout`` and its worker is
    killed and replaced."""

    def __init__(self, jobs: int, timeout: float) -> None:
        self.timeout = timeout
        self.hard = timeout + 30.0
        self.ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
        self.workers = [self._start() for _ in range(max(1, jobs))]

    def _start(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child, self.timeout), daemon=True)
        p.start()
        child.close()
        return {"proc": p, "conn": parent, "job": None, "since": 0.0}

    def map(self, jobs, on_result) -> None:
        """Run ``jobs`` (index, payload, mode) and call ``on_result(index, payload, result)`` as each comes back."""
        todo = collections.deque(jobs)
        busy = 0
        while todo or busy:
            for w in self.workers:
                if w["job"] is None and todo:
                    w["job"] = todo.popleft()
                    w["since"] = time.monotonic()
                    w["conn"].send(w["job"])
                    busy += 1
            conns = [w["conn"] for w in self.workers if w["job"] is not None]
            ready = mp.connection.wait(conns, timeout=1.0)
            now = time.monotonic()
            for i, w in enumerate(self.workers):
                if w["job"] is None:
                    continue
                if w["conn"] in ready:
                    try:
                        index, result = w["conn"].recv()
                    except EOFError:  # the worker died (e.g. out of memory)
                        index, result = w["job"][0], comp.Outcome("failed", "worker died", "worker died")
                        self._replace(i)
                    job, w["job"] = w["job"], None
                    busy -= 1
                    on_result(index, job[1], result)
                elif now - w["since"] > self.hard:
                    job = w["job"]
                    self._replace(i)
                    busy -= 1
                    result = comp.Outcome("failed", "timeout", f"timeout: no result within {self.hard:g} s "
                                          "(worker killed)", seconds=self.hard)
                    on_result(job[0], job[1], result if job[2] != "shrink" else (job[1][0], result))

    def _replace(self, i: int) -> None:
        w = self.workers[i]
        w["proc"].kill()
        w["proc"].join()
        w["conn"].close()
        self.workers[i] = self._start()

    def close(self) -> None:
        for w in self.workers:
            try:
                w["conn"].send(None)
            except OSError:
                pass
            w["proc"].join(timeout=5)
            if w["proc"].is_alive():
                w["proc"].kill()


def main(argv: list[str] | None = None) -> int:
    """Run the draws and print the tallies; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=200, help="number of draws")
    ap.add_argument("--seed", type=int, default=0, help="draw sequence (draw i of seed s is always the same)")
    ap.add_argument("--start", type=int, default=0, help="first draw index")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per draw (both runs together)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/composition_failures"), help="reproducer folder")
    ap.add_argument("--shrink", type=int, default=60, help="reruns spent shrinking each failure class's reproducer")
    ap.add_argument("--replay", type=Path, help="run one reproducer YAML and print its outcome")
    ap.add_argument("--skip", default="", help="invariants not checked, comma-separated (e.g. hand_off_tokens): "
                    "to look past a known failure class for others")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    if args.skip:
        comp.SKIP.update(s for s in args.skip.split(",") if s)
        os.environ["SERVELAB_COMPOSITION_SKIP"] = ",".join(sorted(comp.SKIP))  # workers started by spawn

    if args.replay:
        out = comp.run_draw(comp.load_reproducer(args.replay), args.timeout)
        print(f"{out.kind}: {out.key}\n{out.message}\n{out.detail}")
        return 0 if out.kind != "failed" else 1

    t0 = time.monotonic()
    ok = 0
    refused: collections.Counter = collections.Counter()
    failed: collections.Counter = collections.Counter()
    first: dict[str, tuple] = {}  # failure class -> (draw, outcome) of its smallest draw
    where: dict[str, list[int]] = collections.defaultdict(list)
    seconds: list[float] = []
    done = [0]

    def on_result(index: int, draw, out) -> None:
        nonlocal ok
        done[0] += 1
        seconds.append(out.seconds)
        if out.kind == "ok":
            ok += 1
        elif out.kind == "refused":
            refused[out.key] += 1
        else:
            failed[out.key] += 1
            where[out.key].append(index)
            if out.key not in first or draw.size() < first[out.key][0].size():
                first[out.key] = (draw, out)
        if not args.quiet and (done[0] % max(100, args.n // 20) == 0 or done[0] == args.n):
            print(f"[{done[0]}/{args.n} {time.monotonic() - t0:.0f} s] ok {ok}, refused {sum(refused.values())}, "
                  f"failed {sum(failed.values())} ({len(failed)} classes)", flush=True)

    pool = Pool(args.jobs, args.timeout)
    try:
        jobs = ((i, comp.draw_from_seed(args.seed, i), "run") for i in range(args.start, args.start + args.n))
        pool.map(jobs, on_result)
        # shrink each failure class's smallest draw, in the workers too
        shrunk: dict[str, tuple] = {}

        def on_shrunk(index: int, payload, result) -> None:
            key = payload[1]
            if not isinstance(result, tuple):  # the worker died while shrinking: keep the unshrunk draw
                return
            small, out = result
            if out.kind == "failed" and out.key == key:
                shrunk[key] = (small, out)

        if args.shrink > 0 and first:
            pool.map([(k, (first[k][0], k, args.shrink), "shrink") for k in first], on_shrunk)
    finally:
        pool.close()

    total = time.monotonic() - t0
    skipped = f"; invariants skipped: {', '.join(sorted(comp.SKIP))}" if comp.SKIP else ""
    print(f"\n{args.n} draws of seed {args.seed} from #{args.start} in {total:.0f} s{skipped} "
          f"({args.jobs} worker(s); median draw {sorted(seconds)[len(seconds) // 2] if seconds else 0:.2f} s, "
          f"slowest {max(seconds, default=0):.1f} s)")
    print(f"  ran OK   {ok}")
    print(f"  refused  {sum(refused.values())}")
    for key, n in refused.most_common():
        print(f"    {n:5d}  {key}")
    print(f"  failed   {sum(failed.values())} in {len(failed)} classes")
    for key, n in failed.most_common():
        draw, out = shrunk.get(key, first[key])
        path = comp.write_reproducer(draw, out, args.out)
        idx = where[key]
        print(f"    {n:5d}  {key}\n           draws {', '.join(map(str, idx[:8]))}{' ...' if len(idx) > 8 else ''}"
              f"\n           reproducer {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
