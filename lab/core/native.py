"""Which of the simulator's hot-core modules run compiled, and the switch back to their sources.

``pip install`` compiles the modules named in :data:`COMPILED_MODULES` with mypyc (setup.py); Python then imports
each from its C extension rather than its ``.py`` file. With the environment variable ``SERVELAB_PURE_PYTHON=1``
set before ``lab`` is imported, :func:`use_sources` makes Python import those modules from their sources instead,
so one installation runs either way. The sources are the reference: tests/test_compiled_core.py runs experiments
both ways and requires identical results.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

# Kept equal to setup.py's HOT_CORE (tests/test_compiled_core.py checks).
COMPILED_MODULES = ("lab.core.request", "lab.core.batch", "lab.core.kv_cache", "lab.core.outputs", "lab.core.speculation", "lab.costmodel.roofline",
                    "lab.engine.jump.base", "lab.engine.jump.pricing", "lab.engine.jump.blocks", "lab.engine.jump.admitting",
                    "lab.engine.jump.arrivals", "lab.engine.jump.free_order", "lab.engine.jump.queue_walk", "lab.engine.jump.core", "lab.engine.jump.applying",
                    "lab.engine.jump.decisions")

PURE_PYTHON_ENV = "SERVELAB_PURE_PYTHON"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the folder holding lab/
_MTIME_SLACK_S = 2.0


def pure_python_requested() -> bool:
    """True when ``SERVELAB_PURE_PYTHON=1`` is set: the hot core is imported from its sources."""
    return os.environ.get(PURE_PYTHON_ENV) == "1"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the hot-core modules' ``.py`` files ahead of the extensions built beside them."""

    def find_spec(self, fullname: str, path, target: ModuleType | None = None):
        if fullname not in COMPILED_MODULES:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        for entry in path or sys.path:
            source = os.path.join(entry, leaf)
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def use_sources() -> None:
    """Import the hot-core modules from their ``.py`` files from now on (idempotent).

    Raises:
        RuntimeError: if one of them was already imported (from wherever it was found first).
    """
    if any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        return
    loaded = [m for m in COMPILED_MODULES if m in sys.modules]
    if loaded:
        raise RuntimeError(f"{PURE_PYTHON_ENV}=1 must be set before these are imported: {', '.join(loaded)}")
    sys.meta_path.insert(0, _SourceFinder())


def stale_extensions(root: str | None = None) -> list[str]:
    """The hot-core sources edited after their extension was built (an editable install does not rebuild it):
    their ``.py`` file is newer than the extension beside it by more than ``_MTIME_SLACK_S`` (installing a wheel
    writes both within it). ``root``: the folder holding ``lab/`` (default: this installation's). Empty without
    extensions."""
    root = root or _ROOT
    stale = []
    for name in COMPILED_MODULES:
        base = os.path.join(root, *name.split("."))
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if os.path.exists(base + suffix):
                if os.path.getmtime(base + ".py") > os.path.getmtime(base + suffix) + _MTIME_SLACK_S:
                    stale.append(name)
                break
    return stale


def _extensions_without_library() -> bool:
    """True when a hot-core extension sits beside its source but no mypyc library (the top-level
    ``<hash>__mypyc`` extension built with it, beside ``lab/`` in an editable or a wheel install) is importable:
    importing the module would fail."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    if not any(os.path.exists(os.path.join(_ROOT, *name.split(".")) + suffix)
               for name in COMPILED_MODULES for suffix in suffixes):
        return False
    libraries = [f.split(".")[0] for f in os.listdir(_ROOT) if "__mypyc" in f and f.endswith(suffixes)]
    return not any(importlib.util.find_spec(name) is not None for name in libraries)


def choose_core() -> None:
    """At ``import lab``: import the hot core from its sources when ``SERVELAB_PURE_PYTHON=1`` is set, or when a
    source changed since its extension was built (then say so on stderr, once per process: the extensions of a
    build go together, so all are left out)."""
    if pure_python_requested():
        use_sources()
        return
    if _extensions_without_library():
        print("servelab: the compiled hot core's shared library (*__mypyc*) is missing; running its pure-Python "
              "sources (rebuild: make, or pip install -e .)", file=sys.stderr)
        use_sources()
        return
    stale = stale_extensions()
    if stale:
        print(f"servelab: {', '.join(stale)} changed since the compiled core was built; running its pure-Python "
              f"sources (rebuild: make, or pip install -e .)", file=sys.stderr)
        use_sources()


def compiled_modules() -> list[str]:
    """The hot-core modules imported from a compiled extension (imports them); empty for the pure-Python path."""
    out = []
    for name in COMPILED_MODULES:
        module = importlib.import_module(name)
        if (module.__file__ or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            out.append(name)
    return out


def core_description() -> str:
    """One line for reports and benchmarks: ``compiled (mypyc): N of M modules`` or ``pure Python``."""
    compiled = compiled_modules()
    if not compiled:
        return "pure Python" + (f" ({PURE_PYTHON_ENV}=1)" if pure_python_requested() else "")
    return f"compiled (mypyc): {len(compiled)} of {len(COMPILED_MODULES)} hot-core modules"
