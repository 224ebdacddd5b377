"""Compare a simulated run with a measured one: per-request latencies, their error distributions, the engine's time
series, and where the simulated time goes.

Measured formats (``validation.format``):

- ``llmservingsim``: the ``requests.jsonl`` of an LLMServingSim bench run (vLLM ``AsyncLLM`` engine timestamps):
  TTFT = first_token_ts − queued_ts, TPOT = (last_token_ts − first_token_ts)/(output_toks − 1),
  E2EL = last_token_ts − queued_ts (``queued_ts`` stands for arrival: ``arrival_time`` is another clock;
  shared/data/validation/llmservingsim/PROVENANCE.md §1). Requests are matched by ``request_id`` (``bench-<i>``).
  A ``meta.json`` beside it may record the measured ``num_gpu_blocks``; a ``timeseries.csv`` the 1-s engine stats.
- ``vllm_bench``: the JSON ``vllm bench serve --save-result --save-detailed`` writes: ``input_lens``,
  ``output_lens``, ``ttfts`` (s), ``itls`` (list of gaps per request, s). E2EL = TTFT + Σ ITL,
  TPOT = (E2EL − TTFT)/(output − 1). Requests are matched by their index in the file (``request_id`` "0", "1", ...;
  the ``vllm_bench`` workload source numbers requests the same way).

The error of a statistic is (simulated − measured) / measured; a request's relative error is the same per request.
The whole run's duration and request / output throughput are compared too (``report["run"]``); a figure the
measured file does not give is reported as "not in the measured file".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from lab.report.metrics import requests_frame
from lab.report.plots import draw_slo, pyplot, series_style
from lab.report.output_folder import atomic_dir, check_out_dir
from lab.report.run_report import write_report
from lab.report.run_tables import steps_frame


class ValidationError(ValueError):
    """A measured file is missing or malformed."""


FORMATS = ("llmservingsim", "vllm_bench")


# Axis labels (with units) of the vLLM StatLogger columns in the measured time series.
_TIMESERIES_LABELS = {"running": "running requests", "waiting": "waiting requests",
                      "kv_cache_pct": "KV cache usage (%)", "gen_throughput": "decode tokens/s",
                      "prompt_throughput": "prefill tokens/s"}


def load_measured(path: str | Path, fmt: str = "llmservingsim") -> pd.DataFrame:
    """Measured per-request table: request_id, prompt_tokens, output_tokens, ttft, tpot, e2el (seconds) and, when
    known, arrival_time / first_token_time / finish_time relative to the first request. ``attrs["run"]`` holds the
    whole run's figures: ``duration_s`` (first queue entry to the last token; vllm_bench: the file's ``duration``),
    ``request_throughput`` (req/s), ``output_throughput`` (tok/s) and ``completed``; None where the file does not
    give them.

    Raises:
        ValidationError: missing file, bad JSON, missing keys, or an unknown format.
    """
    path = Path(path)
    if not path.is_file():
        raise ValidationError(f"validation.measured: {path} does not exist")
    if fmt == "llmservingsim":
        return _load_llmservingsim(path)
    if fmt == "vllm_bench":
        return _load_vllm_bench(path)
    raise ValidationError(f"validation.format: unknown format {fmt!r}; expected one of {FORMATS}")


def _load_llmservingsim(path: Path) -> pd.DataFrame:
    rows = []
    need = ("request_id", "input_toks", "output_toks", "queued_ts", "first_token_ts", "last_token_ts")
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValidationError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
            missing = [k for k in need if k not in r]
            if missing:
                raise ValidationError(f"{path}: line {lineno}: missing key(s) {missing}")
            rows.append(r)
    if not rows:
        raise ValidationError(f"{path}: no requests")
    df = pd.DataFrame(rows)
    t0 = df["queued_ts"].min()
    out = pd.DataFrame({
        "request_id": df["request_id"].astype(str),
        "prompt_tokens": df["input_toks"].astype(int),
        "output_tokens": df["output_toks"].astype(int),
        "arrival_time": df["queued_ts"] - t0,
        "first_token_time": df["first_token_ts"] - t0,
        "finish_time": df["last_token_ts"] - t0,
    })
    out["ttft"] = out["first_token_time"] - out["arrival_time"]
    out["e2el"] = out["finish_time"] - out["arrival_time"]
    out["tpot"] = _tpot(out["e2el"], out["ttft"], out["output_tokens"])
    duration = float(out["finish_time"].max() - out["arrival_time"].min())  # first queue entry to the last token
    out.attrs["run"] = _run_figures(duration, len(out), float(out["output_tokens"].sum()))
    return out


def _run_figures(duration: float | None, completed: int | None, output_tokens: float | None,
                 request_throughput: float | None = None, output_throughput: float | None = None) -> dict:
    """A measured run's duration (s), request and output-token throughput (req/s, tok/s) and completed requests;
    throughputs not given are derived from the duration where it is known; None: unknown."""
    ok = duration is not None and duration > 0
    if request_throughput is None and ok and completed is not None:
        request_throughput = completed / duration
    if output_throughput is None and ok and output_tokens is not None:
        output_throughput = output_tokens / duration
    return {"duration_s": duration, "request_throughput": request_throughput,
            "output_throughput": output_throughput, "completed": completed}


def _load_vllm_bench(path: Path) -> pd.DataFrame:
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValidationError(f"{path}: not valid JSON ({e.msg})") from None
    need = ("input_lens", "output_lens", "ttfts", "itls")
    missing = [k for k in need if k not in d]
    if missing:
        raise ValidationError(f"{path}: missing key(s) {missing}; save it with vllm bench serve --save-result "
                              "--save-detailed")
    n = len(d["input_lens"])
    if any(len(d[k]) != n for k in need):
        raise ValidationError(f"{path}: {', '.join(need)} must have one entry per request ({n})")
    ttft = np.array([np.nan if t is None else t for t in d["ttfts"]], dtype=float)
    itl_sum = np.array([float(np.sum(x)) if x else 0.0 for x in d["itls"]])
    out = pd.DataFrame({
        "request_id": [str(i) for i in range(n)],
        "prompt_tokens": np.asarray(d["input_lens"], dtype=int),
        "output_tokens": np.asarray(d["output_lens"], dtype=int),
        "ttft": ttft,
    })
    errors = d.get("errors") or [""] * n
    out = out[[not e for e in errors]].copy() if len(errors) == n else out
    out["e2el"] = out["ttft"] + itl_sum[out.index]
    out["tpot"] = _tpot(out["e2el"], out["ttft"], out["output_tokens"])
    out = out.reset_index(drop=True)

    def number(key: str) -> float | None:
        v = d.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) else None

    completed = number("completed")
    out.attrs["run"] = _run_figures(number("duration"), int(completed) if completed is not None else len(out),
                                    number("total_output_tokens"), number("request_throughput"),
                                    number("output_throughput"))
    return out


def _tpot(e2el: pd.Series, ttft: pd.Series, out: pd.Series) -> np.ndarray:
    return np.where(out > 1, (e2el - ttft) / (out - 1).clip(lower=1), np.nan)


def load_measured_blocks(measured_path: Path) -> int | None:
    """``kv_cache.num_gpu_blocks`` from a ``meta.json`` beside the measured file, if it records one."""
    meta = Path(measured_path).parent / "meta.json"
    if not meta.is_file():
        return None
    try:
        return (json.loads(meta.read_text()).get("kv_cache") or {}).get("num_gpu_blocks")
    except json.JSONDecodeError:
        return None


def load_timeseries(path: str | Path) -> pd.DataFrame:
    """Measured 1-s engine statistics (``t, prompt_throughput, gen_throughput, running, waiting, kv_cache_pct``).

    Raises:
        ValidationError: missing file or columns.
    """
    path = Path(path)
    if not path.is_file():
        raise ValidationError(f"validation.timeseries: {path} does not exist")
    df = pd.read_csv(path)
    need = {"t", "prompt_throughput", "gen_throughput", "running", "waiting"}
    if not need <= set(df.columns):
        raise ValidationError(f"{path}: missing columns {sorted(need - set(df.columns))}")
    if "kv_cache_pct" in df and not (df["kv_cache_pct"] > 0).any():
        df = df.drop(columns="kv_cache_pct")  # all zero: the LLMServingSim RTX PRO 6000 logger bug (PROVENANCE §1)
    return df


def simulated_timeseries(steps: pd.DataFrame, requests: pd.DataFrame, bucket_s: float = 1.0) -> pd.DataFrame:
    """The simulated run in the measured time-series form: per ``bucket_s`` bucket (labelled by its end, seconds
    from the first arrival), prompt and generated tokens per second, running and waiting requests at the bucket's
    last step, and KV usage (%) at that step. Prompt throughput counts each request's prompt once, in the bucket of
    its first token, as vLLM's ``IterationStats.num_prompt_tokens`` does (recomputation after a preemption and
    prefix-cache hits are not separate prompt tokens there)."""
    if steps.empty:
        return pd.DataFrame(columns=["t", "prompt_throughput", "gen_throughput", "running", "waiting", "kv_cache_pct"])

    def bucket(t: pd.Series) -> np.ndarray:
        return (np.floor(t / bucket_s).astype(int) + 1) * bucket_s

    end = steps["start"] + steps["duration"]
    g = steps.assign(_b=bucket(end)).groupby("_b")
    ft = requests.dropna(subset=["first_token_time"])
    prompt = ft.groupby(bucket(ft["first_token_time"]))["prompt_tokens"].sum()
    out = pd.DataFrame({
        "prompt_throughput": prompt.reindex(g.size().index, fill_value=0) / bucket_s,
        "gen_throughput": g["output_tokens"].sum() / bucket_s,
        "running": g["num_running"].last(),
        "waiting": g["num_waiting"].last(),
        "kv_cache_pct": g["kv_usage"].last() * 100,
    })
    out.index.name = "t"
    return out.reset_index()


STATS = ("mean", "p50", "p90", "p99")


def _stat(a: np.ndarray, s: str) -> float:
    a = a[np.isfinite(a)]
    if a.size == 0:
        return float("nan")
    return float(a.mean()) if s == "mean" else float(np.percentile(a, int(s[1:])))


def compare(measured: pd.DataFrame, simulated: pd.DataFrame) -> dict:
    """Errors of mean and p50/p90/p99 of TTFT, TPOT and E2EL over the requests both tables hold (matched by
    ``request_id``; only requests finished in the simulation count), and the distribution of per-request relative
    errors (signed mean, and p50/p90 of the absolute error).

    Returns:
        {"num_compared", "num_measured", "num_simulated_finished", "metrics": {metric: {stat: {measured,
        simulated, error_pct}}}, "per_request_error_pct": {metric: {mean, abs_p50, abs_p90}}, "per_request":
        DataFrame of matched requests}.
    """
    sim = simulated[simulated["status"] == "finished"]
    j = measured[["request_id", "ttft", "tpot", "e2el"]].merge(
        sim[["request_id", "ttft", "tpot", "e2el"]], on="request_id", suffixes=("_meas", "_sim"))
    metrics: dict = {}
    per_req: dict = {}
    for m in ("ttft", "tpot", "e2el"):
        a, b = j[f"{m}_meas"].to_numpy(float), j[f"{m}_sim"].to_numpy(float)
        metrics[m] = {}
        for s in STATS:
            mv, sv = _stat(a, s), _stat(b, s)
            metrics[m][s] = {"measured": mv, "simulated": sv,
                             "error_pct": (sv - mv) / mv * 100 if mv else float("nan")}
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = (b - a) / a * 100
        j[f"{m}_error_pct"] = rel
        fin = rel[np.isfinite(rel)]
        per_req[m] = ({"mean": float(fin.mean()), "abs_p50": float(np.percentile(np.abs(fin), 50)),
                       "abs_p90": float(np.percentile(np.abs(fin), 90))} if fin.size else
                      {"mean": None, "abs_p50": None, "abs_p90": None})
    return {
        "num_compared": int(len(j)),
        "num_measured": int(len(measured)),
        "num_simulated_finished": int(len(sim)),
        "metrics": metrics,
        "per_request_error_pct": per_req,
        "per_request": j,
    }


def compare_timeseries(measured: pd.DataFrame, simulated: pd.DataFrame) -> dict:
    """Mean absolute difference of running / waiting requests and KV usage between the two series over the
    buckets both cover, and the mean of each (a quick read of whether queues build the same way)."""
    j = measured.merge(simulated, on="t", how="inner", suffixes=("_meas", "_sim"))
    out = {"num_buckets": int(len(j))}
    for c in ("running", "waiting", "kv_cache_pct", "gen_throughput", "prompt_throughput"):
        if c in measured and c in simulated and len(j):
            a, b = j[f"{c}_meas"].to_numpy(float), j[f"{c}_sim"].to_numpy(float)
            out[c] = {"measured_mean": float(a.mean()), "simulated_mean": float(b.mean()),
                      "mean_abs_diff": float(np.abs(a - b).mean())}
    return out


# The whole-run figures compared: key in report["run"], label, unit, key in the simulated summary.json.
RUN_FIGURES = (("duration_s", "duration", "s", "duration_s"),
               ("request_throughput", "request throughput", "req/s", "request_throughput"),
               ("output_throughput", "output throughput", "tok/s", "output_token_throughput"))
NOT_MEASURED = "not in the measured file"


def compare_run(measured_run: dict | None, summary: dict) -> dict:
    """Duration (s, first arrival to last token), request throughput (req/s) and output throughput (tok/s) of the
    whole run, measured vs simulated.

    Args:
        measured_run: the measured file's figures (``load_measured(...).attrs["run"]``; None entries unknown).
        summary: the simulated run's summary (summary.json: ``duration_s``, ``request_throughput``,
            ``output_token_throughput``).

    Returns:
        {key: {"measured": float | None, "simulated": float, "error_pct": float | None}} for each of
        :data:`RUN_FIGURES`; ``measured`` None (and no error) when the measured file does not give it.
    """
    measured_run = measured_run or {}
    out = {}
    for key, _, _, sim_key in RUN_FIGURES:
        mv, sv = measured_run.get(key), summary.get(sim_key)
        err = (sv - mv) / mv * 100 if mv and sv is not None else None
        out[key] = {"measured": mv, "simulated": sv, "error_pct": err}
    return out


def run_rows(report: dict) -> list[tuple[str, str, str, str]]:
    """(label, measured, simulated, error) text of the whole-run figures, for the console and validation.md; a
    figure the measured file lacks reads :data:`NOT_MEASURED`, never None."""
    rows = []
    for key, label, unit, _ in RUN_FIGURES:
        r = (report.get("run") or {}).get(key)
        if r is None or r.get("simulated") is None:
            continue
        fmt = {"s": "{:.1f}", "req/s": "{:.2f}", "tok/s": "{:.0f}"}[unit]
        meas = NOT_MEASURED if r["measured"] is None else f"{fmt.format(r['measured'])} {unit}"
        err = "–" if r["error_pct"] is None else f"{r['error_pct']:+.1f}"
        rows.append((label, meas, f"{fmt.format(r['simulated'])} {unit}", err))
    return rows


def kv_capacity_line(kv: dict) -> str:
    """One sentence on the KV blocks: simulated with, derived, measured; an unknown figure is said in words."""
    derived = kv.get("derived")
    measured = kv.get("measured")
    if measured is None:
        measured = "not recorded (no meta.json block count beside the measured file; validation.num_gpu_blocks unset)"
    return (f"KV capacity: simulated with {kv.get('used')} blocks; derived from first principles "
            f"{derived if derived is not None else 'not derived for this run'}; measured {measured}.")


def write_validation(report: dict, out_dir: Path) -> None:
    """Write validation.json (statistics) and validation_requests.csv (per-request measured vs simulated)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in report.items() if k not in ("per_request", "timeseries_frames")}
    (out_dir / "validation.json").write_text(json.dumps(data, indent=2, default=float))
    report["per_request"].to_csv(out_dir / "validation_requests.csv", index=False)
    frames = report.get("timeseries_frames")
    if frames is not None:
        meas, sim = frames
        meas.merge(sim, on="t", how="outer", suffixes=("_meas", "_sim")).sort_values("t").to_csv(
            out_dir / "validation_timeseries.csv", index=False)


def plot_validation(report: dict, out_dir: Path, slo=None) -> list[str]:
    """Per-request error CDFs, measured vs simulated latency CDFs (with the experiment's SLO bounds, ``slo``, as
    vertical lines), time series and the time breakdown; returns the PNG file names."""
    plt = pyplot()

    files = []
    j = report["per_request"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for k, m in enumerate(("ttft", "tpot", "e2el")):
        ax = axes[0, k]
        for i, (col, lab) in enumerate(((f"{m}_meas", "measured"), (f"{m}_sim", "simulated"))):
            v = np.sort(j[col].dropna().to_numpy() * 1000)
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=lab, **series_style(i))
        draw_slo(ax, slo, m)
        ax.locator_params(axis="x", nbins=6)  # six-digit millisecond labels would run together
        ax.set_xlabel(f"{m.upper()} (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{m.upper()}: measured vs simulated", fontsize=10)
        ax.legend()
        ax.grid(alpha=0.3)
        ax = axes[1, k]
        e = np.sort(j[f"{m}_error_pct"].replace([np.inf, -np.inf], np.nan).dropna().to_numpy())
        if len(e):
            ax.plot(e, np.arange(1, len(e) + 1) / len(e))
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_xlabel(f"per-request {m.upper()} error (%)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{m.upper()}: (simulated - measured) / measured", fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "validation_latency.png", dpi=110)
    plt.close(fig)
    files.append("validation_latency.png")

    frames = report.get("timeseries_frames")
    if frames is not None:
        meas, sim = frames
        cols = [c for c in ("running", "waiting", "kv_cache_pct", "gen_throughput", "prompt_throughput") if c in meas]
        fig, axes = plt.subplots(len(cols), 1, figsize=(11, 2.4 * len(cols)), sharex=True)
        for ax, c in zip(np.atleast_1d(axes), cols):
            ax.plot(meas["t"], meas[c], label="measured", **series_style(0))
            ax.plot(sim["t"], sim[c], label="simulated", alpha=0.8, **series_style(1))
            ax.set_ylabel(_TIMESERIES_LABELS[c])
            ax.set_title(f"{_TIMESERIES_LABELS[c]}, 1-s buckets", fontsize=10)
            ax.grid(alpha=0.3)
        np.atleast_1d(axes)[0].legend()
        np.atleast_1d(axes)[-1].set_xlabel("time (s)")
        fig.tight_layout()
        fig.savefig(out_dir / "validation_timeseries.png", dpi=110)
        plt.close(fig)
        files.append("validation_timeseries.png")

    bd = report.get("time_breakdown")
    if bd:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        names = list(bd["share"].keys())
        ax.barh(names, [bd["share"][n] * 100 for n in names])
        ax.set_xlabel("share of simulated busy time (%)")
        ax.set_title("Where the simulated GPU time goes", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / "validation_breakdown.png", dpi=110)
        plt.close(fig)
        files.append("validation_breakdown.png")
    return files


def validation_markdown(name: str, report: dict, files: list[str]) -> str:
    """validation.md: the error table, per-request errors, KV capacity, time-series and breakdown summaries."""
    lines = [f"# Validation: {name}", "",
             f"{report['num_compared']} requests compared ({report['num_measured']} measured, "
             f"{report['num_simulated_finished']} finished in the simulation).", "",
             "| metric | measured (ms) | simulated (ms) | error |", "|---|---:|---:|---:|"]
    for m in ("ttft", "tpot", "e2el"):
        for s in STATS:
            r = report["metrics"][m][s]
            lines.append(f"| {m.upper()} {s} | {r['measured'] * 1000:.1f} | {r['simulated'] * 1000:.1f} | "
                         f"{r['error_pct']:+.1f} % |")
    rows = run_rows(report)
    if rows:
        lines += ["", "The whole run (duration: first arrival to last token):", "",
                  "| figure | measured | simulated | error |", "|---|---:|---:|---:|"]
        lines += [f"| {label} | {m} | {sim} | {err if err == '–' else err + ' %'} |" for label, m, sim, err in rows]
    lines += ["", "Per-request relative error (%): signed mean, median and p90 of |error|", "",
              "| metric | mean | abs p50 | abs p90 |", "|---|---:|---:|---:|"]
    for m, r in report["per_request_error_pct"].items():
        if r["mean"] is not None:
            lines.append(f"| {m.upper()} | {r['mean']:+.1f} | {r['abs_p50']:.1f} | {r['abs_p90']:.1f} |")
    kv = report.get("kv_capacity")
    if kv:
        lines += ["", kv_capacity_line(kv)]
    ts = report.get("timeseries")
    if ts:
        lines += ["", "Time series (1-s buckets; mean measured / mean simulated / mean |difference|):", ""]
        for c, r in ts.items():
            if isinstance(r, dict) and c in ("running", "waiting", "kv_cache_pct", "gen_throughput",
                                             "prompt_throughput"):
                lines.append(f"- {c}: {r['measured_mean']:.1f} / {r['simulated_mean']:.1f} / {r['mean_abs_diff']:.1f}")
    bd = report.get("time_breakdown")
    if bd:
        lines += ["", "Where the simulated busy time goes:", ""]
        lines += [f"- {k}: {v * 100:.1f} %" for k, v in bd["share"].items()]
    lines.append("")
    lines += [f"![{f}]({f})" for f in files]
    return "\n".join(lines) + "\n"


def run_validation(exp, out_dir: Path, simulate_fn, plots: bool = True) -> dict:
    """Simulate ``exp`` (with per-step cost breakdowns), write its normal report, compare it with the measured
    run named in ``exp.validation`` and write validation.json / .md / CSVs / plots into ``out_dir``.

    Everything is written into a temporary sibling folder that replaces ``out_dir`` in one rename at the end
    (lab/report/output_folder.py ``atomic_dir``): ``out_dir`` is the earlier complete folder or the new one.

    Args:
        exp: the experiment (must have a ``validation`` section).
        simulate_fn: ``exp -> SimResult`` (the CLI passes one with a progress bar).

    Raises:
        ValidationError: a measured file is missing or malformed.
        lab.report.output_folder.OutputDirError: ``out_dir`` is a file or a folder that is not an output folder
            (checked before simulating).
    """
    v = exp.validation
    measured_path = exp.path(v.measured, "validation.measured")
    measured = load_measured(measured_path, v.format)
    ts_path = exp.path(v.timeseries, "validation.timeseries") if v.timeseries else None
    if ts_path is None and v.format == "llmservingsim" and (measured_path.parent / "timeseries.csv").is_file():
        ts_path = measured_path.parent / "timeseries.csv"
    ts_meas = load_timeseries(ts_path) if ts_path else None
    check_out_dir(out_dir)
    result = simulate_fn(exp)
    with atomic_dir(out_dir) as tmp:
        return _compare_and_write(exp, result, measured, measured_path, ts_meas, tmp, plots)


def _compare_and_write(exp, result, measured: pd.DataFrame, measured_path: Path, ts_meas: pd.DataFrame | None,
                       out_dir: Path, plots: bool) -> dict:
    """run_validation after the run: the run's report, the comparison, its files and plots into ``out_dir``."""
    v = exp.validation
    summary = write_report(result, out_dir, plots=plots, atomic=False)
    sim_requests = requests_frame(result.requests)
    report = compare(measured, sim_requests)
    report["run"] = compare_run(measured.attrs.get("run"), summary)
    dep = result.deployment
    report["kv_capacity"] = {
        "used": dep.num_gpu_blocks,
        "derived": dep.derived_kv_capacity.num_gpu_blocks if dep.derived_kv_capacity else None,
        "measured": v.num_gpu_blocks or (load_measured_blocks(measured_path) if v.format == "llmservingsim" else None),
    }
    if ts_meas is not None:
        ts_sim = simulated_timeseries(steps_frame(result), sim_requests)
        report["timeseries"] = compare_timeseries(ts_meas, ts_sim)
        report["timeseries_frames"] = (ts_meas, ts_sim)
    totals: dict[str, float] = {}
    for inst in result.instances:
        for k, col in inst.breakdown.items():
            totals[k] = totals.get(k, 0.0) + float(np.sum(np.frombuffer(col, dtype=float)))
    if totals:
        busy = sum(inst.busy_time for inst in result.instances)
        model_total = sum(totals.values())
        totals["cpu_overhead_and_padding"] = max(0.0, busy - model_total)
        s = sum(totals.values())
        report["time_breakdown"] = {"seconds": totals, "share": {k: val / s for k, val in totals.items()}}
    write_validation(report, out_dir)
    files = plot_validation(report, out_dir, exp.slo) if plots else []
    (out_dir / "validation.md").write_text(validation_markdown(exp.name, report, files))
    return report
