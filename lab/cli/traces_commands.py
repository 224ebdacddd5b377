"""``servelab traces``: the public trace catalog (traces/manifest.yaml; lab/workload/catalog.py): list, verify,
fetch."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from lab.cli.common import DATA_OPT, console, err_console, fail

traces_app = typer.Typer(no_args_is_help=True, help="The public trace catalog (traces/manifest.yaml): list, verify, "
                                                    "fetch.")
MANIFEST_OPT = typer.Option(None, "--manifest", help="trace manifest (default traces/manifest.yaml)")


def _traces_manifest(manifest: Optional[Path]):
    from lab.workload.catalog import CatalogError, load_manifest

    try:
        return load_manifest(manifest)
    except CatalogError as e:
        fail(str(e))


def traces_list(data_dir: Optional[Path] = DATA_OPT, manifest: Optional[Path] = MANIFEST_OPT) -> None:
    """List the catalog's traces and whether each is present under the data directory (not hashed: see verify)."""
    from lab.experiment.paths import default_data_dir

    m = _traces_manifest(manifest)
    dd = data_dir or default_data_dir()
    t = Table(title=f"traces ({m.source}; data dir {dd})")
    for c in ("name", "format", "requests", "size", "licence", "local"):
        t.add_column(c, justify="right" if c in ("requests", "size") else "left")
    t.add_column("path (under the data dir)", overflow="fold")
    for e in m.traces:
        t.add_row(e.name, e.format, f"{e.num_requests:,}", f"{e.size / 1e6:.2f} MB", e.licence.split(" (")[0],
                  "present" if e.local_path(dd).is_file() else "missing", e.path)
    console.print(t)


def traces_verify(name: Optional[str] = typer.Argument(None, help="one trace (default: all)"),
                  data_dir: Optional[Path] = DATA_OPT, manifest: Optional[Path] = MANIFEST_OPT) -> None:
    """Check the sha256 of local trace files against the manifest (exit status 2 if any is missing or differs)."""
    from lab.experiment.paths import default_data_dir
    from rich.markup import escape

    from lab.workload.catalog import CatalogError, verify

    m = _traces_manifest(manifest)
    dd = data_dir or default_data_dir()
    if name:
        try:
            m.get(name)
        except CatalogError as e:
            fail(str(e))
    names = [name] if name else m.names()
    t = Table(title=f"trace checksums (data dir {dd})")
    t.add_column("name")
    t.add_column("status")
    t.add_column("detail", overflow="fold")
    failed = 0
    for n in names:
        try:
            p = verify(n, dd, m)
            t.add_row(n, "[green]ok[/]", str(p))
        except CatalogError as e:
            failed += 1
            t.add_row(n, "[red]FAILED[/]", escape(str(e)))
    console.print(t)
    if failed:
        fail(f"{failed} of {len(names)} trace(s) missing or mismatched")


def traces_fetch(name: str = typer.Argument(..., help="trace name (servelab traces list)"),
                 data_dir: Optional[Path] = DATA_OPT, manifest: Optional[Path] = MANIFEST_OPT,
                 force: bool = typer.Option(False, "--force", help="download even if a verified copy exists"),
                 timeout: float = typer.Option(60.0, "--timeout", help="network timeout, seconds")) -> None:
    """Download one trace from its public URL into the data directory, refusing it unless its sha256 matches."""
    from lab.experiment.paths import default_data_dir
    from lab.workload.catalog import CatalogError, fetch, verify

    m = _traces_manifest(manifest)
    dd = data_dir or default_data_dir()
    try:
        entry = m.get(name)
        if not force and entry.local_path(dd).is_file():
            try:
                console.print(f"{name}: {verify(name, dd, m)} already present (sha256 verified)", highlight=False)
                return
            except CatalogError:
                pass  # replaced below once the download verifies
        err_console.print(f"fetching {name} from {entry.url} ...", highlight=False)
        p = fetch(name, dd, m, timeout=timeout, force=True)
    except CatalogError as e:
        fail(str(e))
    console.print(f"{name}: {p} (sha256 verified)", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``servelab traces list|verify|fetch`` to the main app."""
    traces_app.command("list")(traces_list)
    traces_app.command("verify")(traces_verify)
    traces_app.command("fetch")(traces_fetch)
    app.add_typer(traces_app, name="traces")
