"""Trace loaders. Each returns requests sorted by arrival time, in seconds: Azure and Mooncake timestamps are made
relative to the first request; the plain CSV's ``arrival_time_s`` and LLMServingSim's ``arrival_time_ns`` are used as
given (a trace may start later than 0 on purpose).

Formats (see shared/data/traces/PROVENANCE.md and shared/data/validation/llmservingsim/PROVENANCE.md):

- Azure LLM inference 2023 CSV: ``TIMESTAMP`` (wall clock), ``ContextTokens``, ``GeneratedTokens``.
- Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token prefix blocks).
- LLMServingSim workload JSONL (optionally .gz): ``input_toks``, ``output_toks``, ``arrival_time_ns``,
  ``input_tok_ids``, ``output_tok_ids``.
- Plain CSV: ``arrival_time_s``, ``prompt_tokens``, ``output_tokens`` and optional ``priority``, ``request_id``,
  ``session_id``.

Every loader checks its columns and values and raises :class:`WorkloadError` naming the file, the row (the file's
line number: the CSV header is row 1) and what was expected. A file without requests is an error too.
"""

from __future__ import annotations

import math

import gzip
import json
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from lab.core.request import Request


class WorkloadError(ValueError):
    """A trace file is missing, malformed or holds an impossible value."""


def _need_file(path: Path) -> None:
    if not path.is_file():
        raise WorkloadError(f"{path}: trace file does not exist")


def _check_columns(path: Path, df: pd.DataFrame, need: Iterable[str]) -> None:
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise WorkloadError(f"{path}: missing column(s) {missing}; found {list(df.columns)}")


def _read_csv(path: Path) -> pd.DataFrame:
    """Read a CSV trace with at least one data row.

    Raises:
        WorkloadError: an empty file, a row with more fields than the header, or no data rows.
    """
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise WorkloadError(f"{path}: the file is empty; expected a header row and one row per request") from None
    except pd.errors.ParserError as e:
        raise WorkloadError(f"{path}: not a well-formed CSV ({str(e).strip()})") from None
    if df.empty:
        raise WorkloadError(f"{path}: no requests (only a header row)")
    return df


def _as_written(v):
    """A cell value for an error message: numpy scalars as plain Python numbers."""
    return v.item() if hasattr(v, "item") else v


def _int_column(path: Path, df: pd.DataFrame, column: str, minimum: int | None = None) -> np.ndarray:
    """A column of whole numbers (a float such as 100.7 is refused, not truncated).

    Raises:
        WorkloadError: the first offending row, with its value as written in the file.
    """
    arr = pd.to_numeric(df[column], errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(arr) & (arr == np.floor(arr))
    if minimum is not None:
        ok &= arr >= minimum
    bad = np.flatnonzero(~ok)
    if len(bad):
        i = int(bad[0])
        need = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        raise WorkloadError(f"{path}: row {i + 2}: {column} must be {need}, got {_as_written(df[column].iloc[i])!r}")
    return arr.astype(np.int64)


def _check_lengths(path: Path, prompt: np.ndarray, output: np.ndarray, first_row: int = 1) -> None:
    for name, arr in (("prompt", prompt), ("output", output)):
        bad = np.flatnonzero(~((arr >= 1) & (arr == np.floor(arr))))
        if len(bad):
            i = int(bad[0])
            raise WorkloadError(f"{path}: row {i + first_row}: {name} tokens must be an integer >= 1, got {arr[i]}")


def load_azure(path: str | Path) -> list[Request]:
    """Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA'24; CC-BY-4.0)."""
    path = Path(path)
    _need_file(path)
    df = _read_csv(path)
    _check_columns(path, df, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
    try:
        ts = pd.to_datetime(df["TIMESTAMP"], format="mixed")
    except (ValueError, TypeError) as e:
        raise WorkloadError(f"{path}: column TIMESTAMP: expected date-times like 2023-11-16 18:15:46.6805900 ({e})") from None
    t = (ts - ts.min()).dt.total_seconds().to_numpy()
    prompt = pd.to_numeric(df["ContextTokens"], errors="coerce").to_numpy()
    output = pd.to_numeric(df["GeneratedTokens"], errors="coerce").to_numpy()
    _check_lengths(path, prompt, output, first_row=2)
    order = np.argsort(t, kind="stable")
    return [Request(int(k), float(t[i]), int(prompt[i]), int(output[i]), request_id=str(i))
            for k, i in enumerate(order)]


def _read_jsonl(path: Path) -> list[dict]:
    _need_file(path)
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
    return rows


def _field(path: Path, lineno: int, row: dict, key: str, kind: type = int):
    if key not in row:
        raise WorkloadError(f"{path}: line {lineno}: missing key {key!r}")
    v = row[key]
    if kind is int and (not isinstance(v, (int, float)) or v != int(v)):
        raise WorkloadError(f"{path}: line {lineno}: {key} must be an integer, got {v!r}")
    return v


def load_mooncake(path: str | Path, jitter_s: float = 0.0, seed: int = 0) -> list[Request]:
    """Mooncake FAST'25 trace JSONL (Qin et al.; Apache-2.0). ``hash_ids`` name 512-token prompt blocks.

    The conversation trace's timestamps are quantised to ~3 s buckets; ``jitter_s`` > 0 spreads each request
    uniformly over ``[t, t + jitter_s)`` (seeded) before sorting.
    """
    path = Path(path)
    rows = _read_jsonl(path)
    rng = np.random.default_rng(seed)
    out = []
    for lineno, r in enumerate(rows, 1):
        ts = float(_field(path, lineno, r, "timestamp", float)) / 1000.0
        p = int(_field(path, lineno, r, "input_length"))
        o = int(_field(path, lineno, r, "output_length"))
        if p < 1 or o < 1:
            raise WorkloadError(f"{path}: line {lineno}: input_length and output_length must be >= 1, got {p}, {o}")
        h = r.get("hash_ids")
        if h is not None and not isinstance(h, list):
            raise WorkloadError(f"{path}: line {lineno}: hash_ids must be a list of integers")
        if jitter_s > 0:
            ts += float(rng.uniform(0.0, jitter_s))
        out.append((ts, lineno - 1, p, o, h))
    out.sort(key=lambda x: (x[0], x[1]))
    t0 = out[0][0] if out else 0.0
    return [Request(k, ts - t0, p, o, request_id=str(i), hash_ids=h, hash_block_size=512)
            for k, (ts, i, p, o, h) in enumerate(out)]


def load_llmservingsim(path: str | Path) -> list[Request]:
    """LLMServingSim workload JSONL (casys-kaist/LLMServingSim ``workloads/``; MIT), with token ids."""
    path = Path(path)
    rows = _read_jsonl(path)
    out = []
    for lineno, r in enumerate(rows, 1):
        p = int(_field(path, lineno, r, "input_toks"))
        o = int(_field(path, lineno, r, "output_toks"))
        t = float(_field(path, lineno, r, "arrival_time_ns", float)) / 1e9
        if p < 1 or o < 1:
            raise WorkloadError(f"{path}: line {lineno}: input_toks and output_toks must be >= 1, got {p}, {o}")
        ids = r.get("input_tok_ids")
        if ids is not None and len(ids) != p:
            raise WorkloadError(f"{path}: line {lineno}: input_tok_ids has {len(ids)} ids but input_toks is {p}")
        out.append((t, lineno - 1, p, o, ids, r.get("output_tok_ids")))
    out.sort(key=lambda x: (x[0], x[1]))
    return [Request(k, t, p, o, request_id=f"bench-{i}", prompt_token_ids=ids, output_token_ids=oids)
            for k, (t, i, p, o, ids, oids) in enumerate(out)]


def load_csv(path: str | Path) -> list[Request]:
    """Plain CSV: ``arrival_time_s, prompt_tokens, output_tokens`` (+ optional ``priority``, ``request_id``,
    ``session_id`` for session-affinity routing)."""
    path = Path(path)
    _need_file(path)
    df = _read_csv(path)
    _check_columns(path, df, ["arrival_time_s", "prompt_tokens", "output_tokens"])
    t = pd.to_numeric(df["arrival_time_s"], errors="coerce").to_numpy(dtype=float)
    bad = np.flatnonzero(~((t >= 0) & np.isfinite(t)))
    if len(bad):
        raise WorkloadError(f"{path}: row {int(bad[0]) + 2}: arrival_time_s must be a number >= 0, "
                            f"got {_as_written(df['arrival_time_s'].iloc[int(bad[0])])!r}")
    prompt = _int_column(path, df, "prompt_tokens", 1)
    output = _int_column(path, df, "output_tokens", 1)
    prio = _int_column(path, df, "priority") if "priority" in df.columns else np.zeros(len(df), dtype=int)
    ids = df["request_id"].astype(str).to_numpy() if "request_id" in df.columns else None
    sessions = df["session_id"].astype(str).to_numpy() if "session_id" in df.columns else None
    order = np.argsort(t, kind="stable")
    return [Request(k, float(t[i]), int(prompt[i]), int(output[i]), priority=int(prio[i]),
                    request_id=str(ids[i]) if ids is not None else str(i),
                    session_id=str(sessions[i]) if sessions is not None else None)
            for k, i in enumerate(order)]


def load_vllm_bench(path: str | Path, seed: int = 0) -> list[Request]:
    """The requests of a ``vllm bench serve --save-result --save-detailed`` JSON: ``input_lens``, ``output_lens``
    and, for arrivals, ``request_rate`` (req/s; ``inf`` = all at once) and ``burstiness`` (Gamma shape; 1 =
    Poisson), drawn with ``seed``. vLLM's own draw order is not reproduced, so arrivals match the benchmark in
    distribution, not request by request; pass ``workload.arrival_times`` for an exact replay. Request ids are the
    indices in the file ("0", "1", ...), which is how ``validation.format: vllm_bench`` matches them.
    """
    path = Path(path)
    _need_file(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path}: not valid JSON ({e.msg})") from None
    for k in ("input_lens", "output_lens"):
        if k not in d:
            raise WorkloadError(f"{path}: missing key {k!r} (save it with --save-result --save-detailed)")
    prompt = np.asarray(d["input_lens"], dtype=float)
    output = np.asarray(d["output_lens"], dtype=float)
    if len(prompt) != len(output):
        raise WorkloadError(f"{path}: input_lens has {len(prompt)} entries but output_lens has {len(output)}")
    _check_lengths(path, prompt, output, first_row=0)
    n = len(prompt)
    rate = float(d.get("request_rate", float("inf")) or float("inf"))
    burst = float(d.get("burstiness", 1.0) or 1.0)
    if np.isinf(rate):
        t = np.zeros(n)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(burst, 1.0 / (rate * burst), n)
        gaps[0] = 0.0
        t = np.cumsum(gaps)
    return [Request(i, float(t[i]), int(prompt[i]), int(output[i]), request_id=str(i)) for i in range(n)]


def check_requests(path: str | Path, requests: list[Request]) -> None:
    """What every trace must satisfy, whatever its format: each arrival time a finite number of seconds >= 0 and
    each request id unique.

    Raises:
        WorkloadError: the first offending request, named by its position in the trace and its id.
    """
    seen: dict[str, int] = {}
    for i, r in enumerate(requests):
        t = r.arrival_time
        if not math.isfinite(t) or t < 0:
            raise WorkloadError(f"{path}: request {i} (id {r.request_id!r}): arrival time {t!r}; expected a finite "
                                "number of seconds >= 0")
        j = seen.setdefault(r.request_id, i)
        if j != i:
            raise WorkloadError(f"{path}: request {i}: id {r.request_id!r} repeats request {j}'s; ids must be unique")


def override_arrivals(requests: list[Request], path: str | Path, column: str) -> list[Request]:
    """Replace each request's arrival time by ``column`` of a CSV with one row per request in trace order
    (e.g. the measured ``arrival_rel_s`` of an LLMServingSim run), then re-sort.

    Raises:
        WorkloadError: missing file/column or a row count that differs from the trace.
    """
    path = Path(path)
    _need_file(path)
    df = pd.read_csv(path)
    _check_columns(path, df, [column])
    by_trace_order = sorted(requests, key=lambda r: int(r.request_id.rsplit("-", 1)[-1]) if r.request_id.rsplit("-", 1)[-1].isdigit() else r.index)
    if len(df) != len(requests):
        raise WorkloadError(f"{path}: {len(df)} rows but the trace has {len(requests)} requests")
    for r, t in zip(by_trace_order, df[column].to_numpy(dtype=float)):
        r.arrival_time = float(t)
    by_trace_order.sort(key=lambda r: (r.arrival_time, r.index))
    for k, r in enumerate(by_trace_order):
        r.index = k
    return by_trace_order
