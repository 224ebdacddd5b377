"""Output folders: checked before they are replaced, written atomically.

A run, a validation, a compare, sweep or search run writes its files into a temporary sibling folder that replaces
the output folder in one rename (:func:`atomic_dir`); :func:`check_out_dir` refuses a folder that is not an earlier
output folder, so that ``--out`` at a wrong folder deletes nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class OutputDirError(ValueError):
    """An output folder that cannot be written: an existing file, or a folder holding files that are not outputs."""


# Files a run, a validation or a compare run writes: a folder of only these (or one with summary.json) is an output
# folder that may be replaced; any other non-empty folder is refused rather than deleted.
OUTPUT_FILES = frozenset({
    "requests.parquet", "requests.csv", "steps.parquet", "events.parquet", "summary.json", "report.md", "report.html",
    "bench_result.json",
    "latency_cdf.png", "timeseries.png", "run.json", "validation.json", "validation.md", "validation_requests.csv",
    "validation_timeseries.csv", "validation_latency.png", "validation_timeseries.png", "validation_breakdown.png",
    # a sweep's tables and run records (lab/report/sweep.py) and a search's answer and probes (lab/report/search.py)
    "sweep.csv", "sweep.parquet", "sweep_summary.csv", "sweep.html", "sweep", "search.md", "search.json", "probes"})


def check_out_dir(path: Path) -> Path:
    """Check that ``path`` may take a run's outputs: absent, an empty folder, or an earlier output folder.

    Returns:
        ``path`` made absolute, a symbolic link resolved (the folder the link points to is the one replaced).

    Raises:
        OutputDirError: ``path`` exists and is not a folder, or is a folder with files no servelab run writes
            (not replaced, so that ``--out`` at a wrong folder deletes nothing).
    """
    p = Path(path)
    p = p.resolve() if p.is_symlink() else Path(os.path.abspath(p))  # "." has a name and a parent
    if not p.exists():
        return p
    if not p.is_dir():
        raise OutputDirError(f"output folder {path} exists and is not a folder; pass --out a folder path")
    names = {e.name for e in p.iterdir()}
    if names and "summary.json" not in names and not names <= OUTPUT_FILES:
        extra = sorted(names - OUTPUT_FILES)
        raise OutputDirError(f"output folder {path} holds files that are not servelab outputs ({', '.join(extra[:3])}"
                             f"{', ...' if len(extra) > 3 else ''}); it would be replaced: pass --out a new or empty "
                             "folder, or remove it")
    return p


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (True where that cannot be told without signalling it)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_temps(target: Path) -> None:
    """Delete the temporary and set-aside siblings of ``target`` (``.<name>.tmp-<pid>``, ``.<name>.old-<pid>``)
    that a killed run left behind: those of processes that no longer exist. Raises nothing."""
    parent = target.parent
    if not parent.is_dir():
        return
    pat = re.compile(rf"^\.{re.escape(target.name)}\.(tmp|old)-(\d+)$")
    for e in parent.iterdir():
        m = pat.match(e.name)
        if m and (int(m.group(2)) == os.getpid() or not pid_alive(int(m.group(2)))):
            shutil.rmtree(e, ignore_errors=True)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a new, empty temporary sibling folder of ``target`` (``.<name>.tmp-<pid>``, same file system); when the
    block ends normally it replaces ``target`` in one rename (an earlier ``target`` is swapped out and deleted);
    when it raises (or is interrupted) the temporary folder is deleted and ``target`` is left as it was. A process
    killed outright leaves its temporary folder, which the next write of ``target`` deletes.

    Raises:
        OutputDirError: from :func:`check_out_dir`.
        OSError: the parent folder cannot be created or written.
    """
    target = check_out_dir(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target``: one atomic exchange where the OS has it (Linux renameat2), else ``target``
    renamed aside, ``new`` renamed in, the old one deleted. Raises OutputDirError (``target`` changed meanwhile)
    or OSError."""
    if not (target.exists() or target.is_symlink()):
        os.rename(new, target)
        return
    check_out_dir(target)
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # now holds the earlier folder
        return
    aside = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(target, aside)
    os.rename(new, target)
    shutil.rmtree(aside, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where unsupported (not Linux, old libc,
    a file system without it). Raises nothing."""
    fn = getattr(linux_libc(), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@functools.lru_cache(maxsize=1)
def linux_libc():
    """The C library on Linux (for renameat2, prctl), else None. Raises nothing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
