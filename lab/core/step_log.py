"""The per-step records of one instance, kept column-wise in compact arrays (one row per step)."""

from __future__ import annotations

from array import array

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

STEP_COLUMNS = (
    "instance", "start", "duration", "scheduled_tokens", "prefill_tokens", "decode_requests", "batch_size",
    "kv_blocks_used", "kv_usage", "num_running", "num_waiting", "num_preempted", "output_tokens", "transfer_s",
    "micro_batch", "stage_s",
)
# what a StepLog stores per row; "instance" and "kv_usage" (= kv_blocks_used / usable blocks) are added when read
LOGGED_COLUMNS = tuple(c for c in STEP_COLUMNS if c not in ("instance", "kv_usage"))


class StepLog:
    """Per-step records of one instance.

    Rows hold ``start, duration, scheduled_tokens, prefill_tokens, decode_requests, batch_size, kv_blocks_used,
    num_running, num_waiting, num_preempted, output_tokens, transfer_s, micro_batch, stage_s`` (seconds, tokens,
    counts); :meth:`frames` adds ``instance`` and ``kv_usage``. ``duration`` runs from the step's first stage start
    to its last stage end; ``stage_s`` is its longest pipeline stage (the whole step without PP); ``micro_batch``
    is the step's slot in the in-flight window under pipeline parallelism (its sequence number modulo
    ``max_concurrent_batches``; 0 without PP, ``num_slots`` = 1).

    With ``spill_path`` set, every ``chunk_rows`` rows are written to that Parquet file and dropped from memory,
    so a long run's memory does not grow with its history.
    """

    def __init__(self, instance_id: int = 0, usable_blocks: int = 1, spill_path: str | None = None,
                 chunk_rows: int = 1 << 16, num_slots: int = 1) -> None:
        self.instance_id = instance_id
        self.usable_blocks = usable_blocks
        self.num_slots = num_slots
        self.cols = {c: array("d") for c in LOGGED_COLUMNS}
        self._cols = list(self.cols.values())
        self.spill_path = spill_path
        self.chunk_rows = chunk_rows
        self.spilled_rows = 0
        self._writer = None

    def append(self, start: float, duration: float, scheduled: int, prefill: int, decodes: int, batch: int,
               used: int, running: int, waiting: int, preempted: int, output: int, transfer_s: float,
               stage_s: float) -> None:
        """Append one step's row (its ``micro_batch`` slot follows from the row count)."""
        slots = self.num_slots
        slot = 0 if slots == 1 else len(self) % slots
        for c, v in zip(self._cols, (start, duration, scheduled, prefill, decodes, batch, used, running, waiting,
                                     preempted, output, transfer_s, slot, stage_s)):
            c.append(v)

    def extend(self, start: list, duration: list, batch: list, used: list, running: int, waiting: int) -> None:
        """Append pure-decode rows (fast-forward): ``batch[i]`` requests each computing and sampling one token."""
        n = len(start)
        (c_start, c_dur, c_sched, c_pre, c_dec, c_batch, c_used, c_run, c_wait, c_pree, c_out,
         c_xfer, c_slot, c_stage) = self._cols
        c_start.extend(start)
        c_dur.extend(duration)
        c_sched.extend(batch)
        zeros = [0.0] * n
        c_pre.extend(zeros)
        c_dec.extend(batch)
        c_batch.extend(batch)
        c_used.extend(used)
        c_run.extend([running] * n)
        c_wait.extend([waiting] * n)
        c_pree.extend(zeros)
        c_out.extend(batch)
        c_xfer.extend(zeros)
        slots = self.num_slots
        c_slot.extend(zeros if slots == 1 else [(len(self) - n + i) % slots for i in range(n)])
        c_stage.extend(duration)

    def add_waiting(self, count: int) -> None:
        """Count ``count`` more waiting requests in the last row (arrivals during a fast-forward jump's last step)."""
        self.cols["num_waiting"][-1] += count

    def maybe_spill(self) -> None:
        if self.spill_path is not None and len(self._cols[0]) >= self.chunk_rows:
            self.flush()

    def _frame_columns(self) -> dict:
        cols = {k: np.frombuffer(v, dtype=float) if len(v) else np.array([], float) for k, v in self.cols.items()}
        n = len(cols["start"])
        out = {"instance": np.full(n, float(self.instance_id))}
        for c in STEP_COLUMNS[1:]:
            out[c] = cols["kv_blocks_used"] / self.usable_blocks if c == "kv_usage" else cols[c]
        return out

    def flush(self) -> None:
        """Write the rows held in memory to the spill file."""
        n = len(self._cols[0])
        if not n or self.spill_path is None:
            return
        table = pa.table(self._frame_columns())
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.spill_path, table.schema)
        self._writer.write_table(table)
        self.spilled_rows += n
        self.cols = {c: array("d") for c in LOGGED_COLUMNS}
        self._cols = list(self.cols.values())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def frames(self, chunk_rows: int = 1 << 19):
        """The whole log as a sequence of DataFrames (spilled chunks first, then the rows in memory)."""
        if self.spilled_rows:
            self.close()
            for batch in pq.ParquetFile(self.spill_path).iter_batches(batch_size=chunk_rows):
                yield batch.to_pandas()
        if len(self._cols[0]):
            yield pd.DataFrame(self._frame_columns())

    def __len__(self) -> int:
        return self.spilled_rows + len(self._cols[0])
