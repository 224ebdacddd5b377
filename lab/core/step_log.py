"""The per-step records of one instance, kept column-wise in compact arrays (one row per step), with memory bounded
by a fixed number of rows held: older rows go to a spill file (Arrow IPC, full log) or are folded into running totals
(summarized log, no rows kept)."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

STEP_COLUMNS = (
    "instance", "start", "duration", "scheduled_tokens", "prefill_tokens", "decode_requests", "spec_tokens",
    "batch_size", "kv_blocks_used", "kv_usage", "num_running", "num_waiting", "num_preempted", "output_tokens",
    "transfer_s", "micro_batch", "stage_s",
)
# A step's tokens: scheduled_tokens = prefill_tokens (prompt chunks and recomputed prompts) + decode_requests (one
# token each: plain decodes and speculative verify queries alike) + spec_tokens (the draft tokens those verify).
# what a StepLog stores per row; "instance" and "kv_usage" (= kv_blocks_used / usable blocks) are added when read
LOGGED_COLUMNS = tuple(c for c in STEP_COLUMNS if c not in ("instance", "kv_usage"))

# Rows an instance's log holds in memory at most (plus the rows of one fast-forward jump): 15 float64 columns,
# about 7.9 MB per instance, whatever the length of the run.
ROW_BUDGET = 1 << 16
# Rows a whole run's full logs hold in memory at most, shared by its instances (each holds at least ROW_BUDGET):
# about 126 MB. A run that fits never spills, so it never loads pyarrow (~0.5 s and ~80 MB of the process).
RUN_ROW_BUDGET = 1 << 20
# A summarized log folds its rows into the totals this often (the rows are needed for nothing else).
SUMMARY_ROWS = 1 << 12
# Rows appended one at a time (real steps) gathered before they become a block of the log.
TAIL_ROWS = 1 << 12
_WAITING = LOGGED_COLUMNS.index("num_waiting")
_PREEMPTED = LOGGED_COLUMNS.index("num_preempted")


def rows_per_log(num_instances: int) -> int:
    """Rows each of ``num_instances`` full step logs holds before spilling: the run's budget shared evenly, at
    least :data:`ROW_BUDGET` (so 16 instances or more hold ROW_BUDGET each)."""
    return max(ROW_BUDGET, RUN_ROW_BUDGET // max(num_instances, 1))


class ExactSum:
    """The exactly rounded sum of float64 values, whatever their order or grouping (so totals folded chunk by chunk,
    instance by instance, equal those of the whole log at once).

    Each value is split into an integer mantissa times a power of two (``numpy.frexp``: ``v = m · 2**e``, ``m · 2**53``
    an integer); the mantissas are summed exactly per exponent (two 27/26-bit halves, whose per-chunk sums stay
    below 2**53 and so are exact in float64 ``bincount``) and kept as Python integers; :meth:`value` rounds the one
    exact total to the nearest float64 (Python's int / int division is correctly rounded). Values must be finite.
    """

    __slots__ = ("_by_exp",)
    _CHUNK = 1 << 24  # values per bincount: 2**27 · 2**24 < 2**53 keeps every partial sum exact

    def __init__(self) -> None:
        self._by_exp: dict[int, int] = {}

    def add(self, values: np.ndarray) -> None:
        """Add a 1-D float64 array (seconds, or any unit; finite values)."""
        for i in range(0, len(values), self._CHUNK):
            self._add(values[i:i + self._CHUNK])

    def _add(self, values: np.ndarray) -> None:
        if not len(values):
            return
        mant, exp = np.frexp(values)
        ints = (mant * 9007199254740992.0).astype(np.int64)  # m · 2**53, exact
        lo_mask = (1 << 26) - 1
        e0 = int(exp.min())
        idx = exp - e0
        hi = np.bincount(idx, weights=(ints >> 26).astype(np.float64))
        lo = np.bincount(idx, weights=(ints & lo_mask).astype(np.float64))
        by_exp = self._by_exp
        for k in np.flatnonzero((hi != 0) | (lo != 0)):
            e = e0 + int(k)
            by_exp[e] = by_exp.get(e, 0) + (int(hi[k]) << 26) + int(lo[k])

    def merge(self, other: "ExactSum") -> None:
        """Add another sum's values."""
        for e, v in other._by_exp.items():
            self._by_exp[e] = self._by_exp.get(e, 0) + v

    def value(self) -> float:
        """The sum, rounded once to the nearest float64 (0.0 when empty)."""
        if not self._by_exp:
            return 0.0
        e0 = min(self._by_exp)
        total = sum(v << (e - e0) for e, v in self._by_exp.items())
        shift = e0 - 53
        return float(total << shift) if shift >= 0 else total / (1 << -shift)


class StepTotals:
    """Running totals over step rows: what the run summary's engine statistics need (``lab/report/run_report.py``).

    ``num_steps``; sums of ``batch_size`` and ``scheduled_tokens`` (integers); ``busy`` = the exact sum of step
    durations (s) and ``kv_weighted`` = the exact sum of ``kv_usage · duration`` (s), both :class:`ExactSum`, so
    totals do not depend on how rows were grouped; peaks of ``kv_usage``, ``num_running`` and ``num_waiting``.
    """

    __slots__ = ("num_steps", "batch", "tokens", "busy", "kv_weighted", "peak_kv", "peak_running", "peak_waiting")

    def __init__(self) -> None:
        self.num_steps = 0
        self.batch = 0
        self.tokens = 0
        self.busy = ExactSum()
        self.kv_weighted = ExactSum()
        self.peak_kv = 0.0
        self.peak_running = 0
        self.peak_waiting = 0

    def add_rows(self, cols: dict[str, np.ndarray], usable_blocks: int) -> None:
        """Fold rows given as LOGGED_COLUMNS arrays (float64, equal lengths) of an instance with ``usable_blocks``."""
        n = len(cols["start"])
        if not n:
            return
        d = cols["duration"]
        kv = cols["kv_blocks_used"] / usable_blocks
        self.num_steps += n
        self.batch += int(cols["batch_size"].sum())  # integers below 2**53: exact in float64
        self.tokens += int(cols["scheduled_tokens"].sum())
        self.busy.add(d)
        self.kv_weighted.add(kv * d)
        self.peak_kv = max(self.peak_kv, float(kv.max()))
        self.peak_running = max(self.peak_running, int(cols["num_running"].max()))
        self.peak_waiting = max(self.peak_waiting, int(cols["num_waiting"].max()))

    def merge(self, other: "StepTotals") -> None:
        """Add another log's totals (another instance, or rows held apart)."""
        self.num_steps += other.num_steps
        self.batch += other.batch
        self.tokens += other.tokens
        self.busy.merge(other.busy)
        self.kv_weighted.merge(other.kv_weighted)
        self.peak_kv = max(self.peak_kv, other.peak_kv)
        self.peak_running = max(self.peak_running, other.peak_running)
        self.peak_waiting = max(self.peak_waiting, other.peak_waiting)

    def engine_stats(self) -> dict | None:
        """The summary's ``engine`` section (None without steps): ``num_steps``, ``mean_batch_size`` (requests),
        ``mean_scheduled_tokens``, ``busy_time_s``, ``peak_kv_usage`` and duration-weighted ``mean_kv_usage``
        (fractions of the usable blocks), ``peak_running``, ``peak_waiting``."""
        n = self.num_steps
        if not n:
            return None
        busy = self.busy.value()
        return {"num_steps": n, "mean_batch_size": self.batch / n, "mean_scheduled_tokens": self.tokens / n,
                "busy_time_s": busy, "peak_kv_usage": self.peak_kv,
                "mean_kv_usage": self.kv_weighted.value() / busy if busy else 0.0,
                "peak_running": self.peak_running, "peak_waiting": self.peak_waiting}


class SpillFolder:
    """The temporary folder a run's step logs spill to, made when the first of them spills (``tempfile.mkdtemp``:
    a private folder) and removed by :meth:`remove`: a run whose rows fit in memory touches no file system (a
    folder made for every run cost a file-system operation, which can wait behind other processes' disk writes,
    and was left behind by a process that ends without its exit handlers)."""

    def __init__(self, prefix: str = "servelab_steps_") -> None:
        self.prefix = prefix
        self.made: str | None = None  # the folder's path once made

    def path(self, name: str) -> str:
        """The path of the file ``name`` in the folder, made first if it is not yet.

        Raises:
            OSError: the folder cannot be made.
        """
        if self.made is None:
            self.made = tempfile.mkdtemp(prefix=self.prefix)
        return os.path.join(self.made, name)

    def remove(self) -> None:
        """Remove the folder and its files, if it was made (raises nothing)."""
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)
            self.made = None


class StepLogSummarized(ValueError):
    """The per-step rows of a summarized log were asked for (``output.step_log: summary`` keeps none)."""


class StepLog:
    """Per-step records of one instance.

    Rows hold ``start, duration, scheduled_tokens, prefill_tokens, decode_requests, spec_tokens, batch_size,
    kv_blocks_used, num_running, num_waiting, num_preempted, output_tokens, transfer_s, micro_batch, stage_s``
    (seconds, tokens, counts); :meth:`frames` adds ``instance`` and ``kv_usage``. ``decode_requests`` counts every
    request computing one token of its output, speculative verify queries included, and ``spec_tokens`` the draft
    tokens they verify, so ``scheduled_tokens = prefill_tokens + decode_requests + spec_tokens``. ``duration``
    runs from the step's first stage start to its last stage end; ``stage_s`` is its longest pipeline stage (the
    whole step without PP); ``micro_batch`` is the step's slot in the in-flight window under pipeline parallelism
    (its sequence number modulo ``max_concurrent_batches``; 0 without PP, ``num_slots`` = 1).

    Memory is bounded by rows held, not by the run's length: once ``chunk_rows`` rows are held (checked before each
    append), all but the last (which an arrival may still update, :meth:`add_waiting`) are folded into
    :meth:`totals` and then, with ``spill_path`` set, written to that Arrow IPC file (created on the first spill),
    or with ``spill_folder``, to ``steps_<instance_id>.arrow`` in that :class:`SpillFolder` (made on the first
    spill); with ``summary`` they are dropped: the log keeps only the totals and :meth:`frames` raises. Without
    any of them, every row stays in memory (``simulation.step_log: memory``).
    """

    def __init__(self, instance_id: int = 0, usable_blocks: int = 1, spill_path: str | None = None,
                 chunk_rows: int = ROW_BUDGET, num_slots: int = 1, *, summary: bool = False,
                 spill_folder: SpillFolder | None = None) -> None:
        self.instance_id = instance_id
        self.usable_blocks = usable_blocks
        self.num_slots = num_slots
        self.summary = summary
        self.spill_path = None if summary else spill_path
        # (or, with ``spill_folder``, the file steps_<instance>.arrow there, once the first rows are spilled)
        self.spill_folder = None if summary or spill_path is not None else spill_folder
        self.chunk_rows = min(chunk_rows, SUMMARY_ROWS) if summary else chunk_rows
        self.bounded = summary or spill_path is not None or self.spill_folder is not None  # rows folded away
        # The rows held: blocks of rows (LOGGED_COLUMNS x rows, float64), then rows appended one at a time
        # (``_tail``, lists, moved into a block every TAIL_ROWS). A fast-forward jump's rows arrive as one block,
        # so no column grows by reallocation (array.array grows by 1/16 at a time: each row was copied about 16
        # times over a long run); the blocks are joined once, when the rows are read (:attr:`cols`).
        self._blocks: list[np.ndarray] = []
        self._tail: list[list[float]] = []
        self._held_rows = 0
        self.spilled_rows = 0  # rows no longer held (in the spill file, or only in the totals)
        self._folded = StepTotals()
        self._writer = None
        self._sink = None

    def append(self, start: float, duration: float, scheduled: int, prefill: int, decodes: int, batch: int,
               used: int, running: int, waiting: int, preempted: int, output: int, transfer_s: float,
               stage_s: float, spec: int = 0) -> None:
        """Append one step's row (its ``micro_batch`` slot follows from the row count); ``spec``: the draft tokens
        the step's verify queries score (speculative decoding), beside their one token each in ``decodes``."""
        slots = self.num_slots
        slot = 0 if slots == 1 else len(self) % slots
        self._tail.append([start, duration, scheduled, prefill, decodes, spec, batch, used, running, waiting,
                           preempted, output, transfer_s, slot, stage_s])
        self._held_rows += 1
        if len(self._tail) >= TAIL_ROWS:
            self._seal_tail()

    def _seal_tail(self) -> None:
        """Move the rows appended one at a time into a block."""
        if self._tail:
            self._blocks.append(np.array(self._tail, dtype=np.float64).T.copy())
            self._tail = []

    def extend(self, start, duration, decodes, used, running, waiting, prefill=None, batch=None,
               output=None) -> None:
        """Append rows of steps without transfers (fast-forward; a row's preemptions, 0 here, are set by
        :meth:`set_preempted`): per row ``decodes`` requests computing and sampling one token and, with
        ``prefill``, as many tokens of prompts (each request of ``batch`` minus ``decodes`` computes its prompt or a
        chunk of it); ``output``: the requests that sample (default: all of ``batch``); ``running``, ``waiting``:
        one count for every row, or one per row. Each column: a sequence or a numpy array of the rows' values
        (seconds, tokens, counts, blocks)."""
        if self.bounded:
            self.maybe_spill()
        n = len(start)
        if not n:
            return
        self._seal_tail()
        block = np.zeros((len(LOGGED_COLUMNS), n))
        (c_start, c_dur, c_sched, c_pre, c_dec, _c_spec, c_batch, c_used, c_run, c_wait, _c_pree, c_out, _c_xfer,
         c_slot, c_stage) = block  # (rows of the block, LOGGED_COLUMNS order; drafts, preemptions, transfers stay 0)
        c_start[:] = start
        c_dur[:] = duration
        c_dec[:] = decodes
        if prefill is None:
            c_sched[:] = c_dec
            c_batch[:] = c_dec
            c_out[:] = c_dec
        else:
            c_pre[:] = prefill
            c_sched[:] = c_dec + c_pre
            c_batch[:] = batch
            c_out[:] = c_batch if output is None else output
        c_used[:] = used
        c_run[:] = running
        c_wait[:] = waiting
        slots = self.num_slots
        if slots != 1:
            c_slot[:] = np.arange(len(self), len(self) + n) % slots
        c_stage[:] = c_dur
        self._blocks.append(block)
        self._held_rows += n

    def _set_from_end(self, rows_back: int, column: int, value: float, add: bool = False) -> None:
        """Set (or with ``add``, add to) ``column`` (index in LOGGED_COLUMNS) of the row ``rows_back`` rows from
        the end (1: the last)."""
        tail = self._tail
        if rows_back <= len(tail):
            row = tail[-rows_back]
            row[column] = row[column] + value if add else value
            return
        rows_back -= len(tail)
        for block in reversed(self._blocks):
            width = block.shape[1]
            if rows_back <= width:
                if add:
                    block[column, width - rows_back] += value
                else:
                    block[column, width - rows_back] = value
                return
            rows_back -= width
        raise IndexError("step log: no such row held")

    def set_preempted(self, rows_back: int, count: int) -> None:
        """Set the preemptions of the row ``rows_back`` rows from the end (1: the last) to ``count`` (a
        fast-forward jump's schedule that preempted; :meth:`extend` writes 0)."""
        self._set_from_end(rows_back, _PREEMPTED, count)

    def add_waiting(self, count: int) -> None:
        """Count ``count`` more waiting requests in the last row (arrivals during a fast-forward jump's last step)."""
        self._set_from_end(1, _WAITING, count, add=True)

    def maybe_spill(self) -> None:
        """Fold (and spill) the held rows once ``chunk_rows`` are held; a no-op for an unbounded log."""
        if self.bounded and self._held_rows >= self.chunk_rows:
            self.flush()

    def _joined(self) -> np.ndarray:
        """The rows held as one block (LOGGED_COLUMNS x rows), joined once and kept so."""
        self._seal_tail()
        blocks = self._blocks
        if len(blocks) != 1:
            self._blocks = blocks = [np.concatenate(blocks, axis=1) if blocks
                                     else np.zeros((len(LOGGED_COLUMNS), 0))]
        return blocks[0]

    @property
    def cols(self) -> dict[str, np.ndarray]:
        """The rows held, by column (LOGGED_COLUMNS; float64 views of the held rows, valid until more rows come)."""
        block = self._joined()
        return dict(zip(LOGGED_COLUMNS, block))

    def _held(self, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        block = self._joined()
        return {k: v[rows] for k, v in zip(LOGGED_COLUMNS, block)}

    def _frame_columns(self, cols: dict[str, np.ndarray]) -> dict:
        n = len(cols["start"])
        out = {"instance": np.full(n, float(self.instance_id))}
        for c in STEP_COLUMNS[1:]:
            out[c] = cols["kv_blocks_used"] / self.usable_blocks if c == "kv_usage" else cols[c]
        return out

    def flush(self) -> None:
        """Fold the rows held, all but the last, into the totals; write them to the spill file (full log) or drop
        them (summarized log). A no-op for an unbounded log."""
        n = self._held_rows - 1
        if n <= 0 or not self.bounded:
            return
        cols = self._held(slice(0, n))
        self._folded.add_rows(cols, self.usable_blocks)
        if self.spill_path is None and self.spill_folder is not None:
            self.spill_path = self.spill_folder.path(f"steps_{self.instance_id}.arrow")
        if self.spill_path is not None:
            self._write(cols)
        self.spilled_rows += n
        self._blocks = [self._blocks[0][:, n:].copy()]  # (the last row, which an arrival may still update)
        self._held_rows = 1

    def _write(self, cols: dict[str, np.ndarray]) -> None:
        """Append the rows to the spill file: an Arrow IPC file, LZ4-compressed (a temporary file read back by
        :meth:`frames`; it writes ~4x faster than Parquet at about Parquet's size)."""
        import pyarrow as pa  # noqa: PLC0415 - only a run that spills needs it

        table = pa.table(self._frame_columns(cols))
        if self._writer is None:
            os.makedirs(os.path.dirname(self.spill_path) or ".", exist_ok=True)
            self._sink = pa.OSFile(self.spill_path, "wb")
            self._writer = pa.ipc.new_file(self._sink, table.schema,
                                           options=pa.ipc.IpcWriteOptions(compression="lz4"))
        self._writer.write_table(table)

    def close(self) -> None:
        """Close the spill file (it can be read after). Raises nothing."""
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None

    def totals(self) -> StepTotals:
        """Totals over every row logged (those folded away and those held), for the summary's engine statistics."""
        out = StepTotals()
        out.merge(self._folded)
        out.add_rows(self._held(), self.usable_blocks)
        return out

    def frames(self, chunk_rows: int = 1 << 19):
        """The whole log as a sequence of DataFrames (spilled chunks first, then the rows in memory).

        Raises:
            StepLogSummarized: a summarized log (it keeps no rows).
        """
        import pandas as pd  # noqa: PLC0415

        if self.summary:
            raise StepLogSummarized("the step log is summarized (output.step_log: summary): it keeps no per-step "
                                    "rows; set output.step_log: full for steps.parquet and time series")
        if self.spilled_rows:
            import pyarrow as pa  # noqa: PLC0415

            self.close()
            with pa.memory_map(self.spill_path) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    for lo in range(0, batch.num_rows, chunk_rows):
                        yield batch.slice(lo, chunk_rows).to_pandas()
        if self._held_rows:
            yield pd.DataFrame(self._frame_columns(self._held()))

    def __len__(self) -> int:
        return self.spilled_rows + self._held_rows
