"""report.html and sweep.html (issue 14): self-contained (no URL of any kind), the headline numbers of summary.json,
a timeline whose phases follow the recorded events, the sweep's CI bands and SLO line; and, in headless Chromium,
no JavaScript or console error, no network request, and every plot drawn with data marks."""

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from lab.experiment.config import parse_experiment
from lab.experiment.simulation import simulate
from lab.report.html import request_timeline, timeline_sample
from lab.report.run_report import write_report
from lab.report.sweep import load_sweep, run_sweep

CHROMIUM = "/usr/bin/chromium"
# a fresh profile (Playwright's default) and these flags: Chromium then never tries the network
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]

# 40 requests of 512-token prompts into 90 KV blocks of 16 tokens: the cache fills, requests are swapped out and in;
# a 256-token budget splits each prompt into chunks
RUN = {"name": "html_run", "seed": 3,
       "workload": {"source": "synthetic", "num_requests": 40, "rate": 25.0,
                    "prompt_tokens": {"kind": "constant", "value": 512},
                    "output_tokens": {"kind": "lognormal", "median": 200, "sigma": 0.5, "max": 400}},
       "model": {"name": "Llama-3.1-8B"},
       "engine": {"num_gpu_blocks": 90, "max_num_batched_tokens": 256, "max_num_seqs": 32},
       "policy": {"preemption": {"mode": "swap"}}, "slo": {"ttft_s": 0.5, "tpot_s": 0.05},
       "simulation": {"progress": False, "record_events": True}}
SWEEP_BASE = {**RUN, "name": "html_sweep_base", "workload": {**RUN["workload"], "num_requests": 15},
              "engine": {}, "policy": {}, "simulation": {"progress": False, "record_events": False}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(SimResult, folder with the run's full report)."""
    result = simulate(parse_experiment(RUN))
    out = tmp_path_factory.mktemp("html") / "run"
    write_report(result, out)
    return result, out


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Folder of a 3-point sweep (2 replications each) with sweep.html."""
    base = tmp_path_factory.mktemp("sweep")
    path = base / "sw.yaml"
    path.write_text(yaml.safe_dump({"name": "html_sweep", "base": SWEEP_BASE, "replications": 2,
                                    "axes": {"workload.rate": [2, 8, 24]}}, sort_keys=False))
    spec, cmp, runs = load_sweep(path)
    run_sweep(spec, cmp, runs, base / "out", jobs=1)
    return base / "out"


def _no_urls(text: str) -> None:
    assert not re.search(r"(?i)\b(?:https?|ftp|wss?):", text), "an external URL in the page"
    refs = re.findall(r"""(?i)\b(?:src|href|action|srcset)\s*=\s*["']?([^"'\s>]*)""", text)
    assert all(r.startswith("#") for r in refs), refs
    assert not re.search(r"(?i)@import|url\(", text)


def _data(text: str) -> dict:
    m = re.search(r'<script type="application/json" id="servelab-data">(.*?)</script>', text, re.S)
    return json.loads(m.group(1))


def test_run_report_is_self_contained_and_holds_the_headline_numbers(run):
    _, out = run
    text = (out / "report.html").read_text()
    _no_urls(text)
    s = json.loads((out / "summary.json").read_text())
    assert s["num_preemptions"] > 0 and s["num_swaps"] > 0  # the run exercises the timeline's preemption marks
    cells = [f"{s['num_requests']}", f"{s['num_finished']}", f"{s['request_throughput']:.2f}",
             f"{s['output_token_throughput']:.0f}", f"{s['goodput']:.2f}", f"{s['slo_attainment'] * 100:.1f}"]
    cells += [f"{s[m][k] * 1000:.1f}" for m in ("ttft", "tpot", "itl", "e2el")
              for k in ("mean", "median", "p90", "p99")]
    for c in cells:
        assert f">{c}</td>" in text, c
    assert s["offered_load"] in text
    charts = _data(text)["charts"]
    assert {"cdf_ttft", "cdf_tpot", "cdf_itl", "cdf_e2el", "ts_tokens", "ts_queue", "ts_kv"} <= set(charts)
    assert charts["cdf_ttft"]["vlines"][0]["x"] == pytest.approx(500)  # the TTFT SLO on its CDF, in ms
    y = charts["cdf_e2el"]["series"][0]["y"]
    assert y == sorted(y) and y[-1] == 1.0


def test_the_timeline_follows_each_requests_events(run):
    _, out = run
    req = pd.read_parquet(out / "requests.parquet")
    ev = pd.read_parquet(out / "events.parquet")
    sample = timeline_sample(req, n=10)
    assert len(sample) == 10 and sample.equals(timeline_sample(req, n=10))
    assert sample["arrival_time"].is_monotonic_increasing and (sample["num_preemptions"] > 0).any()
    summary = json.loads((out / "summary.json").read_text())
    rows, t0, t1, note = request_timeline(req, ev, out / "steps.parquet", summary)
    assert len(rows) == min(40, len(req)) and t0 < t1 and "preempted" in note
    by_label = {r["label"]: r for r in rows}
    for r in timeline_sample(req).itertuples():
        row = by_label[f"req {r.request_id}"]
        phases = [s for s in row["segs"] if s[2] != "chunk"]
        # back to back from the client's send to the finish: the front end (API server), queued, prefill, decode,
        # then preempted gaps and decode
        assert phases[0][0] == pytest.approx(r.arrival_time) and phases[-1][1] == pytest.approx(r.finish_time)
        assert all(a[1] == b[0] for a, b in zip(phases, phases[1:]))
        assert phases[0][2] == "frontend" and phases[0][1] == pytest.approx(r.engine_arrival_time)
        phases = phases[1:]
        kinds = [p[2] for p in phases]
        assert kinds[kinds[0] == "queued":][:2] == ["prefill", "decode"]  # no queued bar when scheduled on arrival
        assert sum(p[2] == "preempted" for p in phases) == r.num_preemptions
        swaps = [m[1] for m in row["marks"]]
        assert swaps.count("swap_out") + swaps.count("swap_in") == 2 * r.num_preemptions  # every preemption swapped
        prefill = phases[kinds.index("prefill")]
        chunks = [s for s in row["segs"] if s[2] == "chunk"]
        # 512-token prompts with a 256-token budget: at least two steps with prefill tokens inside the prefill phase
        assert len(chunks) >= 2 and all(prefill[0] <= c[0] < c[1] <= prefill[1] for c in chunks)


def test_without_plots_the_report_holds_the_tables_only(run, tmp_path):
    result, _ = run
    out = tmp_path / "noplots"
    s = write_report(result, out, plots=False)
    text = (out / "report.html").read_text()
    _no_urls(text)
    assert _data(text) == {"charts": {}, "gantts": {}} and 'class="chart"' not in text
    assert "Plots were not drawn" in text
    assert f">{s['ttft']['p99'] * 1000:.1f}</td>" in text


def test_sweep_report_has_a_band_per_line_and_the_slo(sweep):
    text = (sweep / "sweep.html").read_text()
    _no_urls(text)
    charts = _data(text)["charts"]
    assert len(charts) == 12  # one per charted sweep metric (lab/report/sweep.py CHART_METRICS)
    summary = pd.read_csv(sweep / "sweep_summary.csv")
    ttft = charts["sweep_ttft_p99_ms"]
    assert ttft["xlabel"] == "workload.rate" and ttft["hlines"][0]["y"] == pytest.approx(500)
    assert "hlines" not in charts["sweep_request_throughput_req_s"]
    (line,) = ttft["series"]
    assert line["x"] == [2, 8, 24]
    assert line["y"] == pytest.approx(summary["ttft_p99_ms"].tolist(), rel=1e-5)  # ms in the file and the chart
    assert line["hi"] == pytest.approx((summary["ttft_p99_ms"] + summary["ttft_p99_ms_ci95"]).tolist(), rel=1e-5)
    assert "TTFT p90 (ms)" in text and "queue time p95 (ms)" in text  # the table of points has every metric


# ---------------------------------------------------------------- headless Chromium

@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file() and not shutil.which("chromium"):
        pytest.skip("chromium not installed: apt-get install -y --no-install-recommends chromium (.ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed: pip install -e '.[test]'")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium"),
                              headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


# every chart or timeline: its size and how many of its data marks have a non-empty box
_PLOTS_JS = """() => Array.from(document.querySelectorAll('[data-chart],[data-gantt]')).map(el => {
  const r = el.getBoundingClientRect();
  const marks = Array.from(el.querySelectorAll('svg .mark'));
  const drawn = marks.filter(m => { const b = m.getBBox(); return b.width > 0 || b.height > 0; }).length;
  return {id: el.dataset.chart || el.dataset.gantt, w: r.width, h: r.height, drawn: drawn}; })"""


def _open(browser, path: Path, shot: Path) -> list[dict]:
    """Open ``path``, screenshot it to ``shot``, fail on any error, warning or request off the file; the plots."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"JavaScript error: {e}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("request", lambda r: problems.append(f"request: {r.url}") if not r.url.startswith("file:") else None)
    page.goto(path.as_uri())
    plots = page.evaluate(_PLOTS_JS)
    # hover first: the full-page screenshot resizes the viewport, and the page redraws its charts 150 ms after a
    # resize (a debounced handler), which would reset a readout read meanwhile
    chart = page.locator("[data-chart] svg").first
    chart.scroll_into_view_if_needed()  # a pointer move outside the viewport reaches no element
    box = chart.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.5)  # the hover readout answers
    try:
        page.wait_for_function("() => document.querySelector('[data-chart] .readout').textContent.includes('=')",
                               timeout=5000)
    except Exception as e:  # playwright's TimeoutError: the readout never answered
        readout = page.locator("[data-chart] .readout").first.text_content()
        page.close()
        raise AssertionError(f"the hover readout did not answer: {readout!r}") from e
    page.screenshot(path=str(shot), full_page=True)
    assert problems == []
    assert shot.stat().st_size > 10_000
    page.close()
    return plots


def test_run_report_renders_in_chromium(browser, run, tmp_path):
    plots = _open(browser, run[1] / "report.html", tmp_path / "report.png")
    assert {p["id"] for p in plots} == {"cdf_ttft", "cdf_tpot", "cdf_itl", "cdf_e2el", "ts_tokens", "ts_queue",
                                        "ts_kv", "timeline"}
    for p in plots:
        assert p["w"] > 100 and p["h"] > 100 and p["drawn"] > 0, p
    assert next(p for p in plots if p["id"] == "timeline")["drawn"] >= 40 * 3


def test_sweep_report_renders_in_chromium(browser, sweep, tmp_path):
    plots = _open(browser, sweep / "sweep.html", tmp_path / "sweep.png")
    assert len(plots) == 12
    for p in plots:
        assert p["w"] > 100 and p["h"] > 100 and p["drawn"] >= 3, p  # a line and its points (and band)
