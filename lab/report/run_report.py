"""Write a run's outputs: requests.parquet/.csv, steps.parquet, events.parquet, summary.json, bench_result.json,
report.md, report.html and plots.

Everything a plot shows is also in a table. The tables come from lab/report/run_tables.py and run_summary.py, the
files are written by table_files.py into a folder made atomic by output_folder.py, the page by run_markdown.py and
the figures by run_plots.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from lab.experiment.simulation import SimResult
from lab.report.metrics import columns_frame, take, vllm_bench_result
from lab.report.output_folder import atomic_dir
from lab.report.run_markdown import markdown
from lab.report.run_plots import plot_all
from lab.report.run_summary import collect_columns, measured_rows
from lab.report.run_tables import (bucket_series, events_columns, iter_steps, num_steps, steps_columns, steps_frame,
                                   steps_summarized)
from lab.report.table_files import json_default, table_frame, write_bench_json, write_csv, write_parquet

if TYPE_CHECKING:
    import pandas as pd

# Above this many steps the report streams the step log instead of loading it whole.
STREAM_STEPS_ABOVE = 2_000_000


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
        detailed = result.experiment.output.save_detailed
    out_dir.mkdir(parents=True, exist_ok=True)
    background = _Background()
    try:
        series = _write_steps(result, out_dir, plots, background)
        req, summary = collect_columns(result)
        background.run(write_parquet, out_dir / "requests.parquet", req)
        ev = events_columns(result)
        if len(ev["time"]):
            background.run(write_parquet, out_dir / "events.parquet", ev)
        write_csv(out_dir / "requests.csv", req)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=json_default))
        bench = bench_result(result, req, summary, detailed=detailed)
        with open(out_dir / "bench_result.json", "w") as f:
            write_bench_json(bench, f)
        req_frame = ev_frame = None
        figs = []
        if plots:
            req_frame = columns_frame(req)
            ev_frame = table_frame(ev)
            figs = plot_all(req_frame, series, result, out_dir)
        (out_dir / "report.md").write_text(markdown(summary, figs))
        write_run_html(out_dir, summary, req_frame, ev_frame, series, result.itl_samples, plots=plots)
    finally:
        background.join()  # (raises what a background write raised)
    return RunOutputs(summary, bench)


def _write_steps(result: SimResult, out_dir: Path, plots: bool, background: "_Background") -> "pd.DataFrame | None":
    """Write steps.parquet (on ``background`` when the log is in memory; none for a summarized log) and return the
    per-second series the figures draw (None without ``plots`` or per-step rows)."""
    if steps_summarized(result):  # output.step_log: summary: no per-step rows: no steps.parquet, no time series
        return None
    if not any(inst.steps.spilled_rows for inst in result.instances):  # the whole log in memory: columns
        steps = steps_columns(result)
        background.run(write_parquet, out_dir / "steps.parquet", steps)
        return bucket_series([table_frame(steps)]) if plots else None
    if num_steps(result) <= STREAM_STEPS_ABOVE:
        steps = steps_frame(result)
        write_parquet(out_dir / "steps.parquet", {c: steps[c].to_numpy() for c in steps.columns})
        return bucket_series([steps]) if plots else None
    _stream_steps(result, out_dir / "steps.parquet")  # long run: stream the log to steps.parquet, chunk by chunk
    return bucket_series(iter_steps(result)) if plots else None


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


def bench_result(result: SimResult, req, summary: dict, detailed: bool = False) -> dict:
    """The run in ``vllm bench serve``'s result format (lab/report/metrics.py ``vllm_bench_result``): the
    aggregates, and with ``detailed`` the per-request lists, each finished request's ``itls`` its real gaps where
    the step log pins them down (lab/report/token_gaps.py) and its TPOT repeated where it does not; those
    requests' positions are listed in ``itls_estimated`` with ``itls_estimated_why`` (servelab's keys)."""
    from lab.experiment.resolve import closed_loop_concurrency

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
