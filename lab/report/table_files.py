"""Tables written without pandas: Parquet through pyarrow's buffers, CSV as pandas writes it, bench_result.json
with its per-request lists formatted in bulk; and the JSON encoding of numpy numbers the outputs share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd


def json_default(o):
    """``json.dumps``'s ``default`` for the outputs: numpy integers and floats as Python numbers, paths as text."""
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o))


def table_frame(cols: dict) -> "pd.DataFrame":
    """A table of columns as a DataFrame, its columns in order (pandas is imported here, on first use)."""
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
        table_frame(cols).to_parquet(path, index=False)
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


_MARK = "\x00{}\x00"


def write_bench_json(d: dict, f) -> None:
    """Write a bench_result.json mapping (lab/report/run_report.py ``bench_result``) to text file ``f`` exactly as
    ``json.dumps(d, default=json_default)`` would, but with the per-request ``itls`` lists (a list of float lists
    or float64 arrays: a number per output token of the run, 4 million for the Vidur conversation setup) formatted
    in bulk: each distinct gap value once (a run's gaps are differences of step ends, far fewer distinct values
    than gaps), a block of requests at a time."""
    itls = d.get("itls")
    if not isinstance(itls, list) or not itls:
        f.write(json.dumps(d, default=json_default))
        return
    lists = [np.asarray(x, dtype=np.float64) for x in itls]
    flat = np.concatenate(lists)
    if not np.isfinite(flat).all():
        f.write(json.dumps(d, default=json_default))
        return
    mark = _MARK.format("itls")
    head, tail = json.dumps({**d, "itls": mark}, default=json_default).split(json.dumps(mark), 1)
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
