"""Where shared data lives and how experiment files name paths.

The data directory (public traces, profiles, measured runs) is, in order: the ``--data-dir`` option, the
``SERVELAB_DATA_DIR`` environment variable, the experiment's ``data_dir`` field, then ``../shared/data`` next to the
project checkout (or next to the current directory). Paths in experiment files may start with ``{data_dir}``;
other relative paths are relative to the experiment file's folder.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def default_data_dir() -> Path:
    """``$SERVELAB_DATA_DIR``, else ``<checkout>/../shared/data``, else ``./../shared/data``."""
    env = os.environ.get("SERVELAB_DATA_DIR")
    if env:
        return Path(env)
    for base in (PROJECT_ROOT, Path.cwd()):
        cand = base.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return PROJECT_ROOT.parent / "shared" / "data"


def expand_path(value: str, data_dir: Path, base_dir: Path, field: str) -> Path:
    """Expand ``{data_dir}`` and make a relative path relative to ``base_dir``.

    Raises:
        ValueError: the path names ``{data_dir}`` and that folder does not exist (the message says how to set it).
    """
    if "{data_dir}" in value:
        if not data_dir.is_dir():
            raise ValueError(f"{field}: {value!r} uses {{data_dir}}, which is {data_dir} and does not exist; "
                             "pass --data-dir or set SERVELAB_DATA_DIR to the shared data folder")
        value = value.replace("{data_dir}", str(data_dir))
    p = Path(os.path.expanduser(value))
    if not p.is_absolute():
        p = base_dir / p
    return p
