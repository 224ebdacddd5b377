"""Self-contained HTML reports: ``report.html`` per run, ``sweep.html`` per sweep (issue 14).

One file each, no server, no network: the data is one inlined JSON object and the charts are drawn by a small
inlined script of our own (lab/report/html_js.py), so the page holds no URL of any kind.

``report.html``: the headline table (counts, throughput, offered load, TTFT / TPOT / ITL / E2EL / queue time
mean, p50, p90, p99, goodput), latency CDFs, throughput / running + waiting / KV usage over time, and a timeline of
a deterministic sample of requests (:func:`timeline_sample`). Without plots (``--no-plots``, ``output.plots:
false``, the runs of a comparison or sweep) it holds the tables only.

``sweep.html``: one chart per metric against the first axis, one line per combination of the other axes, with the
95 % confidence band of ``sweep_summary.csv`` and the SLO threshold as a dashed line where the base experiment sets
one; the per-point table below.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:  # imported where used: a report without charts is written without pandas
    import pandas as pd

from lab.report.html_js import CSS, JS

# Requests in a run report's timeline, and the most points one chart line gets (CDFs and time series are
# resampled to it; the tables keep every number).
TIMELINE_REQUESTS = 40
MAX_POINTS = 600


# ---------------------------------------------------------------- page frame

def _page(title: str, body: list[str], data: dict) -> str:
    """A whole HTML document: ``body`` fragments, ``data`` inlined as JSON ('</' escaped so it cannot end the
    script element), the CSS and the chart script."""
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>", f"<style>{CSS}</style></head><body>", *body,
        f'<script type="application/json" id="servelab-data">{blob}</script>', f"<script>{JS}</script>",
        "</body></html>", ""])


def _num(v: Any) -> float | None:
    """A JSON-safe number: None for None, NaN and infinities."""
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _cell(v: Any, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    """A numeric table cell: the formatted value, with the raw value in ``data-v`` for sorting; '–' for none."""
    x = _num(v)
    if x is None:
        return '<td data-v="">–</td>'
    return f'<td data-v="{x * scale!r}">{fmt.format(x * scale)}</td>'


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], sortable: bool = False, left: int = 0) -> str:
    """An HTML table; ``rows`` are lists of ready ``<td>`` strings; the first ``left`` columns align left."""
    th = "".join(f'<th{" class=l" if i < left else ""}>{html.escape(h)}</th>' for i, h in enumerate(head))
    body = "".join(f"<tr>{''.join(r)}</tr>" for r in rows)
    cls = ' class="sortable"' if sortable else ""
    return f'<div class="scroll"><table{cls}><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>'


def _text(v: Any) -> str:
    return f'<td class="l">{html.escape(str(v))}</td>'


def _figure(kind: str, key: str, caption: str) -> str:
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure>{cap}<div class="{kind}" data-{kind}="{key}"></div></figure>'


# ---------------------------------------------------------------- run report

def write_run_html(out_dir: Path, summary: dict, requests: pd.DataFrame, events: pd.DataFrame | None,
                   series: pd.DataFrame | None, itl=None, plots: bool = True) -> Path:
    """Write ``out_dir/report.html`` for one run and return its path.

    Args:
        out_dir: the run's folder; ``steps.parquet`` in it is read (only the steps inside the timeline's time
            window) to place the prefill steps.
        summary: the run's summary (lab/report/run_summary.py ``collect``; times in seconds).
        requests: one row per request (lab/report/metrics.py ``requests_frame``).
        events: lifecycle events (``events_frame``: request_id, instance, time, event, detail); empty or None when
            the run did not record them (the timeline then shows queued / prefill / decode from the request rows).
        series: per-second buckets (``bucket_series``: output_tokens, prefill_tokens per second, num_running,
            num_waiting, kv_usage 0..1); None = no step log (``output.step_log: summary``): no time-series charts.
        itl: the run's ITL samples (lab/core/samples.py ``WeightedSamples``, seconds) for the ITL CDF.
        plots: draw the charts; False = the tables only (``--no-plots``, comparison and sweep runs).

    Raises:
        OSError: the file cannot be written.
    """
    body = _run_tables(summary)
    data: dict = {"charts": {}, "gantts": {}}
    if not plots:
        body.append('<p class="note">Plots were not drawn (<code>--no-plots</code>, <code>output.plots: false</code>, '
                    'or a run of a comparison or sweep); the tables above are complete.</p>')
    else:
        body += _run_plots(summary, requests, events, series, itl, out_dir / "steps.parquet", data)
    body.append('<p class="note">Tables beside this file: <code>requests.parquet</code> / <code>requests.csv</code>, '
                '<code>steps.parquet</code>, <code>events.parquet</code>, <code>summary.json</code>.</p>')
    path = out_dir / "report.html"
    path.write_text(_page(f"servelab run: {summary.get('experiment', '')}", body, data), encoding="utf-8")
    return path


def _deployment_line(summary: dict) -> str:
    d = summary.get("deployment", {})
    pre = d.get("preemption", {})
    return (f"{d.get('model')} on {d.get('gpu')} × TP{d.get('tensor_parallel_size')}, {d.get('num_instances')} "
            f"instance(s), router {d.get('router')}; scheduler {d.get('scheduler')} ({d.get('queue')}), cost model "
            f"{d.get('cost_model')}; {d.get('num_gpu_blocks')} KV blocks of {d.get('block_size')} tokens, "
            f"max_num_batched_tokens {d.get('max_num_batched_tokens')}, max_num_seqs {d.get('max_num_seqs')}; "
            f"preemption {pre.get('mode')} (victim {pre.get('victim')}).")


def _run_tables(s: dict) -> list[str]:
    """Heading, deployment, headline table, latency table, engine line and per-instance table."""
    out = [f"<h1>{html.escape(str(s.get('experiment', '')))}</h1>",
           f'<p class="note">{html.escape(_deployment_line(s))}</p>', "<h2>Headline</h2>"]
    head = ["requests", "finished", "rejected", "unfinished", "duration (s)", "req/s", "output tok/s", "total tok/s",
            "preemptions", "swaps"]
    row = [_cell(s["num_requests"], "{:.0f}"), _cell(s["num_finished"], "{:.0f}"), _cell(s["num_rejected"], "{:.0f}"),
           _cell(s["num_unfinished"], "{:.0f}"), _cell(s["duration_s"], "{:.1f}"), _cell(s["request_throughput"]),
           _cell(s["output_token_throughput"], "{:.0f}"), _cell(s["total_token_throughput"], "{:.0f}"),
           _cell(s["num_preemptions"], "{:.0f}"), _cell(s.get("num_swaps", 0), "{:.0f}")]
    if "goodput" in s:
        head += ["goodput (req/s)", "SLO attainment (%)"]
        row += [_cell(s["goodput"]), _cell(s["slo_attainment"], "{:.1f}", 100)]
    out.append(_table(head, [row]))
    out.append(f'<p class="note">Offered load: {html.escape(str(s.get("offered_load", "")))}.'
               + (f" SLO: {html.escape(_slo_words(s.get('slo') or {}))}." if s.get("slo") else "") + "</p>")
    lat = []
    for m, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"), ("queue_time", "queue time")):
        st = s.get(m) or {}
        lat.append([_text(name)] + [_cell(st.get(k), "{:.1f}", 1000) for k in ("mean", "median", "p90", "p99")])
    out.append(_table(["metric (ms)", "mean", "p50", "p90", "p99"], lat, left=1))
    eng = s.get("engine")
    if eng:
        out.append(f'<p class="note">Engine: {eng["num_steps"]} steps, mean batch {eng["mean_batch_size"]:.1f} '
                   f'requests / {eng["mean_scheduled_tokens"]:.0f} tokens, peak KV usage '
                   f'{eng["peak_kv_usage"] * 100:.1f} %, peak running {eng["peak_running"]}, peak waiting '
                   f'{eng["peak_waiting"]}.</p>')
    inst = s.get("instances") or []
    if len(inst) > 1:
        keys = ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99", "e2el_mean", "e2el_p99")
        rows = [[_cell(r["instance"], "{:.0f}"), _text(r.get("pool") or "-"), _cell(r["num_requests"], "{:.0f}"),
                 _cell(r["num_finished"], "{:.0f}")] + [_cell(r[k], "{:.1f}", 1000) for k in keys]
                + [_cell(r["output_token_throughput"], "{:.0f}"), _cell(r["num_preemptions"], "{:.0f}"),
                   _cell(r["busy_fraction"], "{:.1f}", 100)] for r in inst]
        out += ["<h2>Per instance</h2>", _table(
            ["instance", "pool", "requests", "finished", "TTFT mean (ms)", "TTFT p99", "TPOT mean", "TPOT p99",
             "E2EL mean", "E2EL p99", "output tok/s", "preemptions", "busy %"], rows, sortable=True)]
    sim = s.get("simulation") or {}
    if sim:
        out.append(f'<p class="note">Simulated {sim["sim_end_s"]:.1f} s in {sim["wall_time_s"]:.2f} s wall time '
                   f'(seed {sim["seed"]}).</p>')
    return out


def _slo_words(slo: dict) -> str:
    parts = [f"{k[:-2].upper()} ≤ {v * 1000:g} ms" for k, v in slo.items() if v is not None]
    return ", ".join(parts) if parts else "none"


def _run_plots(summary: dict, req: pd.DataFrame, events: pd.DataFrame | None, series: pd.DataFrame | None, itl,
               steps_path: Path, data: dict) -> list[str]:
    """The chart sections; their specs go into ``data``."""
    out = ["<h2>Latency CDFs</h2>", '<div class="grid4">']
    fin = req[req["status"] == "finished"]
    slo = summary.get("slo") or {}
    for key, name, vals, weights in (("ttft", "TTFT", fin["ttft"], None), ("tpot", "TPOT", fin["tpot"], None),
                                     ("itl", "ITL", *(_itl_arrays(itl))), ("e2el", "E2EL", fin["e2el"], None)):
        x, y = cdf_points(np.asarray(vals, dtype=float), weights)
        limit = slo.get(f"{key}_s")
        wide = bool(len(x) and x[0] > 0 and x[-1] / x[0] > 50)  # a log x axis where the values span decades
        data["charts"][f"cdf_{key}"] = {
            "xlabel": f"{name} (ms{', log scale' if wide else ''})", "xlog": wide,
            "ylabel": "fraction of requests" if key != "itl" else "fraction of token gaps",
            "ymin": 0, "ymax": 1, "series": [{"name": f"{name} CDF", "x": _round(x * 1000), "y": _round(y, 4)}],
            **({} if limit is None else {"vlines": [{"x": limit * 1000, "label": f"SLO {limit * 1000:g} ms"}]})}
        caption = f"{name} of finished requests" if key != "itl" else "ITL (every token gap)"
        out.append(_figure("chart", f"cdf_{key}", caption))
    out.append("</div>")
    out += ["<h2>Over time</h2>", '<p class="note">Per second of simulated time, all instances (running and waiting '
            'summed, KV usage averaged over instances).</p>', '<div class="grid">']
    if series is None or not len(series):
        out += ['<p class="note">No per-step log was kept (<code>output.step_log: summary</code>), so there are no '
                'time series.</p>', "</div>"]
        return out + _timeline_section(summary, req, events, steps_path, data)
    ser = _resample(series)
    t = _round(ser.index.to_numpy(dtype=float))
    data["charts"]["ts_tokens"] = {"xlabel": "time (s)", "ylabel": "tokens/s", "series": [
        {"name": "output tokens/s", "x": t, "y": _round(ser["output_tokens"])},
        {"name": "prefill tokens/s", "x": t, "y": _round(ser["prefill_tokens"])}]}
    data["charts"]["ts_queue"] = {"xlabel": "time (s)", "ylabel": "requests", "series": [
        {"name": "running", "x": t, "y": _round(ser["num_running"])},
        {"name": "waiting", "x": t, "y": _round(ser["num_waiting"])}]}
    data["charts"]["ts_kv"] = {"xlabel": "time (s)", "ylabel": "KV usage (%)", "ymin": 0, "series": [
        {"name": "KV usage", "x": t, "y": _round(ser["kv_usage"] * 100)}]}
    out += [_figure("chart", "ts_tokens", "Throughput"), _figure("chart", "ts_queue", "Running and waiting requests"),
            _figure("chart", "ts_kv", "KV cache usage"), "</div>"]
    return out + _timeline_section(summary, req, events, steps_path, data)


def _timeline_section(summary: dict, req: pd.DataFrame, events: pd.DataFrame | None, steps_path: Path,
                      data: dict) -> list[str]:
    rows, t0, t1, note = request_timeline(req, events, steps_path, summary)
    data["gantts"]["timeline"] = {"rows": rows, "t0": t0, "t1": t1}
    return ["<h2>Request timeline</h2>", f'<p class="note">{html.escape(note)}</p>', _figure("gantt", "timeline", "")]


def _itl_arrays(itl) -> tuple[np.ndarray, np.ndarray | None]:
    if itl is None:
        return np.array([], float), None
    v, w = itl.arrays()
    return np.asarray(v, float), np.asarray(w, float)


def _round(a, digits: int = 6) -> list:
    """A float array as a JSON list rounded to ``digits`` significant decimals; NaN -> None."""
    arr = np.asarray(a, dtype=float)
    out = np.round(arr, digits).tolist()
    return [None if not math.isfinite(v) else v for v in out]


def cdf_points(values: np.ndarray, weights: np.ndarray | None = None,
               max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(x, F(x)) of the empirical CDF of ``values`` (non-finite ones dropped), each value weighted by ``weights``
    (default 1), thinned to at most ``max_points`` points evenly spaced in probability (first and last kept).
    Returns two empty arrays for no values."""
    keep = np.isfinite(values)
    v = values[keep]
    w = np.ones_like(v) if weights is None else np.asarray(weights, float)[keep]
    if not len(v):
        return np.array([]), np.array([])
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(w[order])
    frac = cum / cum[-1]
    if len(v) > max_points:
        idx = np.unique(np.searchsorted(frac, np.linspace(0, 1, max_points), side="left").clip(0, len(v) - 1))
        v, frac = v[idx], frac[idx]
    return v, frac


def _resample(series: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Per-second buckets averaged into at most ``max_points`` rows."""
    if not len(series):
        return series
    step = max(1, math.ceil(len(series) / max_points))
    if step == 1:
        return series
    idx = series.index.to_numpy(dtype=float)
    span = (idx.max() - idx.min()) / max_points
    return series.groupby(np.floor((idx - idx.min()) / span) * span + idx.min()).mean()


# ---------------------------------------------------------------- request timeline

def timeline_sample(req: pd.DataFrame, n: int = TIMELINE_REQUESTS) -> pd.DataFrame:
    """The requests the timeline shows: ``n`` consecutive requests in arrival order, centred on the middle
    preempted request (by arrival) when any was preempted, else on the middle of the run, so that neighbours that
    competed for the same batches are seen together. Deterministic: a function of the requests table alone."""
    ordered = req.sort_values(["arrival_time", "request_id"], kind="stable").reset_index(drop=True)
    if len(ordered) <= n:
        return ordered
    pre = np.flatnonzero(ordered["num_preemptions"].to_numpy() > 0)
    centre = int(pre[len(pre) // 2]) if len(pre) else len(ordered) // 2
    start = min(max(0, centre - n // 2), len(ordered) - n)
    return ordered.iloc[start:start + n]


# event -> the phase that follows it (None = the request's life here ends)
_NEXT_PHASE = {"arrived": "queued", "received": "queued", "first_token": "decode", "resumed": "decode",
               "preempted": "preempted", "handed_off": "transfer", "finished": None, "rejected": None}


def request_timeline(req: pd.DataFrame, events: pd.DataFrame | None, steps_path: Path,
                     summary: dict) -> tuple[list[dict], float, float, str]:
    """The timeline rows of :func:`timeline_sample`'s requests, its time window (s) and a note on what it shows.

    Each row: ``label``, ``segs`` [[start, end, kind, detail]] with kind frontend | queued | prefill | decode |
    preempted | transfer | chunk, and ``marks`` [[time, kind, detail]] with kind swap_out | swap_in | recompute | rejected.
    Phases come from the lifecycle events (arrived -> queued, scheduled -> prefill, first_token -> decode,
    preempted -> gap, resumed -> decode, handed_off -> transfer, received -> queued); without events, from the
    request rows (arrival, first scheduled, first token, finish). A ``chunk`` is an engine step of the request's
    instance that ran prefill tokens inside the request's prefill phase (read from ``steps.parquet``)."""
    sample = timeline_sample(req)
    if not len(sample):
        return [], 0.0, 1.0, "No requests."
    end_of_run = float(summary.get("simulation", {}).get("sim_end_s") or 0.0)
    ids = set(sample["request_id"].tolist())
    have_events = events is not None and len(events) > 0
    if have_events:
        ev = events[events["request_id"].isin(ids)].sort_values(["request_id", "time"], kind="stable")
        per_req = {rid: grp for rid, grp in ev.groupby("request_id", sort=False)}
    rows = []
    for r in sample.itertuples(index=False):
        label = f"req {r.request_id}" + (f" @{r.instance}" if summary.get("deployment", {}).get("num_instances", 1) > 1
                                         else "")
        grp = per_req.get(r.request_id) if have_events else None
        if grp is not None:
            segs, marks, instances = _phases_from_events(grp, end_of_run)
        else:
            segs, marks = _phases_from_row(r, end_of_run)
            instances = [int(r.instance)] * len(segs)
        engine_in = r.engine_arrival_time  # (NaN: no front end)
        if engine_in == engine_in and segs and engine_in > r.arrival_time:
            segs.insert(0, [float(r.arrival_time), float(engine_in), "frontend",
                            f"API server {r.arrival_time:.4f}–{engine_in:.4f} s "
                            f"({(engine_in - r.arrival_time) * 1000:.1f} ms before the engine's queue)"])
            instances.insert(0, instances[0])
        rows.append({"label": label, "segs": segs, "marks": marks, "instances": instances})
    t0 = float(sample["arrival_time"].min())
    t1 = max([s[1] for row in rows for s in row["segs"]] + [m[0] for row in rows for m in row["marks"]] + [t0 + 1e-3])
    _add_chunks(rows, steps_path, t0, t1)
    for row in rows:
        del row["instances"]
    note = (f"{len(rows)} consecutive requests by arrival (of {len(req)}), centred on "
            + ("the middle preempted request" if (req["num_preemptions"] > 0).any() else "the middle of the run")
            + ". Light orange: in the API server before the engine's queue (the front end); grey: queued; blue: prefill, dark ticks below it: the instance's engine steps that ran prefill "
              "tokens during it (its chunks when it was the only prefill in flight; the step log does not say how "
              "many of a step's prefill tokens were this request's); green: decode; red: preempted; purple: "
              "hand-off between pools. Diamonds: swap-out / swap-in; brown triangles: resumed by recompute (the "
              "recompute itself is not separated from the decode that follows); black triangles: rejected. "
              "Hover a bar for its detail.")
    if not have_events:
        note += (" Lifecycle events were not recorded (simulation.record_events), so preemptions and swaps are not "
                 "shown: queued / prefill / decode come from the request rows.")
    return rows, t0, float(t1), note


def _phases_from_events(grp: pd.DataFrame, end_of_run: float) -> tuple[list, list, list]:
    """(segments, marks, the instance of each segment) of one request from its events, in time order."""
    segs: list = []
    marks: list = []
    instances: list = []
    phase, since, detail, where = None, 0.0, "", 0
    seen_first = False
    for t, kind, det, inst in zip(grp["time"].to_numpy(dtype=float), grp["event"], grp["detail"], grp["instance"]):
        if kind == "scheduled":
            nxt = "decode" if seen_first else "prefill"
        elif kind in _NEXT_PHASE:
            nxt = _NEXT_PHASE[kind]
        else:  # e.g. "verified" (speculative decoding): no phase change
            continue
        if kind == "first_token":
            seen_first = True
        if phase is not None and t > since:
            segs.append([since, float(t), phase, f"{phase} {since:.4f}–{t:.4f} s ({(t - since) * 1000:.1f} ms)"
                         + (f"; {detail}" if detail else "")])
            instances.append(where)
        if kind == "preempted":
            marks.append([float(t), "swap_out" if str(det).startswith("swap-out") else "recompute_out", str(det)])
        elif kind == "resumed":
            marks.append([float(t), "swap_in" if str(det).startswith("swap-in") else "recompute", str(det)])
        elif kind == "rejected":
            marks.append([float(t), "rejected", str(det) or "rejected"])
        phase, since, where = nxt, float(t), int(inst)
        detail = str(det) if kind in ("scheduled", "preempted", "received") else ""
    if phase is not None and end_of_run > since:  # unfinished at the end of the run
        segs.append([since, end_of_run, phase, f"{phase} from {since:.4f} s, unfinished at the end of the run"])
        instances.append(where)
    marks = [m for m in marks if m[1] != "recompute_out"]  # the red gap shows a recompute preemption
    return segs, marks, instances


def _phases_from_row(r, end_of_run: float) -> tuple[list, list]:
    times = [("queued", r.arrival_time), ("prefill", r.first_scheduled_time), ("decode", r.first_token_time),
             (None, r.finish_time)]
    known = [(k, float(t)) for k, t in times if t is not None and math.isfinite(float(t))]
    segs = [[a, b, k, f"{k} {a:.4f}–{b:.4f} s ({(b - a) * 1000:.1f} ms)"]
            for (k, a), (_, b) in zip(known, known[1:]) if k is not None and b > a]
    if r.status == "rejected":
        return segs, [[float(r.arrival_time), "rejected", str(r.reason) or "rejected"]]
    if r.status != "finished" and known and known[-1][0] is not None and end_of_run > known[-1][1]:
        segs.append([known[-1][1], end_of_run, known[-1][0], "unfinished at the end of the run"])
    return segs, []


def _add_chunks(rows: list[dict], steps_path: Path, t0: float, t1: float) -> None:
    """Add a ``chunk`` segment for every step with prefill tokens on the instance of a row's prefill phase inside
    that phase (only the steps of [t0, t1] are read)."""
    if not steps_path.is_file() or not any(s[2] == "prefill" for row in rows for s in row["segs"]):
        return
    import pyarrow.parquet as pq  # noqa: PLC0415

    cols = ["instance", "start", "duration", "prefill_tokens"]
    st = pq.read_table(steps_path, columns=cols, filters=[("start", ">=", t0 - 1e-9), ("start", "<=", t1),
                                                          ("prefill_tokens", ">", 0)]).to_pandas()
    by_inst = {i: (g["start"].to_numpy(float), (g["start"] + g["duration"]).to_numpy(float),
                   g["prefill_tokens"].to_numpy(np.int64)) for i, g in st.groupby("instance")}
    eps = 1e-9
    for row in rows:
        chunks = []
        for (a, b, kind, _), inst in zip(row["segs"], row["instances"]):
            arrays = by_inst.get(inst)
            if kind != "prefill" or arrays is None:
                continue
            start, end, tokens = arrays
            inside = np.flatnonzero((end > a + eps) & (start < b - eps))
            chunks += [[float(max(start[i], a)), float(min(end[i], b)), "chunk",
                        f"engine step {start[i]:.4f}–{end[i]:.4f} s with {tokens[i]} prefill tokens (all requests)"]
                       for i in inside]
        row["segs"] += chunks


# ---------------------------------------------------------------- sweep report

# metric column (lab/report/sweep.py METRICS, already in the unit of its name) -> (label, SLO field whose
# threshold applies: seconds in the experiment, drawn in ms on the ms charts)
_LATENCY_LABELS = {"ttft": ("TTFT", "ttft_s"), "tpot": ("TPOT", "tpot_s"), "itl": ("ITL", None),
                   "e2el": ("E2EL", "e2el_s"), "queue_time": ("queue time", None)}
_SWEEP_METRICS = {
    "request_throughput_req_s": ("request throughput (req/s)", None),
    "output_throughput_tok_s": ("output throughput (tok/s)", None),
    "total_token_throughput_tok_s": ("total token throughput (tok/s)", None),
    "request_goodput_req_s": ("goodput (req/s)", None), "slo_attainment_pct": ("SLO attainment (%)", None),
    **{f"{m}_{s}_ms": (f"{label} {s} (ms)", slo) for m, (label, slo) in _LATENCY_LABELS.items()
       for s in ("mean", "p50", "p90", "p95", "p99")},
    "num_preemptions": ("preemptions", None), "num_finished": ("finished requests", None),
}


def write_sweep_html(out_dir: Path, name: str, axes: dict[str, list], summary: pd.DataFrame,
                     metrics: Sequence[str], slo: dict | None = None, num_runs: int | None = None,
                     table_metrics: Sequence[str] | None = None) -> Path:
    """Write ``out_dir/sweep.html`` from a sweep's per-point table and return its path.

    Args:
        out_dir: the sweep folder.
        name: the sweep's name (the page title).
        axes: axis field path -> its values, in the sweep file's order; the first is the x axis of every chart,
            each combination of the others one line.
        summary: ``sweep_summary.csv``'s table: one row per point with the axes as columns and, per metric,
            ``<metric>`` (the mean over the replications) and ``<metric>_ci95`` (95 % half-width; empty with one
            replication), in the unit the metric's name ends with (``_ms``, ``_req_s``, ``_pct``, ...).
        metrics: the metric names to chart, in order.
        table_metrics: the metric names of the table of points (default: ``metrics``).
        slo: the base experiment's ``slo`` mapping (``ttft_s``, ``tpot_s``, ``e2el_s``; seconds); each set field is
            drawn as a dashed line on the charts of its metric (not where an axis sweeps that field).
        num_runs: runs in the sweep (for the heading).

    Raises:
        OSError: the file cannot be written.
    """
    import pandas as pd  # noqa: PLC0415
    names = list(axes)
    x_axis, others = names[0], names[1:]
    summary = summary.copy()
    for a in names:  # a list- or mapping-valued axis is shown (and grouped) by its text
        if any(isinstance(v, (list, dict)) for v in axes[a]):
            summary[a] = summary[a].map(str)
            axes = {**axes, a: [str(v) for v in axes[a]]}
    slo = {k: v for k, v in (slo or {}).items() if v is not None and f"slo.{k}" not in names}
    x_vals = list(dict.fromkeys(axes[x_axis]))
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x_vals)
    if numeric:
        x_vals.sort()  # lines run left to right whatever order the sweep file lists the values in
    data: dict = {"charts": {}, "gantts": {}}
    body = [f"<h1>Sweep {html.escape(name)}</h1>",
            f'<p class="note">{len(summary)} points' + (f", {num_runs} runs" if num_runs is not None else "")
            + ". Axes: " + html.escape("; ".join(f"{a} = {', '.join(map(str, v))}" for a, v in axes.items()))
            + ". Lines: the mean over the replications at each point; bands: its 95 % confidence interval "
              "(Student t, sweep_summary.csv's _ci95; none with one replication)"
            + (f"; dashed red line: the SLO ({html.escape(_slo_words(slo))})" if slo else "") + ".</p>",
            '<div class="grid">']
    one_line = not others or summary[x_axis].nunique() == len(summary)  # zip mode: every axis moves together
    groups = [((), summary)] if one_line else list(summary.groupby(others, sort=False))
    if one_line:
        others = []
    for m in metrics:
        label, slo_key = _SWEEP_METRICS.get(m, (m, None))
        scale = 1.0  # the columns are in the unit of their names already
        series = []
        for key, grp in groups:
            key = key if isinstance(key, tuple) else (key,)
            grp = grp.set_index(x_axis).reindex([v for v in x_vals if v in set(grp[x_axis])])
            xs = grp.index.tolist() if numeric else [x_vals.index(v) for v in grp.index]
            mean = pd.to_numeric(grp[m], errors="coerce").to_numpy(float) * scale
            ci_col = grp[f"{m}_ci95"] if f"{m}_ci95" in grp else pd.Series(np.nan, index=grp.index)
            ci = pd.to_numeric(ci_col, errors="coerce").to_numpy(float) * scale
            s = {"name": ", ".join(f"{a}={v}" for a, v in zip(others, key)) or "mean", "x": [float(x) for x in xs],
                 "y": _round(mean), "points": True}
            if np.isfinite(ci).any():
                s["lo"], s["hi"] = _round(mean - ci), _round(mean + ci)
            series.append(s)
        spec = {"xlabel": x_axis, "ylabel": label, "series": series, "height": 260, "xpad": 0.04}
        if not numeric:
            spec["xcats"] = [str(v) for v in x_vals]
        if slo_key in slo:
            limit = slo[slo_key]
            spec["hlines"] = [{"y": limit * 1000.0, "label": f"SLO {slo_key[:-2].upper()} {limit * 1000:g} ms"}]
        data["charts"][f"sweep_{m}"] = spec
        body.append(_figure("chart", f"sweep_{m}", label))
    body.append("</div>")
    body += ["<h2>Points</h2>", '<p class="note">mean ± 95 % half-width over the replications; click a column to '
             'sort. The same numbers are in sweep_summary.csv (in the units of its column names).</p>',
             _sweep_table(summary, names, table_metrics if table_metrics is not None else metrics)]
    path = out_dir / "sweep.html"
    path.write_text(_page(f"servelab sweep: {name}", body, data), encoding="utf-8")
    return path


def _sweep_table(summary: pd.DataFrame, axes: list[str], metrics: Sequence[str]) -> str:
    counts = [c for c in ("replications", "failed") if c in summary]
    head = ["point", *axes, *counts] + [_SWEEP_METRICS.get(m, (m,))[0] for m in metrics]
    scale = 1.0  # the columns are in the unit of their names already
    rows = []
    for _, r in summary.iterrows():
        cells = ([_cell(r["point"], "{:.0f}")] + [_text(r[a]) for a in axes]
                 + [_cell(r[c], "{:.0f}") for c in counts])
        for m in metrics:
            mean, ci = _num(r.get(m)), _num(r.get(f"{m}_ci95"))
            if mean is None:
                cells.append('<td data-v="">–</td>')
                continue
            text = f"{mean * scale:.4g}" + (f" ± {ci * scale:.2g}" if ci is not None else "")
            cells.append(f'<td data-v="{mean * scale!r}">{html.escape(text)}</td>')
        rows.append(cells)
    return _table(head, rows, sortable=True, left=1 + len(axes))
