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
from operator import attrgetter
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np

from lab.cluster.frontend import received_time, sent_time
from lab.core.request import Request, RequestStatus

if TYPE_CHECKING:
    import pandas as pd

# A table of requests as columns: a :func:`requests_frame` DataFrame, or the mapping :func:`request_columns` returns
# (numpy arrays for numbers, lists of str for text). The summary functions below read either, so a run's outputs
# are computed without importing pandas (0.3 s of a short run's start-up).
Columns = Mapping[str, "np.ndarray | list"]

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


def request_columns(requests: Sequence[Request]) -> dict[str, np.ndarray | list]:
    """The requests table (:func:`requests_frame`) as columns, in :data:`REQUEST_COLUMNS` order, then ``session_id``
    (sessions), ``warmup`` (closed-loop warm-up) and :data:`PD_COLUMNS` (disaggregation) when the run has them.

    Numbers are numpy arrays (float64 seconds with NaN where a time does not exist yet, int64 counts); text columns
    (``request_id``, ``status``, ``reason``, ``pool``, ``served_by``) are lists of str. The values are those of
    :func:`request_latencies` and :func:`engine_latencies`, computed by the same float operations, column by column.
    """
    nan = float("nan")
    finished = RequestStatus.FINISHED

    def attr(name: str) -> list:
        return list(map(attrgetter(name), requests))

    status = [_STATUS.get(s, "unfinished") for s in attr("status")]
    fin_mask = np.array([s == "finished" for s in status], dtype=bool)

    def floats(values) -> np.ndarray:
        return np.array(values, dtype=float) if len(values) else np.zeros(0)  # None -> NaN

    def ints(values) -> np.ndarray:
        return np.array(values, dtype=np.int64) if len(values) else np.zeros(0, np.int64)

    engine_arrival = floats(attr("arrival_time"))
    sent = floats([sent_time(r) for r in requests])
    stream = floats(attr("stream_s"))
    first_sched = floats(attr("first_scheduled_time"))
    first_token = floats(attr("first_token_time"))
    finish = np.where(fin_mask, floats(attr("finish_time")), nan)
    max_tokens = ints(attr("max_tokens"))
    # client view (request_latencies): receipt = engine time + the request's streaming time
    ttft = (first_token + stream) - sent
    received = np.where(fin_mask, finish + stream, nan)
    e2el = received - sent
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(fin_mask & (max_tokens > 1), (e2el - ttft) / (max_tokens - 1), nan)
    cols: dict[str, np.ndarray | list] = {
        "request_id": list(map(str, attr("request_id"))),
        "instance": ints(attr("instance_id")),
        "priority": ints(attr("priority")),
        "arrival_time": sent,
        "first_scheduled_time": first_sched,
        "first_token_time": first_token,
        "finish_time": finish,
        "prompt_tokens": ints(attr("prompt_len")),
        "output_tokens": max_tokens,
        "generated_tokens": ints(attr("num_output_tokens")),
        "ttft": ttft, "tpot": tpot, "e2el": e2el,
        "queue_time": first_sched - engine_arrival,
        "num_preemptions": ints(attr("num_preemptions")),
        "prefix_hit_tokens": ints(attr("prefix_hit_tokens")),
        "status": status,
        "reason": list(map(str, attr("reason"))),
        "pool": list(map(str, attr("pool"))),
        "served_by": [",".join(map(str, s)) for s in attr("served_by")],
        "num_drafts": ints(attr("num_drafts")),
        "num_draft_tokens": ints(attr("num_draft_tokens")),
        "num_accepted_tokens": ints(attr("num_accepted_tokens")),
        "engine_arrival_time": engine_arrival,
        "engine_ttft": first_token - engine_arrival,
        "engine_e2el": finish - engine_arrival,
        "received_time": received,
    }
    if any(r.session_id is not None for r in requests):
        cols["session_id"] = _inferred([r.session_id or "" for r in requests])
    if any(r.warmup for r in requests):
        cols["warmup"] = np.array([bool(r.warmup) for r in requests], dtype=bool)
    if any(r.remote is not None for r in requests):
        pd_rows = [ttft_decomposition(r) for r in requests]
        for i, col in enumerate(PD_COLUMNS):
            cols[col] = _inferred([row[i] for row in pd_rows])
    return cols


def _inferred(values: list) -> np.ndarray | list:
    """A column of Python values typed as pandas types a list: all str -> the list; all bool -> bool; ints ->
    int64; numbers with NaN or None -> float64; anything else an object array (written through pandas)."""
    if all(type(v) is str for v in values):
        return values
    if all(v is None for v in values):
        return np.array(values, dtype=object)
    if all(type(v) is bool or type(v) is np.bool_ for v in values):
        return np.array(values, dtype=bool)
    if all(type(v) is int for v in values):
        return np.array(values, dtype=np.int64)
    if all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
        return np.array(values, dtype=float)
    return np.array(values, dtype=object)


def requests_frame(requests: Sequence[Request]) -> "pd.DataFrame":
    """One row per request (seconds for times; NaN where a time does not exist yet); TTFT, TPOT and E2EL are
    :func:`request_latencies` (client view), ``engine_ttft`` and ``engine_e2el`` :func:`engine_latencies`.
    ``arrival_time`` is the client's send, ``engine_arrival_time`` the engine's queue entry, ``first_token_time``
    and ``finish_time`` the engine's emissions, ``received_time`` the client's receipt of the last token.
    (:func:`request_columns` as a DataFrame.)"""
    return columns_frame(request_columns(requests))


def columns_frame(cols: Columns) -> "pd.DataFrame":
    """A :func:`request_columns` mapping as the :func:`requests_frame` DataFrame (text columns as pandas str)."""
    import pandas as pd  # noqa: PLC0415 - a run's own outputs are written without pandas

    df = pd.DataFrame({k: (pd.Series(v, dtype=object) if isinstance(v, list) and not v else v)
                       for k, v in cols.items()}, columns=list(cols))
    for c in ("request_id", "reason", "pool", "served_by"):
        df[c] = df[c].astype(str)
    return df


def take(cols: Columns, rows: np.ndarray) -> dict[str, np.ndarray | list]:
    """The rows ``rows`` (a boolean mask or positions) of a column mapping (a DataFrame: its columns), in order."""
    idx = np.flatnonzero(rows) if np.asarray(rows).dtype == bool else np.asarray(rows, dtype=np.int64)
    out: dict[str, np.ndarray | list] = {}
    for k in _names(cols):
        v = cols[k]
        if isinstance(v, list):
            out[k] = [v[i] for i in idx.tolist()]
        else:
            out[k] = np.asarray(v)[idx]
    return out


def _names(cols: Columns) -> list[str]:
    return list(cols.columns) if hasattr(cols, "columns") else list(cols)


def _num(cols: Columns, name: str) -> np.ndarray:
    """Column ``name`` as a float64 array (NaN for missing values)."""
    return np.asarray(cols[name], dtype=float)


def _text(cols: Columns, name: str) -> np.ndarray:
    return np.asarray(cols[name], dtype=object) if not isinstance(cols[name], list) else np.array(cols[name])


def _len(cols: Columns) -> int:
    names = _names(cols)
    return len(cols[names[0]]) if names else 0


# Prefill/decode disaggregation: where a request's TTFT goes (seconds; they sum to TTFT), and the bytes it moved.
PD_COLUMNS = ["p_instance", "d_instance", "pd_p_queue_s", "pd_prefill_s", "pd_handover_s", "pd_kv_wait_s",
              "pd_transfer_s", "pd_d_queue_s", "pd_first_decode_s", "kv_transfer_bytes", "kv_drafter_bytes",
              "kv_recomputed"]
_PD_MARKS = ("arrival", "p_scheduled", "p_done", "d_arrived", "transfer_start", "transfer_end", "d_scheduled")


def ttft_decomposition(r: Request) -> tuple:
    """A disaggregated request's TTFT in parts (seconds), :data:`PD_COLUMNS` order: queue on P, prefill on P,
    handover (P's output processing and the proxy hop), wait on D for blocks and the next schedule, the KV read,
    queue on D after the read, and D's first step (recompute of the last prompt token and its first token). Each
    part is the gap between two successive marks, so they sum to first token - arrival at the engine (the engine's
    TTFT; the client's adds the front end's time in and out); NaN where a mark was never reached (not handed over,
    or unfinished)."""
    nan = float("nan")
    remote = r.remote
    if remote is None:
        return (nan, nan) + (nan,) * 7 + (0.0, 0.0, False)
    t = remote.times
    marks = [t.get(k) for k in _PD_MARKS] + [r.first_token_time]
    if remote.first_token == "from_prefill":  # the first token was P's: TTFT is P's queue and prefill
        marks[3:] = [None] * (len(marks) - 4) + [r.first_token_time]
        marks[2] = r.first_token_time
    elif remote.first_token == "with_kv":  # D emits P's token when the read ends: no D queue, no first decode
        marks[6] = marks[7] = r.first_token_time
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


def summarize(df: Columns, itl, steps: "pd.DataFrame | None" = None, horizon: float | None = None,
              slo: dict[str, float | None] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES, engine: dict | None = None) -> dict:
    """The run summary: counts, duration, throughputs, latency statistics, engine statistics and SLO goodput.

    Args:
        df: the requests table: :func:`requests_frame`'s DataFrame or :func:`request_columns`' mapping.
        itl: all inter-token latency samples (seconds): an array or a :class:`lab.samples.WeightedSamples`.
        steps: the per-step table (for engine statistics), optional.
        engine: engine statistics already computed (:func:`engine_stats`), instead of ``steps``.
        horizon: the run's fixed horizon, if any (then duration = horizon − first arrival).
        slo: optional ``{"ttft_s": .., "tpot_s": .., "e2el_s": ..}``; None entries are not checked.

    Latencies, duration (first send to the last token received) and goodput are the client's view; with
    ``engine_ttft`` / ``engine_e2el`` columns, ``engine_latency`` gives the engine's view of TTFT and E2EL (TPOT and
    ITL are the same in both: the front-end adds one constant time to every output). ``arrival_window_s`` (first
    to last send, seconds), ``arrival_window_request_throughput`` (requests received in full within that window,
    per second; None for a window of 0 s) and ``arrival_window_in_flight`` (requests sent and not yet received in
    full at the last send: about rate x E2EL for a server that keeps up, growing for one that does not) say what
    the server did while requests were still arriving; the duration-based throughputs include the drain after the
    last arrival, as ``vllm bench serve`` counts them.
    """
    names = _names(df)
    status = _text(df, "status")
    n = len(status)
    fin = status == "finished"
    nfin = int(fin.sum())
    arrival = _num(df, "arrival_time")
    first_arrival = float(arrival.min()) if n else 0.0
    last = "received_time" if "received_time" in names else "finish_time"
    done_at = _num(df, last)
    if horizon is not None:
        duration = horizon - first_arrival
    else:
        duration = (float(done_at[fin].max()) - first_arrival) if nfin else 0.0
    dur = duration if duration > 0 else float("nan")
    out_tokens = int(np.asarray(df["output_tokens"])[fin].sum())
    in_tokens = int(np.asarray(df["prompt_tokens"])[fin].sum())
    ttft, tpot, e2el = (_num(df, c)[fin] for c in ("ttft", "tpot", "e2el"))
    s: dict = {
        "num_requests": n,
        "num_finished": nfin,
        "num_rejected": int((status == "rejected").sum()),
        "num_unfinished": int((status == "unfinished").sum()),
        "duration_s": duration,
        "request_throughput": nfin / dur if nfin else 0.0,
        "output_token_throughput": out_tokens / dur if nfin else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / dur if nfin else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft": describe(ttft, percentiles),
        "tpot": describe(tpot, percentiles),
        "itl": itl.describe(percentiles) if hasattr(itl, "describe") else describe(itl, percentiles),
        "e2el": describe(e2el, percentiles),
        "queue_time": describe(_num(df, "queue_time")[fin], percentiles),
        "num_preemptions": int(np.asarray(df["num_preemptions"]).sum()),
        "prefix_hit_tokens": int(np.asarray(df["prefix_hit_tokens"]).sum()),
    }
    if n:
        last_arrival = float(arrival.max())
        window = last_arrival - first_arrival
        within = fin & (done_at <= last_arrival)
        s["arrival_window_s"] = window
        s["arrival_window_request_throughput"] = int(within.sum()) / window if window > 0 else None
        s["arrival_window_in_flight"] = int(((status != "rejected") & ~within).sum())
    if "engine_ttft" in names:
        s["engine_latency"] = {"ttft": describe(_num(df, "engine_ttft")[fin], percentiles),
                               "e2el": describe(_num(df, "engine_e2el")[fin], percentiles)}
    eng = engine if engine is not None else (engine_stats([steps]) if steps is not None else None)
    if eng:
        s["engine"] = eng
    if slo and any(v is not None for v in slo.values()):
        ok = np.ones(nfin, dtype=bool)
        for key, vals in (("ttft_s", ttft), ("e2el_s", e2el)):
            if slo.get(key) is not None:
                ok &= vals <= slo[key]  # (NaN: not met)
        if slo.get("tpot_s") is not None:
            ok &= np.where(np.isnan(tpot), 0.0, tpot) <= slo["tpot_s"]
        good = int(ok.sum())
        s["slo"] = {k: v for k, v in slo.items() if v is not None}
        s["goodput"] = good / dur if nfin else 0.0
        s["slo_attainment"] = good / n if n else 0.0
    return s


# bench_result.json's per-request lists (vllm bench serve writes them only with --save-detailed; servelab adds
# engine_ttfts): left out of the default file, as vLLM leaves them out
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors", "engine_ttfts")


def vllm_bench_result(df: Columns, summary: dict, itl, percentiles: Sequence[float] = (99,),
                      max_concurrency: int | None = None, request_rate: float | None = None,
                      model_id: str = "", num_warmups: int = 0,
                      metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el"), detailed: bool = False,
                      itls: Sequence[Sequence[float]] | None = None) -> dict:
    """The run as ``vllm bench serve --save-result`` writes it (benchmarks/serve.py): the same keys and units
    (milliseconds for latencies, seconds for ``duration``, ``ttfts`` and ``itls``), so dashboards and
    ``servelab validate`` read a simulated run like a measured one.

    Without ``detailed`` the result holds the aggregates only (counts, ``duration``, throughputs, ``failed``,
    ``mean_<m>_ms`` ...), as vLLM writes it without ``--save-detailed``; with it, also the per-request lists
    (:data:`PER_REQUEST_KEYS`): ``input_lens``, ``output_lens``, ``ttfts``, ``itls`` (each finished request's list
    of gaps between the outputs that carried its tokens, seconds: ``itls``, which the caller recovers from the
    step log, lab/report/token_gaps.py; without it, the request's TPOT repeated ``output - 1`` times) and
    ``errors`` (the reason of every request that did not finish). Rejected and unfinished requests are
    ``failed``. ``df``: the measured requests (warm-up excluded), a DataFrame or :func:`request_columns` mapping;
    ``summary``: :func:`summarize` of them. ``metrics`` and ``percentiles`` are vLLM's ``--percentile-metrics`` and
    ``--metric-percentiles``: as in vLLM, a metric not named gets no statistics keys. TTFT, TPOT, ITL and E2EL are
    the client's view, as vLLM measures them; servelab adds the engine's view (``engine_ttfts`` per request,
    ``mean_engine_ttft_ms``, ``p99_engine_e2el_ms``, ...: queue entry to token emitted, no front-end time) where
    ``df`` has the ``engine_ttft`` / ``engine_e2el`` columns."""
    names = _names(df)
    status = _text(df, "status")
    fin = status == "finished"
    fin_idx = np.flatnonzero(fin)
    out_lens = np.asarray(df["output_tokens"])[fin_idx]
    out: dict = {
        "model_id": model_id, "num_prompts": int(len(status)), "num_warmups": num_warmups,
        "request_rate": request_rate if request_rate else "inf",
        "max_concurrency": max_concurrency, "duration": summary["duration_s"], "completed": int(len(fin_idx)),
        "failed": int(len(status) - len(fin_idx)),
        "total_input_tokens": summary["total_input_tokens"], "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"], "output_throughput": summary["output_token_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
        "request_goodput": summary.get("goodput"),
    }
    if detailed:
        ttft_s = _num(df, "ttft")[fin_idx]
        if itls is None:  # no recovered gaps: the request's TPOT repeated (TTFT + sum(ITL) = E2EL still holds)
            tpot_s = _num(df, "tpot")[fin_idx]
            itls = [[float(t)] * (int(k) - 1) if k > 1 else [] for t, k in zip(tpot_s.tolist(), out_lens.tolist())]
        reasons = np.asarray(df["reason"], dtype=object)[~fin] if len(status) else []
        out.update({
            "input_lens": [int(x) for x in np.asarray(df["prompt_tokens"])[fin_idx].tolist()],
            "output_lens": [int(x) for x in out_lens.tolist()],
            "ttfts": ttft_s.tolist(),
            "itls": itls,
            "errors": [str(r) for r in reasons],
        })
    ms = 1e3
    for m in (m for m in ("ttft", "tpot", "e2el") if m in metrics):
        vals = _num(df, m)[fin_idx]
        vals = vals[~np.isnan(vals)] * ms
        if m == "tpot":
            vals = np.concatenate([vals, np.zeros(int((out_lens <= 1).sum()))])  # vLLM: TPOT 0
        _put_stats(out, m, vals, percentiles)
    if "engine_ttft" in names:  # servelab's addition: the engine's view (queue entry -> token emitted)
        if detailed:
            out["engine_ttfts"] = _num(df, "engine_ttft")[fin_idx].tolist()
        for m in (m for m in ("engine_ttft", "engine_e2el") if m.removeprefix("engine_") in metrics):
            vals = _num(df, m)[fin_idx]
            _put_stats(out, m, vals[~np.isnan(vals)] * ms, percentiles)
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
