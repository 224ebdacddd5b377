"""A run's report page (report.md) and the phrases the console shares with it: the SLO and the achieved load in
words."""

from __future__ import annotations


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.1f}"


def slo_words(slo: dict) -> str:
    """An SLO mapping (``ttft_s``, ``tpot_s``, ``e2el_s``: seconds) in words, e.g. ``TTFT <= 0.5 s, TPOT <= 50 ms``
    (a bound under 0.1 s in milliseconds); "none" when no bound is set."""
    parts = []
    for key, bound in slo.items():
        if bound is None:
            continue
        name = key.removesuffix("_s").upper()
        parts.append(f"{name} <= {bound:g} s" if bound >= 0.1 else f"{name} <= {bound * 1000:g} ms")
    return ", ".join(parts) if parts else "none"


def achieved_words(summary: dict, lead: str = "") -> str:
    """The achieved request throughput in words: over the arrival window (first to last request sent: requests
    received in full within it, and those still in flight at its end) and over the whole duration (to the last
    token received, as ``vllm bench serve`` divides), both windows named; '' when the arrivals span no time
    (every request sent at once)."""
    rate = summary.get("arrival_window_request_throughput")
    if rate is None:
        return ""
    return (f"{lead}Achieved {rate:.2f} req/s over the arrival window (first to last request sent, "
            f"{summary['arrival_window_s']:.1f} s; {summary.get('arrival_window_in_flight', 0)} requests in flight "
            f"at its end), {summary['request_throughput']:.2f} req/s over the whole {summary['duration_s']:.1f} s "
            "(to the last token received: the drain after the last arrival included, as vllm bench serve counts).")


def _layout(d: dict) -> str:
    """Pipeline, DP/EP, lock-step and pools, for the report's first line ('' for a plain deployment)."""
    parts = []
    if d.get("pipeline_parallel_size", 1) > 1:
        parts.append(f"PP{d['pipeline_parallel_size']}")
    if d.get("data_parallel_size", 1) > 1:
        parts.append(f"DP{d['data_parallel_size']} x EP{d['expert_parallel_size']}"
                     + (f", {d['lock_step_groups']} lock-step group(s)" if d.get("lock_step_groups") else ""))
    if d.get("pools"):
        pools = ", ".join(f"{p['name']} ({p['num_instances']} x {p['gpu']})" for p in d["pools"])
        parts.append(f"pools {pools}, {d.get('hand_offs', 0)} hand-offs")
    return "; " + "; ".join(parts) if parts else ""


def markdown(summary: dict, figures: list[tuple[str, str]]) -> str:
    """The report page: headline table, latency table, engine statistics, then the figures."""
    d = summary["deployment"]
    lines = [f"# {summary['experiment']}", "",
             f"{d['model']} on {d['gpu']} × TP{d['tensor_parallel_size']}, scheduler `{d['scheduler']}` "
             f"({d['queue']}), cost model `{d['cost_model']}`, {d['num_gpu_blocks']} KV blocks of {d['block_size']} "
             f"tokens ({d['num_gpu_blocks_source']}), max_num_batched_tokens {d['max_num_batched_tokens']}, "
             f"max_num_seqs {d['max_num_seqs']}; preemption {d['preemption']['mode']} "
             f"(victim {d['preemption']['victim']}); {d['num_instances']} instance(s), router `{d['router']}`"
             f"{_layout(d)}.", "",
             "| requests | finished | rejected | unfinished | duration (s) | req/s | output tok/s | total tok/s | preemptions |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {summary['num_requests']} | {summary['num_finished']} | {summary['num_rejected']} | "
             f"{summary['num_unfinished']} | {summary['duration_s']:.1f} | {summary['request_throughput']:.2f} | "
             f"{summary['output_token_throughput']:.0f} | {summary['total_token_throughput']:.0f} | "
             f"{summary['num_preemptions']} |", "",
             f"Offered load: {summary.get('offered_load', '')}." + achieved_words(summary, " ")
             + (f" {summary['num_warmup']} warm-up requests ran first and are left out of every figure."
                if summary.get("num_warmup") else ""), "",
             "| metric (ms) | mean | median | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for m in ("ttft", "tpot", "itl", "e2el", "queue_time"):
        s = summary[m]
        lines.append(f"| {m.upper()} | {_ms(s['mean'])} | {_ms(s['median'])} | {_ms(s['p90'])} | {_ms(s['p99'])} |")
    if "goodput" in summary:
        lines += ["", f"Goodput {summary['goodput']:.2f} req/s; SLO attainment {summary['slo_attainment'] * 100:.1f} % "
                      f"(SLO {slo_words(summary['slo'])})."]
    eng = summary.get("engine")
    if eng:
        lines += ["", f"Engine: {eng['num_steps']} steps, mean batch {eng['mean_batch_size']:.1f} requests / "
                      f"{eng['mean_scheduled_tokens']:.0f} tokens, peak KV usage {eng['peak_kv_usage'] * 100:.1f} %, "
                      f"peak running {eng['peak_running']}, peak waiting {eng['peak_waiting']}."]
    off = summary.get("kv_offload")
    if off:
        lines += ["", f"KV offloading: {off['cpu_blocks']} CPU blocks; {off['cpu_hit_requests']} loads of "
                      f"{off['cpu_hit_tokens']} tokens from CPU ({off['bytes_loaded'] / 1e9:.2f} GB), "
                      f"{off['bytes_stored'] / 1e9:.2f} GB stored, {off['cpu_evictions']} CPU-tier evictions."]
    dis = summary.get("disaggregation")
    if dis:
        parts = ", ".join(f"{k[3:-2].replace('_', ' ')} {_ms(v)} ms" for k, v in dis["ttft_decomposition_mean_s"].items())
        util = ", ".join(f"{x['busy_fraction'] * 100:.1f} %" for x in dis["links"])
        lines += ["", f"Disaggregated: {dis['kv_transfer_bytes'] / 1e9:.2f} GB of KV moved "
                      f"({dis['kv_drafter_bytes'] / 1e9:.2f} GB drafter), link busy {util}, "
                      f"{dis['num_lease_expiries']} lease expiries. Mean TTFT by part: {parts}."]
    sp = summary.get("speculative")
    if sp and sp["num_drafts"]:
        pos = ", ".join(f"{p:.3f}" for p in sp["per_position_acceptance"])
        lines += ["", f"Speculative decoding: {sp['method']}, k = {sp['num_speculative_tokens']}; "
                      f"{sp['num_drafts']} verifications, acceptance rate {sp['acceptance_rate'] * 100:.1f} %, mean "
                      f"acceptance length {sp['mean_acceptance_length']:.2f} tokens per step, per-position acceptance "
                      f"{pos} (acceptance model: {sp['acceptance_source']})."]
    inst = summary.get("instances") or []
    if len(inst) > 1:
        lines += ["", f"Per instance (router `{d.get('router')}`; latencies in ms):", "",
                  "| instance | requests | finished | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 | E2EL mean | E2EL p99 "
                  "| output tok/s | preemptions | prefix-hit tokens | busy % |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in inst:
            lines.append(f"| {row['instance']} | {row['num_requests']} | {row['num_finished']} | "
                         + " | ".join(_ms(row[k]) for k in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99",
                                                              "e2el_mean", "e2el_p99"))
                         + f" | {row['output_token_throughput']:.0f} | {row['num_preemptions']} | "
                           f"{row['prefix_hit_tokens']} | {row['busy_fraction'] * 100:.1f} |")
    sim = summary["simulation"]
    lines += ["", f"Simulated {sim['sim_end_s']:.1f} s in {sim['wall_time_s']:.2f} s wall time (seed {sim['seed']}).", ""]
    for title, fname in figures:
        lines += [f"## {title}", "", f"![{title}]({fname})", ""]
    lines += ["Tables: `requests.parquet` / `requests.csv` (one row per request), `steps.parquet` (one row per step), "
              "`events.parquet` (request lifecycle events), `summary.json`.", ""]
    return "\n".join(lines)
