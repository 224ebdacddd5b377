"""The trace catalog (traces/manifest.yaml, lab/workload/catalog.py), `servelab traces`, and traces/generated/."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import importlib.util
import itertools
import re
import shutil
import threading
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lab.cli.main import app
from lab.experiment.paths import default_data_dir
from lab.workload import catalog, loaders
from lab.workload.catalog import CatalogError, fetch, load_manifest, verify

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = default_data_dir()
MANIFEST = load_manifest()
LOADERS = {"azure": loaders.load_azure, "mooncake": loaders.load_mooncake, "llmservingsim": loaders.load_llmservingsim,
           "csv": loaders.load_csv, "vllm_bench": loaders.load_vllm_bench}
needs_shared = pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"shared data not found: {DATA_DIR}")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_COUNT = itertools.count()


def _write_manifest(tmp_path: Path, **entry) -> Path:
    """A one-entry manifest in tmp_path (a csv trace at traces/t.csv unless overridden)."""
    base = dict(name="t", format="csv", path="traces/t.csv", url="file:///nonexistent", sha256="0" * 64, size=1,
                licence="CC0-1.0", num_requests=1, provenance="test")
    p = tmp_path / f"manifest{next(_COUNT)}.yaml"  # a new file each time: earlier ones stay valid
    p.write_text(yaml.safe_dump({"version": 1, "traces": [{**base, **entry}]}))
    return p


TRACE = b"arrival_time_s,prompt_tokens,output_tokens\n0.0,10,5\n0.5,20,7\n"


# --- the manifest -----------------------------------------------------------------------------------------------

def test_manifest_loads_with_unique_names_and_known_formats():
    names = MANIFEST.names()
    assert len(names) == len(set(names)) >= 4
    assert {t.format for t in MANIFEST.traces} <= set(LOADERS)
    for t in MANIFEST.traces:
        assert t.url.startswith("https://"), t.name
        assert t.used_by, t.name
        for f in t.used_by:
            assert (REPO / f).is_file(), f


def test_every_public_trace_a_shipped_experiment_reads_is_in_the_manifest():
    used: dict[str, set[str]] = {}
    for f in sorted((REPO / "experiments").glob("*.yaml")) + sorted((REPO / "bench").glob("*.yaml")):
        text = f.read_text()
        for rel in re.findall(r"\{data_dir\}/(traces/[^\"'\s,}]+|validation/[^/]+/workloads/[^\"'\s,}]+)", text):
            used.setdefault(rel, set()).add(str(f.relative_to(REPO)))
    by_path = {t.path: t for t in MANIFEST.traces}
    assert set(used) == set(by_path)
    for rel, files in used.items():
        assert files == set(by_path[rel].used_by), rel


@needs_shared
@pytest.mark.parametrize("name", MANIFEST.names())
def test_every_entry_verifies_against_the_shared_data_and_has_its_request_count(name):
    entry = MANIFEST.get(name)
    path = verify(name, DATA_DIR, MANIFEST)
    assert path == DATA_DIR / entry.path
    if entry.licence_file:
        assert (DATA_DIR / entry.licence_file).is_file()
    assert len(LOADERS[entry.format](path)) == entry.num_requests
    if entry.stored_as == "gzip":
        assert catalog.sha256_file(path, gunzip=True) == (entry.upstream_sha256, entry.upstream_size)


def test_manifest_errors_name_the_manifest_entry_and_field(tmp_path):
    p = _write_manifest(tmp_path, sha256="xyz")
    with pytest.raises(CatalogError, match=r"manifest\d+\.yaml: traces\[0\] \(t\)\.sha256: String should match"):
        load_manifest(p)
    p = _write_manifest(tmp_path, format="parquet")
    with pytest.raises(CatalogError, match=r"traces\[0\] \(t\)\.format: "):
        load_manifest(p)
    p = _write_manifest(tmp_path, path="../outside.csv")
    with pytest.raises(CatalogError, match=r"traces\[0\] \(t\)\.path: .*relative path inside the data directory"):
        load_manifest(p)
    p = _write_manifest(tmp_path, stored_as="gzip")
    with pytest.raises(CatalogError, match=r"traces\[0\] \(t\): stored_as: gzip needs upstream_sha256"):
        load_manifest(p)
    p = tmp_path / "m2.yaml"
    p.write_text("version: 1\ntraces:\n  - name: t\n")
    with pytest.raises(CatalogError, match=r"m2\.yaml: traces\[0\] \(t\)\.format: Field required \(and \d+ more\)"):
        load_manifest(p)
    with pytest.raises(CatalogError, match="does not exist"):
        load_manifest(tmp_path / "missing.yaml")
    with pytest.raises(CatalogError, match="no trace named 'nope'; known: "):
        MANIFEST.get("nope")


# --- verify -----------------------------------------------------------------------------------------------------

def test_verify_detects_a_missing_or_corrupted_copy(tmp_path):
    m = _write_manifest(tmp_path, sha256=_sha(TRACE), size=len(TRACE))
    data = tmp_path / "data"
    with pytest.raises(CatalogError, match=r"t: .*traces/t\.csv is missing; `servelab traces fetch t`"):
        verify("t", data, m)
    (data / "traces").mkdir(parents=True)
    (data / "traces" / "t.csv").write_bytes(TRACE)
    assert verify("t", data, m) == data / "traces" / "t.csv"
    (data / "traces" / "t.csv").write_bytes(TRACE.replace(b"20", b"21"))
    with pytest.raises(CatalogError, match="does not match the manifest: sha256 .* expected " + _sha(TRACE)):
        verify("t", data, m)


@needs_shared
def test_verify_detects_a_corrupted_copy_of_a_real_trace(tmp_path):
    entry = MANIFEST.get("azure_code_2023")
    dst = tmp_path / entry.path
    dst.parent.mkdir(parents=True)
    shutil.copyfile(DATA_DIR / entry.path, dst)
    assert verify(entry.name, tmp_path, MANIFEST) == dst
    raw = bytearray(dst.read_bytes())
    raw[-3] = ord("9") if raw[-3] != ord("9") else ord("8")  # one digit of the last row
    dst.write_bytes(bytes(raw))
    with pytest.raises(CatalogError, match="does not match the manifest"):
        verify(entry.name, tmp_path, MANIFEST)


# --- fetch ------------------------------------------------------------------------------------------------------

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_root(tmp_path):
    """A local http.server on 127.0.0.1 serving tmp_path/www; yields (folder, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_fetch_from_a_file_url_verifies_and_moves_into_place(tmp_path):
    src = tmp_path / "upstream.csv"
    src.write_bytes(TRACE)
    m = _write_manifest(tmp_path, url=src.as_uri(), sha256=_sha(TRACE), size=len(TRACE))
    data = tmp_path / "data"
    p = fetch("t", data, m)
    assert p == data / "traces" / "t.csv" and p.read_bytes() == TRACE
    assert _leftovers(p.parent) == ["t.csv"]
    assert len(loaders.load_csv(p)) == 2
    src.unlink()  # a verified copy is kept: no download needed
    assert fetch("t", data, m) == p


def test_fetch_over_http_and_a_checksum_mismatch_is_refused_without_a_partial_file(tmp_path, http_root):
    root, base = http_root
    (root / "t.csv").write_bytes(TRACE)
    good = _write_manifest(tmp_path, url=f"{base}/t.csv", sha256=_sha(TRACE), size=len(TRACE))
    data = tmp_path / "data"
    assert fetch("t", data, good).read_bytes() == TRACE

    other = tmp_path / "other"
    bad = _write_manifest(tmp_path, url=f"{base}/t.csv", sha256=_sha(b"something else"), size=len(TRACE))
    with pytest.raises(CatalogError, match=r"t: download from http://127\.0\.0\.1:\d+/t\.csv refused: sha256"):
        fetch("t", other, bad)
    assert _leftovers(other / "traces") == []  # the temp file is gone, nothing at the destination

    # a mismatched download never replaces an existing (corrupted) copy, and a good one does
    dest = data / "traces" / "t.csv"
    dest.write_bytes(b"corrupted")
    (root / "t.csv").write_bytes(TRACE + b"1.0,1,1\n")  # the server now serves different bytes
    with pytest.raises(CatalogError, match="refused: sha256 .*more than"):
        fetch("t", data, good)
    assert dest.read_bytes() == b"corrupted" and _leftovers(dest.parent) == ["t.csv"]
    (root / "t.csv").write_bytes(TRACE)
    assert fetch("t", data, good).read_bytes() == TRACE and _leftovers(dest.parent) == ["t.csv"]

    missing = _write_manifest(tmp_path, url=f"{base}/absent.csv", sha256=_sha(TRACE), size=len(TRACE))
    with pytest.raises(CatalogError, match=r"download from .*/absent\.csv failed \(HTTP 404 "):
        fetch("t", tmp_path / "third", missing)
    assert _leftovers(tmp_path / "third" / "traces") == []


def test_fetch_of_a_gzip_stored_trace_checks_the_upstream_bytes_and_writes_gzip(tmp_path, http_root):
    root, base = http_root
    body = b'{"input_toks": 3, "output_toks": 2, "arrival_time_ns": 0, "input_tok_ids": [1, 2, 3]}\n'
    (root / "w.jsonl").write_bytes(body)
    shared = gzip.compress(body, mtime=12345)  # the shared copy's own compressed bytes
    m = _write_manifest(tmp_path, name="w", format="llmservingsim", path="validation/w.jsonl.gz",
                        url=f"{base}/w.jsonl", sha256=_sha(shared), size=len(shared), stored_as="gzip",
                        upstream_sha256=_sha(body), upstream_size=len(body))
    p = fetch("w", tmp_path / "data", m)
    assert gzip.decompress(p.read_bytes()) == body
    assert verify("w", tmp_path / "data", m) == p  # accepted by content though the gzip bytes differ
    assert len(loaders.load_llmservingsim(p)) == 1
    p.write_bytes(gzip.compress(body + b"\n", mtime=0))
    with pytest.raises(CatalogError, match="does not match the manifest"):
        verify("w", tmp_path / "data", m)


# --- traces/generated/ ------------------------------------------------------------------------------------------

def _generate_module():
    spec = importlib.util.spec_from_file_location("traces_generate", REPO / "traces" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_traces_load_with_the_csv_loader_and_regenerate_identically(tmp_path):
    gen = _generate_module()
    shipped = REPO / "traces" / "generated"
    assert sorted(p.stem for p in shipped.glob("*.csv")) == sorted(gen.SPECS)
    readme = (shipped / "README.md").read_text()
    for p in gen.write_all(tmp_path):
        assert p.read_bytes() == (shipped / p.name).read_bytes(), p.name
        assert p.stem in readme
        reqs = loaders.load_csv(shipped / p.name)
        spec = gen.SPECS[p.stem]
        assert len(reqs) == spec["num_requests"] == 200
        assert reqs[0].arrival_time == 0.0 and reqs[0].request_id == f"{p.stem}-0"
        assert {r.priority for r in reqs} <= set(range(spec.get("num_priorities", 1)))
        assert all(1 <= r.prompt_len <= spec["prompt"].max for r in reqs)


# --- the CLI ----------------------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_traces_list_runs():
    res = runner.invoke(app, ["traces", "list"])
    assert res.exit_code == 0, res.output
    for name in MANIFEST.names():
        assert name in res.output


def test_cli_traces_verify_and_fetch(tmp_path):
    src = tmp_path / "upstream.csv"
    src.write_bytes(TRACE)
    m = _write_manifest(tmp_path, url=src.as_uri(), sha256=_sha(TRACE), size=len(TRACE))
    data = tmp_path / "data"
    res = runner.invoke(app, ["traces", "verify", "--manifest", str(m), "--data-dir", str(data)])
    assert res.exit_code == 2 and "missing" in res.output
    res = runner.invoke(app, ["traces", "fetch", "t", "--manifest", str(m), "--data-dir", str(data)])
    assert res.exit_code == 0, res.output
    assert (data / "traces" / "t.csv").read_bytes() == TRACE
    res = runner.invoke(app, ["traces", "verify", "t", "--manifest", str(m), "--data-dir", str(data)])
    assert res.exit_code == 0 and "ok" in res.output
    res = runner.invoke(app, ["traces", "fetch", "nope", "--manifest", str(m), "--data-dir", str(data)])
    assert res.exit_code == 2 and "no trace named 'nope'" in res.output
