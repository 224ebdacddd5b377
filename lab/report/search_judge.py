"""Whether a probe met the SLO: its figures from its requests table and summary (each bound at its percentile, the
SLO attainment, the goodput), and whether its load was sustained (:func:`queue_growth`: the backlog's growth over
the second half of the arrivals against a sustained load's)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from lab.report.search_spec import SLO_METRICS, SearchSLO

# a backlog that grows by fewer requests than this over the second half of the arrivals is not told from noise
MIN_BACKLOG_GROWTH = 5
# an arrival window shorter than this many median times in the system cannot show a sustained load
MIN_WINDOW_STAYS = 3.0
# the backlog growth's noise: its spread over this many random orders of the times in the system (seeded), for up
# to this many requests (beyond, the spread is small: about 0.005 at 3,200 long-tailed requests, and not computed)
NOISE_PERMUTATIONS = 39
NOISE_MAX_REQUESTS = 200_000
# a growth counts only above this many times its noise (one-sided: a sustained load passes ~99 % of the time)
NOISE_SIGMAS = 2.5


@dataclass
class Probe:
    """One simulation of the search: the value tried, whether it met the SLO (``max_goodput``: whether it may be
    the answer), and its figures (:func:`probe_figures`; ``{"error": why}`` for a ``max_goodput`` value the
    deployment cannot be built with, which a re-run tries again)."""

    value: Any
    ok: bool
    figures: dict
    reused: bool = False  # read back from the probe's complete folder instead of simulated (not in the outputs)
    needed: bool = True  # on the search's path; False: simulated ahead (--jobs) for an outcome that did not come
    wall_s: float | None = None  # seconds from its start to its result in this run (None when reused)


def meets(figures: dict, slo: SearchSLO, require_stable_queue: bool = True) -> bool:
    """Whether a probe's figures meet the SLO: every request finished, the backlog not growing over the arrivals
    when ``require_stable_queue``, and the bounds by the SLO's rule (``percentile``: each bounded metric's
    ``p_<metric>`` within its bound; ``attainment``: the share of requests meeting every per-request bound, and
    the pooled ITL percentile within ``itl_s``)."""
    if figures["num_unserved"] or (require_stable_queue and figures["queue_growing"]):
        return False
    return _rule_met(figures, slo)


def _rule_met(figures: dict, slo: SearchSLO) -> bool:
    """The SLO's rule alone (True without a rule)."""
    checks = []
    for m, bound in slo.bounds().items():
        if slo.percentile_of(m) is not None:
            checks.append(figures[f"p_{m}"] <= bound)
    if slo.attainment is not None:
        checks.append(figures["attainment"] >= slo.attainment)
    return all(checks)


def eligible(figures: dict, slo: SearchSLO, require_stable_queue: bool = True) -> bool:
    """``max_goodput``: whether a probe may be the answer: its backlog not growing (when ``require_stable_queue``)
    and the SLO's rule met where it has one. Requests it did not serve only lower its goodput."""
    if require_stable_queue and figures["queue_growing"]:
        return False
    return _rule_met(figures, slo)


def probe_figures(df: pd.DataFrame, slo: SearchSLO, summary: dict | None = None,
                  max_backlog_growth: float = 0.05) -> dict:
    """What the SLO is judged on, from a probe's requests table (``requests.parquet``: lab/report/metrics.py
    ``requests_frame``; seconds) and its ``summary.json`` (``summary``: the pooled ITL statistics, the duration).

    Returns:
        ``p_ttft``, ``p_tpot``, ``p_e2el``, ``p_queue`` (s): each metric's percentile over the finished requests
        at the percentile its bound is judged at (the median under an attainment SLO; inf with no finished
        request); ``p_itl`` (s, with an ITL bound): that percentile of the pooled ITL; ``attainment`` (0..1): the
        share of requests meeting every per-request bound; ``goodput`` (req/s): those requests per second of the
        run's duration (summary.json's ``duration_s``: first send to last token received; without ``summary``,
        first arrival to last finish); ``num_requests`` and ``num_unserved`` (rejected or unfinished);
        ``request_throughput`` (finished requests per second, first arrival to last finish); and
        :func:`queue_growth`'s figures. Closed-loop warm-up requests are left out.

    Raises:
        KeyError: a column is missing.
    """
    if "warmup" in df:
        df = df[~df["warmup"].astype(bool)]
    fin = df[df["status"] == "finished"]
    out: dict = {"num_requests": int(len(df)), "num_unserved": int(len(df) - len(fin))}
    ok = fin["ttft"] == fin["ttft"]
    bounds = slo.bounds()
    for m in ("ttft", "tpot", "e2el", "queue"):
        key, column, _ = SLO_METRICS[m]
        col = fin[column].fillna(0.0) if m == "tpot" else fin[column]  # a one-token output has no TPOT (vLLM: 0)
        q = slo.percentile_of(m) or 50.0
        out[f"p_{m}"] = float(col.quantile(q / 100.0)) if len(col) else math.inf
        if m in bounds:
            ok &= col <= bounds[m]
    if "itl" in bounds:
        q = slo.percentile_of("itl")
        value = ((summary or {}).get("itl") or {}).get(f"p{q:g}")
        out["p_itl"] = float(value) if value is not None else math.inf
    good = int(ok.sum())
    out["attainment"] = good / len(df) if len(df) else 0.0
    span = float(fin["finish_time"].max() - df["arrival_time"].min()) if len(fin) else 0.0
    duration = float((summary or {}).get("duration_s") or span)
    out["goodput"] = good / duration if duration > 0 else 0.0
    out.update(queue_growth(df, max_backlog_growth))
    out["request_throughput"] = len(fin) / span if span > 0 else 0.0
    return out


def queue_growth(df, max_growth: float = 0.05) -> dict:
    """Whether the backlog grows over the arrivals faster than a sustained load's would.

    The backlog is the requests in the system (arrived, not finished), counted at 41 instants across the second
    half of the arrival window (its middle to the last arrival). Even a sustained load's backlog rises there while
    the long requests accumulate: at time t it holds each earlier arrival that is not done after t - its arrival,
    so it fills up over as long as the longest times in the system, and with long-tailed output lengths that is much
    of a short trace. So the count is compared with what it would be if the same times in the system (finish -
    arrival; never finished: for ever) were given to the requests in random order, as a sustained load gives them:
    at each instant, the sum over the requests arrived of the share of all requests whose time in the system exceeds
    the time since that arrival. The excess of the count over this is fitted with a straight line (least squares);
    its slope x the half-window is the backlog the second half added beyond a sustained load's, and divided by the
    arrivals of the second half it is ``backlog_growth``: the share of those arrivals the deployment did not keep up
    with. A load above what the deployment serves makes the times in the system grow with the arrival time, and
    the share is then about 1 - service rate / arrival rate (less where the times in the system are long against
    the window, the comparison drawing on the grown times too); a sustained load's is about 0 (noise either way).

    Growing: ``backlog_growth`` above ``max_growth`` (default 0.05: the deployment serves less than 95 % of the
    arrival rate) and above :data:`NOISE_SIGMAS` (2.5) times its noise, and at least :data:`MIN_BACKLOG_GROWTH`
    requests added (fewer is not told from noise). The noise, ``backlog_growth_noise``, is the spread (standard
    deviation) of the share over :data:`NOISE_PERMUTATIONS` random orders of the same times in the system (seeded:
    the same every time), what a sustained load of these requests gives by chance: long-tailed lengths make it
    large over a short trace (about 0.03 over 600 demo requests, 0.01 over 3,000). So a backlog that grows by 8
    requests over a 300-request second half (2.7 %) is not growing, and one growing by 13 % of the arrivals is,
    however large it was at the middle.

    On experiments/demo.yaml (Llama-3.1-8B on one H100), whose 3,000-request runs sustain 18 req/s and not 20 (p90
    TTFT 6.9 s, the queue time growing by 0.074 s per s of arrivals), share +- noise: 600-request runs give 0.015
    +- 0.024 at 14 req/s, 0.019 +- 0.029 at 16, 0.054 +- 0.032 at 18 (not growing), 0.116 +- 0.032 at 20 and 0.252
    +- 0.038 at 24 (growing); 3,000-request runs -0.006 +- 0.005 at 16, -0.008 +- 0.008 at 18 and 0.071 +- 0.011
    at 20 (growing). The raw count's slope, without the comparison, gives 0.059, 0.074 and 0.124 at 14, 16 and 18
    req/s over 600 requests: it flags sustained loads. Of 200 seeded stationary processes of 640 requests (16 per s,
    lognormal times in the system of median 4 s, sigma 0.9), 1 is flagged.

    It needs an arrival window of several times in the system: over a burst shorter than most requests' time in the
    system every request is still there at every instant, overloaded or not (120 demo requests in 4.5 s at 30
    req/s, median time in the system 3.5 s: 0.062, 4 requests added), and an overloaded batch that shares the GPU
    finishes its requests together, the later arrivals no later. So an arrival window shorter than
    :data:`MIN_WINDOW_STAYS` median times in the system counts as too short to show a sustained load, and the probe
    as not shown sustained: a search at a fixed number of requests meets this at high rates (the window shrinks as
    the rate grows), where it errs on the safe side (a longer trace, ``workload.num_requests``, decides;
    ``require_stable_queue: false`` skips the check). A load less than ``max_growth`` above capacity is not flagged
    (over a finite trace it shows in the latency bounds, if at all).

    Args:
        df: requests table (``arrival_time``, ``finish_time`` in seconds; NaN = never finished).
        max_growth: the share of the second half's arrivals that may pile up (0..1).

    Returns:
        ``in_system_at_last_arrival``, ``in_system_at_mid_arrivals`` (requests counted), ``backlog_growth`` (the
        share above, may be negative: a backlog draining; 0 when the window is too short), ``backlog_growth_noise``
        (its spread, 0..1; 0 when not computed), ``arrival_window_s``
        and ``median_stay_s`` (seconds; inf when half the requests never finished), ``window_too_short`` (bool)
        and ``queue_growing`` (bool: the load is not shown sustained, its backlog growing or its window too short).
    """
    none = {"in_system_at_last_arrival": 0, "in_system_at_mid_arrivals": 0, "backlog_growth": 0.0,
            "backlog_growth_noise": 0.0, "arrival_window_s": 0.0, "median_stay_s": 0.0, "window_too_short": False,
            "queue_growing": False}
    if not len(df):
        return none
    arrival = df["arrival_time"].to_numpy(dtype=float)
    finish = df["finish_time"].to_numpy(dtype=float)
    stay = np.where(np.isfinite(finish), finish - arrival, np.inf)  # time in the system; never finished: for ever
    order = np.argsort(arrival, kind="stable")
    arrival, stay = arrival[order], stay[order]
    ends = np.sort(arrival + stay)
    stays = np.sort(stay)
    first, last = float(arrival[0]), float(arrival[-1])

    def in_system(t: float) -> int:
        return int(np.searchsorted(arrival, t, side="right") - np.searchsorted(ends, t, side="right"))

    def shuffled(t: float) -> float:  # expected count with the times in the system given in random order
        lags = t - arrival[: np.searchsorted(arrival, t, side="right")]
        return float((len(stays) - np.searchsorted(stays, lags, side="right")).sum()) / len(stays)

    mid = (first + last) / 2
    median_stay = float(stays[(len(stays) - 1) // 2])
    too_short = bool(last - first < MIN_WINDOW_STAYS * median_stay)
    out = {"in_system_at_last_arrival": in_system(last), "in_system_at_mid_arrivals": in_system(mid),
           "backlog_growth": 0.0, "backlog_growth_noise": 0.0, "arrival_window_s": last - first,
           "median_stay_s": median_stay, "window_too_short": too_short, "queue_growing": too_short}
    arrived = int(len(arrival) - np.searchsorted(arrival, mid, side="right"))  # in (mid, last]
    if too_short or arrived < 2:
        return out
    ts = np.linspace(mid, last, 41)
    expected = np.array([shuffled(t) for t in ts])
    arrived_by = np.searchsorted(arrival, ts, side="right")

    def share(ends_sorted: np.ndarray) -> float:  # the second half's added backlog / its arrivals
        excess = arrived_by - np.searchsorted(ends_sorted, ts, side="right") - expected
        return float(np.polyfit(ts, excess, 1)[0]) * (last - mid) / arrived

    growth = share(ends)
    noise = 0.0
    if len(arrival) <= NOISE_MAX_REQUESTS:  # the same times in the system in random orders: the share's spread
        rng = np.random.default_rng(0)
        noise = float(np.std([share(np.sort(arrival + rng.permutation(stay))) for _ in range(NOISE_PERMUTATIONS)]))
    out["backlog_growth"], out["backlog_growth_noise"] = growth, noise
    out["queue_growing"] = bool(growth > max(max_growth, NOISE_SIGMAS * noise)
                                and growth * arrived >= MIN_BACKLOG_GROWTH)
    return out
