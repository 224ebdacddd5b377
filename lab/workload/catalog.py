"""The trace catalog: ``traces/manifest.yaml`` names every public trace file the shipped experiments and benchmarks
read, where it lies under the data directory, where it was downloaded from and its sha256.

- :func:`load_manifest` reads and validates the manifest (one-line errors naming the manifest and the field).
- :func:`verify` checks a local copy against the manifest's sha256.
- :func:`fetch` downloads a file from its URL into the data directory, verifying it before it is moved into place.

A file kept compressed locally (``stored_as: gzip``, e.g. LLMServingSim's workload, kept as ``.jsonl.gz``) also
records ``upstream_sha256`` / ``upstream_size``, the digest of the uncompressed bytes its URL serves: :func:`fetch`
checks the download against those and gzips it, and :func:`verify` accepts either the exact stored bytes or a
gzip file whose content is the upstream bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lab.experiment.paths import PROJECT_ROOT

DEFAULT_MANIFEST = PROJECT_ROOT / "traces" / "manifest.yaml"
FORMATS = ("azure", "mooncake", "llmservingsim", "csv", "vllm_bench")  # workload.source values that read a file
_CHUNK = 1 << 20


class CatalogError(ValueError):
    """The manifest is malformed, names no such trace, or a trace file is missing, mismatched or not fetchable."""


class TraceEntry(BaseModel):
    """One public trace file of the manifest."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_]*$")
    format: Literal["azure", "mooncake", "llmservingsim", "csv", "vllm_bench"]
    path: str
    url: str
    url_note: Optional[str] = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(gt=0)
    stored_as: Literal["as_downloaded", "gzip"] = "as_downloaded"
    upstream_sha256: Optional[str] = Field(None, pattern=r"^[0-9a-f]{64}$")
    upstream_size: Optional[int] = Field(None, gt=0)
    licence: str
    licence_file: Optional[str] = None
    citation: Optional[str] = None
    num_requests: int = Field(gt=0)
    provenance: str
    used_by: list[str] = []
    description: Optional[str] = None

    @field_validator("path", "licence_file")
    @classmethod
    def _relative(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise ValueError(f"must be a relative path inside the data directory, got {v!r}")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("https://", "http://", "file://")):
            raise ValueError(f"must be an https://, http:// or file:// URL, got {v!r}")
        return v

    @model_validator(mode="after")
    def _upstream(self) -> "TraceEntry":
        if self.stored_as == "gzip" and (self.upstream_sha256 is None or self.upstream_size is None):
            raise ValueError("stored_as: gzip needs upstream_sha256 and upstream_size (the bytes the URL serves)")
        return self

    @property
    def download_sha256(self) -> str:
        """The sha256 of the bytes the URL serves."""
        return self.upstream_sha256 if self.stored_as == "gzip" else self.sha256

    @property
    def download_size(self) -> int:
        """The size in bytes of what the URL serves."""
        return self.upstream_size if self.stored_as == "gzip" else self.size

    def local_path(self, data_dir: str | Path) -> Path:
        """Where this file lies under ``data_dir``."""
        return Path(data_dir) / self.path


class Manifest(BaseModel):
    """The whole manifest: ``version`` and the list of ``traces``."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    traces: list[TraceEntry]
    source: Optional[Path] = Field(None, exclude=True)

    def names(self) -> list[str]:
        """Trace names in manifest order."""
        return [t.name for t in self.traces]

    def get(self, name: str) -> TraceEntry:
        """The entry called ``name``.

        Raises:
            CatalogError: no such name (the message lists the known ones).
        """
        for t in self.traces:
            if t.name == name:
                return t
        raise CatalogError(f"{self.source or 'manifest'}: no trace named {name!r}; known: {', '.join(self.names())}")


def _loc(raw: dict, loc: tuple) -> str:
    """``traces[2] (azure_conv_2023).sha256`` for a pydantic error location."""
    out, node = "", raw
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            try:
                node = node[part]
                if isinstance(node, dict) and "name" in node:
                    out += f" ({node['name']})"
            except (IndexError, KeyError, TypeError):
                node = None
        else:
            out += ("." if out else "") + str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out or "(top level)"


def load_manifest(path: str | Path | None = None) -> Manifest:
    """Read and validate a manifest (default ``traces/manifest.yaml`` of the checkout).

    Raises:
        CatalogError: the file is missing or not YAML, a field is missing, unknown or invalid (the one-line message
            names the manifest, the entry and the field), or two entries share a name or a path.
    """
    path = Path(path) if path is not None else DEFAULT_MANIFEST
    if not path.is_file():
        raise CatalogError(f"{path}: trace manifest does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise CatalogError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise CatalogError(f"{path}: expected a mapping with 'version' and 'traces', got {type(raw).__name__}")
    try:
        m = Manifest.model_validate(raw)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        msg = first["msg"].removeprefix("Value error, ")
        raise CatalogError(f"{path}: {_loc(raw, first['loc'])}: {msg}{more}") from None
    for key in ("name", "path"):
        seen: set[str] = set()
        for i, t in enumerate(m.traces):
            v = getattr(t, key)
            if v in seen:
                raise CatalogError(f"{path}: traces[{i}] ({t.name}).{key}: {v!r} appears twice")
            seen.add(v)
    m.source = path
    return m


def _manifest(manifest: Manifest | str | Path | None) -> Manifest:
    return manifest if isinstance(manifest, Manifest) else load_manifest(manifest)


def sha256_file(path: str | Path, gunzip: bool = False) -> tuple[str, int]:
    """The sha256 (hex) and size in bytes of a file, or of its gzip-decompressed content when ``gunzip``."""
    h, n = hashlib.sha256(), 0
    with (gzip.open if gunzip else open)(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def verify(name: str, data_dir: str | Path, manifest: Manifest | str | Path | None = None) -> Path:
    """Check the local copy of trace ``name`` under ``data_dir`` against the manifest; return its path.

    A ``stored_as: gzip`` entry also passes when the file is a gzip file whose content has ``upstream_sha256``
    (what :func:`fetch` writes: the compressed bytes need not be identical to the shared copy's).

    Raises:
        CatalogError: unknown name, the file is missing, or its size or sha256 differs from the manifest's.
    """
    entry = _manifest(manifest).get(name)
    path = entry.local_path(data_dir)
    if not path.is_file():
        raise CatalogError(f"{name}: {path} is missing; `servelab traces fetch {name}` downloads it from {entry.url}")
    digest, size = sha256_file(path)
    if digest == entry.sha256 and size == entry.size:
        return path
    if entry.stored_as == "gzip":
        try:
            udigest, usize = sha256_file(path, gunzip=True)
        except (OSError, EOFError, gzip.BadGzipFile):
            udigest, usize = None, None
        if udigest == entry.upstream_sha256 and usize == entry.upstream_size:
            return path
    raise CatalogError(f"{name}: {path} does not match the manifest: sha256 {digest} ({size} bytes), expected "
                       f"{entry.sha256} ({entry.size} bytes); the copy is corrupted or a different version")


def fetch(name: str, data_dir: str | Path, manifest: Manifest | str | Path | None = None, timeout: float = 60.0,
          force: bool = False) -> Path:
    """Download trace ``name`` from its URL to ``data_dir/<path>`` and return the path.

    The download goes to a temporary file in the destination folder; its sha256 and size are checked against the
    manifest (for ``stored_as: gzip``, against ``upstream_sha256`` / ``upstream_size``, then it is gzipped) and only
    then is it moved into place with :func:`os.replace`, so a failed or mismatched download leaves no partial file
    and does not touch an existing copy. A copy that already verifies is kept unless ``force``.

    Raises:
        CatalogError: unknown name, the URL cannot be read, the destination folder cannot be written, or the
            downloaded bytes do not have the manifest's sha256 / size (the file is then refused).
    """
    m = _manifest(manifest)
    entry = m.get(name)
    dest = entry.local_path(data_dir)
    if dest.is_file() and not force:
        try:
            return verify(name, data_dir, m)
        except CatalogError:
            pass  # a mismatched copy is replaced once the download verifies
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    except OSError as e:
        raise CatalogError(f"{name}: cannot write into {dest.parent} ({e.strerror or e})") from None
    tmp = Path(tmp_name)
    try:
        h, size = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(entry.url, timeout=timeout) as resp:
                while chunk := resp.read(_CHUNK):
                    h.update(chunk)
                    size += len(chunk)
                    if size > entry.download_size:
                        break  # more bytes than expected: refuse without reading the rest
                    out.write(chunk)
        except (urllib.error.URLError, OSError, ValueError) as e:
            if isinstance(e, urllib.error.HTTPError):
                reason = f"HTTP {e.code} {e.reason}"
            else:
                reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
            raise CatalogError(f"{name}: download from {entry.url} failed ({reason})") from None
        digest = h.hexdigest()
        if digest != entry.download_sha256 or size != entry.download_size:
            got = f"more than {entry.download_size} bytes" if size > entry.download_size else f"{size} bytes"
            raise CatalogError(f"{name}: download from {entry.url} refused: sha256 {digest} ({got}), expected "
                               f"{entry.download_sha256} ({entry.download_size} bytes)")
        if entry.stored_as == "gzip":
            packed = tmp.with_name(tmp.name + ".gz")
            try:
                with open(tmp, "rb") as src, open(packed, "wb") as raw_out, \
                        gzip.GzipFile(filename="", mode="wb", fileobj=raw_out, compresslevel=9, mtime=0) as gz:
                    while chunk := src.read(_CHUNK):
                        gz.write(chunk)
                os.replace(packed, tmp)
            finally:
                packed.unlink(missing_ok=True)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a trace is ordinary readable data
        os.replace(tmp, dest)
    except OSError as e:
        raise CatalogError(f"{name}: cannot write {dest} ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return dest
