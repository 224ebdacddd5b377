"""Policy comparisons: one YAML file runs several policies on several traces and writes one side-by-side report.

A comparison file (docs/experiments.md, "Comparison files") has a ``base`` experiment (any experiment fields), named
``traces`` (experiment fields too, usually just ``workload``) and ``groups``; each group names the traces it runs
on and its ``variants`` (experiment-field overrides, e.g. ``policy: {scheduler: sarathi}``). Every
(group, trace, variant) is one experiment, built by merging base <- trace <- group.base <- variant and validated
like any experiment file (errors name the comparison file and the run) before anything runs. Runs go to a local
process pool (``--jobs``); each run's full outputs land in ``<out>/<group>/<trace>/<variant>/`` and the
comparison in ``<out>/comparison.md`` (tables per group and trace, the written reading from ``note``),
``comparison.csv`` (one row per run) and one CDF figure per group (TTFT, TPOT, E2EL side by side per trace).
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lab.experiment.config import ConfigError, _format_errors, deep_merge, parse_experiment, read_yaml
from lab.report.metrics import latency_samples

_NAME = r"^[A-Za-z0-9_.-]+$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GroupSpec(_Strict):
    """One question: the traces it runs on and the variants it compares."""

    description: str = ""
    traces: list[str] = Field(min_length=1)
    base: dict[str, Any] = Field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = Field(min_length=1)


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
        import re

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
        raise ConfigError(_format_errors(str(p), e).replace("invalid experiment", "invalid comparison")) from None
    if groups:
        unknown = [g for g in groups if g not in spec.groups]
        if unknown:
            raise ConfigError(f"{p}: unknown group(s) {unknown}; groups: {', '.join(spec.groups)}")
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
                parse_experiment(data, source, p.resolve().parent, dd)  # validate now: fail before running
                runs.append(Run(group=g, trace=t, variant=v, data=data, source=source,
                                base_dir=str(p.resolve().parent), data_dir=dd))
    return spec, runs


def _run_one(run: Run, out_dir: str) -> dict:
    """Worker: simulate one run, write its report (no plots), return its summary and latency samples."""
    from lab.report.run_report import write_report
    from lab.experiment.simulation import simulate

    exp = parse_experiment(run.data, run.source, Path(run.base_dir), run.data_dir)
    t0 = time.perf_counter()
    result = simulate(exp)
    d = Path(out_dir) / run.group / run.trace / run.variant
    summary = write_report(result, d, plots=False)
    lat = latency_samples(result.requests)
    pre = latency_samples([r for r in result.requests if r.num_preemptions])["e2el"]  # finished, preempted
    return {"group": run.group, "trace": run.trace, "variant": run.variant, "summary": summary,
            "wall_s": time.perf_counter() - t0, "ttft": lat["ttft"], "tpot": lat["tpot"], "e2el": lat["e2el"],
            "preempted_requests": len(pre), "preempted_e2el_mean": float(np.mean(pre)) if len(pre) else None}


def run_comparison(spec: ComparisonSpec, runs: list[Run], out_dir: Path, jobs: int | None = None,
                   plots: bool | None = None, progress: Callable[[dict], None] | None = None,
                   note_base: Path | None = None) -> pd.DataFrame:
    """Run every run (``jobs`` worker processes), write the comparison report, return the comparison table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs or spec.jobs
    results: list[dict] = []
    if jobs == 1:
        for r in runs:
            res = _run_one(r, str(out_dir))
            results.append(res)
            if progress:
                progress(res)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futs = [pool.submit(_run_one, r, str(out_dir)) for r in runs]
            for f in futs:
                res = f.result()
                results.append(res)
                if progress:
                    progress(res)
    table = comparison_table(results)
    table.to_csv(out_dir / "comparison.csv", index=False)
    figs = plot_groups(spec, results, out_dir) if (spec.plots if plots is None else plots) else {}
    note = ""
    if spec.note:
        p = Path(spec.note)
        if not p.is_absolute() and note_base is not None:
            p = note_base / p
        note = p.read_text() if p.is_file() else f"(note file {p} not found)\n"
    (out_dir / "comparison.md").write_text(comparison_markdown(spec, table, figs, note))
    return table


def _ms(v) -> str:
    return "–" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{v * 1000:.0f}" if v >= 1 else f"{v * 1000:.1f}"


def comparison_table(results: list[dict]) -> pd.DataFrame:
    """One row per run: counts, TTFT/TPOT/E2EL mean and p99 (s), throughputs, preemptions, prefix hits, balance."""
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
        })
    return pd.DataFrame(rows)


def comparison_markdown(spec: ComparisonSpec, table: pd.DataFrame, figures: dict[str, str], note: str) -> str:
    """comparison.md: the reading (note), then per group and trace one table (ms for latencies)."""
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
        if g in figures:
            lines += [f"![{g}: latency CDFs]({figures[g]})", ""]
    return "\n".join(lines)


def plot_groups(spec: ComparisonSpec, results: list[dict], out_dir: Path) -> dict[str, str]:
    """One figure per group: a row per trace, TTFT / TPOT / E2EL CDFs of every variant side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
                for res in results:
                    if res["group"] != g or res["trace"] != t:
                        continue
                    v = np.sort(np.asarray(res[metric], dtype=float))
                    v = v[np.isfinite(v) & (v > 0)]
                    if len(v):  # tab20 colours, a new line style every 10 variants
                        ax.plot(v * 1000, np.arange(1, len(v) + 1) / len(v), label=res["variant"], lw=1.2,
                                color=plt.cm.tab20(k % 20), ls=("-", "--", ":")[(k // 10) % 3])
                    k += 1
                ax.set_xscale("log")
                ax.set_xlabel(f"{metric.upper()} (ms, log)")
                ax.set_ylabel("CDF")
                ax.set_title(f"{t}: {metric.upper()}", fontsize=10)
                ax.grid(alpha=0.3)
            axes[i][0].legend(fontsize=7)
        fig.tight_layout()
        name = f"{g}_cdf.png"
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        figs[g] = name
    return figs

