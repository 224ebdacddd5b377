"""A corpus of bad trace files, generated in tmp_path: every loader rejects each with a one-line WorkloadError that
names the file, the row / line / key and what was expected; `servelab run` turns a few into exit status 2."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import math
import zipfile
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lab.workload import loaders, synthetic
from lab.workload.loaders import WorkloadError

REPO = Path(__file__).resolve().parent.parent
LOAD = {"azure": loaders.load_azure, "mooncake": loaders.load_mooncake, "llmservingsim": loaders.load_llmservingsim,
        "csv": loaders.load_csv, "vllm_bench": loaders.load_vllm_bench}
NAMES = {"azure": "azure.csv", "mooncake": "mooncake.jsonl", "llmservingsim": "lss.jsonl", "csv": "trace.csv",
         "vllm_bench": "bench.json"}


# ------------------------------------------------------------------------------------------------ file builders
def _put(path: Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path``: text compressed as the name says (.gz, .bz2, .xz; for .zip, a zip of two members,
    for the "one member" check), bytes as they are."""
    if isinstance(data, str):
        if path.suffix == ".zip":
            with zipfile.ZipFile(path, "w") as z:
                z.writestr("a.csv", data)
                z.writestr("b.csv", data)
            return path
        pack = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}.get(path.suffix)
        data = pack(data.encode()) if pack else data.encode()
    path.write_bytes(data)
    return path


def _jsonl(*rows) -> str:
    """JSON lines; a row that is a str is written as it is (a malformed line)."""
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"


def moon(**over) -> dict:
    return {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2], **over}


def lss(**over) -> dict:
    return {"input_toks": 3, "output_toks": 2, "arrival_time_ns": 0, "input_tok_ids": [1, 2, 3],
            "output_tok_ids": [4, 5], **over}


def bench(**over) -> str:
    return json.dumps({"request_rate": 4.0, "burstiness": 1.0, "input_lens": [100, 200], "output_lens": [3, 1],
                       **over})


def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


CSV_HEAD = "arrival_time_s,prompt_tokens,output_tokens\n"
AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_OK = "2023-11-16 18:15:46.6805900,374,44\n"
GOOD_MOON = moon()
GOOD_LSS = lss()


def _truncated_gzip(text: str) -> bytes:
    z = gzip.compress(text.encode())
    return z[: len(z) // 2]


# (loader, file name or None for the default, content, compress, fragments the message must hold)
CASES = {
    # --- plain CSV
    "csv-nan-arrival": ("csv", None, CSV_HEAD + "0,10,5\nnan,10,5\n", ["row 3", "arrival_time_s", "nan"]),
    "csv-inf-arrival": ("csv", None, CSV_HEAD + "0,10,5\ninf,10,5\n", ["row 3", "arrival_time_s", "inf"]),
    "csv-negative-arrival": ("csv", None, CSV_HEAD + "-0.5,10,5\n", ["row 2", "arrival_time_s", ">= 0"]),
    "csv-text-arrival": ("csv", None, CSV_HEAD + "0,10,5\nsoon,10,5\n", ["row 3", "arrival_time_s", "'soon'"]),
    "csv-empty-arrival-cell": ("csv", None, CSV_HEAD + "0,10,5\n,10,5\n", ["row 3", "arrival_time_s"]),
    "csv-fractional-prompt": ("csv", None, CSV_HEAD + "0,12.5,5\n", ["row 2", "prompt_tokens", "integer", "12.5"]),
    "csv-text-prompt": ("csv", None, CSV_HEAD + "0,abc,5\n", ["row 2", "prompt_tokens", "'abc'"]),
    "csv-zero-prompt": ("csv", None, CSV_HEAD + "0,0,5\n", ["row 2", "prompt_tokens", ">= 1"]),
    "csv-negative-output": ("csv", None, CSV_HEAD + "0,10,5\n1,10,-3\n", ["row 3", "output_tokens", ">= 1"]),
    "csv-boolean-output": ("csv", None, CSV_HEAD + "0,10,True\n1,10,False\n", ["row 2", "output_tokens", "True"]),
    "csv-fractional-priority": ("csv", None, "arrival_time_s,prompt_tokens,output_tokens,priority\n0,10,5,1.5\n",
                                ["row 2", "priority", "integer"]),
    "csv-duplicate-id": ("csv", None, "arrival_time_s,prompt_tokens,output_tokens,request_id\n0,10,5,a\n1,10,5,b\n"
                         "2,10,5,a\n", ["row 4", "request_id", "'a'", "repeats row 2"]),
    "csv-empty-id": ("csv", None, "arrival_time_s,prompt_tokens,output_tokens,request_id\n0,10,5,a\n1,10,5,\n",
                     ["row 3", "request_id", "empty"]),
    "csv-missing-column": ("csv", None, "arrival_time_s,prompt_tokens\n0,10\n", ["missing column", "output_tokens"]),
    "csv-empty-file": ("csv", None, "", ["empty"]),
    "csv-header-only": ("csv", None, CSV_HEAD, ["no requests", "header"]),
    "csv-header-and-blank-lines": ("csv", None, CSV_HEAD + "\n\n", ["no requests", "header"]),
    "csv-row-with-extra-field": ("csv", None, CSV_HEAD + "0,10,5\n1,2,3,4\n", ["not a well-formed CSV", "line 3"]),
    "csv-first-row-with-extra-field": ("csv", None, CSV_HEAD + "0,10,5,7\n1,10,5\n",
                                       ["not a well-formed CSV", "line 2"]),
    "csv-row-missing-a-field": ("csv", None, CSV_HEAD + "0,10,5\n1,10\n", ["row 3", "output_tokens"]),
    "csv-row-number-counts-blank-lines": ("csv", None, CSV_HEAD + "0,10,5\n\n1,0,5\n", ["row 4", "prompt_tokens"]),
    "csv-non-utf8": ("csv", None, CSV_HEAD.encode() + b"0,10,5\n1,\xff\xfe,5\n", ["UTF-8", "0xff"]),
    "csv-unclosed-quote": ("csv", None, CSV_HEAD + "0,10,5\n1,\"2,3\n" + "2,5,5\n" * 50,
                           ["not a well-formed CSV", "line 3", "unclosed quote"]),
    "csv-error-in-a-record-spanning-lines": ("csv", None, "arrival_time_s,prompt_tokens,output_tokens,session_id\n"
                                             "0,10,5,a\n1,x,3,\"multi\nline\"\n", ["row 3", "prompt_tokens", "'x'"]),
    "csv-huge-integer": ("csv", None, CSV_HEAD + "0,99999999999999999999,5\n", ["row 2", "prompt_tokens", "2**53"]),
    "csv-corrupt-bzip2": ("csv", "trace.csv.bz2", b"this is not bzip2 at all", ["bzip2"]),
    "csv-zip-with-two-members": ("csv", "trace.csv.zip", "two", ["zip", "members"]),
    "csv-corrupt-gzip": ("csv", "trace.csv.gz", b"this is not gzip at all", ["gzip"]),
    "csv-truncated-gzip": ("csv", "trace.csv.gz", _truncated_gzip(CSV_HEAD + "0,10,5\n" * 400), ["gzip"]),
    # --- Azure CSV
    "azure-bad-timestamp": ("azure", None, AZ_HEAD + AZ_OK + "yesterday,10,5\n", ["row 3", "TIMESTAMP", "'yesterday'"]),
    "azure-empty-timestamp": ("azure", None, AZ_HEAD + AZ_OK + ",10,5\n", ["row 3", "TIMESTAMP"]),
    "azure-fractional-context": ("azure", None, AZ_HEAD + AZ_OK + "2023-11-16 18:15:47,12.5,5\n",
                                 ["row 3", "ContextTokens", "12.5"]),
    "azure-text-context": ("azure", None, AZ_HEAD + "2023-11-16 18:15:47,abc,5\n", ["row 2", "ContextTokens", "'abc'"]),
    "azure-negative-context": ("azure", None, AZ_HEAD + "2023-11-16 18:15:47,-5,5\n", ["row 2", "ContextTokens"]),
    "azure-zero-generated": ("azure", None, AZ_HEAD + AZ_OK + "2023-11-16 18:15:47,10,0\n",
                             ["row 3", "GeneratedTokens", ">= 1"]),
    "azure-missing-column": ("azure", None, "TIMESTAMP,ContextTokens\n2023-11-16 18:15:47,10\n",
                             ["missing column", "GeneratedTokens"]),
    "azure-header-only": ("azure", None, AZ_HEAD, ["no requests"]),
    "azure-empty-file": ("azure", None, "", ["empty"]),
    "azure-non-utf8": ("azure", None, AZ_HEAD.encode() + b"2023-11-16 18:15:47\xc3\x28,10,5\n", ["UTF-8"]),
    # --- Mooncake JSONL
    "mooncake-nan-timestamp": ("mooncake", None, _jsonl(GOOD_MOON, moon(timestamp=math.nan)),
                               ["line 2", "timestamp", "NaN"]),
    "mooncake-infinite-timestamp": ("mooncake", None, _jsonl(moon(timestamp=math.inf)),
                                    ["line 1", "timestamp", "Infinity"]),
    "mooncake-negative-timestamp": ("mooncake", None, _jsonl(GOOD_MOON, moon(timestamp=-1)),
                                    ["line 2", "timestamp", ">= 0"]),
    "mooncake-string-timestamp": ("mooncake", None, _jsonl(moon(timestamp="0")), ["line 1", "timestamp", '"0"']),
    "mooncake-fractional-input": ("mooncake", None, _jsonl(GOOD_MOON, moon(input_length=12.5)),
                                  ["line 2", "input_length", "integer", "12.5"]),
    "mooncake-string-input": ("mooncake", None, _jsonl(moon(input_length="abc")), ["line 1", "input_length", '"abc"']),
    "mooncake-boolean-input": ("mooncake", None, _jsonl(moon(input_length=True)), ["line 1", "input_length", "true"]),
    "mooncake-null-input": ("mooncake", None, _jsonl(moon(input_length=None)), ["line 1", "input_length", "null"]),
    "mooncake-zero-output": ("mooncake", None, _jsonl(GOOD_MOON, moon(output_length=0)),
                             ["line 2", "output_length", ">= 1"]),
    "mooncake-negative-output": ("mooncake", None, _jsonl(moon(output_length=-2)), ["line 1", "output_length"]),
    "mooncake-hash-ids-scalar": ("mooncake", None, _jsonl(moon(hash_ids=5)), ["line 1", "hash_ids", "list"]),
    "mooncake-hash-ids-string-entry": ("mooncake", None, _jsonl(moon(hash_ids=[1, "b"])),
                                       ["line 1", "hash_ids[1]", "integer"]),
    "mooncake-hash-ids-float-entry": ("mooncake", None, _jsonl(GOOD_MOON, moon(hash_ids=[1.5, 2])),
                                      ["line 2", "hash_ids[0]", "1.5"]),
    "mooncake-hash-ids-boolean-entry": ("mooncake", None, _jsonl(moon(hash_ids=[1, True])),
                                        ["line 1", "hash_ids[1]", "true"]),
    "mooncake-hash-ids-too-many": ("mooncake", None, _jsonl(moon(hash_ids=[1, 2, 3])),
                                   ["line 1", "hash_ids has 3", "input_length 600 needs 2", "512"]),
    "mooncake-hash-ids-too-few": ("mooncake", None, _jsonl(GOOD_MOON, moon(input_length=1025, hash_ids=[1, 2])),
                                  ["line 2", "hash_ids has 2", "needs 3"]),
    "mooncake-missing-key": ("mooncake", None, _jsonl(GOOD_MOON, without(GOOD_MOON, "output_length")),
                             ["line 2", "missing key 'output_length'"]),
    "mooncake-bare-number-line": ("mooncake", None, _jsonl(GOOD_MOON, "5"), ["line 2", "JSON object", "a number"]),
    "mooncake-list-line": ("mooncake", None, _jsonl("[1, 2]"), ["line 1", "JSON object", "a list"]),
    "mooncake-string-line": ("mooncake", None, _jsonl('"hello"'), ["line 1", "JSON object", "a string"]),
    "mooncake-invalid-json": ("mooncake", None, _jsonl(GOOD_MOON, '{"timestamp": 0,'), ["line 2", "not valid JSON"]),
    "mooncake-empty-file": ("mooncake", None, "", ["empty"]),
    "mooncake-blank-lines-only": ("mooncake", None, "\n  \n\n", ["empty"]),
    "mooncake-non-utf8": ("mooncake", None, _jsonl(GOOD_MOON).encode() + b'{"timestamp": \xff}\n',
                          ["line 2", "UTF-8", "0xff"]),
    "mooncake-corrupt-gzip": ("mooncake", "mooncake.jsonl.gz", b"\x1f\x8b\x08\x00garbage-bytes", ["gzip"]),
    "mooncake-truncated-gzip": ("mooncake", "mooncake.jsonl.gz", _truncated_gzip(_jsonl(*[GOOD_MOON] * 300)),
                                ["gzip"]),
    # --- LLMServingSim JSONL
    "lss-nan-arrival": ("llmservingsim", None, _jsonl(GOOD_LSS, lss(arrival_time_ns=math.nan)),
                        ["line 2", "arrival_time_ns", "NaN"]),
    "lss-negative-arrival": ("llmservingsim", None, _jsonl(lss(arrival_time_ns=-5)), ["line 1", "arrival_time_ns"]),
    "lss-infinite-arrival": ("llmservingsim", None, _jsonl(lss(arrival_time_ns=-math.inf)),
                             ["line 1", "arrival_time_ns", "-Infinity"]),
    "lss-fractional-input": ("llmservingsim", None, _jsonl(lss(input_toks=2.5)), ["line 1", "input_toks", "2.5"]),
    "lss-boolean-output": ("llmservingsim", None, _jsonl(GOOD_LSS, lss(output_toks=True)),
                           ["line 2", "output_toks", "true"]),
    "lss-zero-input": ("llmservingsim", None, _jsonl(lss(input_toks=0, input_tok_ids=[])), ["line 1", "input_toks"]),
    "lss-input-ids-count": ("llmservingsim", None, _jsonl(lss(input_tok_ids=[1])),
                            ["line 1", "input_tok_ids has 1 ids but input_toks is 3"]),
    "lss-input-ids-string-entry": ("llmservingsim", None, _jsonl(lss(input_tok_ids=[1, "x", 3])),
                                   ["line 1", "input_tok_ids[1]"]),
    "lss-input-ids-scalar": ("llmservingsim", None, _jsonl(lss(input_tok_ids=7)), ["line 1", "input_tok_ids", "list"]),
    "lss-output-ids-count": ("llmservingsim", None, _jsonl(GOOD_LSS, lss(output_tok_ids=[4, 5, 6])),
                             ["line 2", "output_tok_ids has 3 ids but output_toks is 2"]),
    "lss-missing-key": ("llmservingsim", None, _jsonl(without(GOOD_LSS, "arrival_time_ns")),
                        ["line 1", "missing key 'arrival_time_ns'"]),
    "lss-bare-number-line": ("llmservingsim", None, _jsonl("42"), ["line 1", "JSON object", "a number"]),
    "lss-empty-gzip": ("llmservingsim", "lss.jsonl.gz", "", ["empty"]),
    "lss-corrupt-gzip": ("llmservingsim", "lss.jsonl.gz", b"PK\x03\x04 a zip, not a gzip", ["gzip"]),
    "lss-truncated-gzip": ("llmservingsim", "lss.jsonl.gz", _truncated_gzip(_jsonl(*[GOOD_LSS] * 300)), ["gzip"]),
    "lss-non-utf8": ("llmservingsim", None, b'{"input_toks": 3, "x": "\xe9"}\n', ["line 1", "UTF-8"]),
    # --- vLLM bench JSON
    "bench-empty-lists": ("vllm_bench", None, bench(input_lens=[], output_lens=[]), ["no requests", "input_lens"]),
    "bench-scalar-lens": ("vllm_bench", None, bench(input_lens=5), ["input_lens", "must be a list", "a number"]),
    "bench-top-level-list": ("vllm_bench", None, "[1, 2, 3]", ["expected a JSON object", "a list"]),
    "bench-top-level-number": ("vllm_bench", None, "17", ["expected a JSON object", "a number"]),
    "bench-missing-key": ("vllm_bench", None, json.dumps({"input_lens": [1]}), ["missing key 'output_lens'"]),
    "bench-fractional-len": ("vllm_bench", None, bench(input_lens=[100, 12.5]), ["input_lens[1]", "integer", "12.5"]),
    "bench-boolean-len": ("vllm_bench", None, bench(input_lens=[True, 200]), ["input_lens[0]", "true"]),
    "bench-null-len": ("vllm_bench", None, bench(output_lens=[3, None]), ["output_lens[1]", "null"]),
    "bench-zero-len": ("vllm_bench", None, bench(output_lens=[0, 1]), ["output_lens[0]", ">= 1"]),
    "bench-string-len": ("vllm_bench", None, bench(output_lens=["abc", 1]), ["output_lens[0]", '"abc"']),
    "bench-length-mismatch": ("vllm_bench", None, bench(output_lens=[3]), ["input_lens has 2", "output_lens has 1"]),
    "bench-text-rate": ("vllm_bench", None, bench(request_rate="fast"), ["request_rate", '"fast"']),
    "bench-negative-rate": ("vllm_bench", None, bench(request_rate=-1), ["request_rate", "> 0"]),
    "bench-nan-rate": ("vllm_bench", None, bench(request_rate=math.nan), ["request_rate", "NaN"]),
    "bench-zero-burstiness": ("vllm_bench", None, bench(burstiness=0), ["burstiness", "> 0"]),
    "bench-invalid-json": ("vllm_bench", None, '{"input_lens": [1,\n  2', ["line 2", "not valid JSON"]),
    "bench-empty-file": ("vllm_bench", None, "", ["empty"]),
    "bench-non-utf8": ("vllm_bench", None, b'{"input_lens": [1],\n "x": "\xff"}', ["line 2", "UTF-8"]),
}


def _write_case(tmp_path: Path, name: str | None, fmt: str, content: str | bytes) -> Path:
    return _put(tmp_path / (name or NAMES[fmt]), content)


def assert_one_line(err: BaseException, path: Path, fragments: list[str]) -> str:
    """The message is one line, names the file and holds every fragment (the row / line / key, the field)."""
    msg = str(err)
    assert "\n" not in msg and msg.strip() == msg, msg
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


@pytest.mark.parametrize("case", list(CASES))
def test_bad_trace_is_rejected_with_a_one_line_error(tmp_path, case):
    fmt, name, content, fragments = CASES[case]
    path = _write_case(tmp_path, name, fmt, content)
    with pytest.raises(WorkloadError) as e:
        LOAD[fmt](path)
    assert type(e.value) is WorkloadError
    assert_one_line(e.value, path, fragments)


# --- the arrival-time override (workload.arrival_times) -----------------------------------------------------------
OVERRIDE_CASES = {
    "override-nan": ("arrival_rel_s\n0.0\nnan\n", ["row 3", "arrival_rel_s", "nan"]),
    "override-negative": ("arrival_rel_s\n-1\n0.5\n", ["row 2", "arrival_rel_s", ">= 0"]),
    "override-text": ("arrival_rel_s\n0\nlater\n", ["row 3", "'later'"]),
    "override-missing-column": ("t\n0\n1\n", ["missing column", "arrival_rel_s"]),
    "override-header-only": ("arrival_rel_s\n", ["no requests"]),
    "override-row-count": ("arrival_rel_s\n0\n1\n2\n", ["3 rows but the trace has 2 requests"]),
}


@pytest.mark.parametrize("case", list(OVERRIDE_CASES))
def test_bad_arrival_override_is_rejected_with_a_one_line_error(tmp_path, case):
    content, fragments = OVERRIDE_CASES[case]
    reqs = loaders.load_csv(_put(tmp_path / "t.csv", CSV_HEAD + "0,10,5\n1,10,5\n"))
    path = _put(tmp_path / "arrivals.csv", content)
    with pytest.raises(WorkloadError) as e:
        loaders.override_arrivals(reqs, path, "arrival_rel_s")
    assert_one_line(e.value, path, fragments)


# --- the synthetic generator's arguments ----------------------------------------------------------------------------
D = synthetic.LengthDist()
SYNTHETIC_CASES = {
    "rate-nan": (dict(num_requests=5, rate=math.nan), "rate must be a finite number > 0"),
    "rate-inf": (dict(num_requests=5, rate=math.inf), "rate must be a finite number > 0"),
    "rate-negative": (dict(num_requests=5, rate=-1.0), "rate must be a finite number > 0"),
    "cv-nan": (dict(num_requests=5, rate=1.0, cv=math.nan), "cv must be a finite number > 0"),
    "count-fractional": (dict(num_requests=2.5, rate=1.0), "num_requests must be an integer >= 1"),
    "count-zero": (dict(num_requests=0, rate=1.0), "num_requests must be an integer >= 1"),
    "priorities-zero": (dict(num_requests=5, rate=1.0, num_priorities=0), "num_priorities must be an integer >= 1"),
    "min-above-max": (dict(num_requests=5, rate=1.0, prompt=synthetic.LengthDist(min=100, max=10)),
                      "need 1 <= min <= max"),
    "uniform-low-above-high": (dict(num_requests=5, rate=1.0,
                                    output=synthetic.LengthDist(kind="uniform", low=50, high=10)), "low 50 > high 10"),
    "median-nan": (dict(num_requests=5, rate=1.0, prompt=synthetic.LengthDist(median=math.nan)),
                   "median must be a finite number"),
}


@pytest.mark.parametrize("case", list(SYNTHETIC_CASES))
def test_bad_generator_arguments_are_rejected(case):
    kw, message = SYNTHETIC_CASES[case]
    kw = {"prompt": D, "output": D, **kw}
    with pytest.raises(ValueError, match=message) as e:
        synthetic.generate(**kw)
    assert "\n" not in str(e.value)


# --- what still loads: the good templates, unsorted arrivals -------------------------------------------------------
GOOD = {"azure": AZ_HEAD + AZ_OK, "mooncake": _jsonl(GOOD_MOON), "llmservingsim": _jsonl(GOOD_LSS),
        "csv": CSV_HEAD + "0,10,5\n", "vllm_bench": bench()}


@pytest.mark.parametrize("fmt", list(GOOD))
def test_the_templates_the_bad_cases_spoil_load(tmp_path, fmt):
    assert len(LOAD[fmt](_write_case(tmp_path, None, fmt, GOOD[fmt]))) >= 1


def test_integral_floats_vllm_inf_rate_and_blank_cells_are_accepted(tmp_path):
    rs = loaders.load_mooncake(_put(tmp_path / "m.jsonl", _jsonl(moon(input_length=600.0, hash_ids=None))))
    assert rs[0].prompt_len == 600 and rs[0].hash_ids is None
    rs = loaders.load_vllm_bench(_put(tmp_path / "b.json", bench(request_rate="inf", burstiness=None)))
    assert [r.arrival_time for r in rs] == [0.0, 0.0]
    rs = loaders.load_csv(_put(tmp_path / "s.csv", "arrival_time_s,prompt_tokens,output_tokens,session_id\n"
                                                    "0,10,5,\n1,10,5,s1\n\n"))
    assert [r.session_id for r in rs] == [None, "s1"]


UNSORTED = {
    "csv": (CSV_HEAD + "2.0,10,5\n0.5,20,5\n0.5,30,5\n", ["1", "2", "0"]),
    "azure": (AZ_HEAD + "2023-11-16 18:15:50,10,5\n2023-11-16 18:15:46,20,5\n2023-11-16 18:15:46,30,5\n",
              ["1", "2", "0"]),
    "mooncake": (_jsonl(moon(timestamp=3000), moon(timestamp=0), moon(timestamp=0)), ["1", "2", "0"]),
    "llmservingsim": (_jsonl(lss(arrival_time_ns=9), lss(arrival_time_ns=1), lss(arrival_time_ns=1)),
                      ["bench-1", "bench-2", "bench-0"]),
}


@pytest.mark.parametrize("fmt", list(UNSORTED))
def test_unsorted_arrivals_are_sorted_stably_and_ids_keep_file_order(tmp_path, fmt):
    content, ids = UNSORTED[fmt]
    rs = LOAD[fmt](_write_case(tmp_path, None, fmt, content))
    assert [r.request_id for r in rs] == ids
    assert [r.index for r in rs] == [0, 1, 2]
    t = [r.arrival_time for r in rs]
    assert t == sorted(t) and np.all(np.isfinite(t))


# --- the command line: exit status 2 and the one line, no traceback ------------------------------------------------
def run_cli(tmp_path: Path, experiment: str) -> subprocess.CompletedProcess:
    """`servelab run` on an experiment YAML written to tmp_path."""
    exp = _put(tmp_path / "exp.yaml", experiment)
    return subprocess.run([sys.executable, "-m", "lab", "run", str(exp), "--out", str(tmp_path / "out"), "-q",
                           "--no-plots"], capture_output=True, text=True, cwd=REPO, timeout=120)


def assert_cli_one_line_error(res: subprocess.CompletedProcess, path: Path, fragments: list[str]) -> None:
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    for f in [str(path), *fragments]:
        assert f in lines[0], (f, lines[0])


CLI_CASES = {
    "csv-nan-arrival": ["row 3", "arrival_time_s"],
    "mooncake-truncated-gzip": ["gzip"],
    "bench-empty-lists": ["no requests"],
    "lss-non-utf8": ["line 1", "UTF-8"],
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_servelab_run_on_a_bad_trace_exits_2_with_one_line(tmp_path, case):
    fmt, name, content, _ = CASES[case]
    path = _write_case(tmp_path, name, fmt, content)
    res = run_cli(tmp_path, f"name: bad\nworkload: {{source: {fmt}, path: {path}}}\nsimulation: {{progress: false}}\n")
    assert_cli_one_line_error(res, path, CLI_CASES[case])


def test_servelab_validate_on_a_bad_trace_exits_2_with_one_line(tmp_path):
    """In process (no subprocess): `validate` reports a bad workload trace as `run` does."""
    from typer.testing import CliRunner

    from lab.cli.main import app

    measured = _put(tmp_path / "measured.json", bench(ttfts=[0.05, 0.08], itls=[[0.01, 0.02], []]))
    bad = _put(tmp_path / "bench.json", bench(input_lens=[], output_lens=[]))
    exp = _put(tmp_path / "exp.yaml", f"name: bad\nworkload: {{source: vllm_bench, path: {bad}}}\n"
                                      f"validation: {{measured: {measured}, format: vllm_bench}}\n"
                                      "simulation: {progress: false}\n")
    res = CliRunner().invoke(app, ["validate", str(exp), "--out", str(tmp_path / "out"), "-q", "--no-plots"])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(bad) in lines[0] and "no requests" in lines[0], res.output


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zip"])
def test_compressed_csv_traces_load_as_the_plain_file(tmp_path, suffix):
    text = CSV_HEAD + "0,10,5\n1.5,12,7\n"
    plain = loaders.load_csv(_put(tmp_path / "t.csv", text))
    packed = tmp_path / f"t.csv{suffix}"
    if suffix == ".zip":
        with zipfile.ZipFile(packed, "w") as z:
            z.writestr("t.csv", text)
    else:
        _put(packed, text)
    got = loaders.load_csv(packed)
    assert [(r.arrival_time, r.prompt_len, r.max_tokens) for r in got] == \
        [(r.arrival_time, r.prompt_len, r.max_tokens) for r in plain] == [(0.0, 10, 5), (1.5, 12, 7)]


def test_csv_rows_keep_their_line_numbers_past_a_quoted_field_spanning_lines(tmp_path):
    text = ("arrival_time_s,prompt_tokens,output_tokens,session_id\n0,10,5,\"a\nb\"\n\n"
            "1,10,5,c\n2,0,5,d\n")
    with pytest.raises(WorkloadError, match="row 6: prompt_tokens"):
        loaders.load_csv(_put(tmp_path / "t.csv", text))
