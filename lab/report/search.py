"""Capacity search: the largest load a deployment serves within an SLO, the fewest instances that serve a load, or
the value of a field that maximises goodput, and candidate deployments ranked by the GPUs they need
(``servelab search FILE.yaml``; docs/search.md).

A search file names a base experiment, what to find and the SLO::

    base: demo.yaml                      # an experiment file (relative to this file), or an inline mapping
    find: max_rate                       # max_rate | max_concurrency | min_instances | max_goodput
    low: 1                               # the bracket searched (the bisections)
    high: 64
    tolerance: 0.02                      # max_rate: relative width of the final bracket
    slo: {ttft_s: 0.5, tpot_s: 0.05, percentile: 90}   # p90 TTFT <= 500 ms and p90 TPOT <= 50 ms
    # or {ttft_s: 0.5, tpot_s: 0.05, attainment: 0.9}: >= 90 % of requests meet every SLO (DistServe)
    # or {itl_s: 0.1, queue_s: 2.0, percentile: 99, percentiles: {queue: 50}}: p99 ITL (TBT) <= 100 ms and median
    #    scheduling delay <= 2 s (Sarathi-Serve)
    jobs: 2                              # probes at once (--jobs)
    candidates:                          # optional: the search runs once per candidate, then ranks them
      tp2: {hardware: {tensor_parallel_size: 2}}
      tp4: {hardware: {tensor_parallel_size: 4}}

``find: max_goodput`` instead tries every value of ``field`` in ``values`` (a list or ``{range: [start, stop,
step]}``) and answers the one with the most goodput (requests per second meeting every per-request bound).

Each probe is one simulation of the base experiment with the searched field set (``workload.rate``,
``workload.concurrency`` or ``cluster.num_instances``, or ``field``). The bisections assume that the SLO, once
missed, stays missed as load grows (or as instances are removed): ``max_rate`` bisects until the bracket is within
``tolerance`` of its lower end, the integer searches exactly. A probe counts as meeting the SLO only if every
request finished (none rejected or unfinished) and, unless ``require_stable_queue: false``, its backlog was not
growing over the second half of the arrivals (:func:`queue_growth`).

Up to ``jobs`` probes run at once (:func:`run_search`): the candidates' searches side by side, a ``max_goodput``
search's values, and a bisection's next probes ahead of its current one (both bracket ends; then the probes each
outcome of the probes in flight would ask for next). The answer does not depend on ``jobs``: the bisection takes
the same path, and probes it did not need are listed as such.

A search that cannot apply to its experiment (``min_instances`` on a disaggregated deployment, ``max_rate`` on a
trace that keeps its own arrival times, a bracket end or value the experiment refuses, ...) is refused before
anything is simulated (:func:`check_search`). Each probe is a sweep run (lab/report/sweep.py ``simulate_task``): its
folder ``<out>/probes/<candidate>/<field>=<value>/`` is written atomically with ``run.json`` (the hash of the probe's
configuration) last, and a re-run reuses every probe whose folder is complete and whose hash is unchanged
(``reuse_task``; ``fresh`` redoes them), judging it again from its ``requests.parquet`` and ``summary.json``.
``search.md`` and ``search.json`` replace the earlier ones as one set, in one rename of the output folder
(``replace_outputs``).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lab.experiment.config import (ConfigError, Experiment, _format_errors, deep_merge, parse_experiment,
                                   read_yaml)
from lab.report.compare import Run, config_hash, run_dir
from lab.report.executors import Executor, PoolExecutor
from lab.report.output_folder import OutputDirError, check_out_dir
from lab.report.sweep import SweepTask, expand_values, replace_outputs, reuse_task, simulate_task

_FIELDS = {"max_rate": "workload.rate", "max_concurrency": "workload.concurrency",
           "min_instances": "cluster.num_instances"}
# the SLO's bounded metrics: name in the SLO's ``percentiles`` -> (bound field, requests-table column, label)
_METRICS = {"ttft": ("ttft_s", "ttft", "TTFT"), "tpot": ("tpot_s", "tpot", "TPOT"), "itl": ("itl_s", None, "ITL"),
            "e2el": ("e2el_s", "e2el", "E2EL"), "queue": ("queue_s", "queue_time", "queue time")}
# ITL is pooled over every request's token gaps: a probe keeps its statistics (summary.json), not its samples
ITL_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
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


class SearchSLO(BaseModel):
    """Latency bounds (seconds) and how they are judged.

    Bounds: ``ttft_s``, ``tpot_s``, ``e2el_s`` (per request), ``queue_s`` (per request: the scheduling delay, the
    requests table's ``queue_time``: first scheduled - the engine's queue entry) and ``itl_s`` (the inter-token
    latency, Sarathi-Serve's TBT, pooled over every request's token gaps, so judged at a percentile of the pool).

    Rules: ``percentile`` (each bound at that percentile of its metric, e.g. p90 TTFT <= ttft_s), with
    ``percentiles`` overriding it per metric (e.g. ``{itl: 99, queue: 50}``); or ``attainment``: the share of
    requests meeting every per-request bound (DistServe's SLO attainment), with an ITL bound judged at
    ``percentiles.itl`` beside it. A ``max_goodput`` search needs no rule (it maximises the requests per second
    meeting every per-request bound); a rule given there is a constraint each value must meet."""

    model_config = ConfigDict(extra="forbid")
    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, gt=0)
    e2el_s: float | None = Field(None, gt=0)
    itl_s: float | None = Field(None, gt=0, description="pooled inter-token latency (TBT) bound, seconds")
    queue_s: float | None = Field(None, gt=0, description="scheduling delay (queue time) bound, seconds")
    percentile: float | None = Field(None, gt=0, le=100)
    percentiles: dict[Literal["ttft", "tpot", "itl", "e2el", "queue"], float] = Field(default_factory=dict)
    attainment: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="after")
    def _consistent(self) -> "SearchSLO":
        if self.percentile is not None and self.attainment is not None:
            raise ValueError("give one of 'percentile' (each bound at that percentile) and 'attainment' (share of "
                             "requests meeting every bound), not both")
        if not self.bounds():
            raise ValueError("give at least one bound: ttft_s, tpot_s, e2el_s, itl_s or queue_s")
        for m, p in self.percentiles.items():
            if not 0 < p <= 100:
                raise ValueError(f"percentiles.{m}: expected a percentile in (0, 100], got {p!r}")
            if m not in self.bounds():
                raise ValueError(f"percentiles.{m}: no {_METRICS[m][0]} bound to judge at it")
            if self.attainment is not None and m != "itl":
                raise ValueError(f"percentiles.{m}: under 'attainment' every request is judged against "
                                 f"{_METRICS[m][0]}; only the pooled ITL takes a percentile (percentiles.itl)")
        if self.itl_s is not None:
            q = self.percentile_of("itl")
            if q is None:
                raise ValueError("itl_s: ITL is pooled over all requests' token gaps, not per request: give "
                                 "percentiles: {itl: 99} (or a 'percentile' rule)")
            if q not in ITL_PERCENTILES:
                raise ValueError(f"itl_s: ITL is judged from a probe's pooled statistics, which have p50, p90, p95 "
                                 f"and p99; got p{q:g} (set percentiles: {{itl: 99}})")
        return self

    def bounds(self) -> dict[str, float]:
        """Bounded metric (``ttft``, ``tpot``, ``itl``, ``e2el``, ``queue``) -> its bound in seconds."""
        return {m: getattr(self, key) for m, (key, _, _) in _METRICS.items() if getattr(self, key) is not None}

    def percentile_of(self, metric: str) -> float | None:
        """The percentile a metric's bound is judged at; None for a per-request bound under ``attainment`` (or with
        no rule at all)."""
        if metric in self.percentiles:
            return float(self.percentiles[metric])
        return float(self.percentile) if self.percentile is not None else None

    @property
    def has_rule(self) -> bool:
        """Whether the SLO has a rule (``percentile`` or ``attainment``)."""
        return self.percentile is not None or self.attainment is not None


class SearchSpec(BaseModel):
    """A search file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("search", pattern=r"^[A-Za-z0-9_.-]+$")
    base: str | dict[str, Any]
    find: Literal["max_rate", "max_concurrency", "min_instances", "max_goodput"] = "max_rate"
    field: str | None = Field(None, description="the field searched (default by 'find'; required for max_goodput)")
    low: float | None = Field(None, gt=0)
    high: float | None = Field(None, gt=0)
    values: list[Any] | dict[str, list[float]] | None = Field(
        None, description="max_goodput: the values tried, a list or {range: [start, stop, step]} (stop included)")
    tolerance: float = Field(0.02, gt=0, lt=1, description="max_rate: final bracket width relative to its low end")
    slo: SearchSLO
    require_stable_queue: bool = Field(True, description="a probe whose backlog (requests in the system) grows "
                                       "over the second half of its arrivals misses (its load is not sustained, "
                                       "however short the trace)")
    max_backlog_growth: float = Field(0.05, gt=0, lt=1, description="the share of the arrivals in the second half "
                                      "of the arrival window that may pile up as backlog before a probe counts as "
                                      "not sustaining its load")
    jobs: int = Field(1, ge=1, description="probes simulated at once (--jobs overrides)")
    candidates: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("candidates")
    @classmethod
    def _candidate_names(cls, candidates: dict) -> dict:
        for name in candidates:
            if not re.match(r"^[A-Za-z0-9_.-]+$", name):
                raise ValueError(f"candidate name {name!r} must match [A-Za-z0-9_.-]+ (it names its probes' folder)")
        return candidates

    @model_validator(mode="after")
    def _bracket(self) -> "SearchSpec":
        if self.find == "max_goodput":
            return self._grid()
        if self.values is not None:
            raise ValueError(f"values is for find max_goodput; find {self.find} bisects between low and high")
        if self.low is None or self.high is None:
            raise ValueError(f"find {self.find}: give the bracket, low and high")
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.find != "max_rate" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError(f"{self.find}: low and high must be integers")
        if self.find != "max_rate" and "tolerance" in self.model_fields_set:
            raise ValueError(f"tolerance does not apply to find {self.find}: the integer searches are exact "
                             "(tolerance is for max_rate)")
        if not self.slo.has_rule:
            raise ValueError("slo: give exactly one of 'percentile' (each bound at that percentile) and "
                             "'attainment' (share of requests meeting every bound)")
        return self

    def _grid(self) -> "SearchSpec":
        if self.field is None:
            raise ValueError("find max_goodput needs field: the experiment field whose value maximises goodput, "
                             "e.g. engine.max_num_batched_tokens")
        if self.low is not None or self.high is not None or "tolerance" in self.model_fields_set:
            raise ValueError("low, high and tolerance are for the bisections; find max_goodput tries every value "
                             "in values (a list or {range: [start, stop, step]})")
        if self.values is None:
            raise ValueError(f"find max_goodput: give the values of {self.field} to try (values: a list or "
                             "{range: [start, stop, step]})")
        vals = expand_values("values", self.values)
        for v in vals:
            if not isinstance(v, (int, float, str)) or (isinstance(v, str) and not _SAFE.match(v)):
                raise ValueError(f"values: {v!r}: expected numbers, booleans or names of A-Z a-z 0-9 _ . : - "
                                 "(each names its probe's folder)")
        if len({repr(v) for v in vals}) != len(vals):
            raise ValueError("values: a value is listed twice")
        self.values = vals
        return self

    @property
    def dotted(self) -> str:
        """The field searched."""
        return self.field or _FIELDS[self.find]


_SAFE = re.compile(r"^[A-Za-z0-9_.:-]+$")


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


@dataclass
class SearchResult:
    """The answer for one candidate: ``value`` (None if even the easiest end of the bracket misses the SLO, or for
    ``max_goodput`` no value qualifies), the GPUs it takes, the goodput of its probe (req/s), and every probe: the
    search's path in order, then those simulated ahead and not needed."""

    candidate: str
    value: Any
    gpus: int | None
    probes: list[Probe] = field(default_factory=list)
    error: str = ""  # why the candidate could not run at all (e.g. the model does not fit)
    goodput: float | None = None


@dataclass
class SearchState:
    """Where a search stands, handed to the progress display after every probe and at least every second.

    ``finished`` probes have a result (``simulated`` now or ``reused``); ``running`` names those in flight
    (``candidate: field=value``); ``remaining`` is the most probes the search may still need, those in flight
    included (a bisection's longest path from where it stands; every value left for ``max_goodput``), so
    ``finished + remaining`` bounds the total. ``eta_s`` bounds the time left from above: remaining x the mean
    wall time of the probes simulated so far / the probes that can run at once (None until one was simulated).
    ``last`` is the candidate and probe that just finished (None on a tick)."""

    finished: int = 0
    simulated: int = 0
    reused: int = 0
    running: list[str] = field(default_factory=list)
    remaining: int = 0
    elapsed_s: float = 0.0
    eta_s: float | None = None
    last: tuple[str, Probe] | None = None

    @property
    def total(self) -> int:
        """At most this many probes in all."""
        return self.finished + self.remaining


def load_search(path: str | Path, data_dir: str | Path | None = None) -> tuple[SearchSpec, Path]:
    """Read a search file.

    Raises:
        ConfigError: missing file, bad YAML, or invalid fields (the message names the file and field).
    """
    p = Path(path)
    data = read_yaml(p, "search file")
    try:
        return SearchSpec.model_validate(data or {}), p
    except ValidationError as e:  # one line per bad field (a single one: one line), unknown ones with a suggestion
        msg = _format_errors(str(p), e, SearchSpec).replace("invalid experiment", "invalid search file")
        raise ConfigError(msg.replace(": (top level): ", ": ")) from None


def _base_data(spec: SearchSpec, where: Path) -> tuple[dict, Path]:
    if isinstance(spec.base, dict):
        return dict(spec.base), where.resolve().parent
    path = (where.resolve().parent / spec.base).resolve()
    data = read_yaml(path, "base experiment")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping")
    return data, path.parent


def _set(data: dict, dotted: str, value: Any) -> dict:
    node: dict = {}
    top = node
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return deep_merge(data, top)


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
        key, column, _ = _METRICS[m]
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


def _bisect(ok: Callable[[float], bool], low: float, high: float, integer: bool, increasing_ok: bool,
            tolerance: float) -> float | None:
    """The boundary value of a monotone predicate on [low, high]: the largest value that is ok when ok holds for
    small values (``increasing_ok`` False: max load), the smallest when it holds for large ones (min instances).
    None when no value in the bracket is ok."""
    good, bad = (low, high) if not increasing_ok else (high, low)
    if not ok(good):
        return None
    if ok(bad):
        return bad
    while True:
        if integer:
            if abs(good - bad) <= 1:
                return good
            mid = float(int((good + bad) // 2))
        else:
            if abs(bad - good) <= tolerance * min(good, bad):
                return good
            mid = (good + bad) / 2.0
        if ok(mid):
            good = mid
        else:
            bad = mid


def _gpus(exp: Experiment) -> int:
    """GPUs of a deployment: per instance TP x PP (a DP rank is an instance), times the instances; a pool (or a
    disaggregated role) with its own ``hardware`` parallelism counts with it."""
    h = exp.hardware
    if exp.pools:
        return sum(p.num_instances * p.hardware.get("tensor_parallel_size", h.tensor_parallel_size)
                   * p.hardware.get("pipeline_parallel_size", h.pipeline_parallel_size) for p in exp.pools)
    return h.tensor_parallel_size * h.pipeline_parallel_size * exp.cluster.num_instances


def _candidates(spec: SearchSpec, where: Path, overrides: dict | None = None) -> tuple[list[tuple[str, dict]], Path]:
    """(every candidate's name and experiment fields: base <- its overrides <- ``overrides`` (``--set``); or the
    base alone as ``base``), and the folder relative paths of the base resolve in. Raises ConfigError: the base
    cannot be read."""
    base, base_dir = _base_data(spec, where)
    return [(name, deep_merge(deep_merge(base, over), overrides or {}))
            for name, over in (spec.candidates or {"base": {}}).items()], base_dir


def _value(spec: SearchSpec, value: Any) -> Any:
    if spec.find == "max_goodput" or spec.find == "max_rate":
        return value
    return int(value)


def _tried(spec: SearchSpec) -> list[Any]:
    """The values every candidate is checked at before the first probe: the bracket's ends, or every value."""
    return list(spec.values) if spec.find == "max_goodput" else [_value(spec, spec.low), _value(spec, spec.high)]


def check_search(spec: SearchSpec, where: Path, data_dir: str | Path | None = None,
                 overrides: dict | None = None) -> None:
    """Refuse a search that cannot apply to its experiment, before anything is simulated: for every candidate, the
    searched field must be one the experiment uses, and the experiment must be valid with it at ``low`` and at
    ``high`` (``max_goodput``: at every value). Refused: ``cluster.num_instances`` (``min_instances``) on a
    disaggregated deployment (its roles have their own counts), on one with ``pools`` or with
    ``hardware.data_parallel_size`` > 1 (only multiples of it are valid); ``workload.rate`` (``max_rate``) on a
    workload that keeps its trace's or a CSV's arrival times; ``overrides`` (``--set``) of the searched field; an
    unknown field; a bracket end or value the experiment refuses (``workload.concurrency`` with ``source:
    sessions``, ...). A deployment that cannot be built (a model that does not fit) is not refused here: the search
    reports it.

    Raises:
        ConfigError: one line naming the search file, the candidate (when there are several), the field and why
            (UnknownFieldError for an unknown field).
    """
    dotted = spec.dotted
    if _get(overrides or {}, dotted, None) is not None:
        raise ConfigError(f"{where}: --set {dotted}: the search sets that field itself (find {spec.find}); change "
                          "the bracket or values instead")
    cands, base_dir = _candidates(spec, where, overrides)
    for name, data in cands:
        label = f"{where}: " + (f"candidate {name}: " if spec.candidates else "")
        what = f"find {spec.find} searches {dotted}" if spec.field is None else f"field {dotted}"
        if dotted == "cluster.num_instances":  # (read from the fields: the experiment may be valid only with it set)
            dp = _get(data, "hardware.data_parallel_size", 1)
            if _get(data, "deployment.mode", "colocated") == "disaggregated":
                raise ConfigError(f"{label}{what}, which a disaggregated deployment (deployment.mode: disaggregated) "
                                  "does not use: search a role's instances with field: deployment.prefill.count or "
                                  "field: deployment.decode.count")
            if _get(data, "pools", None):
                raise ConfigError(f"{label}{what}, which a deployment with pools does not use (each pool has its own "
                                  "num_instances)")
            if isinstance(dp, int) and dp > 1:
                raise ConfigError(f"{label}{what} one instance at a time, but with hardware.data_parallel_size {dp} "
                                  f"only multiples of {dp} are valid (each DP rank is an instance)")
        if dotted == "workload.rate":
            source = _get(data, "workload.source", "synthetic")
            if source not in ("synthetic", "sessions"):
                raise ConfigError(f"{label}{what}, which source {source!r} does not use: it replays the arrival times "
                                  "of its trace (workload.rate is for source synthetic or sessions)")
            if source == "synthetic" and _get(data, "workload.arrival_times", None):
                raise ConfigError(f"{label}{what}, which this workload does not use: workload.arrival_times sets its "
                                  "arrival times")
        for v in _tried(spec):
            parse_experiment(_set(data, dotted, v), f"{where} [{name}: {dotted}={v}]", base_dir, data_dir)


def _get(data: Any, dotted: str, default: Any) -> Any:
    """The value at a dotted path of nested experiment fields, ``default`` where it is absent or null."""
    for part in dotted.split("."):
        if not isinstance(data, dict) or data.get(part) is None:
            return default
        data = data[part]
    return data


def _folder_value(value: Any) -> str:
    """How a value names its probe's folder: ``repr`` for numbers (``workload.rate=18.5``), the name itself for a
    name (``policy.scheduler=sarathi``)."""
    return value if isinstance(value, str) else repr(value)


# ------------------------------------------------------------------------------------------- one candidate's plan

class _Unknown(Exception):
    """Raised inside a replay of the search at a value whose outcome is not known (yet)."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.value = value


class _Plan:
    """One candidate's search: the outcomes known so far, which probe it needs next (:meth:`next_value`), the probes
    it may need after the ones in flight (:meth:`ahead`), and its answer once complete."""

    def __init__(self, spec: SearchSpec, name: str, data: dict) -> None:
        self.spec, self.name, self.data = spec, name, data
        self.known: dict[Any, bool] = {}
        self.probes: dict[Any, Probe] = {}
        self.running: set = set()
        self.submitted: list = []  # values in the order they were started
        self.error = ""

    @property
    def grid(self) -> bool:
        return self.spec.find == "max_goodput"

    def next_value(self, known: dict[Any, bool]) -> tuple[bool, Any]:
        """``(True, value)``: the probe the search asks for next, given the outcomes ``known``; ``(False,
        answer)`` once it needs none (the bisection's answer; None for a grid: :meth:`answer` picks it)."""
        if self.grid:
            for v in self.spec.values:
                if v not in known:
                    return True, v
            return False, None
        spec = self.spec

        def ok(v: float) -> bool:
            v = _value(spec, v)
            if v not in known:
                raise _Unknown(v)
            return known[v]

        try:
            found = _bisect(ok, spec.low, spec.high, spec.find != "max_rate", spec.find == "min_instances",
                            spec.tolerance)
        except _Unknown as u:
            return True, u.value
        return False, found

    @property
    def complete(self) -> bool:
        return bool(self.error) or not self.next_value(self.known)[0]

    def ahead(self, limit: int) -> list[Any]:
        """Up to ``limit`` values the search needs now or may need next, in order of need: the one it needs now
        first, then (breadth first over the outcomes of the probes not known yet, a hit before a miss) those the
        next decisions would ask for. A grid: its values not known, in order."""
        if self.grid:
            return [v for v in self.spec.values if v not in self.known][:limit]
        out: list = []
        queue = [dict(self.known)]
        looked = 0
        while queue and len(out) < limit and looked < 4 * limit + 8:
            hyp = queue.pop(0)
            looked += 1
            more, v = self.next_value(hyp)
            if not more:
                continue
            if v not in out:
                out.append(v)
            queue += [{**hyp, v: True}, {**hyp, v: False}]
        return out

    def remaining(self) -> int:
        """The most probes the search may still need, those in flight included: a grid's values not known; a
        bisection's path from here when every outcome not known is a miss except at the bracket's easy end (the
        longest for max_rate, whose tolerance is relative to the lower end)."""
        if self.error:
            return 0
        if self.grid:
            return sum(v not in self.known for v in self.spec.values)
        spec = self.spec
        easy = _value(spec, spec.high if spec.find == "min_instances" else spec.low)
        hyp = dict(self.known)
        n = 0
        while True:
            more, v = self.next_value(hyp)
            if not more:
                return n
            hyp[v] = v == easy
            n += 1

    def path(self) -> list[Any]:
        """The values the search asked for, in order, given the outcomes known (its probes that were needed)."""
        hyp: dict = {}
        out = []
        while True:
            more, v = self.next_value(hyp)
            if not more or v not in self.known:
                return out
            out.append(v)
            hyp[v] = self.known[v]

    def answer(self) -> Any:
        """The answer: the bisection's boundary value, or the grid's value with the most goodput among the eligible
        probes (the earliest listed on a tie); None when none qualifies."""
        more, found = self.next_value(self.known)
        if not self.grid:
            return None if found is None else _value(self.spec, found)
        best = None
        for v in self.spec.values:
            p = self.probes.get(v)
            if p is not None and p.ok and (best is None or p.figures["goodput"] > self.probes[best].figures["goodput"]):
                best = v
        return best


def _probe_task(spec: SearchSpec, where: Path, out_dir: Path, name: str, data: dict, base_dir: Path, value: Any,
                data_dir: str | None) -> SweepTask:
    """The sweep task of one probe, its folder ``<out_dir>/probes/<name>/<field>=<value>``."""
    dotted = spec.dotted
    run = Run(group="probes", trace=name, variant=f"{dotted}={_folder_value(value)}", data=_set(data, dotted, value),
              source=f"{where} [{name}: {dotted}={value}]", base_dir=str(base_dir), data_dir=data_dir)
    return SweepTask(run=run, folder=str(check_out_dir(run_dir(out_dir, run))), config_hash=config_hash(run))


def _judge(spec: SearchSpec, task: SweepTask, value: Any, reused: bool, wall_s: float | None) -> Probe:
    """A probe from its complete folder: its figures from ``requests.parquet`` and ``summary.json``, and whether
    it met the SLO (``max_goodput``: whether it is eligible)."""
    folder = Path(task.folder)
    summary = json.loads((folder / "summary.json").read_text())
    figures = probe_figures(pd.read_parquet(folder / "requests.parquet"), spec.slo, summary, spec.max_backlog_growth)
    judge = eligible if spec.find == "max_goodput" else meets
    return Probe(value, judge(figures, spec.slo, spec.require_stable_queue), figures, reused, True, wall_s)


def run_search(spec: SearchSpec, where: Path, out_dir: Path, data_dir: str | Path | None = None,
               on_probe: Callable[[str, Probe], None] | None = None, fresh: bool = False, jobs: int | None = None,
               overrides: dict | None = None, progress: Callable[[SearchState], None] | None = None,
               executor: Executor | None = None) -> list[SearchResult]:
    """Run the search for every candidate (or the base alone), write ``search.md`` and ``search.json`` into
    ``out_dir`` as one set (:func:`write_search`), and return the answers, cheapest first (fewest GPUs, then the
    larger answer for a max search, the most goodput for ``max_goodput``).

    The probes run on ``executor`` (lab/report/executors.py; default: a local process pool of ``jobs`` workers,
    else the file's ``jobs``; 1: in this process), as many at once as it has slots: each time one finishes, the
    free slots take the probes most needed over all candidates: each candidate's next probe first, then the probes
    its next decisions may ask for (:meth:`_Plan.ahead`). The answers do not depend on ``jobs``. ``overrides``
    (``--set``: nested experiment fields) apply to every candidate, over its own overrides.

    Every probe's folder is ``<out_dir>/probes/<candidate>/<field>=<value>/``; a probe whose folder is complete
    with an unchanged configuration is reused (``Probe.reused``) unless ``fresh``, so a search interrupted or
    re-run simulates only the probes it has not completed. ``on_probe(candidate, probe)`` is called after each,
    ``progress(state)`` after each and at least every second while probes run (:class:`SearchState`).

    Raises:
        OutputDirError: ``out_dir`` is a file or holds files no servelab command writes (before any probe).
        ConfigError: the base or a candidate is not a valid experiment, or the search cannot apply to it
            (:func:`check_search`; before any probe), or the experiment refuses a value inside the bracket.
        KeyboardInterrupt / SystemExit (SIGTERM): the workers are stopped; the probes complete by then are kept for
            a re-run; the earlier outputs are left as they were. Whatever a probe raises other than a deployment
            that cannot be built (PolicyError, WorkloadError, ...).
    """
    out_dir = check_out_dir(Path(out_dir))
    check_search(spec, where, data_dir, overrides)
    dd = str(Path(data_dir).resolve()) if data_dir is not None else None
    cands, base_dir = _candidates(spec, where, overrides)
    plans = [_Plan(spec, name, data) for name, data in cands]
    executor = executor or PoolExecutor(max(1, jobs or spec.jobs))
    state = SearchState()
    t0 = time.perf_counter()
    started: dict[int, tuple[_Plan, Any, SweepTask, float]] = {}  # task id -> the probe in flight

    def update(last: tuple[str, Probe] | None) -> None:
        state.last = last
        state.elapsed_s = time.perf_counter() - t0
        state.running = [f"{plan.name}: {spec.dotted}={value_label(v, plan.probes)}"
                         for plan, v, _, _ in started.values()]
        state.remaining = sum(p.remaining() for p in plans)
        walls = [p.wall_s for plan in plans for p in plan.probes.values() if p.wall_s is not None]
        if walls:
            active = sum(not p.complete for p in plans)
            width = max(1, min(slots, state.remaining if spec.find == "max_goodput" else active))
            state.eta_s = sum(walls) / len(walls) * state.remaining / width
        if progress is not None:
            progress(state)

    def record(plan: _Plan, probe: Probe) -> None:
        plan.known[probe.value] = probe.ok
        plan.probes[probe.value] = probe
        state.finished += 1
        state.reused += probe.reused
        state.simulated += not probe.reused
        if on_probe is not None:
            on_probe(plan.name, probe)
        update((plan.name, probe))

    def pick() -> tuple[_Plan, Any] | None:
        best = None
        for i, plan in enumerate(plans):
            if plan.complete:
                continue
            for rank, v in enumerate(plan.ahead(slots)):
                if v not in plan.known and v not in plan.running:
                    if best is None or (rank, i) < best[0]:
                        best = ((rank, i), plan, v)
                    break
        return None if best is None else (best[1], best[2])

    with executor:
        slots = executor.slots
        update(None)
        while True:
            while len(started) < slots:
                chosen = pick()
                if chosen is None:
                    break
                plan, v = chosen
                task = _probe_task(spec, where, out_dir, plan.name, plan.data, base_dir, v, dd)
                plan.submitted.append(v)
                if not fresh and reuse_task(task) is not None:
                    record(plan, _judge(spec, task, v, True, None))
                    continue
                plan.running.add(v)
                started[executor.submit(simulate_task, task)] = (plan, v, task, time.perf_counter())
                update(None)
            if not started:
                break
            finished = executor.finished(timeout=1.0)
            if not finished:
                update(None)
            for outcome in finished:
                plan, v, task, t_start = started.pop(outcome.index)
                plan.running.discard(v)
                try:
                    outcome.result()
                except (ConfigError, OutputDirError):
                    raise  # the search file's or the output folder's fault, not a deployment that cannot run
                except ValueError as e:  # the candidate cannot be built (a model that does not fit, a layout)
                    why = "; ".join(line.strip() for line in str(e).splitlines())
                    if plan.grid and not plan.error:  # one value that cannot run: not the answer, the rest go on
                        record(plan, Probe(v, False, {"error": why}, False, True, time.perf_counter() - t_start))
                    elif not plan.error:
                        plan.error = why
                        update(None)
                    continue
                if not plan.error:
                    record(plan, _judge(spec, task, v, False, time.perf_counter() - t_start))
    results = [_result(spec, plan, base_dir, dd) for plan in plans]
    maximize = spec.find != "min_instances"

    def rank(r: SearchResult) -> tuple:
        if spec.find == "max_goodput":
            return (r.value is None, r.gpus if r.gpus is not None else math.inf, -(r.goodput or 0.0))
        return (r.value is None, r.gpus if r.gpus is not None else math.inf,
                -(r.value or 0) if maximize else (r.value or 0))

    results.sort(key=rank)
    write_search(spec, results, out_dir)
    return results


def _result(spec: SearchSpec, plan: _Plan, base_dir: Path, data_dir: str | None) -> SearchResult:
    """A candidate's answer, its GPUs and its probes: the path in order, then the probes simulated ahead."""
    if plan.error:
        return SearchResult(plan.name, None, None, [plan.probes[v] for v in plan.submitted if v in plan.probes],
                            plan.error)
    path = plan.path()
    for v, p in plan.probes.items():
        p.needed = v in path or spec.find == "max_goodput"
    probes = [plan.probes[v] for v in path] + [plan.probes[v] for v in plan.submitted
                                               if v in plan.probes and v not in path]
    value = plan.answer()
    result = SearchResult(plan.name, value, None, probes)
    if value is not None:
        exp = parse_experiment(_set(plan.data, spec.dotted, value), spec.name, base_dir, data_dir)
        result.gpus = _gpus(exp)
        result.goodput = plan.probes[value].figures.get("goodput") if value in plan.probes else None
    return result


def search_json(results: list[SearchResult]) -> str:
    """``search.json``: per candidate, cheapest first, its answer (``value``; null when not met in the bracket or,
    for ``max_goodput``, when no value qualifies), ``gpus``, ``goodput`` (req/s at the answer), ``error`` (why it
    cannot run, else empty) and every probe: ``value``, ``ok``, ``needed`` (false: simulated ahead with ``--jobs``
    and not on the search's path) and the figures of :func:`probe_figures` (seconds, req/s, shares in 0..1)."""
    return json.dumps([{"candidate": r.candidate, "value": r.value, "gpus": r.gpus, "goodput": r.goodput,
                        "error": r.error,
                        "probes": [{"value": p.value, "ok": p.ok, "needed": p.needed, **p.figures} for p in r.probes]}
                       for r in results], indent=1)


def write_search(spec: SearchSpec, results: list[SearchResult], out_dir: Path) -> None:
    """Write ``search.md`` and ``search.json`` into ``out_dir`` as one set, the probes' folders carried over
    (lab/report/sweep.py ``replace_outputs``: one rename; a kill leaves the earlier pair or the new one).

    Raises:
        OutputDirError: ``out_dir`` is a file or holds files no servelab command writes.
        OSError: a file cannot be written (``out_dir`` is then left as it was).
    """
    def write(folder: Path) -> None:
        (folder / "search.md").write_text(search_markdown(spec, results))
        (folder / "search.json").write_text(search_json(results))

    replace_outputs(out_dir, write, keep=("probes",))


# ------------------------------------------------------------------------------------------------ in words

def number(x: float, digits: int = 3) -> str:
    """A number to ``digits`` significant digits without an exponent: ``18.5``, ``0.0123``, ``1,234`` (thousands
    and up as whole numbers with separators)."""
    if x is None or not math.isfinite(x):
        return str(x)
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    if x == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def duration(seconds: float) -> str:
    """A time in words to 3 significant digits: ``412 ms``, ``31.2 ms`` below a second, ``1.52 s`` above;
    ``inf`` with no value."""
    if seconds is None or not math.isfinite(seconds):
        return "inf"
    return f"{number(seconds * 1e3)} ms" if abs(seconds) < 1 else f"{number(seconds)} s"


def value_label(value: Any, others: dict | list = ()) -> str:
    """A probe's value in words: integers and names as they are, other numbers to 3 significant digits, or more
    where needed to tell it from the ``others`` (the candidate's other probes)."""
    if not isinstance(value, float):
        return str(value)
    rest = [o for o in others if isinstance(o, float) and o != value]
    for digits in range(3, 17):
        text = number(value, digits)
        if all(number(o, digits) != text for o in rest):
            return text
    return repr(value)


def slo_text(slo: SearchSLO) -> str:
    """The SLO in words: "p90 TTFT <= 500 ms and p90 TPOT <= 50 ms"; "at least 90 % of requests with TTFT <= 500 ms
    and TPOT <= 50 ms, and p99 ITL <= 100 ms"; without a rule (``max_goodput``): "goodput counts the requests with
    TTFT <= 500 ms and TPOT <= 30 ms; every value needs p99 ITL <= 50 ms"."""
    bounds = slo.bounds()
    judged = [f"p{slo.percentile_of(m):g} {_METRICS[m][2]} <= {duration(v)}" for m, v in bounds.items()
              if slo.percentile_of(m) is not None]
    per_request = " and ".join(f"{_METRICS[m][2]} <= {duration(v)}" for m, v in bounds.items() if m != "itl")
    if slo.percentile is not None:
        return " and ".join(judged)
    if slo.attainment is not None:
        text = f"at least {slo.attainment * 100:g} % of requests with {per_request}"
        return text + (", and " + " and ".join(judged) if judged else "")
    text = f"goodput counts the requests with {per_request}" if per_request else "goodput counts every request"
    return text + ("; every value needs " + " and ".join(judged) if judged else "")


def probe_text(spec: SearchSpec, probe: Probe) -> str:
    """One probe's outcome in words: met or missed, then each bound as judged ("p90 TTFT 412 ms <= 500 ms"), the
    attainment against its target, the goodput, and why it missed otherwise (requests not served, a growing
    backlog)."""
    f, slo = probe.figures, spec.slo
    if "error" in f:
        return f"cannot run: {f['error']}"
    parts = []
    for m, bound in slo.bounds().items():
        q = slo.percentile_of(m)
        if q is not None:
            value = f[f"p_{m}"]
            parts.append(f"p{q:g} {_METRICS[m][2]} {duration(value)} {'<=' if value <= bound else '>'} "
                         f"{duration(bound)}")
    att = f"attainment {number(f['attainment'] * 100)} %"
    if slo.attainment is not None:
        att += f" {'>=' if f['attainment'] >= slo.attainment else '<'} {slo.attainment * 100:g} %"
    parts.append(att)
    parts.append(f"goodput {number(f['goodput'])} req/s")
    if f["num_unserved"]:
        parts.append(f"{f['num_unserved']} of {f['num_requests']} requests not served")
    if f.get("window_too_short"):
        parts.append(f"arrivals too short to show a sustained load ({duration(f['arrival_window_s'])} < "
                     f"{MIN_WINDOW_STAYS:g} x the median time in the system, {duration(f['median_stay_s'])})")
    elif f.get("queue_growing"):
        parts.append(f"backlog growing ({f['in_system_at_mid_arrivals']} -> {f['in_system_at_last_arrival']} "
                     f"requests in the system: {number(f['backlog_growth'] * 100, 2)} % of the second half's "
                     f"arrivals piled up beyond a sustained load's, noise {number(f['backlog_growth_noise'] * 100, 2)}"
                     " %)")
    word = ("eligible" if probe.ok else "not eligible") if spec.find == "max_goodput" else \
        ("met" if probe.ok else "missed")
    return f"{word}: " + ", ".join(parts)


_ANSWER_LABEL = {"max_rate": "max rate (req/s)", "max_concurrency": "max concurrency",
                 "min_instances": "min instances"}


def search_markdown(spec: SearchSpec, results: list[SearchResult]) -> str:
    """The answer as a Markdown table: one row per candidate, cheapest first, with its goodput and the probes it
    took; then every probe in words (:func:`probe_text`)."""
    dotted = spec.dotted
    answer = _ANSWER_LABEL.get(spec.find, f"{dotted} with the most goodput")
    lines = [f"# {spec.name}: {spec.find} ({dotted})", "", f"SLO: {slo_text(spec.slo)}.", "",
             f"| candidate | {answer} | GPUs | goodput (req/s) | probes |", "|---|---:|---:|---:|---:|"]
    for r in results:
        if r.error:
            val = f"cannot run: {r.error}"
        elif r.value is None:
            val = "no value qualifies" if spec.find == "max_goodput" else "not met in the bracket"
        else:
            val = value_label(r.value)
        good = number(r.goodput) if r.goodput is not None else "–"
        lines.append(f"| {r.candidate} | {val} | {r.gpus if r.gpus is not None else '–'} | {good} | "
                     f"{len(r.probes)} |")
    lines += ["", "Probes (the search's path in order; those simulated ahead and not needed last):", ""]
    for r in results:
        values = [p.value for p in r.probes]
        for p in r.probes:
            ahead = "" if p.needed else " (simulated ahead, not needed)"
            lines.append(f"- {r.candidate} {dotted}={value_label(p.value, values)}: {probe_text(spec, p)}{ahead}")
    return "\n".join(lines) + "\n"
