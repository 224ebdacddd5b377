"""Write a run's outputs: requests.parquet/.csv, steps.parquet, events.parquet, summary.json, report.md and plots.

Everything a plot shows is also in a table.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np

from lab.core.step_log import STEP_COLUMNS, StepTotals
from lab.report.plots import draw_slo, pyplot, series_style
from lab.report.metrics import (columns_frame, request_columns, speculative_stats, summarize, take,
                                vllm_bench_result)
from lab.experiment.speculative import acceptance_rates
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


# Above this many steps the report streams the step log instead of loading it whole.
STREAM_STEPS_ABOVE = 2_000_000


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


def instances_table(req, result: SimResult, duration: float) -> list[dict]:
    """Per-instance metrics (issue #5): requests routed, finished, TTFT/TPOT/E2EL mean and p99 (s), output
    token throughput over the cluster's duration, preemptions, prefix-hit tokens, busy fraction, steps and
    swap (host-link) time, pool, and dummy steps (lock-stepped DP ranks with nothing to run). ``req``: the
    requests table (a DataFrame or :func:`lab.report.metrics.request_columns` mapping)."""
    rows = []
    dur = duration if duration > 0 else float("nan")
    dummy = {rank.instance_id: n for g in result.groups for rank, n in zip(g.ranks, g.num_dummy_steps)}
    # with hand-offs a request counts on every instance that served it (its latencies are end-to-end)
    served_elsewhere = any(len(q.served_by) > 1 for q in result.requests)
    instance = np.asarray(req["instance"])
    status = np.asarray(req["status"], dtype=object) if not isinstance(req["status"], list) else np.array(req["status"])
    names = list(req.columns) if hasattr(req, "columns") else list(req)
    measured = ~np.asarray(req["warmup"], dtype=bool) if "warmup" in names else np.ones(len(status), dtype=bool)
    finished = status == "finished"
    lat = {c: np.asarray(req[c], dtype=float) for c in ("ttft", "tpot", "e2el")}
    out_tokens = np.asarray(req["output_tokens"])
    preemptions = np.asarray(req["num_preemptions"])
    hits = np.asarray(req["prefix_hit_tokens"])
    for inst in result.instances:
        i = inst.instance_id
        here = (np.array([i in q.served_by for q in result.requests], dtype=bool) if served_elsewhere
                else instance == i)
        here &= measured  # closed-loop warm-up requests are not measured, here as in the run's totals
        fin = here & finished

        def stat(col: str, fn) -> float | None:
            v = lat[col][fin]
            v = v[np.isfinite(v)]
            return float(fn(v)) if len(v) else None

        rows.append({
            "instance": int(i), "num_requests": int(here.sum()), "num_finished": int(fin.sum()),
            "ttft_mean": stat("ttft", np.mean), "ttft_p99": stat("ttft", lambda a: np.percentile(a, 99)),
            "tpot_mean": stat("tpot", np.mean), "tpot_p99": stat("tpot", lambda a: np.percentile(a, 99)),
            "e2el_mean": stat("e2el", np.mean), "e2el_p99": stat("e2el", lambda a: np.percentile(a, 99)),
            "output_token_throughput": float(out_tokens[fin].sum()) / dur,
            "num_preemptions": int(preemptions[here].sum()), "prefix_hit_tokens": int(hits[here].sum()),
            "num_steps": int(len(inst.steps)), "busy_fraction": inst.busy_time / dur, "pool": inst.pool,
            "dummy_steps": dummy.get(inst.instance_id, 0),
            "transfer_s": inst.transfer_total,
        })
    return rows


def kv_offload_summary(result: SimResult) -> dict | None:
    """The CPU tier's counters summed over the instances (lab/core/kv_offload.py), or None without KV offloading:
    capacity (blocks), CPU hits (requests whose load started, tokens loaded), blocks and bytes stored / loaded
    over the host link (all GPU ranks), CPU-tier evictions."""
    tiers = [i.kv_offload for i in result.instances if i.kv_offload is not None]
    if not tiers:
        return None
    return {
        "cpu_blocks": sum(t.tier.num_blocks for t in tiers),
        "cpu_hit_requests": sum(t.cpu_hit_requests for t in tiers),
        "cpu_hit_tokens": sum(t.cpu_hit_tokens for t in tiers),
        "blocks_stored": sum(t.blocks_stored for t in tiers),
        "blocks_loaded": sum(t.blocks_loaded for t in tiers),
        "bytes_stored": float(sum(t.bytes_stored for t in tiers)),
        "bytes_loaded": float(sum(t.bytes_loaded for t in tiers)),
        "cpu_evictions": sum(t.num_evictions for t in tiers),
    }


def collect(result: SimResult, steps: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict]:
    """(requests table, summary dict) of a run. Engine statistics come from the step logs' running totals
    (:func:`step_totals`), so a summarized log gives the same summary; ``steps`` is accepted for older callers and
    not read. (:func:`collect_columns` with the table as a DataFrame.)"""
    cols, summary = collect_columns(result)
    return columns_frame(cols), summary


def measured_rows(cols) -> np.ndarray:
    """Boolean mask of the measured requests of a requests table (closed-loop warm-up requests left out)."""
    n = len(cols["status"])
    return ~np.asarray(cols["warmup"], dtype=bool) if "warmup" in cols else np.ones(n, dtype=bool)


def collect_columns(result: SimResult) -> tuple[dict, dict]:
    """(requests table as :func:`lab.report.metrics.request_columns` columns, summary dict) of a run: what
    :func:`collect` returns, without pandas."""
    exp = result.experiment
    req = request_columns(result.requests)
    slo = exp.slo.model_dump()
    eng = step_totals(result).engine_stats()
    warm = "warmup" in req
    measured = take(req, measured_rows(req)) if warm else req  # closed-loop warm-up requests are not measured
    summary = summarize(measured, result.itl_samples, horizon=exp.simulation.horizon_s, slo=slo, engine=eng)
    if warm:
        summary["num_warmup"] = int(np.asarray(req["warmup"]).sum())
    dep = result.deployment
    summary["experiment"] = exp.name
    summary["experiment_file"] = str(Path(exp.source).resolve()) if Path(exp.source).is_file() else None
    summary["offered_load"] = offered_load(exp)
    summary["instances"] = instances_table(req, result, summary["duration_s"])
    summary["num_swaps"] = int(sum(r.num_swaps for r in result.requests))
    offload = kv_offload_summary(result)
    if offload is not None:  # KV offloading: the CPU tier's counters, and each request's tokens loaded from it
        summary["kv_offload"] = offload
        req["cpu_loaded_tokens"] = np.array([r.cpu_loaded_tokens for r in result.requests], dtype=np.int64)
    if "engine" in summary:
        summary["engine"]["transfer_s"] = float(sum(i.transfer_total for i in result.instances))
    summary["deployment"] = {
        "model": dep.model.name, "gpu": dep.hardware.name, "tensor_parallel_size": exp.hardware.tensor_parallel_size,
        "num_instances": len(result.instances),
        "pipeline_parallel_size": exp.hardware.pipeline_parallel_size,
        "expert_parallel_size": exp.hardware.expert_parallel_size,
        "data_parallel_size": exp.hardware.data_parallel_size,
        "scheduler": exp.policy.scheduler, "queue": exp.policy.queue, "cost_model": dep.cost_model.name,
        "scheduler_options": dict(exp.policy.options), "preemption": exp.policy.preemption.model_dump(),
        "router": exp.cluster.router,
        "num_gpu_blocks": dep.num_gpu_blocks, "block_size": exp.engine.block_size,
        "num_gpu_blocks_source": "config" if dep.kv_capacity is None else "derived",
        "max_num_batched_tokens": dep.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": dep.scheduler_config.max_num_seqs, "max_model_len": dep.scheduler_config.max_model_len,
    }
    if dep.kv_capacity is not None:
        summary["deployment"]["kv_capacity"] = dep.kv_capacity.as_dict()
    summary["deployment"]["pools"] = [
        {"name": name, "gpu": d.hardware.name, "num_instances": sum(1 for i in result.instances if i.pool == name),
         "max_num_seqs": d.scheduler_config.max_num_seqs, "num_gpu_blocks": d.num_gpu_blocks,
         "cost_model": d.cost_model.name} for name, d in result.pools if name]
    summary["deployment"]["lock_step_groups"] = len(result.groups)
    summary["deployment"]["hand_offs"] = result.cluster.num_hand_offs if result.cluster is not None else 0
    cl = result.cluster
    if cl is not None and cl.links:
        dur = max(summary["duration_s"], 1e-12)
        handed = (~np.isnan(np.asarray(req["pd_transfer_s"], dtype=float)) if "pd_transfer_s" in req
                  else np.zeros(len(req["status"]), dtype=bool))
        summary["disaggregation"] = {
            "kv_transfer_bytes": cl.bytes_transferred, "kv_drafter_bytes": cl.drafter_bytes_transferred,
            "num_lease_expiries": cl.num_lease_expiries,
            "links": [{"name": link.name, "bandwidth_Bps": link.bandwidth, "bytes": link.bytes_sent,
                       "busy_fraction": link.busy_s / dur, "mean_utilisation": link.bytes_sent / (link.bandwidth * dur),
                       "peak_concurrent_transfers": link.peak_concurrent} for link in cl.links.values()],
            "peak_pinned_blocks": {str(i.instance_id): i.peak_pinned_blocks for i in result.instances
                                   if i.peak_pinned_blocks},
            "ttft_decomposition_mean_s": {c: _nanmean(np.asarray(req[c], dtype=float)[handed]) if handed.any()
                                          else None for c in
                                          ("pd_p_queue_s", "pd_prefill_s", "pd_handover_s", "pd_kv_wait_s",
                                           "pd_transfer_s", "pd_d_queue_s", "pd_first_decode_s")},
        }
    spec = exp.speculative
    if spec is not None:
        drafters = [i.acceptance for i in result.instances if i.acceptance is not None]
        per_pos = [sum(d.accepted_per_pos[j] for d in drafters) for j in range(spec.num_speculative_tokens)]
        summary["speculative"] = {
            "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "acceptance_source": acceptance_rates(exp, dep.model)[1] if spec.acceptance.kind != "per_request"
            else "per request", "drafter_kv_bytes_per_token": dep.drafter.kv_bytes_per_token if dep.drafter else 0,
            **speculative_stats(sum(d.num_drafts for d in drafters), sum(d.num_draft_tokens for d in drafters),
                                sum(d.num_accepted_tokens for d in drafters), per_pos)}
    summary["simulation"] = {"sim_end_s": result.sim_end, "wall_time_s": result.wall_time_s,
                             "seed": exp.seed, "fast_forward_jumps": sum(i.jump.num_jumps for i in result.instances),
                             "fast_forward_steps": sum(i.jump.jumped_steps for i in result.instances),
                             "itl_resolution_s": 1e-7 if result.itl_samples.compacted else 0.0}
    return req, summary


def _nanmean(v: np.ndarray) -> float:
    """The mean of the non-NaN values, as pandas' ``Series.mean`` computes it (NaN taken as 0 in the sum, divided
    by the count; NaN when none)."""
    missing = np.isnan(v)
    count = int((~missing).sum())
    return float(np.where(missing, 0.0, v).sum() / count) if count else float("nan")


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.1f}"


class RunOutputs(NamedTuple):
    """What :func:`write_outputs` wrote, kept in memory: the summary (summary.json) and bench_result.json's
    mapping (the vLLM figures a caller prints without reading the file back)."""

    summary: dict
    bench: dict


def write_report(result: SimResult, out_dir: Path, plots: bool = True, atomic: bool = True,
                 detailed: bool | None = None) -> dict:
    """Write every output file of the run and return the summary (:func:`write_outputs`, whose arguments these
    are)."""
    return write_outputs(result, out_dir, plots, atomic, detailed).summary


def write_outputs(result: SimResult, out_dir: Path, plots: bool = True, atomic: bool = True,
                  detailed: bool | None = None) -> RunOutputs:
    """Write every output file of the run; return the summary and bench_result.json's content.

    With ``atomic`` (the default) the files go to a temporary sibling folder that replaces ``out_dir`` in one
    rename once all are written (:func:`atomic_dir`): ``out_dir`` is then the earlier complete folder or the new
    one, never a mix, and keeps no file of an earlier run. Without it they are written straight into ``out_dir``
    (created if needed), for a caller that makes its own folder atomic (``servelab validate``, compare runs).

    ``detailed``: bench_result.json with vLLM's per-request lists (``--save-detailed``: ``ttfts``, ``itls``, ...;
    each request's ITLs recovered from the step log, lab/report/token_gaps.py); None takes the experiment's
    ``output.save_detailed``. Without it, the file holds the aggregates only, as ``vllm bench serve
    --save-result`` writes them.

    Raises:
        OutputDirError: ``out_dir`` is an existing file, or a folder with files that are not a servelab report.
        OSError: a file cannot be written (nothing is left at ``out_dir`` then, unless it was there before).
    """
    if atomic:
        with atomic_dir(out_dir) as tmp:
            return write_outputs(result, tmp, plots, atomic=False, detailed=detailed)
    from lab.report.html import write_run_html  # noqa: PLC0415

    if detailed is None:
        detailed = bool(getattr(result.experiment.output, "save_detailed", False))
    out_dir.mkdir(parents=True, exist_ok=True)
    background = _Background()
    try:
        series = None
        if steps_summarized(result):  # output.step_log: summary: no per-step rows: no steps.parquet, no time series
            pass
        elif not any(inst.steps.spilled_rows for inst in result.instances):  # the whole log in memory: columns
            steps = steps_columns(result)
            background.run(write_parquet, out_dir / "steps.parquet", steps)
            series = bucket_series([_frame(steps)]) if plots else None
            del steps
        elif num_steps(result) <= STREAM_STEPS_ABOVE:
            steps = steps_frame(result)
            write_parquet(out_dir / "steps.parquet", {c: steps[c].to_numpy() for c in steps.columns})
            series = bucket_series([steps]) if plots else None
            del steps
        else:  # long run: stream the log to steps.parquet, chunk by chunk
            _stream_steps(result, out_dir / "steps.parquet")
            series = bucket_series(iter_steps(result)) if plots else None
        req, summary = collect_columns(result)
        background.run(write_parquet, out_dir / "requests.parquet", req)
        ev = events_columns(result)
        if len(ev["time"]):
            background.run(write_parquet, out_dir / "events.parquet", ev)
        write_csv(out_dir / "requests.csv", req)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=_json_default))
        bench = bench_result(result, req, summary, detailed=detailed)
        with open(out_dir / "bench_result.json", "w") as f:
            write_bench_json(bench, f)
        req_frame = ev_frame = None
        figs = []
        if plots:
            req_frame = columns_frame(req)
            ev_frame = _frame(ev)
            figs = plot_all(req_frame, series, result, out_dir)
        (out_dir / "report.md").write_text(markdown(summary, figs))
        write_run_html(out_dir, summary, req_frame, ev_frame, series, result.itl_samples, plots=plots)
    finally:
        background.join()  # (raises what a background write raised)
    return RunOutputs(summary, bench)


class _Background:
    """Parquet files written on threads of their own while the caller formats the other outputs: pyarrow encodes,
    compresses and writes without holding the GIL, so on a machine with a free core that time is hidden (the
    steps, requests and events tables of the Vidur setup: about 0.1 s). :meth:`join` waits for every one and
    raises the first error a write raised."""

    def __init__(self) -> None:
        self._threads: list = []
        self._errors: list[BaseException] = []

    def run(self, fn, *args) -> None:
        import threading  # noqa: PLC0415

        def body() -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to join()
                self._errors.append(e)

        t = threading.Thread(target=body, name="servelab-output", daemon=True)
        t.start()
        self._threads.append(t)

    def join(self) -> None:
        for t in self._threads:
            t.join()
        self._threads = []
        if self._errors:
            raise self._errors[0]


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


def _frame(cols: dict) -> "pd.DataFrame":
    import pandas as pd  # noqa: PLC0415

    return pd.DataFrame(cols, columns=list(cols))


def _arrow_array(values):
    """A pyarrow array of one column, as pandas' ``to_parquet`` types it: float64 (NaN as null), int64, bool,
    large_string (a list of str). Built from the buffers: ``pyarrow.array`` would import pandas to inspect its
    argument. Returns None for any other column (written through pandas instead)."""
    import pyarrow as pa  # noqa: PLC0415

    if isinstance(values, list):
        n = len(values)
        try:
            joined = "".join(values)  # (TypeError: not all str)
        except TypeError:
            return None
        if joined.isascii():
            data = joined.encode("ascii")
            lengths = np.fromiter(map(len, values), dtype=np.int64, count=n)
        else:
            encoded = [v.encode("utf-8") for v in values]
            data = b"".join(encoded)
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return pa.Array.from_buffers(pa.large_string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    values = np.asarray(values)
    n = len(values)
    if values.dtype == np.float64:
        values = np.ascontiguousarray(values)
        missing = np.isnan(values)
        nulls = int(missing.sum())
        validity = pa.py_buffer(np.packbits(~missing, bitorder="little")) if nulls else None
        return pa.Array.from_buffers(pa.float64(), n, [validity, pa.py_buffer(values)], null_count=nulls)
    if values.dtype == np.int64:
        return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(np.ascontiguousarray(values))])
    if values.dtype == np.bool_:
        return pa.Array.from_buffers(pa.bool_(), n, [None, pa.py_buffer(np.packbits(values, bitorder="little"))])
    return None


def write_parquet(path: Path, cols: dict) -> None:
    """Write a table of columns (numpy arrays, lists of str) to Parquet with pyarrow, with the column types and
    the compression (snappy) pandas' ``to_parquet`` gives the same table; a column of any other kind sends the whole
    table through pandas."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    arrays = [_arrow_array(v) for v in cols.values()]
    if any(a is None for a in arrays):
        _frame(cols).to_parquet(path, index=False)
        return
    pq.write_table(pa.Table.from_arrays(arrays, names=list(cols)), path)


def write_csv(path: Path, cols: dict) -> None:
    """Write a table of columns as pandas' ``to_csv(index=False)`` writes it, byte for byte: the csv module's
    minimal quoting, floats as their shortest repr (``0.0``, ``1e-05``; numpy's ``astype(str)``, which pandas uses,
    gives the same text), NaN as an empty field, bools as True/False.

    Formatting floats is most of the cost (about 1 us a value), so each distinct value of a column is formatted
    once, and a column equal to one already written (client and engine times, often the same numbers) reuses its
    text. Rows are joined directly when no text field needs quoting (no comma, quote or line break in it), else
    written by the csv module."""
    texts: list[list[str]] = []
    done: list[tuple[np.ndarray, list[str]]] = []
    plain = True
    for v in cols.values():
        if isinstance(v, list):  # (str; the csv module writes any other value as str() would)
            if plain:
                joined = "\x00".join(map(str, v))
                plain = not any(c in joined for c in ',"\r\n')
            texts.append(v)
            continue
        v = np.asarray(v)
        if v.dtype == np.float64:
            same = next((t for a, t in done if a.shape == v.shape and np.array_equal(a, v, equal_nan=True)), None)
            if same is None:
                same = _float_texts(v)
                done.append((v, same))
            texts.append(same)
        elif v.dtype == object:  # (pandas writes None and NaN as empty fields)
            texts.append(["" if x is None or (isinstance(x, float) and x != x) else str(x) for x in v.tolist()])
        else:
            texts.append(list(map(str, v.tolist())))
    with open(path, "w", newline="", encoding="utf-8") as f:
        if plain and all(isinstance(t, list) and all(type(x) is str for x in t[:1]) for t in texts):
            try:
                body = "\n".join(map(",".join, zip(*texts)))
            except TypeError:  # a text column held something else than str
                body = None
            if body is not None and len(cols) > 1 and not any(c in name for name in cols for c in ',"\r\n'):
                f.write(",".join(cols) + "\n" + (body + "\n" if texts and texts[0] else ""))
                return
        import csv  # noqa: PLC0415

        w = csv.writer(f, lineterminator="\n")
        w.writerow(list(cols))
        w.writerows(zip(*texts))


def _float_texts(v: np.ndarray) -> list[str]:
    """Each value's ``repr`` ('' for NaN), formatting each distinct value once."""
    if len(v) > 64 and not ((v == 0) & np.signbit(v)).any():  # (np.unique would merge -0.0 with 0.0)
        uniq, inverse = np.unique(v, return_inverse=True)
        texts = list(map(repr, uniq.tolist()))
        if len(uniq) and np.isnan(uniq[-1]):
            texts[-1] = ""
        return list(map(texts.__getitem__, inverse.tolist()))
    out = list(map(repr, v.tolist()))
    for i in np.flatnonzero(np.isnan(v)).tolist():
        out[i] = ""
    return out


def offered_load(exp) -> str:
    """The load the workload offers, in words (beside the achieved throughput in every report)."""
    from lab.experiment.simulation import closed_loop_concurrency

    w = exp.workload
    n = closed_loop_concurrency(exp)
    if n is not None:
        think = f", think time {w.think_time_s:g} s" if w.think_time_s else ""
        return f"closed loop, concurrency {n}{think}"
    if w.source == "sessions":
        think = f", think time {w.think_time_s:g} s" if w.think_time_s else ""
        return f"{w.num_requests} multi-turn sessions starting at {w.rate:g} sessions/s{think}"
    if w.source == "synthetic":
        if w.rate == float("inf"):
            return f"all {w.num_requests} requests at t = 0 (request rate inf)"
        kind = "Poisson" if w.cv == 1.0 else f"Gamma (cv {w.cv:g})"
        return f"{kind} arrivals at {w.rate:g} req/s"
    scale = f", time_scale {w.time_scale:g}" if w.time_scale != 1.0 else ""
    return f"{w.source} trace arrivals{scale}"


def bench_result(result: SimResult, req, summary: dict, detailed: bool = False) -> dict:
    """The run in ``vllm bench serve``'s result format (lab/report/metrics.py ``vllm_bench_result``): the
    aggregates, and with ``detailed`` the per-request lists, each finished request's ``itls`` its real gaps where
    the step log pins them down (lab/report/token_gaps.py) and its TPOT repeated where it does not; those
    requests' positions are listed in ``itls_estimated`` with ``itls_estimated_why`` (servelab's keys)."""
    from lab.experiment.simulation import closed_loop_concurrency

    exp = result.experiment
    keep = measured_rows(req)
    measured = take(req, keep) if not keep.all() else req
    w = exp.workload
    open_rate = w.source == "synthetic" and (w.concurrency is None or "rate" in w.model_fields_set)
    rate = w.rate if open_rate and w.rate != float("inf") else None  # None: vLLM's "inf"
    itls = estimated = None
    if detailed:
        itls, estimated = _request_itls(result, measured)
    out = vllm_bench_result(measured, summary, result.itl_samples, exp.output.percentiles(),
                            closed_loop_concurrency(exp), rate, result.deployment.model.name,
                            int(len(keep) - keep.sum()), exp.output.metrics(), detailed=detailed, itls=itls)
    if estimated is not None and estimated.estimated:
        out["itls_estimated"] = estimated.estimated
        out["itls_estimated_why"] = estimated.reasons
    return out


def _request_itls(result: SimResult, measured) -> tuple[list, "object"]:
    """Each finished measured request's gaps (seconds; lab/report/token_gaps.py), its TPOT repeated where they
    cannot be recovered, in bench_result.json's order; and the :class:`TokenGaps` (which were estimated)."""
    from lab.report.token_gaps import request_token_gaps  # noqa: PLC0415

    by_id = {str(r.request_id): r for r in result.requests}
    status = np.asarray(measured["status"])
    fin_idx = np.flatnonzero(status == "finished")
    rid = np.asarray(measured["request_id"], dtype=object)
    ids = [str(rid[i]) for i in fin_idx.tolist()]
    reqs = [by_id[i] for i in ids]
    gaps = request_token_gaps(result, reqs)
    tpot = np.asarray(measured["tpot"], dtype=float)[fin_idx].tolist()
    outs = np.asarray(measured["output_tokens"])[fin_idx].tolist()
    itls = [g if g is not None else ([float(t)] * (int(k) - 1) if k > 1 else [])
            for g, t, k in zip(gaps.gaps, tpot, outs)]
    return itls, gaps


class OutputDirError(ValueError):
    """An output folder that cannot be written: an existing file, or a folder holding files that are not outputs."""


# Files a run, a validation or a compare run writes: a folder of only these (or one with summary.json) is an output
# folder that may be replaced; any other non-empty folder is refused rather than deleted.
OUTPUT_FILES = frozenset({
    "requests.parquet", "requests.csv", "steps.parquet", "events.parquet", "summary.json", "report.md", "report.html",
    "bench_result.json",
    "latency_cdf.png", "timeseries.png", "run.json", "validation.json", "validation.md", "validation_requests.csv",
    "validation_timeseries.csv", "validation_latency.png", "validation_timeseries.png", "validation_breakdown.png",
    # a sweep's tables and run records (lab/report/sweep.py) and a search's answer and probes (lab/report/search.py)
    "sweep.csv", "sweep.parquet", "sweep_summary.csv", "sweep.html", "sweep", "search.md", "search.json", "probes"})


def check_out_dir(path: Path) -> Path:
    """Check that ``path`` may take a run's outputs: absent, an empty folder, or an earlier output folder.

    Returns:
        ``path`` made absolute, a symbolic link resolved (the folder the link points to is the one replaced).

    Raises:
        OutputDirError: ``path`` exists and is not a folder, or is a folder with files no servelab run writes
            (not replaced, so that ``--out`` at a wrong folder deletes nothing).
    """
    p = Path(path)
    p = p.resolve() if p.is_symlink() else Path(os.path.abspath(p))  # "." has a name and a parent
    if not p.exists():
        return p
    if not p.is_dir():
        raise OutputDirError(f"output folder {path} exists and is not a folder; pass --out a folder path")
    names = {e.name for e in p.iterdir()}
    if names and "summary.json" not in names and not names <= OUTPUT_FILES:
        extra = sorted(names - OUTPUT_FILES)
        raise OutputDirError(f"output folder {path} holds files that are not servelab outputs ({', '.join(extra[:3])}"
                             f"{', ...' if len(extra) > 3 else ''}); it would be replaced: pass --out a new or empty "
                             "folder, or remove it")
    return p


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (True where that cannot be told without signalling it)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_temps(target: Path) -> None:
    """Delete the temporary and set-aside siblings of ``target`` (``.<name>.tmp-<pid>``, ``.<name>.old-<pid>``)
    that a killed run left behind: those of processes that no longer exist. Raises nothing."""
    parent = target.parent
    if not parent.is_dir():
        return
    pat = re.compile(rf"^\.{re.escape(target.name)}\.(tmp|old)-(\d+)$")
    for e in parent.iterdir():
        m = pat.match(e.name)
        if m and (int(m.group(2)) == os.getpid() or not pid_alive(int(m.group(2)))):
            shutil.rmtree(e, ignore_errors=True)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a new, empty temporary sibling folder of ``target`` (``.<name>.tmp-<pid>``, same file system); when the
    block ends normally it replaces ``target`` in one rename (an earlier ``target`` is swapped out and deleted);
    when it raises (or is interrupted) the temporary folder is deleted and ``target`` is left as it was. A process
    killed outright leaves its temporary folder, which the next write of ``target`` deletes.

    Raises:
        OutputDirError: from :func:`check_out_dir`.
        OSError: the parent folder cannot be created or written.
    """
    target = check_out_dir(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target``: one atomic exchange where the OS has it (Linux renameat2), else ``target``
    renamed aside, ``new`` renamed in, the old one deleted. Raises OutputDirError (``target`` changed meanwhile)
    or OSError."""
    if not (target.exists() or target.is_symlink()):
        os.rename(new, target)
        return
    check_out_dir(target)
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # now holds the earlier folder
        return
    aside = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(target, aside)
    os.rename(new, target)
    shutil.rmtree(aside, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where unsupported (not Linux, old libc,
    a file system without it). Raises nothing."""
    fn = getattr(linux_libc(), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@functools.lru_cache(maxsize=1)
def linux_libc():
    """The C library on Linux (for renameat2, prctl), else None. Raises nothing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_MARK = "\x00{}\x00"


def write_bench_json(d: dict, f) -> None:
    """Write a :func:`bench_result` dict to text file ``f`` exactly as ``json.dumps(d, default=_json_default)``
    would, but with the per-request ``itls`` lists (a list of float lists or float64 arrays: a number per output
    token of the run, 4 million for the Vidur conversation setup) formatted in bulk: each distinct gap value once
    (a run's gaps are differences of step ends, far fewer distinct values than gaps), a block of requests at a
    time."""
    itls = d.get("itls")
    if not isinstance(itls, list) or not itls:
        f.write(json.dumps(d, default=_json_default))
        return
    lists = [np.asarray(x, dtype=np.float64) for x in itls]
    flat = np.concatenate(lists)
    if not np.isfinite(flat).all():
        f.write(json.dumps(d, default=_json_default))
        return
    mark = _MARK.format("itls")
    head, tail = json.dumps({**d, "itls": mark}, default=_json_default).split(json.dumps(mark), 1)
    keys = flat.view(np.int64)  # the values' bits: equal keys, equal text (-0.0 and 0.0 apart)
    ordered = np.sort(keys)
    distinct = ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered
    inverse = np.searchsorted(distinct, keys)  # (a sort and a search: a third of np.unique's inverse)
    texts = list(map(repr, distinct.view(np.float64).tolist()))
    f.write(head + "[")
    pos = i = 0
    block = 1 << 18  # values formatted per write (bounded memory)
    while i < len(lists):
        j, n = i, 0
        while j < len(lists) and (n == 0 or n + len(lists[j]) <= block):
            n += len(lists[j])
            j += 1
        words = list(map(texts.__getitem__, inverse[pos:pos + n].tolist()))
        parts = []
        q = 0
        for k in range(i, j):
            m = len(lists[k])
            parts.append(("[" if k == 0 else ", [") + ", ".join(words[q:q + m]) + "]")
            q += m
        f.write("".join(parts))
        pos += n
        i = j
    f.write("]" + tail)


def _stream_steps(result: SimResult, path: Path) -> None:
    """Write the whole step log to ``path`` chunk by chunk (instance by instance)."""
    import pyarrow as pa  # noqa: PLC0415 - only a long run streams its log
    import pyarrow.parquet as pq  # noqa: PLC0415

    writer = None
    for chunk in iter_steps(result):
        table = pa.Table.from_pandas(chunk, preserve_index=False)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    if writer is not None:
        writer.close()


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o))


def slo_words(slo: dict) -> str:
    """An SLO mapping (``ttft_s``, ``tpot_s``, ``e2el_s``: seconds) in words, e.g. ``TTFT <= 0.5 s, TPOT <= 50 ms``
    (a bound under 0.1 s in milliseconds); "none" when no bound is set."""
    parts = []
    for key, bound in slo.items():
        if bound is None:
            continue
        name = key.removesuffix("_s").upper()
        parts.append(f"{name} <= {bound:g} s" if bound >= 0.1 else f"{name} <= {bound * 1000:g} ms")
    return ", ".join(parts) if parts else "none"


def achieved_words(summary: dict, lead: str = "") -> str:
    """The achieved request throughput in words: over the arrival window (first to last request sent: requests
    received in full within it, and those still in flight at its end) and over the whole duration (to the last
    token received, as ``vllm bench serve`` divides), both windows named; '' when the arrivals span no time
    (every request sent at once)."""
    rate = summary.get("arrival_window_request_throughput")
    if rate is None:
        return ""
    return (f"{lead}Achieved {rate:.2f} req/s over the arrival window (first to last request sent, "
            f"{summary['arrival_window_s']:.1f} s; {summary.get('arrival_window_in_flight', 0)} requests in flight "
            f"at its end), {summary['request_throughput']:.2f} req/s over the whole {summary['duration_s']:.1f} s "
            "(to the last token received: the drain after the last arrival included, as vllm bench serve counts).")


def _layout(d: dict) -> str:
    """Pipeline, DP/EP, lock-step and pools, for the report's first line ('' for a plain deployment)."""
    parts = []
    if d.get("pipeline_parallel_size", 1) > 1:
        parts.append(f"PP{d['pipeline_parallel_size']}")
    if d.get("data_parallel_size", 1) > 1:
        parts.append(f"DP{d['data_parallel_size']} x EP{d['expert_parallel_size']}"
                     + (f", {d['lock_step_groups']} lock-step group(s)" if d.get("lock_step_groups") else ""))
    if d.get("pools"):
        pools = ", ".join(f"{p['name']} ({p['num_instances']} x {p['gpu']})" for p in d["pools"])
        parts.append(f"pools {pools}, {d.get('hand_offs', 0)} hand-offs")
    return "; " + "; ".join(parts) if parts else ""


def markdown(summary: dict, figures: list[tuple[str, str]]) -> str:
    """The report page: headline table, latency table, engine statistics, then the figures."""
    d = summary["deployment"]
    lines = [f"# {summary['experiment']}", "",
             f"{d['model']} on {d['gpu']} × TP{d['tensor_parallel_size']}, scheduler `{d['scheduler']}` "
             f"({d['queue']}), cost model `{d['cost_model']}`, {d['num_gpu_blocks']} KV blocks of {d['block_size']} "
             f"tokens ({d['num_gpu_blocks_source']}), max_num_batched_tokens {d['max_num_batched_tokens']}, "
             f"max_num_seqs {d['max_num_seqs']}; preemption {d['preemption']['mode']} "
             f"(victim {d['preemption']['victim']}); {d['num_instances']} instance(s), router `{d['router']}`"
             f"{_layout(d)}.", "",
             "| requests | finished | rejected | unfinished | duration (s) | req/s | output tok/s | total tok/s | preemptions |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {summary['num_requests']} | {summary['num_finished']} | {summary['num_rejected']} | "
             f"{summary['num_unfinished']} | {summary['duration_s']:.1f} | {summary['request_throughput']:.2f} | "
             f"{summary['output_token_throughput']:.0f} | {summary['total_token_throughput']:.0f} | "
             f"{summary['num_preemptions']} |", "",
             f"Offered load: {summary.get('offered_load', '')}." + achieved_words(summary, " ")
             + (f" {summary['num_warmup']} warm-up requests ran first and are left out of every figure."
                if summary.get("num_warmup") else ""), "",
             "| metric (ms) | mean | median | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for m in ("ttft", "tpot", "itl", "e2el", "queue_time"):
        s = summary[m]
        lines.append(f"| {m.upper()} | {_ms(s['mean'])} | {_ms(s['median'])} | {_ms(s['p90'])} | {_ms(s['p99'])} |")
    if "goodput" in summary:
        lines += ["", f"Goodput {summary['goodput']:.2f} req/s; SLO attainment {summary['slo_attainment'] * 100:.1f} % "
                      f"(SLO {slo_words(summary['slo'])})."]
    eng = summary.get("engine")
    if eng:
        lines += ["", f"Engine: {eng['num_steps']} steps, mean batch {eng['mean_batch_size']:.1f} requests / "
                      f"{eng['mean_scheduled_tokens']:.0f} tokens, peak KV usage {eng['peak_kv_usage'] * 100:.1f} %, "
                      f"peak running {eng['peak_running']}, peak waiting {eng['peak_waiting']}."]
    off = summary.get("kv_offload")
    if off:
        lines += ["", f"KV offloading: {off['cpu_blocks']} CPU blocks; {off['cpu_hit_requests']} loads of "
                      f"{off['cpu_hit_tokens']} tokens from CPU ({off['bytes_loaded'] / 1e9:.2f} GB), "
                      f"{off['bytes_stored'] / 1e9:.2f} GB stored, {off['cpu_evictions']} CPU-tier evictions."]
    dis = summary.get("disaggregation")
    if dis:
        parts = ", ".join(f"{k[3:-2].replace('_', ' ')} {_ms(v)} ms" for k, v in dis["ttft_decomposition_mean_s"].items())
        util = ", ".join(f"{x['busy_fraction'] * 100:.1f} %" for x in dis["links"])
        lines += ["", f"Disaggregated: {dis['kv_transfer_bytes'] / 1e9:.2f} GB of KV moved "
                      f"({dis['kv_drafter_bytes'] / 1e9:.2f} GB drafter), link busy {util}, "
                      f"{dis['num_lease_expiries']} lease expiries. Mean TTFT by part: {parts}."]
    sp = summary.get("speculative")
    if sp and sp["num_drafts"]:
        pos = ", ".join(f"{p:.3f}" for p in sp["per_position_acceptance"])
        lines += ["", f"Speculative decoding: {sp['method']}, k = {sp['num_speculative_tokens']}; "
                      f"{sp['num_drafts']} verifications, acceptance rate {sp['acceptance_rate'] * 100:.1f} %, mean "
                      f"acceptance length {sp['mean_acceptance_length']:.2f} tokens per step, per-position acceptance "
                      f"{pos} (acceptance model: {sp['acceptance_source']})."]
    inst = summary.get("instances") or []
    if len(inst) > 1:
        lines += ["", f"Per instance (router `{d.get('router')}`; latencies in ms):", "",
                  "| instance | requests | finished | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 | E2EL mean | E2EL p99 "
                  "| output tok/s | preemptions | prefix-hit tokens | busy % |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in inst:
            lines.append(f"| {row['instance']} | {row['num_requests']} | {row['num_finished']} | "
                         + " | ".join(_ms(row[k]) for k in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99",
                                                              "e2el_mean", "e2el_p99"))
                         + f" | {row['output_token_throughput']:.0f} | {row['num_preemptions']} | "
                           f"{row['prefix_hit_tokens']} | {row['busy_fraction'] * 100:.1f} |")
    sim = summary["simulation"]
    lines += ["", f"Simulated {sim['sim_end_s']:.1f} s in {sim['wall_time_s']:.2f} s wall time (seed {sim['seed']}).", ""]
    for title, fname in figures:
        lines += [f"## {title}", "", f"![{title}]({fname})", ""]
    lines += ["Tables: `requests.parquet` / `requests.csv` (one row per request), `steps.parquet` (one row per step), "
              "`events.parquet` (request lifecycle events), `summary.json`.", ""]
    return "\n".join(lines)


def plot_all(req: pd.DataFrame, series: pd.DataFrame | None, result: SimResult, out_dir: Path) -> list[tuple[str, str]]:
    """Latency CDFs, throughput and queue length over time, KV usage over time; returns (title, file) pairs."""
    plt = pyplot()

    figs = []
    fin = req[req["status"] == "finished"]
    itl = result.itl_samples.arrays()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, vals) in zip(axes, (("TTFT", (fin["ttft"], None)), ("TPOT", (fin["tpot"], None)), ("ITL", itl),
                                       ("E2EL", (fin["e2el"], None)))):
        x, y = cdf_points(*vals)
        if len(x):
            ax.plot(x * 1000, y, label="simulated", **series_style(0))
        if draw_slo(ax, result.experiment.slo, name) is not None:  # the SLO bound as a vertical line
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{name} of finished requests" if name != "ITL" else "ITL (every token gap)", fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_cdf.png", dpi=110)
    plt.close(fig)
    figs.append(("Latency CDFs", "latency_cdf.png"))

    if series is not None and len(series):
        span = series.index.max() - series.index.min() + 1
        step = max(1, int(span // 4000))  # at most ~4000 points per line
        ser = series.groupby(series.index // step * step).mean() if step > 1 else series
        fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
        axes[0].plot(ser.index, ser["output_tokens"], label="output tokens/s")
        axes[0].plot(ser.index, ser["prefill_tokens"], label="prefill tokens/s", alpha=0.7)
        axes[0].set_ylabel("tokens/s")
        axes[0].set_title("Throughput, queue and KV usage over time (all instances)", fontsize=10)
        axes[0].legend()
        axes[1].plot(ser.index, ser["num_running"], label="running", lw=0.8)
        axes[1].plot(ser.index, ser["num_waiting"], label="waiting", lw=0.8)
        axes[1].set_ylabel("requests (all instances)")
        axes[1].legend()
        axes[2].plot(ser.index, ser["kv_usage"] * 100, lw=0.8)
        axes[2].set_ylabel("KV usage (%, mean of instances)")
        axes[2].set_xlabel("time (s)")
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "timeseries.png", dpi=110)
        plt.close(fig)
        figs.append(("Throughput, queues and KV usage over time", "timeseries.png"))
    return figs


def cdf_points(values, weights=None, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """Points of the empirical CDF of ``values`` (finite ones; each counted ``weights[i]`` times, default once) for
    a plot: (sorted values, cumulative fraction), at most ``max_points`` + 1 of them, taken at evenly spaced
    fractions (a line of 2,000 points draws the same curve as one per sample, at a fraction of the time)."""
    v = np.asarray(values, dtype=float)
    w = np.ones(len(v)) if weights is None else np.asarray(weights, dtype=float)
    keep = np.isfinite(v) & (w > 0)
    v, w = v[keep], w[keep]
    if not len(v):
        return v, v
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(w[order])
    cum /= cum[-1]
    if len(v) > max_points:
        idx = np.unique(np.searchsorted(cum, np.linspace(0.0, 1.0, max_points + 1)[1:], side="left"))
        v, cum = v[np.minimum(idx, len(v) - 1)], cum[np.minimum(idx, len(v) - 1)]
    return v, cum


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
