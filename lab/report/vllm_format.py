"""The console block ``vllm bench serve`` prints at the end of a benchmark, rebuilt from a simulated run's
bench_result.json, so a vLLM user reads a simulated run the way they read a measured one.

The layout follows vLLM's ``benchmarks/serve.py`` (``vllm bench serve``): a title rule, the request counts,
duration and throughputs, then one section per latency metric named in ``--percentile-metrics`` with its mean,
median and the percentiles of ``--metric-percentiles``, all in milliseconds.
"""

from __future__ import annotations

from typing import Sequence

WIDTH = 50
LABEL_WIDTH = 40

# Section titles and short names per metric, as the vLLM client labels them.
_SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{WIDTH}}" if title else fill * WIDTH


def _line(label: str, value) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<{LABEL_WIDTH}}{text}"


def _percentile_word(p: float) -> str:
    return f"{p:g}"


def serving_result_block(result: dict, metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """The text block, one line per figure.

    Args:
        result: a bench_result.json mapping (lab/report/metrics.py ``vllm_bench_result``): ``completed``,
            ``failed`` (else the length of ``errors``, as an older file has it),
            ``duration`` (s), ``total_input_tokens``, ``total_output_tokens``, ``request_throughput`` (req/s),
            ``output_throughput`` and ``total_token_throughput`` (tok/s), ``request_goodput`` (req/s or None),
            ``max_concurrency``, ``mean_<m>_ms``, ``median_<m>_ms``, ``p<q>_<m>_ms``.
        metrics: metric names to give sections for (``ttft``, ``tpot``, ``itl``, ``e2el``).
        percentiles: percentiles printed per metric, e.g. (50, 90, 99).

    Returns:
        The block, newline-separated, without a trailing newline.
    """
    lines = [_rule(" Serving Benchmark Result ", "="),
             _line("Successful requests:", result.get("completed")),
             _line("Failed requests:", result["failed"] if result.get("failed") is not None
                   else len(result.get("errors") or []))]
    if result.get("max_concurrency") is not None:  # a closed loop; vLLM prints the line only then
        lines.append(_line("Maximum request concurrency:", result.get("max_concurrency")))
    lines += [_line("Benchmark duration (s):", result.get("duration")),
             _line("Total input tokens:", result.get("total_input_tokens")),
             _line("Total generated tokens:", result.get("total_output_tokens")),
             _line("Request throughput (req/s):", result.get("request_throughput"))]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result.get("request_goodput")))
    lines += [_line("Output token throughput (tok/s):", result.get("output_throughput")),
              _line("Total token throughput (tok/s):", result.get("total_token_throughput"))]
    for m in metrics:
        title, short = _SECTIONS[m]
        lines.append(_rule(title, "-"))
        lines.append(_line(f"Mean {short} (ms):", result.get(f"mean_{m}_ms")))
        lines.append(_line(f"Median {short} (ms):", result.get(f"median_{m}_ms")))
        for p in percentiles:
            word = _percentile_word(p)
            lines.append(_line(f"P{word} {short} (ms):", result.get(f"p{word}_{m}_ms")))
    lines.append(_rule("", "="))
    return "\n".join(lines)
