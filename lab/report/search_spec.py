"""A search file (``servelab search``; docs/search.md): what to find, the SLO and how it is judged, the bracket or
the values, the candidates; and the refusals of a search that cannot apply to its experiment, before anything is
simulated (:func:`check_search`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lab.experiment.config import (ConfigError, Experiment, deep_merge, format_errors, parse_experiment,
                                   read_yaml)
from lab.report.sweep import expand_values

_FIELDS = {"max_rate": "workload.rate", "max_concurrency": "workload.concurrency",
           "min_instances": "cluster.num_instances"}
# the SLO's bounded metrics: name in the SLO's ``percentiles`` -> (bound field, requests-table column, label)
SLO_METRICS = {"ttft": ("ttft_s", "ttft", "TTFT"), "tpot": ("tpot_s", "tpot", "TPOT"),
               "itl": ("itl_s", None, "ITL"), "e2el": ("e2el_s", "e2el", "E2EL"),
               "queue": ("queue_s", "queue_time", "queue time")}
# ITL is pooled over every request's token gaps: a probe keeps its statistics (summary.json), not its samples
ITL_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


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
                raise ValueError(f"percentiles.{m}: no {SLO_METRICS[m][0]} bound to judge at it")
            if self.attainment is not None and m != "itl":
                raise ValueError(f"percentiles.{m}: under 'attainment' every request is judged against "
                                 f"{SLO_METRICS[m][0]}; only the pooled ITL takes a percentile (percentiles.itl)")
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
        return {m: getattr(self, key) for m, (key, _, _) in SLO_METRICS.items() if getattr(self, key) is not None}

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


class RoleGrid(BaseModel):
    """The values a placement search tries for one role of a disaggregated deployment."""

    model_config = ConfigDict(extra="forbid")
    count: list[int] = Field(min_length=1, description="instances of the role")
    tensor_parallel_size: list[int] = Field([1], min_length=1)
    pipeline_parallel_size: list[int] = Field([1], min_length=1)

    @field_validator("count", "tensor_parallel_size", "pipeline_parallel_size")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v) or len(set(v)) != len(v):
            raise ValueError(f"expected distinct positive integers, got {v}")
        return v

    def options(self) -> list[tuple[int, int, int]]:
        """Every (count, TP, PP) of the grid."""
        return [(c, t, p) for c in self.count for t in self.tensor_parallel_size for p in self.pipeline_parallel_size]


class PlacementSpec(BaseModel):
    """DistServe's placement search (OSDI'24 §4, Algorithm 1 in spirit: every parallelism of each phase, simulated,
    the one with the most goodput per GPU): every combination of the prefill and decode roles' instance counts and
    parallelism becomes a candidate (``p<count>tp<tp>[pp<pp>]-d<count>tp<tp>[pp<pp>]``)."""

    model_config = ConfigDict(extra="forbid")
    prefill: RoleGrid
    decode: RoleGrid

    def candidates(self) -> dict[str, dict[str, Any]]:
        """Candidate name -> the overrides that make it (a disaggregated deployment of that shape)."""
        def label(role: str, c: int, t: int, p: int) -> str:
            return f"{role}{c}tp{t}" + (f"pp{p}" if p > 1 else "")

        def role(c: int, t: int, p: int) -> dict[str, Any]:
            return {"count": c, "hardware": {"tensor_parallel_size": t, "pipeline_parallel_size": p}}
        return {f"{label('p', *a)}-{label('d', *b)}": {"deployment": {"mode": "disaggregated", "prefill": role(*a),
                                                                      "decode": role(*b)}}
                for a in self.prefill.options() for b in self.decode.options()}


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
    placement: PlacementSpec | None = Field(None, description="prefill/decode placements tried as candidates (beside "
                                            "any candidates given)")
    rank: Literal["gpus", "per_gpu"] = Field("gpus", description="gpus: fewest GPUs first, then the answer; "
                                             "per_gpu: the answer per GPU (max rate or goodput / GPUs), DistServe's "
                                             "per-GPU goodput")

    @field_validator("candidates")
    @classmethod
    def _candidate_names(cls, candidates: dict) -> dict:
        for name in candidates:
            if not re.match(r"^[A-Za-z0-9_.-]+$", name):
                raise ValueError(f"candidate name {name!r} must match [A-Za-z0-9_.-]+ (it names its probes' folder)")
        return candidates

    @model_validator(mode="after")
    def _bracket(self) -> "SearchSpec":
        if self.rank == "per_gpu" and self.find == "min_instances":
            raise ValueError("rank per_gpu ranks an answer per GPU (a rate, or goodput); find min_instances answers "
                             "a count of instances: use rank gpus")
        if self.placement is not None:
            clash = set(self.placement.candidates()) & set(self.candidates)
            if clash:
                raise ValueError(f"candidates {sorted(clash)} repeat names the placement grid makes")
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
        msg = format_errors(str(p), e, SearchSpec).replace("invalid experiment", "invalid search file")
        raise ConfigError(msg.replace(": (top level): ", ": ")) from None


def _base_data(spec: SearchSpec, where: Path) -> tuple[dict, Path]:
    """The base experiment's fields and the folder its relative paths resolve in (beside the search file for an
    inline base). Raises ConfigError: the base file cannot be read or is not a mapping."""
    if isinstance(spec.base, dict):
        return dict(spec.base), where.resolve().parent
    path = (where.resolve().parent / spec.base).resolve()
    data = read_yaml(path, "base experiment")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping")
    return data, path.parent


def with_field(data: dict, dotted: str, value: Any) -> dict:
    """Experiment fields ``data`` with the dotted field set to ``value`` (a new mapping)."""
    node: dict = {}
    top = node
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return deep_merge(data, top)


def candidate_experiments(spec: SearchSpec, where: Path,
                          overrides: dict | None = None) -> tuple[list[tuple[str, dict]], Path]:
    """(every candidate's name and experiment fields: base <- its overrides <- ``overrides`` (``--set``); or the
    base alone as ``base``), and the folder relative paths of the base resolve in. Raises ConfigError: the base
    cannot be read."""
    base, base_dir = _base_data(spec, where)
    named = dict(spec.candidates)
    if spec.placement is not None:
        named.update(spec.placement.candidates())
    return [(name, deep_merge(deep_merge(base, over), overrides or {}))
            for name, over in (named or {"base": {}}).items()], base_dir


def searched_value(spec: SearchSpec, value: Any) -> Any:
    """A value of the searched field as the search sets it: as it is for ``max_rate`` and ``max_goodput``, an
    integer for the integer searches (the bisection computes in floats)."""
    if spec.find == "max_goodput" or spec.find == "max_rate":
        return value
    return int(value)


def _tried(spec: SearchSpec) -> list[Any]:
    """The values every candidate is checked at before the first probe: the bracket's ends, or every value."""
    if spec.find == "max_goodput":
        return list(spec.values)
    return [searched_value(spec, spec.low), searched_value(spec, spec.high)]


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
    cands, base_dir = candidate_experiments(spec, where, overrides)
    for name, data in cands:
        label = f"{where}: " + (f"candidate {name}: " if spec.candidates else "")
        what = f"find {spec.find} searches {dotted}" if spec.field is None else f"field {dotted}"
        if dotted == "cluster.num_instances":
            _refuse_instances_search(data, f"{label}{what}")
        if dotted == "workload.rate":
            _refuse_rate_search(data, f"{label}{what}")
        for v in _tried(spec):
            parse_experiment(with_field(data, dotted, v), f"{where} [{name}: {dotted}={v}]", base_dir, data_dir)


def _refuse_instances_search(data: dict, what: str) -> None:
    """Refuse searching ``cluster.num_instances`` where the deployment does not use it one instance at a time (read
    from the fields: the experiment may be valid only with it set). Raises ConfigError starting with ``what``."""
    dp = _get(data, "hardware.data_parallel_size", 1)
    if _get(data, "deployment.mode", "colocated") == "disaggregated":
        raise ConfigError(f"{what}, which a disaggregated deployment (deployment.mode: disaggregated) "
                          "does not use: search a role's instances with field: deployment.prefill.count or "
                          "field: deployment.decode.count")
    if _get(data, "pools", None):
        raise ConfigError(f"{what}, which a deployment with pools does not use (each pool has its own "
                          "num_instances)")
    if isinstance(dp, int) and dp > 1:
        raise ConfigError(f"{what} one instance at a time, but with hardware.data_parallel_size {dp} "
                          f"only multiples of {dp} are valid (each DP rank is an instance)")


def _refuse_rate_search(data: dict, what: str) -> None:
    """Refuse searching ``workload.rate`` where the workload keeps its own arrival times. Raises ConfigError
    starting with ``what``."""
    source = _get(data, "workload.source", "synthetic")
    if source not in ("synthetic", "sessions"):
        raise ConfigError(f"{what}, which source {source!r} does not use: it replays the arrival times "
                          "of its trace (workload.rate is for source synthetic or sessions)")
    if source == "synthetic" and _get(data, "workload.arrival_times", None):
        raise ConfigError(f"{what}, which this workload does not use: workload.arrival_times sets its "
                          "arrival times")


def _get(data: Any, dotted: str, default: Any) -> Any:
    """The value at a dotted path of nested experiment fields, ``default`` where it is absent or null."""
    for part in dotted.split("."):
        if not isinstance(data, dict) or data.get(part) is None:
            return default
        data = data[part]
    return data


def deployment_gpus(exp: Experiment) -> int:
    """GPUs of a deployment: per instance TP x PP (a DP rank is an instance), times the instances; a pool (or a
    disaggregated role) with its own ``hardware`` parallelism counts with it."""
    h = exp.hardware
    if exp.pools:
        return sum(p.num_instances * p.hardware.get("tensor_parallel_size", h.tensor_parallel_size)
                   * p.hardware.get("pipeline_parallel_size", h.pipeline_parallel_size) for p in exp.pools)
    return h.tensor_parallel_size * h.pipeline_parallel_size * exp.cluster.num_instances
