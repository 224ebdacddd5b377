"""A run's step log and lifecycle events as tables (numpy columns, or DataFrames where asked for), and the
per-second time series the plots and report.html draw."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lab.core.step_log import STEP_COLUMNS, StepTotals
from lab.experiment.simulation import SimResult

if TYPE_CHECKING:
    import pandas as pd

# A run's own outputs (tables, summary, bench_result.json, report.md, report.html without plots) are built from
# numpy columns and written with pyarrow and the csv module, without pandas: importing it was 0.3 s of a short
# run's whole process. pandas is imported where a DataFrame is asked for (plots, compare, validate, the *_frame
# functions below).


_INT_COLS = ("instance", "scheduled_tokens", "prefill_tokens", "decode_requests", "spec_tokens", "batch_size",
             "kv_blocks_used", "num_running", "num_waiting", "num_preempted", "output_tokens")


def _typed(df: "pd.DataFrame") -> "pd.DataFrame":
    for c in _INT_COLS:
        df[c] = df[c].astype(np.int64)
    return df


def iter_steps(result: SimResult):
    """The step log of every instance as DataFrame chunks (instance by instance; bounded memory)."""
    for inst in result.instances:
        for chunk in inst.steps.frames():
            yield _typed(chunk)


def num_steps(result: SimResult) -> int:
    return sum(len(i.steps) for i in result.instances)


def step_totals(result: SimResult) -> StepTotals:
    """The step-log totals of every instance (the summary's engine statistics; the same whether the log was kept
    whole, spilled or summarized: lab/core/step_log.py ``StepTotals``)."""
    out = StepTotals()
    for inst in result.instances:
        out.merge(inst.steps.totals())
    return out


def steps_summarized(result: SimResult) -> bool:
    """Whether the run kept no per-step rows (``output.step_log: summary``): no steps.parquet, no time series."""
    return any(inst.steps.summary for inst in result.instances)


def steps_frame(result: SimResult) -> "pd.DataFrame":
    """One row per engine step of every instance, ordered by start time (the whole log in memory)."""
    import pandas as pd  # noqa: PLC0415

    frames = list(iter_steps(result))
    df = pd.concat(frames, ignore_index=True) if frames else _typed(pd.DataFrame(
        {c: np.array([], float) for c in STEP_COLUMNS}))
    return df.sort_values(["start", "instance"], kind="stable").reset_index(drop=True)


def steps_columns(result: SimResult) -> dict[str, np.ndarray]:
    """The step log of every instance held in memory (no spilled rows) as steps.parquet's columns
    (:data:`STEP_COLUMNS`; int64 counts, float64 seconds), ordered by start time then instance: the rows
    :func:`steps_frame` gives, without pandas."""
    parts = []
    for inst in result.instances:
        log = inst.steps
        cols = log.cols
        n = len(cols["start"])
        part = {"instance": np.full(n, float(inst.instance_id))}
        for c in STEP_COLUMNS[1:]:
            part[c] = cols["kv_blocks_used"] / log.usable_blocks if c == "kv_usage" else cols[c]
        parts.append(part)
    out = {c: (np.concatenate([p[c] for p in parts]) if parts else np.zeros(0)) for c in STEP_COLUMNS}
    for c in _INT_COLS:
        out[c] = out[c].astype(np.int64)
    order = np.lexsort((out["instance"], out["start"]))  # stable: by start, then instance
    if not (order == np.arange(len(order))).all():
        out = {c: v[order] for c, v in out.items()}
    return out


def events_columns(result: SimResult) -> dict[str, np.ndarray | list]:
    """The lifecycle events of every request (:func:`events_frame`) as columns: ``request_id`` (the request's id,
    as the run has it), ``instance`` (int64), ``time`` (float64, s), ``event`` and ``detail`` (lists of str)."""
    rid: list = []
    inst: list[int] = []
    flat: list[tuple] = []
    for r in result.requests:
        evs = r.events
        if not evs:
            continue
        served = r.served_by or [r.instance_id]
        n = len(evs)
        rid += [r.request_id] * n
        flat += evs
        if len(served) == 1:
            inst += [served[0]] * n
            continue
        hop = 0
        for e in evs:
            inst.append(served[hop])
            if e[1] == "handed_off" and hop + 1 < len(served):
                hop += 1  # what follows happens on the next instance that served it
    from operator import itemgetter  # noqa: PLC0415

    return {"request_id": rid, "instance": np.array(inst, dtype=np.int64),
            "time": np.array(list(map(itemgetter(0), flat)), dtype=float), "event": list(map(itemgetter(1), flat)),
            "detail": [e[2] if len(e) > 2 else "" for e in flat]}


def events_frame(result: SimResult) -> "pd.DataFrame":
    """One row per lifecycle event of every request (arrived, scheduled, preempted, resumed, first_token,
    finished, rejected), when the run recorded them: request_id, instance, time, event and detail (why: the
    preemption cause and mode, swap-in or recompute with its prefix hit, ...).

    The instance is where the event happened: a request's stays follow ``served_by``, and each stay but the last
    ends with its "handed_off" event, the last one its instance records (the next instance's first may be
    "received" or, when that instance can never hold the request, "rejected")."""
    import pandas as pd  # noqa: PLC0415

    cols = events_columns(result)
    return pd.DataFrame.from_records(list(zip(*cols.values())), columns=list(cols))


def bucket_series(chunks, bucket_s: float = 1.0) -> pd.DataFrame:
    """Per ``bucket_s`` bucket of step end times: output and prefill tokens per second, running and waiting
    requests (summed over instances, each at its last step in the bucket) and KV usage (mean over instances)."""
    import pandas as pd  # noqa: PLC0415

    parts = []
    for st in chunks:
        if not len(st):
            continue
        b = np.floor((st["start"] + st["duration"]) / bucket_s).astype(np.int64)
        g = st.assign(bucket=b).groupby(["instance", "bucket"], sort=False)
        parts.append(pd.DataFrame({"output_tokens": g["output_tokens"].sum(), "prefill_tokens": g["prefill_tokens"].sum(),
                                   "num_running": g["num_running"].last(), "num_waiting": g["num_waiting"].last(),
                                   "kv_usage": g["kv_usage"].last()}))
    if not parts:
        return pd.DataFrame(columns=["output_tokens", "prefill_tokens", "num_running", "num_waiting", "kv_usage"])
    per = pd.concat(parts).groupby(level=[0, 1], sort=False).agg(
        {"output_tokens": "sum", "prefill_tokens": "sum", "num_running": "last", "num_waiting": "last",
         "kv_usage": "last"})
    out = per.groupby(level=1).agg({"output_tokens": "sum", "prefill_tokens": "sum", "num_running": "sum",
                                    "num_waiting": "sum", "kv_usage": "mean"}).sort_index()
    out[["output_tokens", "prefill_tokens"]] /= bucket_s
    out.index = out.index * bucket_s
    return out
