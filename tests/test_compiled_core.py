"""The compiled hot core (setup.py, lab/core/native.py) against its pure-Python sources, the reference."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from lab.core import native

ROOT = Path(__file__).resolve().parents[1]


def _run(code_or_module: list[str], pure: bool) -> str:
    env = dict(os.environ)
    env.pop(native.PURE_PYTHON_ENV, None)
    if pure:
        env[native.PURE_PYTHON_ENV] = "1"
    out = subprocess.run([sys.executable, *code_or_module], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout


@pytest.mark.skipif(not native.compiled_modules(), reason="the hot core is not compiled in this installation "
                    "(SERVELAB_PURE_PYTHON=1, or no C compiler at install)")
def test_the_compiled_core_gives_its_sources_results():
    """Same requests' timelines and step rows, compiled and from the sources, on experiments that take the hot
    core's paths (planned preemptions and resumptions, both free-queue orders, Sarathi, four instances)."""
    compiled = json.loads(_run(["-m", "tests.core_digest"], pure=False))
    pure = json.loads(_run(["-m", "tests.core_digest"], pure=True))
    assert compiled["core"] == f"compiled (mypyc): {len(native.COMPILED_MODULES)} of {len(native.COMPILED_MODULES)} hot-core modules"
    assert pure["core"] == f"pure Python ({native.PURE_PYTHON_ENV}=1)"
    assert sum(c["preemptions"] for c in pure["cases"].values()) > 0
    assert compiled["cases"] == pure["cases"]


def test_the_switch_imports_every_hot_core_module_from_its_source():
    code = ("import importlib, lab.core.native as n; "
            "print([importlib.import_module(m).__file__ for m in n.COMPILED_MODULES]); print(n.compiled_modules())")
    files, compiled = _run(["-c", code], pure=True).splitlines()
    assert all(f.endswith(".py") for f in ast.literal_eval(files))
    assert compiled == "[]"


def test_setup_compiles_the_modules_lab_native_names():
    tree = ast.parse((ROOT / "setup.py").read_text())
    hot_core = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                    and node.targets[0].id == "HOT_CORE")
    paths = ast.literal_eval(hot_core)
    assert [p.removesuffix(".py").replace("/", ".") for p in paths] == list(native.COMPILED_MODULES)


def test_a_source_edited_after_the_build_is_stale(tmp_path):
    """A source newer than its extension (beyond the slack a wheel install leaves) is reported; one built after its
    source is not, nor a module with no extension."""
    suffix = EXTENSION_SUFFIXES[0]
    names = [m.split(".") for m in native.COMPILED_MODULES]
    for parts in names:
        (tmp_path.joinpath(*parts[:-1])).mkdir(parents=True, exist_ok=True)
        tmp_path.joinpath(*parts[:-1], parts[-1] + ".py").write_text("")
    paths = {".".join(p): tmp_path.joinpath(*p[:-1], p[-1]) for p in names}
    kv, roofline = paths["lab.core.kv_cache"], paths["lab.costmodel.roofline"]
    for base, built_after in ((kv, 100.0), (roofline, -100.0)):  # roofline.py edited 100 s after its build
        ext = base.with_name(base.name + suffix)
        ext.write_text("")
        source_mtime = os.path.getmtime(base.with_suffix(".py"))
        os.utime(ext, (source_mtime + built_after, source_mtime + built_after))
    assert native.stale_extensions(str(tmp_path)) == ["lab.costmodel.roofline"]


def test_the_switch_must_come_before_the_hot_core_is_imported():
    import lab.core.kv_cache  # noqa: F401  (imported, from wherever it was found)

    if any(isinstance(f, native._SourceFinder) for f in sys.meta_path):
        pytest.skip("this process already imports the sources (SERVELAB_PURE_PYTHON=1)")
    with pytest.raises(RuntimeError, match="must be set before these are imported: .*lab.core.kv_cache"):
        native.use_sources()
