"""Per-request table and run summary, defined as shared/specs/metrics.md (``vllm bench serve`` definitions).

TTFT = first token time − arrival; E2EL = last token time − arrival; TPOT = (E2EL − TTFT)/(output_tokens − 1),
undefined for one-token outputs (left out of TPOT statistics, counted as 0 against a TPOT SLO); ITL = every gap
between consecutive step outputs of a request, pooled over requests. Throughputs divide by duration = last finish −
first arrival (or the horizon when the run has one). Percentiles are numpy's linear interpolation, as ``vllm bench
serve`` computes them.

These are the client's view (``vllm bench serve`` measures at the client): with an API server in front of the engine
(``frontend``, lab/cluster/frontend.py) ``arrival_time`` is the client's send, and TTFT and E2EL run to the client's
receipt of the first and last token; ``engine_ttft`` and ``engine_e2el`` run from the engine's queue entry
(``engine_arrival_time``) to the engine's emission of those tokens, as vLLM's own request metrics do
(v1/metrics/stats.py). With no front-end time the two views are the same numbers. ``queue_time`` is engine-side.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from lab.cluster.frontend import received_time, sent_time
from lab.core.request import Request, RequestStatus

REQUEST_COLUMNS = [
    "request_id", "instance", "priority", "arrival_time", "first_scheduled_time", "first_token_time", "finish_time",
    "prompt_tokens", "output_tokens", "generated_tokens", "ttft", "tpot", "e2el", "queue_time", "num_preemptions",
    "prefix_hit_tokens", "status", "reason", "pool", "served_by", "num_drafts", "num_draft_tokens",
    "num_accepted_tokens", "engine_arrival_time", "engine_ttft", "engine_e2el", "received_time",
]

DEFAULT_PERCENTILES = (50, 90, 95, 99)

_STATUS = {RequestStatus.FINISHED: "finished", RequestStatus.REJECTED: "rejected"}


def request_latencies(r: Request) -> tuple[float, float, float]:
    """(TTFT, TPOT, E2EL) of one request in seconds as the client sees them (the module docstring): the one
    definition that the requests table, the summary and the comparison report all use. TTFT = the client's receipt
    of the first token − its send; E2EL the same for the last token; without a front-end, engine times − arrival.

    TTFT is NaN until the first token; E2EL and TPOT are NaN unless the request finished; TPOT is NaN for a
    one-token output (``max_tokens`` = 1).
    """
    nan = float("nan")
    arr = sent_time(r)
    ft = r.first_token_time
    fin = r.finish_time if r.status == RequestStatus.FINISHED else None
    ttft = received_time(r, ft) - arr if ft is not None else nan
    e2el = received_time(r, fin) - arr if fin is not None else nan
    tpot = (e2el - ttft) / (r.max_tokens - 1) if fin is not None and r.max_tokens > 1 else nan
    return ttft, tpot, e2el


def engine_latencies(r: Request) -> tuple[float, float]:
    """(engine TTFT, engine E2EL) of one request in seconds: from its entry into the engine's waiting queue
    (``arrival_time``) to the step outputs carrying its first and last token, with no front-end time (vLLM's
    v1/metrics/stats.py definitions). NaN where the token does not exist yet or the request did not finish."""
    nan = float("nan")
    arr = r.arrival_time
    ft = r.first_token_time
    fin = r.finish_time if r.status == RequestStatus.FINISHED else None
    return (ft - arr if ft is not None else nan, fin - arr if fin is not None else nan)


def latency_samples(requests: Iterable[Request]) -> dict[str, np.ndarray]:
    """TTFT, TPOT and E2EL samples (seconds) of the finished requests among ``requests``, in their order.

    Returns:
        ``{"ttft": (F,), "tpot": (T,), "e2el": (F,)}`` float arrays over the F finished requests, with
        :func:`request_latencies`' values; ``tpot`` leaves out one-token outputs (TPOT undefined), so T <= F.
    """
    lat = [request_latencies(r) for r in requests if r.status == RequestStatus.FINISHED]
    return {"ttft": np.array([x[0] for x in lat], dtype=float),
            "tpot": np.array([x[1] for x in lat if not math.isnan(x[1])], dtype=float),
            "e2el": np.array([x[2] for x in lat], dtype=float)}


def requests_frame(requests: Sequence[Request]) -> pd.DataFrame:
    """One row per request (seconds for times; NaN where a time does not exist yet); TTFT, TPOT and E2EL are
    :func:`request_latencies` (client view), ``engine_ttft`` and ``engine_e2el`` :func:`engine_latencies`.
    ``arrival_time`` is the client's send, ``engine_arrival_time`` the engine's queue entry, ``first_token_time``
    and ``finish_time`` the engine's emissions, ``received_time`` the client's receipt of the last token."""
    nan = float("nan")
    rows = []
    for r in requests:
        arr = r.arrival_time
        ft = r.first_token_time
        fin = r.finish_time if r.status == RequestStatus.FINISHED else None
        ttft, tpot, e2el = request_latencies(r)
        engine_ttft, engine_e2el = engine_latencies(r)
        rows.append((
            r.request_id, r.instance_id, r.priority, sent_time(r),
            r.first_scheduled_time if r.first_scheduled_time is not None else nan,
            ft if ft is not None else nan, fin if fin is not None else nan,
            r.prompt_len, r.max_tokens, r.num_output_tokens, ttft, tpot, e2el,
            (r.first_scheduled_time - arr) if r.first_scheduled_time is not None else nan,
            r.num_preemptions, r.prefix_hit_tokens, _STATUS.get(r.status, "unfinished"), r.reason, r.pool,
            ",".join(map(str, r.served_by)), r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens,
            arr, engine_ttft, engine_e2el, received_time(r, fin) if fin is not None else nan,
        ))
    df = pd.DataFrame.from_records(rows, columns=REQUEST_COLUMNS)
    if any(r.session_id is not None for r in requests):
        df["session_id"] = [r.session_id or "" for r in requests]
    if any(r.warmup for r in requests):
        df["warmup"] = [r.warmup for r in requests]
    if any(r.remote is not None for r in requests):
        pd_rows = [ttft_decomposition(r) for r in requests]
        for i, col in enumerate(PD_COLUMNS):
            df[col] = [row[i] for row in pd_rows]
    df["request_id"] = df["request_id"].astype(str)
    df["reason"] = df["reason"].astype(str)
    df["pool"] = df["pool"].astype(str)
    df["served_by"] = df["served_by"].astype(str)
    return df


# Prefill/decode disaggregation: where a request's TTFT goes (seconds; they sum to TTFT), and the bytes it moved.
PD_COLUMNS = ["p_instance", "d_instance", "pd_p_queue_s", "pd_prefill_s", "pd_handover_s", "pd_kv_wait_s",
              "pd_transfer_s", "pd_d_queue_s", "pd_first_decode_s", "kv_transfer_bytes", "kv_drafter_bytes",
              "kv_recomputed"]
_PD_MARKS = ("arrival", "p_scheduled", "p_done", "d_arrived", "transfer_start", "transfer_end", "d_scheduled")


def ttft_decomposition(r: Request) -> tuple:
    """A disaggregated request's TTFT in parts (seconds), :data:`PD_COLUMNS` order: queue on P, prefill on P,
    handover (P's output processing and the proxy hop), wait on D for blocks and the next schedule, the KV read,
    queue on D after the read, and D's first step (recompute of the last prompt token and its first token). Each
    part is the gap between two successive marks, so they sum to first token - arrival; NaN where a mark was never
    reached (not handed over, or unfinished)."""
    nan = float("nan")
    remote = r.remote
    if remote is None:
        return (nan, nan) + (nan,) * 7 + (0.0, 0.0, False)
    t = remote.times
    marks = [t.get(k) for k in _PD_MARKS] + [r.first_token_time]
    parts = [b - a if a is not None and b is not None else nan for a, b in zip(marks, marks[1:])]
    return (remote.source.instance_id, remote.d_instance, *parts, remote.bytes, remote.drafter_bytes, remote.expired)


def speculative_stats(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                      accepted_per_pos: Sequence[int]) -> dict:
    """vLLM's spec-decode figures (v1/spec_decode/metrics.py): acceptance rate = accepted / draft tokens, mean
    acceptance length = 1 + accepted / drafts (tokens per verification, the bonus token included), per-position
    acceptance = verifications whose draft i was accepted / drafts (unconditional, as vLLM logs it)."""
    return {
        "num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted_tokens,
        "acceptance_rate": num_accepted_tokens / num_draft_tokens if num_draft_tokens else None,
        "mean_acceptance_length": 1 + num_accepted_tokens / num_drafts if num_drafts else None,
        "per_position_acceptance": [n / num_drafts if num_drafts else None for n in accepted_per_pos],
    }


def describe(values: Iterable[float] | np.ndarray, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
             weights: np.ndarray | None = None) -> dict[str, float | int | None]:
    """mean, std, median and the given percentiles of the finite values (None when there are none)."""
    a = np.asarray(values, dtype=float)
    a = a[np.isfinite(a)]
    out: dict[str, float | int | None] = {"count": int(a.size)}
    if a.size == 0:
        out.update({"mean": None, "median": None, "std": None, **{f"p{p:g}": None for p in percentiles}})
        return out
    out["mean"] = float(a.mean())
    out["median"] = float(np.median(a))
    out["std"] = float(a.std())
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def engine_stats(chunks) -> dict | None:
    """Engine statistics over the step log, given as an iterable of DataFrame chunks (streamed for long runs)."""
    n = 0
    batch = tokens = busy = kv_weighted = 0.0
    peak_kv = 0.0
    peak_running = peak_waiting = 0
    for st in chunks:
        if not len(st):
            continue
        n += len(st)
        batch += float(st["batch_size"].sum())
        tokens += float(st["scheduled_tokens"].sum())
        d = st["duration"]
        busy += float(d.sum())
        kv_weighted += float((st["kv_usage"] * d).sum())
        peak_kv = max(peak_kv, float(st["kv_usage"].max()))
        peak_running = max(peak_running, int(st["num_running"].max()))
        peak_waiting = max(peak_waiting, int(st["num_waiting"].max()))
    if not n:
        return None
    return {"num_steps": n, "mean_batch_size": batch / n, "mean_scheduled_tokens": tokens / n, "busy_time_s": busy,
            "peak_kv_usage": peak_kv, "mean_kv_usage": kv_weighted / busy if busy else 0.0,
            "peak_running": peak_running, "peak_waiting": peak_waiting}


def summarize(df: pd.DataFrame, itl, steps: pd.DataFrame | None = None, horizon: float | None = None,
              slo: dict[str, float | None] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES, engine: dict | None = None) -> dict:
    """The run summary: counts, duration, throughputs, latency statistics, engine statistics and SLO goodput.

    Args:
        df: :func:`requests_frame` output.
        itl: all inter-token latency samples (seconds): an array or a :class:`lab.samples.WeightedSamples`.
        steps: the per-step table (for engine statistics), optional.
        engine: engine statistics already computed (:func:`engine_stats`), instead of ``steps``.
        horizon: the run's fixed horizon, if any (then duration = horizon − first arrival).
        slo: optional ``{"ttft_s": .., "tpot_s": .., "e2el_s": ..}``; None entries are not checked.

    Latencies, duration (first send to the last token received) and goodput are the client's view; with
    ``engine_ttft`` / ``engine_e2el`` columns, ``engine_latency`` gives the engine's view of TTFT and E2EL (TPOT and
    ITL are the same in both: the front-end adds one constant time to every output).
    """
    fin = df[df["status"] == "finished"]
    n = len(df)
    first_arrival = float(df["arrival_time"].min()) if n else 0.0
    last = "received_time" if "received_time" in df.columns else "finish_time"
    if horizon is not None:
        duration = horizon - first_arrival
    else:
        duration = (float(fin[last].max()) - first_arrival) if len(fin) else 0.0
    dur = duration if duration > 0 else float("nan")
    out_tokens = int(fin["output_tokens"].sum())
    in_tokens = int(fin["prompt_tokens"].sum())
    s: dict = {
        "num_requests": n,
        "num_finished": int(len(fin)),
        "num_rejected": int((df["status"] == "rejected").sum()),
        "num_unfinished": int((df["status"] == "unfinished").sum()),
        "duration_s": duration,
        "request_throughput": len(fin) / dur if len(fin) else 0.0,
        "output_token_throughput": out_tokens / dur if len(fin) else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / dur if len(fin) else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft": describe(fin["ttft"], percentiles),
        "tpot": describe(fin["tpot"], percentiles),
        "itl": itl.describe(percentiles) if hasattr(itl, "describe") else describe(itl, percentiles),
        "e2el": describe(fin["e2el"], percentiles),
        "queue_time": describe(fin["queue_time"], percentiles),
        "num_preemptions": int(df["num_preemptions"].sum()),
        "prefix_hit_tokens": int(df["prefix_hit_tokens"].sum()),
    }
    if "engine_ttft" in df.columns:
        s["engine_latency"] = {"ttft": describe(fin["engine_ttft"], percentiles),
                               "e2el": describe(fin["engine_e2el"], percentiles)}
    eng = engine if engine is not None else (engine_stats([steps]) if steps is not None else None)
    if eng:
        s["engine"] = eng
    if slo and any(v is not None for v in slo.values()):
        ok = pd.Series(True, index=fin.index)
        for key, col in (("ttft_s", "ttft"), ("e2el_s", "e2el")):
            if slo.get(key) is not None:
                ok &= fin[col] <= slo[key]
        if slo.get("tpot_s") is not None:
            ok &= fin["tpot"].fillna(0.0) <= slo["tpot_s"]
        good = int(ok.sum())
        s["slo"] = {k: v for k, v in slo.items() if v is not None}
        s["goodput"] = good / dur if len(fin) else 0.0
        s["slo_attainment"] = good / n if n else 0.0
    return s


def vllm_bench_result(df: pd.DataFrame, summary: dict, itl, percentiles: Sequence[float] = (99,),
                      max_concurrency: int | None = None, request_rate: float | None = None,
                      model_id: str = "", num_warmups: int = 0,
                      metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el")) -> dict:
    """The run as ``vllm bench serve --save-result --save-detailed`` writes it (benchmarks/serve.py): the same
    keys and units (milliseconds for latencies, seconds for ``duration``, ``ttfts`` and ``itls``), so dashboards and
    ``servelab validate`` read a simulated run like a measured one.

    Per request, ``itls`` is the request's mean gap (its TPOT) repeated ``output - 1`` times: the simulator keeps
    the ITL distribution for the run (``mean_itl_ms`` etc. come from it), not per request, and the repeated gap
    keeps TTFT + Σ ITL = E2EL exactly. Rejected and unfinished requests are ``errors``. ``df``: the measured
    requests (warm-up excluded); ``summary``: :func:`summarize` of them. ``metrics`` and ``percentiles`` are vLLM's
    ``--percentile-metrics`` and ``--metric-percentiles``: as in vLLM, a metric not named gets no statistics keys.
    TTFT, TPOT, ITL and E2EL are the client's view, as vLLM measures them; servelab adds the engine's view
    (``engine_ttfts`` per request, ``mean_engine_ttft_ms``, ``p99_engine_e2el_ms``, ...: queue entry to token
    emitted, no front-end time) where ``df`` has the ``engine_ttft`` / ``engine_e2el`` columns."""
    fin = df[df["status"] == "finished"]
    out: dict = {
        "model_id": model_id, "num_prompts": int(len(df)), "num_warmups": num_warmups,
        "request_rate": request_rate if request_rate else "inf",
        "max_concurrency": max_concurrency, "duration": summary["duration_s"], "completed": int(len(fin)),
        "total_input_tokens": summary["total_input_tokens"], "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"], "output_throughput": summary["output_token_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
        "request_goodput": summary.get("goodput"),
        "input_lens": [int(x) for x in fin["prompt_tokens"]], "output_lens": [int(x) for x in fin["output_tokens"]],
        "ttfts": [float(x) for x in fin["ttft"]],
        "itls": [[float(t)] * (int(n) - 1) if n > 1 else [] for t, n in zip(fin["tpot"], fin["output_tokens"])],
        "errors": [str(r) for r in df.loc[df["status"] != "finished", "reason"]],
    }
    ms = 1e3
    for m in (m for m in ("ttft", "tpot", "e2el") if m in metrics):
        vals = fin[m].dropna().to_numpy(dtype=float) * ms
        if m == "tpot":
            vals = np.concatenate([vals, np.zeros(int((fin["output_tokens"] <= 1).sum()))])  # vLLM: TPOT 0
        _put_stats(out, m, vals, percentiles)
    if "engine_ttft" in fin.columns:  # servelab's addition: the engine's view (queue entry -> token emitted)
        out["engine_ttfts"] = [float(x) for x in fin["engine_ttft"]]
        for m in (m for m in ("engine_ttft", "engine_e2el") if m.removeprefix("engine_") in metrics):
            _put_stats(out, m, fin[m].dropna().to_numpy(dtype=float) * ms, percentiles)
    if "itl" not in metrics:
        return out
    d = itl.describe(list(percentiles)) if hasattr(itl, "describe") else describe(itl, percentiles)
    out.update({"mean_itl_ms": _ms(d["mean"]), "median_itl_ms": _ms(d["median"]), "std_itl_ms": _ms(d.get("std"))})
    for p in percentiles:
        out[f"p{p:g}_itl_ms"] = _ms(d.get(f"p{p:g}"))
    return out


def _ms(v) -> float | None:
    return None if v is None else float(v) * 1e3


def _put_stats(out: dict, metric: str, vals: np.ndarray, percentiles: Sequence[float]) -> None:
    """vLLM's mean/median/std/p<q> keys of one metric (values already in ms)."""
    have = len(vals) > 0
    out[f"mean_{metric}_ms"] = float(vals.mean()) if have else None
    out[f"median_{metric}_ms"] = float(np.median(vals)) if have else None
    out[f"std_{metric}_ms"] = float(vals.std()) if have else None
    for p in percentiles:
        out[f"p{p:g}_{metric}_ms"] = float(np.percentile(vals, p)) if have else None
