"""servelab: a trace-driven discrete-event simulator and policy lab for LLM inference serving."""

from lab.core.native import choose_core

__version__ = "0.1.0"

# the hot core compiled, or from its sources (SERVELAB_PURE_PYTHON=1, or a stale build): lab/core/native.py
choose_core()
