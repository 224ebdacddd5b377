"""Policy comparisons: one YAML file runs several policies on several traces and writes one side-by-side report.

A comparison file (docs/experiments.md, "Comparison files") has a ``base`` experiment (any experiment fields), named
``traces`` (experiment fields too, usually just ``workload``) and ``groups``; each group names the traces it runs
on and its ``variants`` (experiment-field overrides, e.g. ``policy: {scheduler: sarathi}``). Every
(group, trace, variant) is one experiment, built by merging base <- trace <- group.base <- variant and validated
like any experiment file (errors name the comparison file and the run) before anything runs. Runs go to an
executor (lab/report/executors.py: a local process pool of ``--jobs`` workers); each run's full outputs land in
``<out>/<group>/<trace>/<variant>/`` and the comparison in ``<out>/comparison.md`` (tables per group and trace, the
written reading from ``note``), ``comparison.csv`` (one row per run) and one CDF figure per group (TTFT, TPOT, E2EL
side by side per trace).

Each run's folder is written atomically (a temporary sibling renamed into place; lab/report/output_folder.py
``atomic_dir``) with a ``run.json`` holding a hash of the run's merged experiment fields. A re-run into the same
output folder reuses every run whose folder is complete and whose hash is unchanged (its summary and latencies are
read back) and simulates only the others; ``fresh`` redoes all. Workers exit when the comparison's process dies,
and are killed when it is interrupted (Ctrl-C, SIGTERM) or a run fails.

A group may also name a ``curve`` (``{x: FIELD.PATH, series: FIELD.PATH}``): dotted paths into each run's
experiment (``engine.max_num_seqs``), resolved on the merged fields first and then on the validated experiment,
so a field left at its default resolves too. Per trace, the group then gets a table and a figure
(``<group>_<trace>_curve.png``) of output token throughput, mean TTFT and mean TPOT against ``x``, one line per
``series`` value.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lab.experiment.config import ConfigError, deep_merge, format_errors, parse_experiment, read_yaml
from lab.report.metrics import latency_samples
from lab.experiment.simulation import simulate
from lab.report.plots import draw_slo, pyplot, series_style, shared_legend
from lab.report.executors import Executor, PoolExecutor
from lab.report.output_folder import OutputDirError, atomic_dir, check_out_dir, remove_stale_temps
from lab.report.run_report import write_report

_NAME = r"^[A-Za-z0-9_.-]+$"
_PATH = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"  # a dotted field path: engine.max_num_seqs
_MISSING = object()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CurveSpec(_Strict):
    """Metrics against one field of the runs (``x``), one line per value of another (``series``, optional)."""

    x: str = Field(pattern=_PATH)
    series: str | None = Field(None, pattern=_PATH)


class GroupSpec(_Strict):
    """One question: the traces it runs on and the variants it compares."""

    description: str = ""
    traces: list[str] = Field(min_length=1)
    base: dict[str, Any] = Field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = Field(min_length=1)
    curve: CurveSpec | None = None


class ComparisonSpec(_Strict):
    """A comparison file (see the module docstring)."""

    name: str = Field(pattern=_NAME)
    description: str = ""
    note: str | None = None
    data_dir: str | None = None
    jobs: int = Field(1, ge=1)
    plots: bool = True
    base: dict[str, Any] = Field(default_factory=dict)
    traces: dict[str, dict[str, Any]] = Field(min_length=1)
    groups: dict[str, GroupSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _names(self) -> "ComparisonSpec":
        for g, grp in self.groups.items():
            for t in grp.traces:
                if t not in self.traces:
                    raise ValueError(f"group {g!r}: unknown trace {t!r}; traces: {', '.join(self.traces)}")
            for n in [g, *grp.variants]:
                if not re.match(_NAME, n):
                    raise ValueError(f"group/variant name {n!r} must match [A-Za-z0-9_.-]+")
        for t in self.traces:
            if not re.match(_NAME, t):
                raise ValueError(f"trace name {t!r} must match [A-Za-z0-9_.-]+")
        return self


class Run(BaseModel):
    """One (group, trace, variant) experiment, still as a dict so it can cross to a worker process."""

    group: str
    trace: str
    variant: str
    data: dict[str, Any]
    source: str
    base_dir: str
    data_dir: str | None = None
    curve_x: Any = None  # the group's curve: this run's x and series values
    curve_series: Any = None


def _lookup(data: Any, path: str) -> Any:
    """The value at a dotted path in nested mappings (an integer part indexes a list); ``_MISSING`` if absent, None
    if a section on the way is None (an optional section left off, e.g. ``speculative`` in a baseline run)."""
    for part in path.split("."):
        if data is None:
            return None
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.lstrip("-").isdigit() and -len(data) <= int(part) < len(data):
            data = data[int(part)]
        else:
            return _MISSING
    return data


def _curve_value(data: dict, exp: Any, path: str) -> Any:
    """A curve field of one run: from its merged fields, else from the validated experiment (defaults)."""
    v = _lookup(data, path)
    if v is _MISSING:
        v = _lookup(exp.model_dump(), path)
    return v


def _check_curves(p: Path, spec: ComparisonSpec, runs: list[Run]) -> None:
    """Every curve group: numeric x values, one run per (series, x) and trace."""
    for g, grp in spec.groups.items():
        c = grp.curve
        if c is None:
            continue
        seen: dict[tuple, str] = {}
        for r in runs:
            if r.group != g:
                continue
            x = r.curve_x
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not np.isfinite(x):
                raise ConfigError(f"{p}: group {g!r}: curve x {c.x!r} is {x!r} in variant {r.variant!r}; "
                                  "expected a number")
            key = (r.trace, _series_key(r.curve_series), x)
            if key in seen:
                what = f"{c.series}={r.curve_series!r}, " if c.series else ""
                raise ConfigError(f"{p}: group {g!r}: variants {seen[key]!r} and {r.variant!r} are the same curve "
                                  f"point ({what}{c.x}={x!r}); give each series value one variant per x")
            seen[key] = r.variant


def _series_key(v: Any) -> Any:
    """A hashable, comparable key of a series value; None (and the NaN a table turns it into) is None."""
    if v is None or (isinstance(v, float) and v != v):
        return None
    return v if isinstance(v, (int, float, str, bool)) else repr(v)


def load_comparison(path: str | Path, data_dir: str | Path | None = None,
                    groups: list[str] | None = None) -> tuple[ComparisonSpec, list[Run]]:
    """Read a comparison file and build (and validate) every run.

    Raises:
        ConfigError: missing file, bad YAML, bad comparison fields, or an invalid run (the message names the run).
    """
    p = Path(path)
    raw = read_yaml(p, "comparison file")
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a YAML mapping at the top level")
    try:
        spec = ComparisonSpec.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(str(p), e, ComparisonSpec).replace("invalid experiment", "invalid comparison")) from None
    if groups:
        unknown = [g for g in groups if g not in spec.groups]
        if unknown:
            raise ConfigError(f"{p}: unknown group(s) {unknown}; groups: {', '.join(spec.groups)}")
    return spec, comparison_runs(spec, p, data_dir, groups)


def comparison_runs(spec: ComparisonSpec, p: Path, data_dir: str | Path | None = None,
                    groups: list[str] | None = None) -> list[Run]:
    """Build and validate every run of a comparison read from ``p`` (relative paths resolve beside it).

    Raises:
        ConfigError: an invalid run (the message names the run) or a bad curve.
    """
    dd = str(data_dir) if data_dir is not None else None
    runs: list[Run] = []
    for g, grp in spec.groups.items():
        if groups and g not in groups:
            continue
        for t in grp.traces:
            for v, over in grp.variants.items():
                data = deep_merge(deep_merge(deep_merge(spec.base, spec.traces[t]), grp.base), over or {})
                data["name"] = f"{spec.name}.{g}.{t}.{v}"
                if spec.data_dir and "data_dir" not in data:
                    data["data_dir"] = spec.data_dir
                data = deep_merge(data, {"simulation": {"progress": False}})
                source = f"{p} [group {g}, trace {t}, variant {v}]"
                exp = parse_experiment(data, source, p.resolve().parent, dd)  # validate now: fail before running
                cx = cs = None
                if grp.curve is not None:
                    for path in (grp.curve.x, grp.curve.series):
                        if path is not None and _curve_value(data, exp, path) is _MISSING:
                            raise ConfigError(f"{p}: group {g!r}: curve path {path!r} does not exist in the "
                                              f"experiment of variant {v!r} (trace {t!r})")
                    cx = _curve_value(data, exp, grp.curve.x)
                    cs = _curve_value(data, exp, grp.curve.series) if grp.curve.series else None
                runs.append(Run(group=g, trace=t, variant=v, data=data, source=source,
                                base_dir=str(p.resolve().parent), data_dir=dd, curve_x=cx, curve_series=cs))
    _check_curves(p, spec, runs)
    return runs


RUN_META = "run.json"  # in every run's folder: the configuration hash and wall time; written last


def config_hash(run: Run) -> str:
    """sha256 of what decides a run's result: its merged experiment fields, the data folder it reads and the
    simulator version (a changed trace file under the same path is not noticed). Raises nothing."""
    key = {"data": run.data, "base_dir": run.base_dir, "data_dir": run.data_dir,
           "env_data_dir": os.environ.get("SERVELAB_DATA_DIR"), "version": _version()}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _version() -> str:
    """The installed servelab version ("unknown" when not installed). Raises nothing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("servelab")
    except PackageNotFoundError:
        return "unknown"


def run_dir(out_dir: Path | str, run: Run) -> Path:
    """The folder of one run's outputs: ``<out>/<group>/<trace>/<variant>``."""
    return Path(out_dir) / run.group / run.trace / run.variant


def _result(run: Run, summary: dict, lat: dict, pre: np.ndarray, wall_s: float, reused: bool) -> dict:
    """The result dict of one run, as the comparison table and the figures read it."""
    return {"group": run.group, "trace": run.trace, "variant": run.variant, "summary": summary,
            "curve_x": run.curve_x, "curve_series": run.curve_series, "wall_s": wall_s, "reused": reused,
            "ttft": lat["ttft"], "tpot": lat["tpot"], "e2el": lat["e2el"],
            "preempted_requests": len(pre), "preempted_e2el_mean": float(np.mean(pre)) if len(pre) else None}


@dataclass(frozen=True)
class ComparisonTask:
    """One run as it crosses to a worker: the run and the comparison's output folder."""

    run: Run
    out_dir: str


def simulate_run(task: ComparisonTask) -> dict:
    """Worker (any executor): simulate one run, write its folder atomically (report without plots, then run.json),
    return its summary and latency samples.

    Raises:
        whatever the simulation raises (the run's folder is then left as it was).
    """
    run = task.run
    exp = parse_experiment(run.data, run.source, Path(run.base_dir), run.data_dir)
    t0 = time.perf_counter()
    with simulate(exp) as result:
        with atomic_dir(run_dir(task.out_dir, run)) as tmp:
            summary = write_report(result, tmp, plots=False, atomic=False)
            wall = time.perf_counter() - t0
            (tmp / RUN_META).write_text(json.dumps({"config_hash": config_hash(run), "wall_s": wall}))
        lat = latency_samples(result.requests)
        pre = latency_samples([r for r in result.requests if r.num_preemptions])["e2el"]  # finished, preempted
    return _result(run, summary, lat, pre, wall, reused=False)


def _reuse(run: Run, out_dir: Path) -> dict | None:
    """The result of a run whose folder is complete (run.json, summary.json, requests.parquet) and whose
    configuration hash is unchanged, read back from its files; None otherwise. Raises nothing."""
    d = run_dir(out_dir, run)
    try:
        meta = json.loads((d / RUN_META).read_text())
        if not isinstance(meta, dict) or meta.get("config_hash") != config_hash(run):
            return None
        summary = json.loads((d / "summary.json").read_text())
        req = pd.read_parquet(d / "requests.parquet", columns=["status", "ttft", "tpot", "e2el", "num_preemptions"])
        wall = float(meta.get("wall_s", float("nan")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    fin = req[req["status"] == "finished"]
    lat = {m: fin[m].to_numpy(dtype=float) for m in ("ttft", "e2el")}
    tpot = fin["tpot"].to_numpy(dtype=float)
    lat["tpot"] = tpot[~np.isnan(tpot)]
    pre = fin.loc[fin["num_preemptions"] > 0, "e2el"].to_numpy(dtype=float)
    return _result(run, summary, lat, pre, wall, reused=True)


def run_comparison(spec: ComparisonSpec, runs: list[Run], out_dir: Path, jobs: int | None = None,
                   plots: bool | None = None, progress: Callable[[dict], None] | None = None,
                   note_base: Path | None = None, fresh: bool = False,
                   executor: Executor | None = None) -> pd.DataFrame:
    """Run every run on ``executor`` (default: a local process pool of ``jobs`` workers, else the file's ``jobs``),
    write the comparison report, return the comparison table (``table.attrs["reused"]``: how many runs were read
    back instead of simulated).

    Runs already complete in ``out_dir`` with an unchanged configuration are reused unless ``fresh``.

    Raises:
        OutputDirError: ``out_dir`` is an existing file, or a run's folder holds files that are not outputs.
        whatever a run raises (PolicyError, WorkloadError, ValueError, ...); the other workers are stopped.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputDirError(f"output folder {out_dir} exists and is not a folder; pass --out a folder path")
    for r in runs:  # before anything runs: a run folder that would be replaced but is not an output
        check_out_dir(run_dir(out_dir, r))
        remove_stale_temps(run_dir(out_dir, r))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict | None] = [None if fresh else _reuse(r, out_dir) for r in runs]
    for res in results:
        if res is not None and progress:
            progress(res)
    todo = [i for i, res in enumerate(results) if res is None]

    def done(i: int, res: dict) -> None:
        results[i] = res
        if progress:
            progress(res)

    _run_all([runs[i] for i in todo], todo, out_dir, executor or PoolExecutor(jobs or spec.jobs), done)
    table = _write_comparison(spec, results, out_dir, plots, note_base)
    table.attrs["reused"] = len(runs) - len(todo)
    return table


def _run_all(runs: list[Run], ids: list[int], out_dir: Path, executor: Executor,
             done: Callable[[int, dict], None]) -> None:
    """Simulate ``runs`` on ``executor`` (lab/report/executors.py), calling ``done(id, result)`` as each finishes.
    Raises whatever a run raises, KeyboardInterrupt, or SystemExit on SIGTERM (the workers stopped first)."""
    if not runs:
        return
    tasks = [ComparisonTask(run=r, out_dir=str(out_dir)) for r in runs]
    with executor:
        for batch in executor.map_unordered(simulate_run, tasks):
            for outcome in batch:
                done(ids[outcome.index], outcome.result())


def _write_comparison(spec: ComparisonSpec, results: list[dict], out_dir: Path, plots: bool | None,
                      note_base: Path | None) -> pd.DataFrame:
    """comparison.csv, the figures and comparison.md (each file replaced whole, comparison.md last)."""
    table = comparison_table(results)
    _write_atomic(out_dir / "comparison.csv", table.to_csv(index=False))
    want_plots = spec.plots if plots is None else plots
    figs = plot_groups(spec, results, out_dir) if want_plots else {}
    curve_figs = plot_curves(spec, table, out_dir) if want_plots else {}
    note = ""
    if spec.note:
        p = Path(spec.note)
        if not p.is_absolute() and note_base is not None:
            p = note_base / p
        note = p.read_text() if p.is_file() else f"(note file {p} not found)\n"
    _write_atomic(out_dir / "comparison.md", comparison_markdown(spec, table, figs, note, curve_figs))
    return table


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``. Raises OSError."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _ms(v) -> str:
    return "–" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{v * 1000:.0f}" if v >= 1 else f"{v * 1000:.1f}"


def comparison_table(results: list[dict]) -> pd.DataFrame:
    """One row per run: counts, TTFT/TPOT/E2EL mean and p99 (s), queue time mean, throughputs, preemptions, prefix
    hits, balance, and the run's curve x / series values (None outside curve groups)."""
    rows = []
    for res in results:
        s = res["summary"]
        inst = s.get("instances") or []
        per_req = [x["num_requests"] for x in inst]
        busy = [x["busy_fraction"] for x in inst]
        inputs = s["total_input_tokens"]
        rows.append({
            "group": res["group"], "trace": res["trace"], "variant": res["variant"],
            "scheduler": s["deployment"]["scheduler"], "router": s["deployment"].get("router"),
            "num_instances": s["deployment"].get("num_instances", 1),
            "num_requests": s["num_requests"], "num_finished": s["num_finished"],
            "num_rejected": s["num_rejected"], "num_unfinished": s["num_unfinished"],
            "ttft_mean": s["ttft"]["mean"], "ttft_p50": s["ttft"]["median"], "ttft_p99": s["ttft"]["p99"],
            "tpot_mean": s["tpot"]["mean"], "tpot_p50": s["tpot"]["median"], "tpot_p99": s["tpot"]["p99"],
            "e2el_mean": s["e2el"]["mean"], "e2el_p99": s["e2el"]["p99"],
            "queue_mean": (s.get("queue_time") or {}).get("mean"),
            "request_throughput": s["request_throughput"], "output_token_throughput": s["output_token_throughput"],
            "num_preemptions": s["num_preemptions"], "num_swaps": s.get("num_swaps", 0),
            "preempted_requests": res.get("preempted_requests", 0),
            "preempted_e2el_mean": res.get("preempted_e2el_mean"),
            "transfer_s": (s.get("engine") or {}).get("transfer_s", 0.0),
            "prefix_hit_rate": s["prefix_hit_tokens"] / inputs if inputs else 0.0,
            "goodput": s.get("goodput"), "slo_attainment": s.get("slo_attainment"),
            "instance_requests_min": min(per_req) if per_req else None,
            "instance_requests_max": max(per_req) if per_req else None,
            "instance_busy_min": min(busy) if busy else None, "instance_busy_max": max(busy) if busy else None,
            "duration_s": s["duration_s"], "wall_s": res["wall_s"],
            "curve_x": res.get("curve_x"), "curve_series": res.get("curve_series"),
        })
    return pd.DataFrame(rows)


def comparison_markdown(spec: ComparisonSpec, table: pd.DataFrame, figures: dict[str, str], note: str,
                        curve_figures: dict[tuple[str, str], str] | None = None) -> str:
    """comparison.md: the reading (note), then per group and trace one table (ms for latencies), and for a group
    with a ``curve`` its curve table and figure per trace."""
    lines = [f"# {spec.name}", "", spec.description.strip(), ""]
    if note:
        lines += [note.strip(), ""]
    lines += ["Latencies in ms (mean / p99 over finished requests); throughput over the run's duration; SLO = share",
              "of requests meeting every SLO of `slo:`; prefix hit = prefix-cache hit tokens / prompt tokens; in groups",
              "with preemptions, `E2EL preempted` is the mean E2EL of the requests preempted at least once. Every run's",
              "full report is in `<group>/<trace>/<variant>/`; all numbers are also in `comparison.csv`.", ""]
    for g, grp in spec.groups.items():
        sub = table[table["group"] == g]
        if not len(sub):
            continue
        lines += [f"## {g}", "", grp.description.strip(), ""]
        multi = bool((sub["num_instances"] > 1).any())
        slo = bool(sub["slo_attainment"].notna().any())
        pre = bool((sub["num_preemptions"] > 0).any())
        for t in grp.traces:
            rows = sub[sub["trace"] == t]
            if not len(rows):
                continue
            lines += [f"### {t}", ""]
            head = ("| variant | finished | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 | E2EL mean | E2EL p99 | req/s "
                    "| out tok/s | preempt. | prefix hit |")
            sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            if slo:
                head += " SLO |"
                sep += "---:|"
            if pre:
                head += " swaps | E2EL preempted |"
                sep += "---:|---:|"
            if multi:
                head += " req/instance | busy % |"
                sep += "---:|---:|"
            lines += [head, sep]
            for _, r in rows.iterrows():
                line = (f"| {r['variant']} | {r['num_finished']}/{r['num_requests']} | {_ms(r['ttft_mean'])} | "
                        f"{_ms(r['ttft_p99'])} | {_ms(r['tpot_mean'])} | {_ms(r['tpot_p99'])} | {_ms(r['e2el_mean'])} | "
                        f"{_ms(r['e2el_p99'])} | {r['request_throughput']:.2f} | {r['output_token_throughput']:.0f} | "
                        f"{r['num_preemptions']} | {r['prefix_hit_rate'] * 100:.1f} % |")
                if slo:
                    line += f" {r['slo_attainment'] * 100:.1f} % |"
                if pre:
                    line += f" {r['num_swaps']} | {_ms(r['preempted_e2el_mean'])} |"
                if multi:
                    line += (f" {r['instance_requests_min']}–{r['instance_requests_max']} | "
                             f"{r['instance_busy_min'] * 100:.0f}–{r['instance_busy_max'] * 100:.0f} |")
                lines.append(line)
            lines.append("")
            if grp.curve is not None:
                lines += _curve_markdown(grp.curve, rows)
                if (g, t) in (curve_figures or {}):
                    lines += [f"![{g} / {t}: throughput, TTFT and TPOT vs {grp.curve.x}]"
                              f"({curve_figures[(g, t)]})", ""]
        if g in figures:
            lines += [f"![{g}: latency CDFs]({figures[g]})", ""]
    return "\n".join(lines)


def plot_groups(spec: ComparisonSpec, results: list[dict], out_dir: Path) -> dict[str, str]:
    """One figure per group: a row per trace, TTFT / TPOT / E2EL CDFs of every variant side by side, one tab10
    colour per variant, the runs' SLO bounds as vertical lines, and one legend for the figure at its right."""
    plt = pyplot()

    figs = {}
    for g, grp in spec.groups.items():
        traces = [t for t in grp.traces if any(r["group"] == g and r["trace"] == t for r in results)]
        if not traces:
            continue
        fig, axes = plt.subplots(len(traces), 3, figsize=(15, 3.4 * len(traces)), squeeze=False)
        for i, t in enumerate(traces):
            for j, metric in enumerate(("ttft", "tpot", "e2el")):
                ax = axes[i][j]
                k = 0
                slo = None
                for res in results:
                    if res["group"] != g or res["trace"] != t:
                        continue
                    v = np.sort(np.asarray(res[metric], dtype=float))
                    v = v[np.isfinite(v) & (v > 0)]
                    if len(v):  # tab10 colours, a new line style every 10 variants (plots.series_style)
                        ax.plot(v * 1000, np.arange(1, len(v) + 1) / len(v), label=res["variant"], lw=1.2,
                                **series_style(k))
                    k += 1
                    slo = slo or res["summary"].get("slo")
                draw_slo(ax, slo, metric)
                ax.set_xscale("log")
                _label_log_minor_ticks(ax.xaxis)
                ax.set_xlabel(f"{metric.upper()} (ms, log)")
                ax.set_ylabel("CDF")
                ax.set_title(f"{t}: {metric.upper()}", fontsize=10)
                ax.grid(alpha=0.3)
        fig.tight_layout()
        shared_legend(fig, axes.flat)
        name = f"{g}_cdf.png"
        fig.savefig(out_dir / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        figs[g] = name
    return figs


def _sorted_values(values) -> list:
    """Distinct values in natural order where they compare, else in first-seen order."""
    out = list(dict.fromkeys(values))
    try:
        return sorted(out)
    except TypeError:
        return out


def _curve_points(rows: pd.DataFrame) -> list[tuple[Any, pd.DataFrame]]:
    """(series value, its rows sorted by x) for one group and trace."""
    out = []
    for key in _sorted_values([_series_key(v) for v in rows["curve_series"]]):
        sub = rows[rows["curve_series"].map(lambda v: _series_key(v) == key)].sort_values("curve_x")
        out.append((sub["curve_series"].iloc[0], sub))
    return out


def _curve_markdown(curve: CurveSpec, rows: pd.DataFrame) -> list[str]:
    """The curve's numbers: one row per run, by x then series."""
    head = f"| {curve.x} |" + (f" {curve.series} |" if curve.series else "")
    head += " variant | out tok/s | TTFT mean (ms) | TPOT mean (ms) | queue mean (ms) |"
    sep = "|---:|" + ("---:|" if curve.series else "") + "---|---:|---:|---:|---:|"
    order = {k: i for i, k in enumerate(_sorted_values([_series_key(v) for v in rows["curve_series"]]))}
    rows = rows.assign(_o=[order[_series_key(v)] for v in rows["curve_series"]]).sort_values(["curve_x", "_o"])
    lines = [f"Against `{curve.x}`" + (f", per `{curve.series}`" if curve.series else "") +
             " (TTFT counts the wait in the queue, shown on its own as queue mean):", "", head, sep]
    for _, r in rows.iterrows():
        line = f"| {_fmt_value(r['curve_x'])} |" + (f" {_fmt_value(r['curve_series'])} |" if curve.series else "")
        line += (f" {r['variant']} | {r['output_token_throughput']:.0f} | {_ms_fixed(r['ttft_mean'])} | "
                 f"{_ms_fixed(r['tpot_mean'])} | {_ms_fixed(r['queue_mean'])} |")
        lines.append(line)
    return lines + [""]


def _fmt_value(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _ms_fixed(v) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "–"
    ms = v * 1000
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _label_log_minor_ticks(axis) -> None:
    """On a log axis, plain numbers at the powers of ten and at the 2x and 5x minor ticks only (matplotlib labels
    every minor tick on a short range, and the labels overlap)."""
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415 - loaded with pyplot, only when drawing

    def plain(v):
        return f"{v:.0f}" if v >= 1 else f"{v:g}"

    def minor(v, _pos):
        if v <= 0:
            return ""
        m = v / 10 ** np.floor(np.log10(v) + 1e-9)
        return plain(v) if np.isclose(m, 2) or np.isclose(m, 5) else ""

    axis.set_major_formatter(FuncFormatter(lambda v, _pos: plain(v) if v > 0 else ""))
    axis.set_minor_formatter(FuncFormatter(minor))


def _powers_of_two(xs) -> bool:
    for x in xs:
        if not (x > 0 and float(x).is_integer() and (int(x) & (int(x) - 1)) == 0):
            return False
    return True


def plot_curves(spec: ComparisonSpec, table: pd.DataFrame, out_dir: Path) -> dict[tuple[str, str], str]:
    """Per group with a ``curve`` and trace: output token throughput, mean TTFT and mean TPOT against x (log2 x
    when every x is a power of two), one line per series value. Returns ``{(group, trace): file name}``."""
    plt = pyplot()

    figs = {}
    panels = (("output_token_throughput", 1.0, "output throughput (tok/s)"),
              ("ttft_mean", 1000.0, "mean TTFT (ms)"), ("tpot_mean", 1000.0, "mean TPOT (ms)"))
    for g, grp in spec.groups.items():
        c = grp.curve
        if c is None:
            continue
        for t in grp.traces:
            rows = table[(table["group"] == g) & (table["trace"] == t)]
            if not len(rows):
                continue
            xs = rows["curve_x"].astype(float).tolist()
            log2 = _powers_of_two(xs)
            fig, axes = plt.subplots(1, 3, figsize=(15, 4), squeeze=False)
            for j, (col, scale, label) in enumerate(panels):
                ax = axes[0][j]
                vals = rows[col].astype(float).to_numpy() * scale
                vals = vals[np.isfinite(vals) & (vals > 0)]
                logy = len(vals) > 0 and vals.max() > 20 * vals.min()  # spans decades: log y
                for k, (sv, sub) in enumerate(_curve_points(rows)):
                    name = f"{c.series}={_fmt_value(sv)}" if c.series else g
                    ax.plot(sub["curve_x"].astype(float), sub[col].astype(float) * scale, marker="o", lw=1.5,
                            ms=4, label=name, color=plt.cm.tab10(k % 10), ls=("-", "--", ":")[(k // 10) % 3])
                if log2:
                    ax.set_xscale("log", base=2)
                    ticks = sorted(set(xs))
                    ax.set_xticks(ticks)
                    ax.set_xticklabels([_fmt_value(x) for x in ticks])
                ax.set_xlabel(c.x + (" (log2)" if log2 else ""))
                if logy:
                    ax.set_yscale("log")
                    _label_log_minor_ticks(ax.yaxis)
                else:
                    ax.set_ylim(bottom=0)
                ax.set_ylabel(label + (", log" if logy else ""))
                ax.set_title(f"{t}: {label}", fontsize=10)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
            fig.tight_layout()
            name = f"{g}_{t}_curve.png"
            fig.savefig(out_dir / name, dpi=100)
            plt.close(fig)
            figs[(g, t)] = name
    return figs
