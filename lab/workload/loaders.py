"""Trace loaders. Each returns requests sorted by arrival time, in seconds: Azure and Mooncake timestamps are made
relative to the first request; the plain CSV's ``arrival_time_s`` and LLMServingSim's ``arrival_time_ns`` are used as
given (a trace may start later than 0 on purpose).

Formats (see shared/data/traces/PROVENANCE.md and shared/data/validation/llmservingsim/PROVENANCE.md):

- Azure LLM inference 2023 CSV: ``TIMESTAMP`` (wall clock), ``ContextTokens``, ``GeneratedTokens``.
- Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one integer per 512-token
  prompt block: ``ceil(input_length / 512)`` of them).
- LLMServingSim workload JSONL: ``input_toks``, ``output_toks``, ``arrival_time_ns``, ``input_tok_ids``,
  ``output_tok_ids`` (one id per token when given).
- Plain CSV: ``arrival_time_s``, ``prompt_tokens``, ``output_tokens`` and optional ``priority``, ``request_id``
  (unique), ``session_id``.
- vLLM bench JSON: an object with the lists ``input_lens``, ``output_lens`` and optional ``request_rate``,
  ``burstiness``.

Any of them may be compressed (a ``.gz``, ``.bz2``, ``.xz`` or one-member ``.zip`` name). Text must be UTF-8. CSV
files are read with the standard library's ``csv`` module (see docs/workloads.md).

**Unsorted arrivals are accepted and sorted**: a trace's rows need not be in arrival order. Each loader sorts its
requests by arrival time with a stable sort (requests arriving at the same time keep their file order); request ids
that are positions ("0", "1", ..., "bench-0", ...) are positions in the file, not in arrival order.

Every loader checks its columns and values and raises :class:`WorkloadError`, a one-line message naming the file,
the row (a CSV's line number: the header is row 1) or JSONL line (or, in a JSON file, the key and index), the field
and what was expected. A file without requests is an error too.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import math
import zipfile
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from lab.core.request import Request

MOONCAKE_BLOCK = 512  # tokens per Mooncake hash_ids entry
_EXACT_INT = float(2 ** 53)  # the largest magnitude below which every integer is a float exactly (and fits int64)


class WorkloadError(ValueError):
    """A trace file is missing, malformed or holds an impossible value."""


# ------------------------------------------------------------------------------------------------ reading files
def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _need_file(path: Path) -> None:
    if not path.is_file():
        raise WorkloadError(f"{path}: trace file does not exist")


def _unreadable(path: Path, e: BaseException) -> WorkloadError:
    """The error for a file that cannot be decompressed or decoded (``e`` from gzip, bz2, lzma, zipfile, zlib or the
    UTF-8 codec)."""
    if isinstance(e, UnicodeDecodeError):
        return WorkloadError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x}); expected a UTF-8 trace")
    kind = _COMPRESSED.get(path.suffix)
    if kind is not None:
        return WorkloadError(f"{path}: corrupt or truncated {kind[0]} file ({_one_line(e) or type(e).__name__})")
    return WorkloadError(f"{path}: cannot read the file ({_one_line(e) or type(e).__name__})")


def _unzip(data: bytes) -> bytes:
    """The one member of a zip archive (as pandas reads a zipped CSV).

    Raises:
        zipfile.BadZipFile: not a zip archive, or one with several members.
    """
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        names = z.namelist()
        if len(names) != 1:
            raise zipfile.BadZipFile(f"{len(names)} members; expected one file")
        return z.read(names[0])


# file name suffix -> (what to call it in an error, how to decompress it)
_COMPRESSED = {".gz": ("gzip", gzip.decompress), ".bz2": ("bzip2", bz2.decompress), ".xz": ("xz", lzma.decompress),
               ".zip": ("zip", _unzip)}


class _CsvRows:
    """A CSV trace's data rows as text, column by column: ``cells[name]`` (one string per kept row, in the header's
    column order, the first of a repeated name kept; '' for a field the row lacks) and ``lines`` (each row's line
    number in the file: the header is line 1, blank lines count)."""

    __slots__ = ("cells", "lines")

    def __init__(self, cells: dict[str, list[str]], lines: list[int]) -> None:
        self.cells = cells
        self.lines = lines

    def __len__(self) -> int:
        return len(self.lines)


def _check_columns(path: Path, rows: _CsvRows, need: Iterable[str]) -> None:
    missing = [c for c in need if c not in rows.cells]
    if missing:
        raise WorkloadError(f"{path}: missing column(s) {missing}; found {list(rows.cells)}")


def _read_csv(path: Path, need: Iterable[str] = ()) -> _CsvRows:
    """Read a CSV trace (the standard library's ``csv`` dialect: commas, double-quoted fields) with at least one
    data row and the columns ``need``. Blank lines are skipped but still counted in the line numbers.

    Raises:
        WorkloadError: a missing, empty, non-UTF-8 or corrupt (compressed) file, a row with more fields than
        the header or an unclosed quote, no data rows, or a missing column.
    """
    try:
        text = _read_bytes(path).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _unreadable(path, e) from None
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next((row for row in reader if any(cell.strip() for cell in row)), None)
        if header is None:
            raise WorkloadError(f"{path}: the file is empty; expected a header row and one row per request")
        names = [name.strip() for name in header]
        width = len(names)
        records, lines = [], []
        start = reader.line_num + 1  # the line the next record starts on (a quoted field may span lines)
        for row in reader:
            if not (row and row[0].strip()) and not any(cell.strip() for cell in row):
                start = reader.line_num + 1
                continue  # a blank line
            if len(row) > width:
                raise WorkloadError(f"{path}: not a well-formed CSV (line {start} has {len(row)} fields, "
                                    f"the header {width})")
            if len(row) < width:
                row += [""] * (width - len(row))
            records.append(row)
            lines.append(start)
            start = reader.line_num + 1
    except csv.Error as e:
        raise WorkloadError(f"{path}: not a well-formed CSV (the record from line {start}: {_one_line(e)}; "
                            f"an unclosed quote?)") from None
    if not records:
        raise WorkloadError(f"{path}: no requests (only a header row)")
    columns = list(zip(*records))
    cells: dict[str, list[str]] = {}
    for name, column in zip(names, columns):
        cells.setdefault(name, list(column))
    rows = _CsvRows(cells, lines)
    _check_columns(path, rows, need)
    return rows


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when its name ends in ``.gz``, ``.bz2``, ``.xz`` or ``.zip`` (one member).

    Raises:
        WorkloadError: missing file, corrupt or truncated compressed file.
    """
    _need_file(path)
    kind = _COMPRESSED.get(path.suffix)
    try:
        data = path.read_bytes()
        return data if kind is None else kind[1](data)
    except (OSError, EOFError, zlib.error, lzma.LZMAError, zipfile.BadZipFile) as e:
        raise _unreadable(path, e) from None


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line.

    Raises:
        WorkloadError: missing file, corrupt gzip, or a line that is not UTF-8 (naming the line).
    """
    for lineno, raw in enumerate(_read_bytes(path).splitlines(), 1):
        try:
            line = raw.decode("utf-8").strip().lstrip("\ufeff")
        except UnicodeDecodeError as e:
            raise WorkloadError(f"{path}: line {lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); expected a UTF-8 trace") from None
        if line:
            yield lineno, line


def _json_kind(v: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSON-lines file.

    Raises:
        WorkloadError: unreadable file, a line that is not JSON or not a JSON object, or no lines at all.
    """
    rows = []
    for lineno, line in _text_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{path}: line {lineno}: expected a JSON object {{...}} per line, got "
                                f"{_json_kind(row)} ({_shown(row)})")
        rows.append((lineno, row))
    if not rows:
        raise WorkloadError(f"{path}: the file is empty; expected one JSON object per line, one per request")
    return rows


def _read_json(path: Path) -> object:
    """A whole JSON document.

    Raises:
        WorkloadError: unreadable or empty file, not UTF-8, not valid JSON (with its line).
    """
    data = _read_bytes(path)
    try:
        text = data.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as e:
        lineno = data[:e.start].count(b"\n") + 1
        raise WorkloadError(f"{path}: line {lineno}: not UTF-8 text (byte 0x{data[e.start]:02x}); expected a UTF-8 "
                            "trace") from None
    if not text.strip():
        raise WorkloadError(f"{path}: the file is empty; expected a JSON object with input_lens and output_lens")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None


# ------------------------------------------------------------------------------------------------ CSV values
def _as_written(cell: str) -> str:
    """A cell for an error message: a number as written (12.5, nan), anything else quoted ('abc', '')."""
    try:
        float(cell)
    except ValueError:
        return repr(cell)
    return cell.strip()


def _float_or_nan(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        return math.nan


def _numbers(path: Path, rows: _CsvRows, column: str, need: str, ok) -> np.ndarray:
    """``column`` as floats, every value passing ``ok(array) -> mask`` (text, booleans and empty cells are not
    numbers).

    Raises:
        WorkloadError: the first offending row (its line number), with its value as written in the file.
    """
    cells = rows.cells[column]
    try:
        arr = np.array(cells, dtype=float)  # (float() of each cell, in C)
    except ValueError:  # some cell is not a number: NaN there, so that the check below names the first
        arr = np.array([_float_or_nan(c) for c in cells], dtype=float)
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~(np.isfinite(arr) & ok(arr)))
    if len(bad):
        i = int(bad[0])
        raise WorkloadError(f"{path}: row {rows.lines[i]}: {column} must be {need}, got {_as_written(cells[i])}")
    return arr


def _int_column(path: Path, rows: _CsvRows, column: str, minimum: int | None = None) -> np.ndarray:
    """A column of whole numbers (a float such as 100.7 is refused, not truncated).

    Raises:
        WorkloadError: the first offending row, with its value as written in the file.
    """
    need = "an integer" + (f" >= {minimum}" if minimum is not None else "")
    low = -np.inf if minimum is None else minimum
    arr = _numbers(path, rows, column, need, lambda a: (a == np.floor(a)) & (a >= low))
    big = np.flatnonzero(np.abs(arr) > _EXACT_INT)
    if len(big):
        i = int(big[0])
        raise WorkloadError(f"{path}: row {rows.lines[i]}: {column} must be at most 2**53 in magnitude, got "
                            f"{_as_written(rows.cells[column][i])}")
    return arr.astype(np.int64)


def _seconds_column(path: Path, rows: _CsvRows, column: str) -> np.ndarray:
    """A column of arrival times: finite numbers >= 0.

    Raises:
        WorkloadError: the first offending row (NaN, infinite, negative, not a number).
    """
    return _numbers(path, rows, column, "a number >= 0", lambda a: a >= 0)


def _id_column(path: Path, rows: _CsvRows, column: str) -> list[str]:
    """A column of request ids (as written, surrounding spaces dropped): none missing, each unique.

    Raises:
        WorkloadError: the first empty id, or the first id that repeats an earlier row's.
    """
    seen: dict[str, int] = {}
    ids = [c.strip() for c in rows.cells[column]]
    for v, row in zip(ids, rows.lines):
        if not v:
            raise WorkloadError(f"{path}: row {row}: {column} is empty; expected a unique id per request")
        first = seen.setdefault(v, row)
        if first != row:
            raise WorkloadError(f"{path}: row {row}: {column} {v!r} repeats row {first}'s; ids must be unique")
    return ids


def _requests_in_order(t: np.ndarray, prompt: np.ndarray, output: np.ndarray, order: np.ndarray,
                       priority: np.ndarray | None = None, ids: list[str] | None = None) -> list[Request]:
    """The requests of rows ``order`` (a permutation of the rows, the time order), indexed 0.. in that order:
    arrival ``t`` (seconds), ``prompt`` and ``output`` tokens, ``priority`` (default 0) and ``ids`` by row
    (default: the row's position as text). The columns go to Python numbers in one ``tolist`` each, not one numpy
    scalar a cell (Azure conversation trace, 19,366 rows: ~20 ms instead of ~60 ms)."""
    rows = order.tolist()
    names = [str(i) for i in rows] if ids is None else [ids[i] for i in rows]
    prio = priority[order].tolist() if priority is not None else [0] * len(rows)
    return list(map(Request, range(len(rows)), t[order].tolist(), prompt[order].tolist(), output[order].tolist(),
                    prio, names))


# ------------------------------------------------------------------------------------------------ JSON values
def _shown(v: object) -> str:
    """A JSON value as written (true, null, NaN), shortened for an error message."""
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _json_int(where: str, key: str, v: object, minimum: int | None = None) -> int:
    """An integer JSON value (12.0 is accepted, 12.5, "12", true and NaN are not).

    Raises:
        WorkloadError: ``where: key must be an integer [>= minimum], got ...``.
    """
    if not (_is_number(v) and v == int(v) and (minimum is None or v >= minimum)):
        need = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        raise WorkloadError(f"{where}: {key} must be {need}, got {_shown(v)}")
    return int(v)


def _json_seconds(where: str, key: str, v: object, scale: float) -> float:
    """A finite non-negative JSON number, divided by ``scale`` (1000 for ms, 1e9 for ns).

    Raises:
        WorkloadError: NaN, infinite, negative, a string, a boolean or null.
    """
    if not (_is_number(v) and v >= 0):
        raise WorkloadError(f"{where}: {key} must be a number >= 0 (finite), got {_shown(v)}")
    return float(v) / scale


def _field(path: Path, lineno: int, row: dict, key: str):
    """``row[key]``.

    Raises:
        WorkloadError: the key is missing.
    """
    if key not in row:
        raise WorkloadError(f"{path}: line {lineno}: missing key {key!r}; found {sorted(row)}")
    return row[key]


def _int_list(where: str, key: str, v: object, count: int, count_of: str) -> list[int]:
    """A JSON list of ``count`` integers (``count_of`` says where the count comes from: "input_toks is 4").

    Raises:
        WorkloadError: not a list, an entry that is not an integer, or the wrong length.
    """
    if not isinstance(v, list):
        raise WorkloadError(f"{where}: {key} must be a list of integers, got {_json_kind(v)} ({_shown(v)})")
    for j, x in enumerate(v):
        if not (isinstance(x, int) and not isinstance(x, bool)):
            raise WorkloadError(f"{where}: {key}[{j}] must be an integer, got {_shown(x)}")
    if len(v) != count:
        raise WorkloadError(f"{where}: {key} has {len(v)} ids but {count_of}")
    return v


# ------------------------------------------------------------------------------------------------ loaders
def load_azure(path: str | Path) -> list[Request]:
    """Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA'24; CC-BY-4.0). Rows need not be in time
    order (sorted, stable); request ids are the data rows' positions ("0" = the first).

    Raises:
        WorkloadError: a bad file, column or value (see the module docstring).
    """
    path = Path(path)
    rows = _read_csv(path, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
    import pandas as pd  # noqa: PLC0415 - only this format's time stamps need it (start-up of other runs)

    stamps = rows.cells["TIMESTAMP"]
    ts = pd.to_datetime(pd.Series(stamps, dtype=object), format="mixed", errors="coerce")
    bad = np.flatnonzero(ts.isna().to_numpy())
    if len(bad):
        i = int(bad[0])
        raise WorkloadError(f"{path}: row {rows.lines[i]}: TIMESTAMP must be a date-time like "
                            f"2023-11-16 18:15:46.6805900, got {stamps[i]!r}")
    t = (ts - ts.min()).dt.total_seconds().to_numpy()
    prompt = _int_column(path, rows, "ContextTokens", 1)
    output = _int_column(path, rows, "GeneratedTokens", 1)
    return _requests_in_order(t, prompt, output, np.argsort(t, kind="stable"))


def _mooncake_row(path: Path, lineno: int, r: dict) -> tuple[float, int, int, list[int] | None]:
    """(seconds, prompt, output, hash_ids) of one Mooncake line.

    Raises:
        WorkloadError: a missing key or a bad value, naming the line and the key.
    """
    where = f"{path}: line {lineno}"
    ts = _json_seconds(where, "timestamp", _field(path, lineno, r, "timestamp"), 1000.0)
    p = _json_int(where, "input_length", _field(path, lineno, r, "input_length"), 1)
    o = _json_int(where, "output_length", _field(path, lineno, r, "output_length"), 1)
    h = r.get("hash_ids")
    if h is not None:
        blocks = -(-p // MOONCAKE_BLOCK)
        h = _int_list(where, "hash_ids", h, blocks,
                      f"input_length {p} needs {blocks} (one per {MOONCAKE_BLOCK}-token block)")
    return ts, p, o, h


def load_mooncake(path: str | Path, jitter_s: float = 0.0, seed: int = 0) -> list[Request]:
    """Mooncake FAST'25 trace JSONL (Qin et al.; Apache-2.0). ``hash_ids`` name 512-token prompt blocks.

    The conversation trace's timestamps are quantised to ~3 s buckets; ``jitter_s`` > 0 spreads each request
    uniformly over ``[t, t + jitter_s)`` (seeded) before sorting. Lines need not be in time order (sorted, stable);
    request ids are the requests' positions in the file ("0" = the first).

    Raises:
        WorkloadError: a bad file, line or value (see the module docstring).
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    out = []
    for k, (lineno, r) in enumerate(_read_jsonl(path)):
        ts, p, o, h = _mooncake_row(path, lineno, r)
        if jitter_s > 0:
            ts += float(rng.uniform(0.0, jitter_s))
        out.append((ts, k, p, o, h))
    out.sort(key=lambda x: (x[0], x[1]))
    t0 = out[0][0]
    return [Request(k, ts - t0, p, o, request_id=str(i), hash_ids=h, hash_block_size=MOONCAKE_BLOCK)
            for k, (ts, i, p, o, h) in enumerate(out)]


def _llmservingsim_row(path: Path, lineno: int, r: dict) -> tuple[float, int, int, list | None, list | None]:
    """(seconds, prompt, output, prompt ids, output ids) of one LLMServingSim line.

    Raises:
        WorkloadError: a missing key or a bad value, naming the line and the key.
    """
    where = f"{path}: line {lineno}"
    p = _json_int(where, "input_toks", _field(path, lineno, r, "input_toks"), 1)
    o = _json_int(where, "output_toks", _field(path, lineno, r, "output_toks"), 1)
    t = _json_seconds(where, "arrival_time_ns", _field(path, lineno, r, "arrival_time_ns"), 1e9)
    ids, oids = r.get("input_tok_ids"), r.get("output_tok_ids")
    if ids is not None:
        ids = _int_list(where, "input_tok_ids", ids, p, f"input_toks is {p}")
    if oids is not None:
        oids = _int_list(where, "output_tok_ids", oids, o, f"output_toks is {o}")
    return t, p, o, ids, oids


def load_llmservingsim(path: str | Path) -> list[Request]:
    """LLMServingSim workload JSONL (casys-kaist/LLMServingSim ``workloads/``; MIT), with token ids. Lines need not
    be in time order (sorted, stable); request ids are ``bench-<position in the file>``.

    Raises:
        WorkloadError: a bad file, line or value (see the module docstring).
    """
    path = Path(path)
    out = []
    for k, (lineno, r) in enumerate(_read_jsonl(path)):
        t, p, o, ids, oids = _llmservingsim_row(path, lineno, r)
        out.append((t, k, p, o, ids, oids))
    out.sort(key=lambda x: (x[0], x[1]))
    return [Request(k, t, p, o, request_id=f"bench-{i}", prompt_token_ids=ids, output_token_ids=oids)
            for k, (t, i, p, o, ids, oids) in enumerate(out)]


def load_csv(path: str | Path) -> list[Request]:
    """Plain CSV: ``arrival_time_s, prompt_tokens, output_tokens`` (+ optional ``priority``, ``request_id``,
    ``session_id`` for session-affinity routing; an empty ``session_id`` means none; ``acceptance_rate``, the
    request's own speculative-decoding acceptance probability in [0, 1], used by ``speculative.acceptance.kind:
    per_request``). Rows need not be in time order (sorted, stable); without ``request_id`` the ids are the data
    rows' positions ("0" = the first).

    Raises:
        WorkloadError: a bad file, column or value (see the module docstring), or a repeated ``request_id``.
    """
    path = Path(path)
    rows = _read_csv(path, ["arrival_time_s", "prompt_tokens", "output_tokens"])
    t = _seconds_column(path, rows, "arrival_time_s")
    prompt = _int_column(path, rows, "prompt_tokens", 1)
    output = _int_column(path, rows, "output_tokens", 1)
    cells = rows.cells
    prio = _int_column(path, rows, "priority") if "priority" in cells else None
    ids = _id_column(path, rows, "request_id") if "request_id" in cells else None
    sessions = [s.strip() or None for s in cells["session_id"]] if "session_id" in cells else None
    acceptance = (_numbers(path, rows, "acceptance_rate", "a probability in [0, 1]", lambda a: (a >= 0) & (a <= 1))
                  if "acceptance_rate" in cells else None)
    order = np.argsort(t, kind="stable")
    reqs = _requests_in_order(t, prompt, output, order, prio, ids)
    if sessions is not None:
        for r, i in zip(reqs, order.tolist()):
            r.session_id = sessions[i]
    if acceptance is not None:
        for r, i in zip(reqs, order):
            r.acceptance_rate = float(acceptance[i])
    return reqs


def _bench_lengths(path: Path, d: dict, key: str) -> np.ndarray:
    """``d[key]``: a non-empty list of integers >= 1.

    Raises:
        WorkloadError: missing key, not a list, empty ("no requests"), or a bad entry (named ``key[i]``).
    """
    if key not in d:
        raise WorkloadError(f"{path}: missing key {key!r} (save it with --save-result --save-detailed)")
    v = d[key]
    if not isinstance(v, list):
        raise WorkloadError(f"{path}: {key} must be a list of token counts, got {_json_kind(v)} ({_shown(v)})")
    if not v:
        raise WorkloadError(f"{path}: no requests ({key} is an empty list)")
    return np.array([_json_int(str(path), f"{key}[{i}]", x, 1) for i, x in enumerate(v)], dtype=np.int64)


def _bench_arrivals(path: Path, d: dict) -> tuple[float, float]:
    """(request_rate, burstiness); a missing or null rate, or ``"inf"``, is ``inf`` (all at once).

    Raises:
        WorkloadError: a rate that is not a number > 0 or "inf", a burstiness that is not a number > 0.
    """
    rate, burst = d.get("request_rate"), d.get("burstiness")
    if rate is None or rate in ("inf", "Infinity") or rate == math.inf:
        rate = math.inf
    elif not (_is_number(rate) and rate > 0):
        raise WorkloadError(f"{path}: request_rate must be a number > 0 (req/s) or \"inf\", got {_shown(rate)}")
    if burst is None:
        burst = 1.0
    elif not (_is_number(burst) and burst > 0):
        raise WorkloadError(f"{path}: burstiness must be a number > 0 (Gamma shape), got {_shown(burst)}")
    return float(rate), float(burst)


def vllm_bench_max_concurrency(path: str | Path) -> int | None:
    """The ``max_concurrency`` a ``vllm bench serve`` result was run with (``--max-concurrency``), or None (open
    loop). Such a run was closed-loop, and is replayed as one (lab/workload/closed_loop.py).

    Raises:
        WorkloadError: a value that is neither null nor an integer >= 1.
    """
    d = _read_json(Path(path))
    v = d.get("max_concurrency") if isinstance(d, dict) else None
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise WorkloadError(f"{path}: max_concurrency must be null or an integer >= 1, got {v!r}")
    return v


def load_vllm_bench(path: str | Path, seed: int = 0) -> list[Request]:
    """The requests of a ``vllm bench serve --save-result --save-detailed`` JSON: ``input_lens``, ``output_lens``
    and, for arrivals, ``request_rate`` (req/s; ``inf`` = all at once) and ``burstiness`` (Gamma shape; 1 =
    Poisson), drawn with ``seed``. vLLM's own draw order is not reproduced, so arrivals match the benchmark in
    distribution, not request by request; pass ``workload.arrival_times`` for an exact replay. Request ids are the
    indices in the file ("0", "1", ...), which is how ``validation.format: vllm_bench`` matches them.

    Raises:
        WorkloadError: a bad file or value, naming the key (``input_lens[3]``); empty lists are "no requests".
    """
    path = Path(path)
    d = _read_json(path)
    if not isinstance(d, dict):
        raise WorkloadError(f"{path}: expected a JSON object with input_lens and output_lens, got "
                            f"{_json_kind(d)} ({_shown(d)})")
    prompt = _bench_lengths(path, d, "input_lens")
    output = _bench_lengths(path, d, "output_lens")
    if len(prompt) != len(output):
        raise WorkloadError(f"{path}: input_lens has {len(prompt)} entries but output_lens has {len(output)}")
    rate, burst = _bench_arrivals(path, d)
    n = len(prompt)
    if np.isinf(rate):
        t = np.zeros(n)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(burst, 1.0 / (rate * burst), n)
        gaps[0] = 0.0
        t = np.cumsum(gaps)
    return _requests_in_order(t, prompt, output, np.arange(n))


def check_requests(path: str | Path, requests: list[Request]) -> None:
    """What every trace must satisfy, whatever its format: each arrival time a finite number of seconds >= 0 and
    each request id unique. (The loaders already check both row by row; this is the last word for any source.)

    Raises:
        WorkloadError: the first offending request, named by its position in the trace and its id.
    """
    times = np.fromiter([r.arrival_time for r in requests], np.float64, len(requests))
    with np.errstate(invalid="ignore"):
        all_times_ok = bool((np.isfinite(times) & (times >= 0)).all())
    if all_times_ok and len({r.request_id for r in requests}) == len(requests):
        return  # (the common case, checked whole: a loop over the requests only to name the first offender)
    seen: dict[str, int] = {}
    for i, r in enumerate(requests):
        t = r.arrival_time
        if not math.isfinite(t) or t < 0:
            raise WorkloadError(f"{path}: request {i} (id {r.request_id!r}): arrival time {t!r}; expected a finite "
                                "number of seconds >= 0")
        j = seen.setdefault(r.request_id, i)
        if j != i:
            raise WorkloadError(f"{path}: request {i}: id {r.request_id!r} repeats request {j}'s; ids must be unique")


def _trace_position(r: Request) -> int:
    tail = r.request_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else r.index


def override_arrivals(requests: list[Request], path: str | Path, column: str) -> list[Request]:
    """Replace each request's arrival time by ``column`` of a CSV with one row per request in trace order
    (e.g. the measured ``arrival_rel_s`` of an LLMServingSim run), then re-sort.

    Raises:
        WorkloadError: missing or malformed file, missing column, a time that is not a finite number >= 0 (naming
        the row), or a row count that differs from the trace.
    """
    path = Path(path)
    rows = _read_csv(path, [column])
    t = _seconds_column(path, rows, column)
    by_trace_order = sorted(requests, key=_trace_position)
    if len(rows) != len(requests):
        raise WorkloadError(f"{path}: {len(rows)} rows but the trace has {len(requests)} requests")
    for r, ti in zip(by_trace_order, t):
        r.arrival_time = float(ti)
    by_trace_order.sort(key=lambda r: (r.arrival_time, r.index))
    for k, r in enumerate(by_trace_order):
        r.index = k
    return by_trace_order
