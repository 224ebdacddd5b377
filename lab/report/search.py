"""Capacity search: the largest load a deployment serves within an SLO, or the fewest instances that serve a load,
and candidate deployments ranked by the GPUs they need (``servelab search FILE.yaml``; docs/search.md).

A search file names a base experiment, what to find and the SLO::

    base: demo.yaml                      # an experiment file (relative to this file), or an inline mapping
    find: max_rate                       # max_rate | max_concurrency | min_instances
    low: 1                               # the bracket searched
    high: 64
    tolerance: 0.02                      # max_rate: relative width of the final bracket
    slo: {ttft_s: 0.5, tpot_s: 0.05, percentile: 90}   # p90 TTFT <= 500 ms and p90 TPOT <= 50 ms
    # or {ttft_s: 0.5, tpot_s: 0.05, attainment: 0.9}: >= 90 % of requests meet every SLO (DistServe)
    candidates:                          # optional: the search runs once per candidate, then ranks them
      tp2: {hardware: {tensor_parallel_size: 2}}
      tp4: {hardware: {tensor_parallel_size: 4}}

Each probe is one simulation of the base experiment with the searched field set (``workload.rate``,
``workload.concurrency`` or ``cluster.num_instances``, or ``field``). The search assumes that the SLO, once missed,
stays missed as load grows (or as instances are removed), and bisects: ``max_rate`` until the bracket is within
``tolerance`` of its lower end, the integer searches exactly. A probe counts as meeting the SLO only if every request
finished (none rejected or unfinished) and, unless ``require_stable_queue: false``, its backlog was not still
growing at the last arrival (:func:`queue_growth`).

A search that cannot apply to its experiment (``min_instances`` on a disaggregated deployment, ``max_rate`` on a
trace that keeps its own arrival times, a bracket end the experiment refuses, ...) is refused before anything is
simulated (:func:`check_search`). Each probe is a sweep run (lab/report/sweep.py ``simulate_task``): its folder
``<out>/probes/<candidate>/<field>=<value>/`` is written atomically with ``run.json`` (the hash of the probe's
configuration) last, and a re-run reuses every probe whose folder is complete and whose hash is unchanged
(``reuse_task``; ``fresh`` redoes them), judging it again from its ``requests.parquet``. ``search.md`` and
``search.json`` replace the earlier ones as one set, in one rename of the output folder (``replace_outputs``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lab.experiment.config import (ConfigError, Experiment, _format_errors, deep_merge, parse_experiment,
                                   read_yaml)
from lab.report.compare import Run, config_hash, run_dir
from lab.report.run_report import OutputDirError, check_out_dir
from lab.report.sweep import SweepTask, replace_outputs, reuse_task, simulate_task

_FIELDS = {"max_rate": "workload.rate", "max_concurrency": "workload.concurrency",
           "min_instances": "cluster.num_instances"}


class SearchSLO(BaseModel):
    """Latency bounds (seconds) and how they are judged: each metric's ``percentile`` (e.g. p90 TTFT <= ttft_s),
    or the ``attainment``: the share of requests meeting every bound (DistServe's SLO attainment)."""

    model_config = ConfigDict(extra="forbid")
    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, gt=0)
    e2el_s: float | None = Field(None, gt=0)
    percentile: float | None = Field(None, gt=0, le=100)
    attainment: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="after")
    def _one_rule(self) -> "SearchSLO":
        if (self.percentile is None) == (self.attainment is None):
            raise ValueError("give exactly one of 'percentile' (each bound at that percentile) and 'attainment' "
                             "(share of requests meeting every bound)")
        if self.ttft_s is None and self.tpot_s is None and self.e2el_s is None:
            raise ValueError("give at least one bound: ttft_s, tpot_s or e2el_s")
        return self


class SearchSpec(BaseModel):
    """A search file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("search", pattern=r"^[A-Za-z0-9_.-]+$")
    base: str | dict[str, Any]
    find: Literal["max_rate", "max_concurrency", "min_instances"] = "max_rate"
    field: str | None = Field(None, description="the field searched (default by 'find')")
    low: float = Field(gt=0)
    high: float = Field(gt=0)
    tolerance: float = Field(0.02, gt=0, lt=1, description="max_rate: final bracket width relative to its low end")
    slo: SearchSLO
    require_stable_queue: bool = Field(True, description="a probe whose backlog (requests in the system) is still "
                                       "growing at its last arrival misses (its load is not sustained, however "
                                       "short the trace)")
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
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.find != "max_rate" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError(f"{self.find}: low and high must be integers")
        if self.find != "max_rate" and "tolerance" in self.model_fields_set:
            raise ValueError(f"tolerance does not apply to find {self.find}: the integer searches are exact "
                             "(tolerance is for max_rate)")
        return self


@dataclass
class Probe:
    """One simulation of the search: the value tried, whether it met the SLO, and its figures."""

    value: float
    ok: bool
    figures: dict
    reused: bool = False  # read back from the probe's complete folder instead of simulated (not in the outputs)


@dataclass
class SearchResult:
    """The answer for one candidate: ``value`` (None if even the easiest end of the bracket misses the SLO), the
    GPUs it takes, and every probe in order."""

    candidate: str
    value: float | None
    gpus: int | None
    probes: list[Probe] = field(default_factory=list)
    error: str = ""  # why the candidate could not run at all (e.g. the model does not fit)


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
    """Whether a probe's figures meet the SLO (every request finished, the queue not growing at the end of the
    arrivals when ``require_stable_queue``, and the bounds by the SLO's rule)."""
    if figures["num_unserved"] or (require_stable_queue and figures["queue_growing"]):
        return False
    if slo.attainment is not None:
        return figures["attainment"] >= slo.attainment
    return all(figures[f"p_{m}"] <= bound for m, bound in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s),
                                                             ("e2el", slo.e2el_s)) if bound is not None)


def probe_figures(df: pd.DataFrame, slo: SearchSLO) -> dict:
    """What the SLO is judged on, from a probe's requests table (``requests.parquet``: lab/report/metrics.py
    ``requests_frame``; seconds): the percentile of each bounded metric (``p_ttft``, ``p_tpot``, ``p_e2el``; the
    median under an attainment SLO; inf with no finished request), ``attainment`` (the share of requests meeting
    every bound, 0..1), ``num_requests`` and ``num_unserved`` (rejected or unfinished), ``request_throughput``
    (finished requests per second, first arrival to last finish) and :func:`queue_growth`. Closed-loop warm-up
    requests are left out. Raises KeyError: a column is missing."""
    if "warmup" in df:
        df = df[~df["warmup"].astype(bool)]
    fin = df[df["status"] == "finished"]
    q = slo.percentile if slo.percentile is not None else 50.0
    out: dict = {"num_requests": int(len(df)), "num_unserved": int(len(df) - len(fin))}
    ok = fin["ttft"] == fin["ttft"]
    for m, bound in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s), ("e2el", slo.e2el_s)):
        col = fin[m].fillna(0.0) if m == "tpot" else fin[m]  # a one-token output has no TPOT (vLLM: 0)
        out[f"p_{m}"] = float(col.quantile(q / 100.0)) if len(col) else math.inf
        if bound is not None:
            ok &= col <= bound
    out["attainment"] = float(ok.sum()) / len(df) if len(df) else 0.0
    out.update(queue_growth(df))
    span = float(fin["finish_time"].max() - df["arrival_time"].min()) if len(fin) else 0.0
    out["request_throughput"] = len(fin) / span if span > 0 else 0.0
    return out


def queue_growth(df) -> dict:
    """Whether the backlog still grows at the end of the arrivals: requests in the system (arrived, not finished)
    at the last arrival, against the same count at the middle of the arrival window. A load above what the
    deployment serves builds a backlog that grows in proportion to time (about twice the mid-window count at the
    end), in the waiting queue or, while KV and ``max_num_seqs`` allow, in an ever larger running batch; a
    sustained load keeps it near its Little's-law level, arrival rate x mean E2EL. Growing: more than max(10, 2 %
    of the requests) in the system at the last arrival and more than 1.5 times the mid-window count. A short trace
    can meet a latency SLO at a rate it cannot sustain; this flags it. It needs an arrival window of several mean
    E2ELs (else a stable system is still filling up at mid-window and may be flagged).

    Args:
        df: requests table (``arrival_time``, ``finish_time`` in seconds; NaN = never finished).

    Returns:
        ``in_system_at_last_arrival``, ``in_system_at_mid_arrivals`` (requests) and ``queue_growing`` (bool).
    """
    if not len(df):
        return {"in_system_at_last_arrival": 0, "in_system_at_mid_arrivals": 0, "queue_growing": False}
    arrival = df["arrival_time"].to_numpy(dtype=float)
    finish = df["finish_time"].to_numpy(dtype=float)
    first, last = float(arrival.min()), float(arrival.max())

    def in_system(t: float) -> int:
        return int(((arrival <= t) & ~(finish <= t)).sum())  # NaN (never finished) counts as in the system

    end, mid = in_system(last), in_system((first + last) / 2)
    growing = end > max(10, 0.02 * len(df)) and end > 1.5 * mid
    return {"in_system_at_last_arrival": end, "in_system_at_mid_arrivals": mid, "queue_growing": bool(growing)}


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


def _candidates(spec: SearchSpec, where: Path) -> tuple[list[tuple[str, dict]], Path]:
    """(every candidate's name and experiment fields, base <- its overrides; or the base alone as ``base``), and
    the folder relative paths of the base resolve in. Raises ConfigError: the base cannot be read."""
    base, base_dir = _base_data(spec, where)
    return [(name, deep_merge(base, over)) for name, over in (spec.candidates or {"base": {}}).items()], base_dir


def _value(spec: SearchSpec, value: float) -> int | float:
    return value if spec.find == "max_rate" else int(value)


def check_search(spec: SearchSpec, where: Path, data_dir: str | Path | None = None) -> None:
    """Refuse a search that cannot apply to its experiment, before anything is simulated: for every candidate, the
    searched field must be one the experiment uses, and the experiment must be valid with it at ``low`` and at
    ``high``. Refused: ``cluster.num_instances`` (``min_instances``) on a disaggregated deployment (its roles have
    their own counts), on one with ``pools`` or with ``hardware.data_parallel_size`` > 1 (only multiples of it
    are valid); ``workload.rate`` (``max_rate``) on a workload that keeps its trace's or a CSV's arrival times; an
    unknown field; a bracket end the experiment refuses (``workload.concurrency`` with ``source: sessions``, ...).
    A deployment that cannot be built (a model that does not fit) is not refused here: the search reports it.

    Raises:
        ConfigError: one line naming the search file, the candidate (when there are several), the field and why
            (UnknownFieldError for an unknown field).
    """
    dotted = spec.field or _FIELDS[spec.find]
    cands, base_dir = _candidates(spec, where)
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
        for end in (spec.low, spec.high):
            v = _value(spec, end)
            parse_experiment(_set(data, dotted, v), f"{where} [{name}: {dotted}={v}]", base_dir, data_dir)


def _get(data: Any, dotted: str, default: Any) -> Any:
    """The value at a dotted path of nested experiment fields, ``default`` where it is absent or null."""
    for part in dotted.split("."):
        if not isinstance(data, dict) or data.get(part) is None:
            return default
        data = data[part]
    return data


def _probe(spec: SearchSpec, where: Path, out_dir: Path, name: str, data: dict, base_dir: Path, value: int | float,
           data_dir: str | None, fresh: bool) -> Probe:
    """One probe: read back from its complete folder when its configuration is unchanged (not ``fresh``), else
    simulated into it (lab/report/sweep.py ``reuse_task`` / ``simulate_task``), then judged from its
    ``requests.parquet``. Raises whatever the simulation raises."""
    dotted = spec.field or _FIELDS[spec.find]
    run = Run(group="probes", trace=name, variant=f"{dotted}={value!r}", data=_set(data, dotted, value),
              source=f"{where} [{name}: {dotted}={value}]", base_dir=str(base_dir), data_dir=data_dir)
    task = SweepTask(run=run, folder=str(check_out_dir(run_dir(out_dir, run))), config_hash=config_hash(run))
    reused = not fresh and reuse_task(task) is not None
    if not reused:
        simulate_task(task)
    figures = probe_figures(pd.read_parquet(Path(task.folder) / "requests.parquet"), spec.slo)
    return Probe(value, meets(figures, spec.slo, spec.require_stable_queue), figures, reused)


def run_search(spec: SearchSpec, where: Path, out_dir: Path, data_dir: str | Path | None = None,
               on_probe: Callable[[str, Probe], None] | None = None, fresh: bool = False) -> list[SearchResult]:
    """Run the search for every candidate (or the base alone), write ``search.md`` and ``search.json`` into
    ``out_dir`` as one set (:func:`write_search`), and return the answers, cheapest first (fewest GPUs, then the
    larger answer for a max search).

    Every probe's folder is ``<out_dir>/probes/<candidate>/<field>=<value>/``; a probe whose folder is complete
    with an unchanged configuration is reused (``Probe.reused``) unless ``fresh``, so a search interrupted or
    re-run simulates only the probes it has not completed. ``on_probe(candidate, probe)`` is called after each.

    Raises:
        OutputDirError: ``out_dir`` is a file or holds files no servelab command writes (before any probe).
        ConfigError: the base or a candidate is not a valid experiment, or the search cannot apply to it
            (:func:`check_search`; before any probe), or the experiment refuses a value inside the bracket.
        KeyboardInterrupt: the probes complete by then are kept for a re-run; the earlier outputs are left as they
            were. Whatever a probe raises other than a deployment that cannot be built (PolicyError,
            WorkloadError, ...).
    """
    out_dir = check_out_dir(Path(out_dir))
    check_search(spec, where, data_dir)
    dd = str(Path(data_dir).resolve()) if data_dir is not None else None
    dotted = spec.field or _FIELDS[spec.find]
    cands, base_dir = _candidates(spec, where)
    results = []
    for name, data in cands:
        result = SearchResult(name, None, None)

        def ok(value: float, data=data, result=result, name=name) -> bool:
            probe = _probe(spec, where, out_dir, name, data, base_dir, _value(spec, value), dd, fresh)
            result.probes.append(probe)
            if on_probe is not None:
                on_probe(name, probe)
            return probe.ok

        try:
            value = _bisect(ok, spec.low, spec.high, spec.find != "max_rate", spec.find == "min_instances",
                            spec.tolerance)
        except (ConfigError, OutputDirError):
            raise  # the search file's or the output folder's fault, not a deployment that cannot run
        except ValueError as e:  # the candidate cannot be built (a model that does not fit, a bad layout)
            result.error = "; ".join(line.strip() for line in str(e).splitlines())
            results.append(result)
            continue
        if value is not None:
            result.value = _value(spec, value)
            result.gpus = _gpus(parse_experiment(_set(data, dotted, result.value), str(where), base_dir, dd))
        results.append(result)
    maximize = spec.find != "min_instances"
    results.sort(key=lambda r: (r.value is None, r.gpus if r.gpus is not None else math.inf,
                                -(r.value or 0) if maximize else (r.value or 0)))
    write_search(spec, results, out_dir)
    return results


def search_json(results: list[SearchResult]) -> str:
    """``search.json``: per candidate, cheapest first, its answer (``value``; null when not met in the bracket),
    ``gpus``, ``error`` (why it cannot run, else empty) and every probe: ``value``, ``ok`` and the figures of
    :func:`probe_figures` (seconds, shares in 0..1)."""
    return json.dumps([{"candidate": r.candidate, "value": r.value, "gpus": r.gpus, "error": r.error,
                        "probes": [{"value": p.value, "ok": p.ok, **p.figures} for p in r.probes]}
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


def slo_text(slo: SearchSLO) -> str:
    """The SLO in words, e.g. "p90 TTFT <= 500 ms and p90 TPOT <= 50 ms"."""
    bounds = [(name, v) for name, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s), ("E2EL", slo.e2el_s))
              if v is not None]
    if slo.percentile is not None:
        return " and ".join(f"p{slo.percentile:g} {name} <= {v * 1e3:g} ms" for name, v in bounds)
    joint = " and ".join(f"{name} <= {v * 1e3:g} ms" for name, v in bounds)
    return f"at least {slo.attainment * 100:g} % of requests with {joint}"


def search_markdown(spec: SearchSpec, results: list[SearchResult]) -> str:
    """The answer as a Markdown table: one row per candidate, cheapest first, with the probes each took."""
    dotted = spec.field or _FIELDS[spec.find]
    lines = [f"# {spec.name}: {spec.find} ({dotted})", "", f"SLO: {slo_text(spec.slo)}.", "",
             f"| candidate | {spec.find} | GPUs | probes |", "|---|---:|---:|---:|"]
    for r in results:
        val = (f"cannot run: {r.error}" if r.error else "not met in the bracket" if r.value is None
               else f"{r.value:.3g}" if isinstance(r.value, float) else str(r.value))
        lines.append(f"| {r.candidate} | {val} | {r.gpus if r.gpus is not None else '–'} | {len(r.probes)} |")
    lines += ["", "Probes (value: met?, p-TTFT / p-TPOT in ms, attainment):", ""]
    for r in results:
        for p in r.probes:
            f = p.figures
            growing = (f", backlog still growing ({f['in_system_at_mid_arrivals']} -> "
                       f"{f['in_system_at_last_arrival']} requests in the system)") if f.get("queue_growing") else ""
            lines.append(f"- {r.candidate} {dotted}={p.value}: {'met' if p.ok else 'missed'}, "
                         f"{f['p_ttft'] * 1e3:.1f} / {f['p_tpot'] * 1e3:.2f} ms, attainment "
                         f"{f['attainment'] * 100:.1f} %, {f['num_unserved']} unserved{growing}")
    return "\n".join(lines) + "\n"
