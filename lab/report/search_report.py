"""A search's answers and what it writes: ``search.md`` (a table of the candidates, then every probe in words) and
``search.json``, replaced as one set; and the numbers, times, values and SLO in words that the progress display
shares."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.report.search_judge import MIN_WINDOW_STAYS, Probe
from lab.report.search_spec import SLO_METRICS, SearchSLO, SearchSpec
from lab.report.sweep import replace_outputs


@dataclass
class SearchResult:
    """The answer for one candidate: ``value`` (None if even the easiest end of the bracket misses the SLO, or for
    ``max_goodput`` no value qualifies), the GPUs it takes, the goodput of its probe (req/s), and every probe: the
    search's path in order, then those simulated ahead and not needed."""

    candidate: str
    value: Any
    gpus: int | None
    probes: list[Probe] = field(default_factory=list)
    error: str = ""  # why the candidate could not run at all (e.g. the model does not fit)
    goodput: float | None = None
    per_gpu: float | None = None  # the answer (max_goodput: its goodput) per GPU


def search_json(results: list[SearchResult]) -> str:
    """``search.json``: per candidate, cheapest first, its answer (``value``; null when not met in the bracket or,
    for ``max_goodput``, when no value qualifies), ``gpus``, ``goodput`` (req/s at the answer), ``error`` (why it
    cannot run, else empty) and every probe: ``value``, ``ok``, ``needed`` (false: simulated ahead with ``--jobs``
    and not on the search's path) and the figures of lab/report/search_judge.py ``probe_figures`` (seconds, req/s,
    shares in 0..1)."""
    return json.dumps([{"candidate": r.candidate, "value": r.value, "gpus": r.gpus, "goodput": r.goodput,
                        "per_gpu": r.per_gpu, "error": r.error,
                        "probes": [{"value": p.value, "ok": p.ok, "needed": p.needed, **p.figures} for p in r.probes]}
                       for r in results], indent=1)


def write_search(spec: SearchSpec, results: list[SearchResult], out_dir: Path) -> None:
    """Write ``search.md`` and ``search.json`` into ``out_dir`` as one set, the probes' folders carried over
    (lab/report/sweep.py ``replace_outputs``: one rename; a kill leaves the earlier pair or the new one).

    Raises:
        OutputDirError: ``out_dir`` is a file or holds files no servelab command writes.
        OSError: a file cannot be written (``out_dir`` is then left as it was).
    """
    def write(folder: Path) -> None:
        (folder / "search.md").write_text(search_markdown(spec, results))
        (folder / "search.json").write_text(search_json(results))

    replace_outputs(out_dir, write, keep=("probes",))


def number(x: float, digits: int = 3) -> str:
    """A number to ``digits`` significant digits without an exponent: ``18.5``, ``0.0123``, ``1,234`` (thousands
    and up as whole numbers with separators)."""
    if x is None or not math.isfinite(x):
        return str(x)
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    if x == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def duration(seconds: float) -> str:
    """A time in words to 3 significant digits: ``412 ms``, ``31.2 ms`` below a second, ``1.52 s`` above;
    ``inf`` with no value."""
    if seconds is None or not math.isfinite(seconds):
        return "inf"
    return f"{number(seconds * 1e3)} ms" if abs(seconds) < 1 else f"{number(seconds)} s"


def value_label(value: Any, others: dict | list = ()) -> str:
    """A probe's value in words: integers and names as they are, other numbers to 3 significant digits, or more
    where needed to tell it from the ``others`` (the candidate's other probes)."""
    if not isinstance(value, float):
        return str(value)
    rest = [o for o in others if isinstance(o, float) and o != value]
    for digits in range(3, 17):
        text = number(value, digits)
        if all(number(o, digits) != text for o in rest):
            return text
    return repr(value)


def slo_text(slo: SearchSLO) -> str:
    """The SLO in words: "p90 TTFT <= 500 ms and p90 TPOT <= 50 ms"; "at least 90 % of requests with TTFT <= 500 ms
    and TPOT <= 50 ms, and p99 ITL <= 100 ms"; without a rule (``max_goodput``): "goodput counts the requests with
    TTFT <= 500 ms and TPOT <= 30 ms; every value needs p99 ITL <= 50 ms"."""
    bounds = slo.bounds()
    judged = [f"p{slo.percentile_of(m):g} {SLO_METRICS[m][2]} <= {duration(v)}" for m, v in bounds.items()
              if slo.percentile_of(m) is not None]
    per_request = " and ".join(f"{SLO_METRICS[m][2]} <= {duration(v)}" for m, v in bounds.items() if m != "itl")
    if slo.percentile is not None:
        return " and ".join(judged)
    if slo.attainment is not None:
        text = f"at least {slo.attainment * 100:g} % of requests with {per_request}"
        return text + (", and " + " and ".join(judged) if judged else "")
    text = f"goodput counts the requests with {per_request}" if per_request else "goodput counts every request"
    return text + ("; every value needs " + " and ".join(judged) if judged else "")


def probe_text(spec: SearchSpec, probe: Probe) -> str:
    """One probe's outcome in words: met or missed, then each bound as judged ("p90 TTFT 412 ms <= 500 ms"), the
    attainment against its target, the goodput, and why it missed otherwise (requests not served, a growing
    backlog)."""
    f, slo = probe.figures, spec.slo
    if "error" in f:
        return f"cannot run: {f['error']}"
    parts = []
    for m, bound in slo.bounds().items():
        q = slo.percentile_of(m)
        if q is not None:
            value = f[f"p_{m}"]
            parts.append(f"p{q:g} {SLO_METRICS[m][2]} {duration(value)} {'<=' if value <= bound else '>'} "
                         f"{duration(bound)}")
    att = f"attainment {number(f['attainment'] * 100)} %"
    if slo.attainment is not None:
        att += f" {'>=' if f['attainment'] >= slo.attainment else '<'} {slo.attainment * 100:g} %"
    parts.append(att)
    parts.append(f"goodput {number(f['goodput'])} req/s")
    if f["num_unserved"]:
        parts.append(f"{f['num_unserved']} of {f['num_requests']} requests not served")
    if f.get("window_too_short"):
        parts.append(f"arrivals too short to show a sustained load ({duration(f['arrival_window_s'])} < "
                     f"{MIN_WINDOW_STAYS:g} x the median time in the system, {duration(f['median_stay_s'])})")
    elif f.get("queue_growing"):
        parts.append(f"backlog growing ({f['in_system_at_mid_arrivals']} -> {f['in_system_at_last_arrival']} "
                     f"requests in the system: {number(f['backlog_growth'] * 100, 2)} % of the second half's "
                     f"arrivals piled up beyond a sustained load's, noise {number(f['backlog_growth_noise'] * 100, 2)}"
                     " %)")
    word = ("eligible" if probe.ok else "not eligible") if spec.find == "max_goodput" else \
        ("met" if probe.ok else "missed")
    return f"{word}: " + ", ".join(parts)


_ANSWER_LABEL = {"max_rate": "max rate (req/s)", "max_concurrency": "max concurrency",
                 "min_instances": "min instances"}


def search_markdown(spec: SearchSpec, results: list[SearchResult]) -> str:
    """The answer as a Markdown table: one row per candidate, cheapest first, with its goodput and the probes it
    took; then every probe in words (:func:`probe_text`)."""
    dotted = spec.dotted
    answer = _ANSWER_LABEL.get(spec.find, f"{dotted} with the most goodput")
    per = spec.rank == "per_gpu"
    lines = [f"# {spec.name}: {spec.find} ({dotted})", "", f"SLO: {slo_text(spec.slo)}.", "",
             (f"Ranked by the {'goodput' if spec.find == 'max_goodput' else 'answer'} per GPU (most first)." if per
              else "Ranked by GPUs (fewest first), then the answer."), "",
             f"| candidate | {answer} | GPUs | goodput (req/s) |{' per GPU |' if per else ''} probes |",
             "|---|---:|---:|---:|" + ("---:|" if per else "") + "---:|"]
    for r in results:
        if r.error:
            val = f"cannot run: {r.error}"
        elif r.value is None:
            val = "no value qualifies" if spec.find == "max_goodput" else "not met in the bracket"
        else:
            val = value_label(r.value)
        good = number(r.goodput) if r.goodput is not None else "–"
        per_gpu = (f" {number(r.per_gpu)} |" if r.per_gpu is not None else " – |") if per else ""
        lines.append(f"| {r.candidate} | {val} | {r.gpus if r.gpus is not None else '–'} | {good} |{per_gpu} "
                     f"{len(r.probes)} |")
    lines += ["", "Probes (the search's path in order; those simulated ahead and not needed last):", ""]
    for r in results:
        values = [p.value for p in r.probes]
        for p in r.probes:
            ahead = "" if p.needed else " (simulated ahead, not needed)"
            lines.append(f"- {r.candidate} {dotted}={value_label(p.value, values)}: {probe_text(spec, p)}{ahead}")
    return "\n".join(lines) + "\n"
