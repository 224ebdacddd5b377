"""Build hook: compile the simulator's hot core with mypyc when the package is installed.

The modules in ``lab.core.native.COMPILED_MODULES`` are plain, type-annotated Python; mypyc (a build requirement in
pyproject.toml) turns each into a C extension that the machine's C compiler builds from source, next to the
``.py`` file (an editable install copies it into the source tree). Python imports the extension in place of the
source. Nothing is downloaded but the build requirements, and the sources stay the reference:

- ``SERVELAB_PURE_PYTHON=1`` at install time builds no extension;
- ``SERVELAB_PURE_PYTHON=1`` at run time imports the sources even where the extensions are built
  (``lab.core.native``), which is how the tests compare the two (tests/test_compiled_core.py).

The extensions are optional: if the compiler fails, the install goes on with the pure-Python modules (``pip install
-v`` shows the compiler's error; ``servelab bench`` prints which core runs). docs/performance.md gives what the compiled core saves and how it was measured.
"""

import os
import sys

from setuptools import setup

# The hot core, as file paths (kept equal to lab.core.native.COMPILED_MODULES; tests/test_compiled_core.py checks).
HOT_CORE = ["lab/core/request.py", "lab/core/batch.py", "lab/core/kv_cache.py", "lab/core/outputs.py", "lab/core/speculation.py", "lab/costmodel/roofline.py",
            "lab/engine/jump/base.py", "lab/engine/jump/pricing.py", "lab/engine/jump/blocks.py", "lab/engine/jump/admitting.py",
            "lab/engine/jump/arrivals.py", "lab/engine/jump/free_order.py", "lab/engine/jump/queue_walk.py", "lab/engine/jump/core.py", "lab/engine/jump/applying.py",
            "lab/engine/jump/decisions.py"]


def _ext_modules() -> list:
    if os.environ.get("SERVELAB_PURE_PYTHON") == "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as e:  # (a --no-build-isolation install without mypy)
        print(f"servelab: no mypyc ({e}): installing the pure-Python hot core", file=sys.stderr)
        return []
    # numpy, simpy and pydantic are not in the build environment: their values are plain objects to mypyc; the
    # modules the hot core imports are read for their types only (not compiled, so their own errors do not count)
    try:
        exts = mypycify(["--ignore-missing-imports", "--follow-imports=silent", *HOT_CORE], opt_level="3")
    except (SystemExit, Exception) as e:  # mypyc exits on a type error it finds
        print(f"servelab: mypyc could not compile the hot core ({e!r}): installing it pure-Python", file=sys.stderr)
        return []
    for ext in exts:
        ext.optional = True
    return exts


setup(ext_modules=_ext_modules())
