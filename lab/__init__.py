"""servelab: a trace-driven discrete-event simulator and policy lab for LLM inference serving."""

__version__ = "0.1.0"
