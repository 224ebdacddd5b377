"""Sweeps: one base experiment run over axes of field values, with replications, into one results table
(``servelab sweep FILE.yaml``; docs/sweeps.md).

A sweep file::

    name: demo_rates
    base: demo.yaml                    # an experiment file (relative to this file) or an inline mapping
    axes:                              # field path -> values: a list, or {range: [start, stop, step]} (stop included)
      workload.rate: [4, 8, 12, 16]
      engine.max_num_seqs: {range: [64, 256, 64]}
    mode: cross                        # cross (every combination) or zip (the i-th value of every axis together)
    replications: 3                    # runs per point, seeds base seed + 0, 1, 2
    jobs: 2                            # worker processes

The runs go through the comparison machinery (lab/report/compare.py): each run's folder is written atomically,
a re-run resumes from the runs already complete (``--fresh`` redoes them), and workers stop with the parent. The
sweep writes ``sweep.csv`` / ``sweep.parquet`` (one row per run: the axes, the replication, the seed, the metrics)
and ``sweep_summary.csv`` (one row per point: each metric's mean over the replications and its 95 % confidence
half-width, Student's t).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lab.experiment.config import ConfigError, deep_merge, read_yaml
from lab.report.compare import ComparisonSpec, Run, comparison_runs, run_comparison

METRICS = ["request_throughput", "output_token_throughput", "ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99",
           "e2el_mean", "e2el_p99", "goodput", "slo_attainment", "num_preemptions", "num_finished"]

# Student's t quantiles for a two-sided 95 % interval, by degrees of freedom (1..30; beyond, the normal's 1.96)
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


class SweepSpec(BaseModel):
    """A sweep file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    base: str | dict[str, Any]
    axes: dict[str, list[Any] | dict[str, list[float]]] = Field(min_length=1)
    mode: Literal["cross", "zip"] = "cross"
    replications: int = Field(1, ge=1)
    jobs: int = Field(1, ge=1)

    @field_validator("axes")
    @classmethod
    def _expand(cls, axes: dict) -> dict:
        out = {}
        for path, vals in axes.items():
            if isinstance(vals, dict):
                if set(vals) != {"range"} or len(vals["range"]) != 3:
                    raise ValueError(f"{path}: expected a list of values or {{range: [start, stop, step]}}")
                start, stop, step = vals["range"]
                if not step > 0 or stop < start:
                    raise ValueError(f"{path}: range needs step > 0 and stop >= start, got {vals['range']}")
                n = int(math.floor((stop - start) / step + 1e-9)) + 1
                vals = [start + i * step for i in range(n)]
                if all(isinstance(x, int) for x in (start, stop, step)):
                    vals = [int(v) for v in vals]
            if not vals:
                raise ValueError(f"{path}: no values")
            out[path] = vals
        return out

    @model_validator(mode="after")
    def _zip_lengths(self) -> "SweepSpec":
        if self.mode == "zip" and len({len(v) for v in self.axes.values()}) > 1:
            raise ValueError("mode zip needs every axis to have as many values")
        return self

    def points(self) -> list[dict[str, Any]]:
        """The axis values of every point, in order."""
        names = list(self.axes)
        combos = zip(*self.axes.values()) if self.mode == "zip" else itertools.product(*self.axes.values())
        return [dict(zip(names, c)) for c in combos]


def _nested(path: str, value: Any) -> dict:
    node: dict = {}
    top = node
    *head, last = path.split(".")
    for part in head:
        node = node.setdefault(part, {})
    node[last] = value
    return top


def load_sweep(path: str | Path, data_dir: str | Path | None = None) -> tuple[SweepSpec, ComparisonSpec, list[Run]]:
    """Read a sweep file and build every run (validated now, so a bad point fails before anything runs).

    Raises:
        ConfigError: a bad sweep file, base experiment or point (the message names the file and the run).
    """
    p = Path(path)
    raw = read_yaml(p, "sweep file")
    try:
        spec = SweepSpec.model_validate(raw or {})
    except ValidationError as e:
        lines = [f"{p}: invalid sweep file"] + [f"  {'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()]
        raise ConfigError("\n".join(lines)) from None
    if isinstance(spec.base, dict):
        base = dict(spec.base)
    else:
        base_path = (p.resolve().parent / spec.base).resolve()
        base = read_yaml(base_path, "base experiment")
        if not isinstance(base, dict):
            raise ConfigError(f"{base_path}: expected a YAML mapping")
    seed = int(base.get("seed", 0))
    variants = {}
    for i, point in enumerate(spec.points()):
        for k in range(spec.replications):
            over: dict = {"seed": seed + k}
            for field, value in point.items():
                over = deep_merge(over, _nested(field, value))
            variants[f"p{i:04d}_r{k}"] = over
    cmp = ComparisonSpec.model_validate({"name": spec.name, "jobs": spec.jobs, "plots": False, "base": base,
                                         "traces": {"base": {}},
                                         "groups": {"sweep": {"traces": ["base"], "variants": variants}}})
    return spec, cmp, comparison_runs(cmp, p, data_dir)


def sweep_tables(spec: SweepSpec, table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per run with the axes, replication and seed as columns, one row per point with each metric's mean
    and 95 % confidence half-width over the replications) from the comparison table."""
    points = spec.points()
    rows = []
    for _, r in table.iterrows():
        i, k = r["variant"][1:].split("_r")
        row = {"point": int(i), "replication": int(k), **points[int(i)]}
        row.update({m: r.get(m) for m in METRICS})
        rows.append(row)
    runs = pd.DataFrame(rows).sort_values(["point", "replication"]).reset_index(drop=True)
    agg = []
    for i, grp in runs.groupby("point", sort=True):
        row = {"point": i, **points[int(i)], "replications": len(grp)}
        for m in METRICS:
            vals = pd.to_numeric(grp[m], errors="coerce").dropna()
            row[f"{m}_mean"] = float(vals.mean()) if len(vals) else None
            row[f"{m}_ci95"] = (_T95[min(len(vals) - 2, 29)] * float(vals.std(ddof=1)) / math.sqrt(len(vals))
                                if len(vals) > 1 else None)
        agg.append(row)
    return runs, pd.DataFrame(agg)


def run_sweep(spec: SweepSpec, cmp: ComparisonSpec, runs: list[Run], out_dir: Path, jobs: int | None = None,
              fresh: bool = False, progress=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run (or resume) the sweep and write ``sweep.csv``, ``sweep.parquet`` and ``sweep_summary.csv``.

    Raises:
        whatever a run raises (the other workers are stopped), OutputDirError for a bad ``out_dir``.
    """
    table = run_comparison(cmp, runs, out_dir, jobs=jobs or spec.jobs, plots=False, progress=progress, fresh=fresh)
    per_run, summary = sweep_tables(spec, table)
    per_run.to_csv(out_dir / "sweep.csv", index=False)
    per_run.to_parquet(out_dir / "sweep.parquet", index=False)
    summary.to_csv(out_dir / "sweep_summary.csv", index=False)
    per_run.attrs["reused"] = table.attrs.get("reused", 0)
    return per_run, summary
