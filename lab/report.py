"""Write a run's outputs: requests.parquet/.csv, steps.parquet, events.parquet, summary.json, report.md and plots.

Everything a plot shows is also in a table.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from lab.engine import STEP_COLUMNS
from lab.metrics import requests_frame, summarize
from lab.simulation import SimResult


def steps_frame(result: SimResult) -> pd.DataFrame:
    """One row per engine step of every instance."""
    frames = []
    for inst in result.instances:
        frames.append(pd.DataFrame({c: np.frombuffer(a, dtype=float) if len(a) else np.array([], float)
                                    for c, a in inst.steps.cols.items()}))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(STEP_COLUMNS))
    for c in ("instance", "scheduled_tokens", "prefill_tokens", "decode_requests", "batch_size", "kv_blocks_used",
              "num_running", "num_waiting", "num_preempted", "output_tokens"):
        df[c] = df[c].astype(np.int64)
    return df.sort_values(["start", "instance"], kind="stable").reset_index(drop=True)


def events_frame(result: SimResult) -> pd.DataFrame:
    """One row per lifecycle event of every request (arrived, scheduled, preempted, resumed, first_token,
    finished, rejected), when the run recorded them."""
    rows = [(r.request_id, t, ev) for r in result.requests if r.events for (t, ev) in r.events]
    return pd.DataFrame.from_records(rows, columns=["request_id", "time", "event"])


def collect(result: SimResult) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(requests table, steps table, summary dict) of a run."""
    exp = result.experiment
    req = requests_frame(result.requests)
    steps = steps_frame(result)
    slo = exp.slo.model_dump()
    summary = summarize(req, np.frombuffer(result.itl_samples, dtype=float) if len(result.itl_samples) else np.array([]),
                        steps, horizon=exp.simulation.horizon_s, slo=slo)
    dep = result.deployment
    summary["experiment"] = exp.name
    summary["deployment"] = {
        "model": dep.model.name, "gpu": dep.hardware.name, "tensor_parallel_size": exp.hardware.tensor_parallel_size,
        "pipeline_parallel_size": exp.hardware.pipeline_parallel_size,
        "expert_parallel_size": exp.hardware.expert_parallel_size,
        "data_parallel_size": exp.hardware.data_parallel_size,
        "scheduler": exp.policy.scheduler, "queue": exp.policy.queue, "cost_model": dep.cost_model.name,
        "num_gpu_blocks": dep.num_gpu_blocks, "block_size": exp.engine.block_size,
        "num_gpu_blocks_source": "config" if dep.kv_capacity is None else "derived",
        "max_num_batched_tokens": dep.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": dep.scheduler_config.max_num_seqs, "max_model_len": dep.scheduler_config.max_model_len,
    }
    if dep.kv_capacity is not None:
        summary["deployment"]["kv_capacity"] = dep.kv_capacity.as_dict()
    summary["simulation"] = {"sim_end_s": result.sim_end, "wall_time_s": result.wall_time_s,
                             "seed": exp.seed}
    return req, steps, summary


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.1f}"


def write_report(result: SimResult, out_dir: Path, plots: bool = True) -> dict:
    """Write every output file into ``out_dir`` (created if needed) and return the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    req, steps, summary = collect(result)
    req.to_parquet(out_dir / "requests.parquet", index=False)
    req.to_csv(out_dir / "requests.csv", index=False)
    steps.to_parquet(out_dir / "steps.parquet", index=False)
    ev = events_frame(result)
    if len(ev):
        ev.to_parquet(out_dir / "events.parquet", index=False)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=_json_default))
    figs = plot_all(req, steps, result, out_dir) if plots else []
    (out_dir / "report.md").write_text(markdown(summary, figs))
    return summary


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o))


def markdown(summary: dict, figures: list[tuple[str, str]]) -> str:
    """The report page: headline table, latency table, engine statistics, then the figures."""
    d = summary["deployment"]
    lines = [f"# {summary['experiment']}", "",
             f"{d['model']} on {d['gpu']} × TP{d['tensor_parallel_size']}, scheduler `{d['scheduler']}` "
             f"({d['queue']}), cost model `{d['cost_model']}`, {d['num_gpu_blocks']} KV blocks of {d['block_size']} "
             f"tokens ({d['num_gpu_blocks_source']}), max_num_batched_tokens {d['max_num_batched_tokens']}, "
             f"max_num_seqs {d['max_num_seqs']}.", "",
             "| requests | finished | rejected | unfinished | duration (s) | req/s | output tok/s | total tok/s | preemptions |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {summary['num_requests']} | {summary['num_finished']} | {summary['num_rejected']} | "
             f"{summary['num_unfinished']} | {summary['duration_s']:.1f} | {summary['request_throughput']:.2f} | "
             f"{summary['output_token_throughput']:.0f} | {summary['total_token_throughput']:.0f} | "
             f"{summary['num_preemptions']} |", "",
             "| metric (ms) | mean | median | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for m in ("ttft", "tpot", "itl", "e2el", "queue_time"):
        s = summary[m]
        lines.append(f"| {m.upper()} | {_ms(s['mean'])} | {_ms(s['median'])} | {_ms(s['p90'])} | {_ms(s['p99'])} |")
    if "goodput" in summary:
        lines += ["", f"Goodput {summary['goodput']:.2f} req/s; SLO attainment {summary['slo_attainment'] * 100:.1f} % "
                      f"(SLO {summary['slo']})."]
    eng = summary.get("engine")
    if eng:
        lines += ["", f"Engine: {eng['num_steps']} steps, mean batch {eng['mean_batch_size']:.1f} requests / "
                      f"{eng['mean_scheduled_tokens']:.0f} tokens, peak KV usage {eng['peak_kv_usage'] * 100:.1f} %, "
                      f"peak running {eng['peak_running']}, peak waiting {eng['peak_waiting']}."]
    sim = summary["simulation"]
    lines += ["", f"Simulated {sim['sim_end_s']:.1f} s in {sim['wall_time_s']:.2f} s wall time (seed {sim['seed']}).", ""]
    for title, fname in figures:
        lines += [f"## {title}", "", f"![{title}]({fname})", ""]
    lines += ["Tables: `requests.parquet` / `requests.csv` (one row per request), `steps.parquet` (one row per step), "
              "`events.parquet` (request lifecycle events), `summary.json`.", ""]
    return "\n".join(lines)


def plot_all(req: pd.DataFrame, steps: pd.DataFrame, result: SimResult, out_dir: Path) -> list[tuple[str, str]]:
    """Latency CDFs, throughput and queue length over time, KV usage over time; returns (title, file) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    fin = req[req["status"] == "finished"]
    itl = np.frombuffer(result.itl_samples, dtype=float) if len(result.itl_samples) else np.array([])
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, vals) in zip(axes, (("TTFT", fin["ttft"]), ("TPOT", fin["tpot"]), ("ITL", itl),
                                       ("E2EL", fin["e2el"]))):
        v = np.sort(np.asarray(vals, dtype=float))
        v = v[np.isfinite(v)]
        if len(v):
            ax.plot(v * 1000, np.arange(1, len(v) + 1) / len(v))
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_cdf.png", dpi=110)
    plt.close(fig)
    figs.append(("Latency CDFs", "latency_cdf.png"))

    if len(steps):
        end = steps["start"] + steps["duration"]
        bucket = np.floor(end).astype(int)
        tput = steps.groupby(bucket)["output_tokens"].sum()
        prefill = steps.groupby(bucket)["prefill_tokens"].sum()
        fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
        axes[0].plot(tput.index, tput.values, label="output tokens/s")
        axes[0].plot(prefill.index, prefill.values, label="prefill tokens/s", alpha=0.7)
        axes[0].set_ylabel("tokens/s")
        axes[0].legend()
        axes[1].plot(steps["start"], steps["num_running"], label="running", lw=0.8)
        axes[1].plot(steps["start"], steps["num_waiting"], label="waiting", lw=0.8)
        axes[1].set_ylabel("requests")
        axes[1].legend()
        axes[2].plot(steps["start"], steps["kv_usage"] * 100, lw=0.8)
        axes[2].set_ylabel("KV usage (%)")
        axes[2].set_xlabel("time (s)")
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "timeseries.png", dpi=110)
        plt.close(fig)
        figs.append(("Throughput, queues and KV usage over time", "timeseries.png"))
    return figs
