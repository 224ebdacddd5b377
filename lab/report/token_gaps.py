"""Each request's inter-token gaps, recovered after the run from the step log (bench_result.json's per-request
``itls`` with ``--save-detailed``).

The engine keeps the run's ITL samples pooled (lab/core/samples.py ``WeightedSamples``), not per request, and keeps
no per-token record on its default path. A request's tokens are emitted at the ends of engine steps of the
instance serving it, though, and a running request takes part in every step of its instance (vLLM's schedulers
schedule every running request each step) except while it is preempted and while a resumed request recomputes its
prompt (those steps end without a token for it). So the token times of a request are the step ends of its instance
from its first token to its last, less the steps inside its preemptions and the first steps after each resumption:

- with no preemption after its first token, the step ends from first token to finish are its token times exactly
  when their count is its number of outputs (each step carries at most one token of a request, so the count
  proves that every one of those steps carried one);
- with preemptions, the steps between a preemption and the resumption are left out, and the excess count is
  the recompute steps after the resumptions: one resumption takes all of it; with several, every split of the
  excess is tried and one is kept only if the steps it gives tokens still had a token to give (the step log's
  ``output_tokens`` per step) and its gaps are among the run's pooled ITL samples that are still unclaimed.

Every gap recovered is then checked against the pooled samples: the recovered gaps of all requests must be a
sub-multiset of them (equal values, compared at the samples' resolution once the store was compacted). A request
whose token times cannot be pinned down this way (speculative decoding, where a step carries several tokens;
pipeline parallelism, where a request is in every other step; hand-offs between instances; a preemption without
recorded events; a summarized step log) is listed as ``estimated``: the caller writes its TPOT repeated, as
before, and says so. Nothing here runs unless per-request detail is asked for.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lab.core.samples import RESOLUTION

# A request whose excess steps can be split among its resumptions in more ways than this is left estimated.
MAX_SPLITS = 512


@dataclass
class TokenGaps:
    """Per-request gaps (seconds) of the requests asked for, in their order, and which are estimated.

    ``gaps[i]`` is request i's gaps between consecutive outputs (a float64 array, ``output - 1`` long without
    speculative decoding), or None where ``i`` is in ``estimated``; ``reasons`` counts why requests were left
    estimated (a short phrase -> requests)."""

    gaps: list[np.ndarray | None]
    estimated: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


def request_token_gaps(result, requests: Sequence) -> TokenGaps:
    """The gaps between the outputs of each of ``requests`` (finished requests of ``result``, a SimResult), from
    the step log, as the module docstring describes.

    Returns:
        A :class:`TokenGaps` with one entry per request of ``requests``.
    """
    out = TokenGaps([None] * len(requests))
    reasons: Counter = Counter()

    def estimate(i: int, why: str) -> None:
        out.gaps[i] = None
        reasons[why] += 1

    if any(inst.steps.summary for inst in result.instances):
        for i in range(len(requests)):
            estimate(i, "the step log is summarized (output.step_log: summary)")
        return _finish(out, reasons)
    ends, outputs = _step_ends(result)
    multi_token = any(inst.acceptance is not None for inst in result.instances)
    residual = {k: v.copy() for k, v in outputs.items()}  # tokens per step not yet given to a request
    done = set() if multi_token else _plain_requests(requests, ends, out, residual)
    ambiguous = []
    for i, r in enumerate(requests):
        if i in done:
            continue
        ft, fin = r.first_token_time, r.finish_time
        if ft is None or fin is None:
            estimate(i, "no first or last token")
            continue
        if len(r.served_by) > 1:
            estimate(i, "served by more than one instance (hand-off)")
            continue
        e = ends.get(r.instance_id)
        if e is None or not len(e):
            estimate(i, "no step rows on its instance")
            continue
        lo = int(np.searchsorted(e, ft, "left"))
        hi = int(np.searchsorted(e, fin, "right"))
        if lo >= len(e) or e[lo] != ft or e[hi - 1] != fin:
            estimate(i, "its first or last token is not at a step end of its instance")
            continue
        windows = _preemption_windows(r, ft)
        if windows is None:
            estimate(i, "preempted, and its lifecycle events were not recorded")
            continue
        idx = np.arange(lo, hi)
        starts = []
        for t_pre, t_res in windows:
            t = e[idx]
            idx = idx[~((t > t_pre) & (t < t_res))]
            starts.append(int(np.searchsorted(e[idx], t_res, "left")))
        if multi_token:
            # a step may carry several tokens: the count of tokens proves nothing; the count of verifications
            # does (each one is a step of its own after the first token)
            if windows or len(idx) - 1 != r.num_drafts:
                estimate(i, "speculative decoding (a step may carry several tokens)")
                continue
            out.gaps[i] = np.diff(e[idx])
            continue
        excess = len(idx) - r.num_output_tokens
        if excess < 0:
            estimate(i, "fewer steps than tokens")
            continue
        if excess and not starts:
            estimate(i, "steps without a token for it and no preemption (pipeline parallelism?)")
            continue
        if excess and len(starts) == 1:
            if starts[0] + excess >= len(idx):
                estimate(i, "recompute steps beyond its last token")
                continue
            idx = np.delete(idx, np.arange(starts[0], starts[0] + excess))
        elif excess:
            ambiguous.append((i, r, idx, starts, excess))
            continue
        out.gaps[i] = np.diff(e[idx])
        np.subtract.at(residual[r.instance_id], idx, 1)
    pool = _pool(result)
    determined = [i for i, g in enumerate(out.gaps) if g is not None]
    claimed = _counts(np.concatenate([out.gaps[i] for i in determined]) if determined else np.zeros(0), pool)
    if claimed is None or (claimed > pool.counts).any():
        for i in determined:  # the step log and the samples disagree: claim nothing
            estimate(i, "its gaps are not among the run's ITL samples")
        for i, *_ in ambiguous:
            estimate(i, "its gaps are not among the run's ITL samples")
        return _finish(out, reasons)
    left = pool.counts - claimed
    for i, r, idx, starts, excess in ambiguous:
        chosen = _split(ends[r.instance_id], idx, starts, excess, residual[r.instance_id], left, pool)
        if chosen is None:
            estimate(i, "several preemptions, and the recompute steps cannot be told apart")
            continue
        keep, counts = chosen
        out.gaps[i] = np.diff(ends[r.instance_id][keep])
        np.subtract.at(residual[r.instance_id], keep, 1)
        left -= counts
    return _finish(out, reasons)


def _plain_requests(requests: Sequence, ends: dict[int, np.ndarray], out: TokenGaps,
                    residual: dict[int, np.ndarray]) -> set[int]:
    """The common case in whole arrays: requests served by one instance and never preempted whose first and last
    tokens are step ends of that instance with exactly one step end per output between them. Sets their gaps in
    ``out`` (views of one array), takes their tokens off ``residual``, and returns their positions."""
    done: set[int] = set()
    by_inst: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if (r.first_token_time is not None and r.finish_time is not None and not r.num_preemptions
                and len(r.served_by) <= 1 and r.instance_id in ends):
            by_inst.setdefault(r.instance_id, []).append(i)
    for inst, members in by_inst.items():
        e = ends[inst]
        if not len(e):
            continue
        pos = np.array(members, dtype=np.int64)
        ft = np.array([requests[i].first_token_time for i in members], dtype=float)
        fin = np.array([requests[i].finish_time for i in members], dtype=float)
        n_out = np.array([requests[i].num_output_tokens for i in members], dtype=np.int64)
        lo = np.searchsorted(e, ft, "left")
        hi = np.searchsorted(e, fin, "right")
        ok = (lo < len(e)) & (hi > lo) & (hi - lo == n_out)
        ok[ok] &= (e[lo[ok]] == ft[ok]) & (e[hi[ok] - 1] == fin[ok])
        pos, lo, hi = pos[ok], lo[ok], hi[ok]
        if not len(pos):
            continue
        steps = np.diff(e)
        lengths = hi - lo - 1
        total = int(lengths.sum())
        starts = np.repeat(lo - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        flat = steps[starts + np.arange(total)]
        for i, part in zip(pos.tolist(), np.split(flat, np.cumsum(lengths)[:-1])):
            out.gaps[i] = part
        emitted = np.repeat(lo - np.concatenate(([0], np.cumsum(hi - lo)[:-1])), hi - lo) + np.arange(int((hi - lo).sum()))
        residual[inst] -= np.bincount(emitted, minlength=len(e)).astype(residual[inst].dtype)
        done.update(pos.tolist())
    return done


def _finish(out: TokenGaps, reasons: Counter) -> TokenGaps:
    out.estimated = [i for i, g in enumerate(out.gaps) if g is None]
    out.reasons = dict(reasons)
    return out


def _step_ends(result) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Per instance: its step end times (start + duration, s) in ascending order and the tokens each step gave
    (``output_tokens``), read from the step log (spilled rows included)."""
    ends: dict[int, np.ndarray] = {}
    outputs: dict[int, np.ndarray] = {}
    for inst in result.instances:
        log = inst.steps
        if not log.spilled_rows:
            cols = log.cols
            start, dur, toks = cols["start"], cols["duration"], cols["output_tokens"]
        else:
            frames = list(log.frames())
            start = np.concatenate([f["start"].to_numpy(float) for f in frames])
            dur = np.concatenate([f["duration"].to_numpy(float) for f in frames])
            toks = np.concatenate([f["output_tokens"].to_numpy(float) for f in frames])
        e = start + dur
        order = np.argsort(e, kind="stable")
        ends[inst.instance_id] = e[order]
        outputs[inst.instance_id] = np.asarray(toks, dtype=np.int64)[order]
    return ends, outputs


def _preemption_windows(r, ft: float) -> list[tuple[float, float]] | None:
    """(preempted, resumed) times (s) of the request's preemptions that end after its first token; None when it
    was preempted and its events were not recorded."""
    if not r.num_preemptions:
        return []
    if not r.events:
        return None
    out = []
    pre = None
    for ev in r.events:
        if ev[1] == "preempted":
            pre = ev[0]
        elif ev[1] == "resumed" and pre is not None:
            if ev[0] > ft:
                out.append((pre, ev[0]))
            pre = None
    if pre is not None:  # preempted and never resumed, yet finished: not a case this reads
        return None
    return out


@dataclass
class _Pool:
    keys: np.ndarray  # the distinct sample values, as integer keys, ascending
    counts: np.ndarray  # samples per key
    compacted: bool


def _pool(result) -> _Pool:
    """The run's pooled ITL samples as (distinct key, count): exact values, or 0.1-us keys once compacted."""
    v, w = result.itl_samples.arrays()
    compacted = bool(result.itl_samples.compacted)
    keys = _keys(v, compacted)
    uniq, inv = np.unique(keys, return_inverse=True)
    counts = np.bincount(inv, weights=w, minlength=len(uniq)).round().astype(np.int64)
    return _Pool(uniq, counts, compacted)


def _keys(values: np.ndarray, compacted: bool) -> np.ndarray:
    """Comparable keys of gap values: the float's bits exactly, or its 0.1-us rounding (the compacted store's)."""
    values = np.asarray(values, dtype=np.float64)
    if compacted:
        return np.round(values / RESOLUTION).astype(np.int64)
    return (values + 0.0).view(np.int64)  # (+0.0: -0.0 and 0.0 alike)


def _counts(gaps: np.ndarray, pool: _Pool) -> np.ndarray | None:
    """How many of ``gaps`` fall on each pool key, or None when one of them is no pool value at all."""
    k = _keys(gaps, pool.compacted)
    pos = np.searchsorted(pool.keys, k)
    if len(k) and ((pos >= len(pool.keys)).any() or (pool.keys[np.minimum(pos, len(pool.keys) - 1)] != k).any()):
        return None
    return np.bincount(pos, minlength=len(pool.keys)).astype(np.int64)


def _split(e: np.ndarray, idx: np.ndarray, starts: list[int], excess: int, residual: np.ndarray,
           left: np.ndarray, pool: _Pool):
    """The split of ``excess`` recompute steps among the resumptions at positions ``starts`` of ``idx`` whose
    token steps all still have a token to give (``residual``) and whose gaps are all among the unclaimed samples
    (``left``): (the kept step indices, their gaps' counts per pool key); None when no split fits, or when two
    that fit give different gaps."""
    found = None
    for n, split in enumerate(s for s in itertools.product(range(excess + 1), repeat=len(starts))
                              if sum(s) == excess):
        if n >= MAX_SPLITS:
            return None
        drop = [p for s, m in zip(starts, split) for p in range(s, s + m)]
        if drop and max(drop) >= len(idx) - 1:
            continue
        keep = np.delete(idx, drop)
        if (residual[keep] < 1).any():
            continue
        counts = _counts(np.diff(e[keep]), pool)
        if counts is None or (counts > left).any():
            continue
        if found is None:
            found = (keep, counts)
        elif not np.array_equal(np.diff(e[found[0]]), np.diff(e[keep])):
            return None
    return found
