"""A run's requests table and summary (summary.json): latency statistics, engine statistics, per-instance
metrics, the deployment, and the KV offloading, disaggregation and speculative decoding figures."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lab.experiment.simulation import SimResult
from lab.experiment.speculative import acceptance_rates
from lab.report.metrics import columns_frame, request_columns, speculative_stats, summarize, take
from lab.report.run_tables import step_totals

if TYPE_CHECKING:
    import pandas as pd


def collect(result: SimResult, steps: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict]:
    """(requests table, summary dict) of a run. Engine statistics come from the step logs' running totals
    (:func:`step_totals`), so a summarized log gives the same summary; ``steps`` is accepted for older callers and
    not read. (:func:`collect_columns` with the table as a DataFrame.)"""
    cols, summary = collect_columns(result)
    return columns_frame(cols), summary


def measured_rows(cols) -> np.ndarray:
    """Boolean mask of the measured requests of a requests table (closed-loop warm-up requests left out)."""
    n = len(cols["status"])
    return ~np.asarray(cols["warmup"], dtype=bool) if "warmup" in cols else np.ones(n, dtype=bool)


def collect_columns(result: SimResult) -> tuple[dict, dict]:
    """(requests table as :func:`lab.report.metrics.request_columns` columns, summary dict) of a run: what
    :func:`collect` returns, without pandas."""
    exp = result.experiment
    req = request_columns(result.requests)
    slo = exp.slo.model_dump()
    eng = step_totals(result).engine_stats()
    warm = "warmup" in req
    measured = take(req, measured_rows(req)) if warm else req  # closed-loop warm-up requests are not measured
    summary = summarize(measured, result.itl_samples, horizon=exp.simulation.horizon_s, slo=slo, engine=eng)
    if warm:
        summary["num_warmup"] = int(np.asarray(req["warmup"]).sum())
    summary["experiment"] = exp.name
    summary["experiment_file"] = str(Path(exp.source).resolve()) if Path(exp.source).is_file() else None
    summary["offered_load"] = offered_load(exp)
    summary["instances"] = instances_table(req, result, summary["duration_s"])
    summary["num_swaps"] = int(sum(r.num_swaps for r in result.requests))
    offload = kv_offload_summary(result)
    if offload is not None:  # KV offloading: the CPU tier's counters, and each request's tokens loaded from it
        summary["kv_offload"] = offload
        req["cpu_loaded_tokens"] = np.array([r.cpu_loaded_tokens for r in result.requests], dtype=np.int64)
    if "engine" in summary:
        summary["engine"]["transfer_s"] = float(sum(i.transfer_total for i in result.instances))
    summary["deployment"] = deployment_summary(result)
    disaggregation = disaggregation_summary(result, req, summary["duration_s"])
    if disaggregation is not None:
        summary["disaggregation"] = disaggregation
    speculative = speculative_summary(result)
    if speculative is not None:
        summary["speculative"] = speculative
    summary["simulation"] = {"sim_end_s": result.sim_end, "wall_time_s": result.wall_time_s,
                             "seed": exp.seed, "fast_forward_jumps": sum(i.jump.num_jumps for i in result.instances),
                             "fast_forward_steps": sum(i.jump.jumped_steps for i in result.instances),
                             "itl_resolution_s": 1e-7 if result.itl_samples.compacted else 0.0}
    return req, summary


def deployment_summary(result: SimResult) -> dict:
    """summary.json's ``deployment``: model, GPU, parallelism, scheduler, router, KV blocks and batch limits, the
    derived KV capacity, the pools, lock-step groups and hand-offs."""
    exp, dep = result.experiment, result.deployment
    out = {
        "model": dep.model.name, "gpu": dep.hardware.name, "tensor_parallel_size": exp.hardware.tensor_parallel_size,
        "num_instances": len(result.instances),
        "pipeline_parallel_size": exp.hardware.pipeline_parallel_size,
        "expert_parallel_size": exp.hardware.expert_parallel_size,
        "data_parallel_size": exp.hardware.data_parallel_size,
        "scheduler": exp.policy.scheduler, "queue": exp.policy.queue, "cost_model": dep.cost_model.name,
        "scheduler_options": dict(exp.policy.options), "preemption": exp.policy.preemption.model_dump(),
        "router": exp.cluster.router,
        "num_gpu_blocks": dep.num_gpu_blocks, "block_size": exp.engine.block_size,
        "num_gpu_blocks_source": "config" if dep.kv_capacity is None else "derived",
        "max_num_batched_tokens": dep.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": dep.scheduler_config.max_num_seqs, "max_model_len": dep.scheduler_config.max_model_len,
    }
    if dep.kv_capacity is not None:
        out["kv_capacity"] = dep.kv_capacity.as_dict()
    out["pools"] = [
        {"name": name, "gpu": d.hardware.name, "num_instances": sum(1 for i in result.instances if i.pool == name),
         "max_num_seqs": d.scheduler_config.max_num_seqs, "num_gpu_blocks": d.num_gpu_blocks,
         "cost_model": d.cost_model.name} for name, d in result.pools if name]
    out["lock_step_groups"] = len(result.groups)
    out["hand_offs"] = result.cluster.num_hand_offs if result.cluster is not None else 0
    return out


def disaggregation_summary(result: SimResult, req: dict, duration_s: float) -> dict | None:
    """summary.json's ``disaggregation`` (KV moved between pools, each link's use, pinned blocks, the mean TTFT of
    the handed-off requests by part), or None without links between pools."""
    cl = result.cluster
    if cl is None or not cl.links:
        return None
    dur = max(duration_s, 1e-12)
    handed = (~np.isnan(np.asarray(req["pd_transfer_s"], dtype=float)) if "pd_transfer_s" in req
              else np.zeros(len(req["status"]), dtype=bool))
    return {
        "kv_transfer_bytes": cl.bytes_transferred, "kv_drafter_bytes": cl.drafter_bytes_transferred,
        "num_lease_expiries": cl.num_lease_expiries,
        "links": [{"name": link.name, "bandwidth_Bps": link.bandwidth, "bytes": link.bytes_sent,
                   "busy_fraction": link.busy_s / dur, "mean_utilisation": link.bytes_sent / (link.bandwidth * dur),
                   "peak_concurrent_transfers": link.peak_concurrent} for link in cl.links.values()],
        "peak_pinned_blocks": {str(i.instance_id): i.peak_pinned_blocks for i in result.instances
                               if i.peak_pinned_blocks},
        "ttft_decomposition_mean_s": {c: _nanmean(np.asarray(req[c], dtype=float)[handed]) if handed.any()
                                      else None for c in
                                      ("pd_p_queue_s", "pd_prefill_s", "pd_handover_s", "pd_kv_wait_s",
                                       "pd_transfer_s", "pd_d_queue_s", "pd_first_decode_s")},
    }


def speculative_summary(result: SimResult) -> dict | None:
    """summary.json's ``speculative`` (method, k, where the acceptance rates come from, vLLM's spec-decode
    counters summed over the instances), or None without speculative decoding."""
    exp, dep = result.experiment, result.deployment
    spec = exp.speculative
    if spec is None:
        return None
    drafters = [i.acceptance for i in result.instances if i.acceptance is not None]
    per_pos = [sum(d.accepted_per_pos[j] for d in drafters) for j in range(spec.num_speculative_tokens)]
    return {
        "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
        "acceptance_source": acceptance_rates(exp, dep.model)[1] if spec.acceptance.kind != "per_request"
        else "per request", "drafter_kv_bytes_per_token": dep.drafter.kv_bytes_per_token if dep.drafter else 0,
        **speculative_stats(sum(d.num_drafts for d in drafters), sum(d.num_draft_tokens for d in drafters),
                            sum(d.num_accepted_tokens for d in drafters), per_pos)}


def instances_table(req, result: SimResult, duration: float) -> list[dict]:
    """Per-instance metrics (issue #5): requests routed, finished, TTFT/TPOT/E2EL mean and p99 (s), output
    token throughput over the cluster's duration, preemptions, prefix-hit tokens, busy fraction, steps and
    swap (host-link) time, pool, and dummy steps (lock-stepped DP ranks with nothing to run). ``req``: the
    requests table (a DataFrame or :func:`lab.report.metrics.request_columns` mapping)."""
    rows = []
    dur = duration if duration > 0 else float("nan")
    dummy = {rank.instance_id: n for g in result.groups for rank, n in zip(g.ranks, g.num_dummy_steps)}
    # with hand-offs a request counts on every instance that served it (its latencies are end-to-end)
    served_elsewhere = any(len(q.served_by) > 1 for q in result.requests)
    instance = np.asarray(req["instance"])
    status = np.asarray(req["status"], dtype=object) if not isinstance(req["status"], list) else np.array(req["status"])
    names = list(req.columns) if hasattr(req, "columns") else list(req)
    measured = ~np.asarray(req["warmup"], dtype=bool) if "warmup" in names else np.ones(len(status), dtype=bool)
    finished = status == "finished"
    lat = {c: np.asarray(req[c], dtype=float) for c in ("ttft", "tpot", "e2el")}
    out_tokens = np.asarray(req["output_tokens"])
    preemptions = np.asarray(req["num_preemptions"])
    hits = np.asarray(req["prefix_hit_tokens"])
    for inst in result.instances:
        i = inst.instance_id
        here = (np.array([i in q.served_by for q in result.requests], dtype=bool) if served_elsewhere
                else instance == i)
        here &= measured  # closed-loop warm-up requests are not measured, here as in the run's totals
        fin = here & finished

        def stat(col: str, fn) -> float | None:
            v = lat[col][fin]
            v = v[np.isfinite(v)]
            return float(fn(v)) if len(v) else None

        rows.append({
            "instance": int(i), "num_requests": int(here.sum()), "num_finished": int(fin.sum()),
            "ttft_mean": stat("ttft", np.mean), "ttft_p99": stat("ttft", lambda a: np.percentile(a, 99)),
            "tpot_mean": stat("tpot", np.mean), "tpot_p99": stat("tpot", lambda a: np.percentile(a, 99)),
            "e2el_mean": stat("e2el", np.mean), "e2el_p99": stat("e2el", lambda a: np.percentile(a, 99)),
            "output_token_throughput": float(out_tokens[fin].sum()) / dur,
            "num_preemptions": int(preemptions[here].sum()), "prefix_hit_tokens": int(hits[here].sum()),
            "num_steps": int(len(inst.steps)), "busy_fraction": inst.busy_time / dur, "pool": inst.pool,
            "dummy_steps": dummy.get(inst.instance_id, 0),
            "transfer_s": inst.transfer_total,
        })
    return rows


def kv_offload_summary(result: SimResult) -> dict | None:
    """The CPU tier's counters summed over the instances (lab/core/kv_offload.py), or None without KV offloading:
    capacity (blocks), CPU hits (requests whose load started, tokens loaded), blocks and bytes stored / loaded
    over the host link (all GPU ranks), CPU-tier evictions."""
    tiers = [i.kv_offload for i in result.instances if i.kv_offload is not None]
    if not tiers:
        return None
    return {
        "cpu_blocks": sum(t.tier.num_blocks for t in tiers),
        "cpu_hit_requests": sum(t.cpu_hit_requests for t in tiers),
        "cpu_hit_tokens": sum(t.cpu_hit_tokens for t in tiers),
        "blocks_stored": sum(t.blocks_stored for t in tiers),
        "blocks_loaded": sum(t.blocks_loaded for t in tiers),
        "bytes_stored": float(sum(t.bytes_stored for t in tiers)),
        "bytes_loaded": float(sum(t.bytes_loaded for t in tiers)),
        "cpu_evictions": sum(t.num_evictions for t in tiers),
    }


def _nanmean(v: np.ndarray) -> float:
    """The mean of the non-NaN values, as pandas' ``Series.mean`` computes it (NaN taken as 0 in the sum, divided
    by the count; NaN when none)."""
    missing = np.isnan(v)
    count = int((~missing).sum())
    return float(np.where(missing, 0.0, v).sum() / count) if count else float("nan")


def offered_load(exp) -> str:
    """The load the workload offers, in words (beside the achieved throughput in every report)."""
    from lab.experiment.resolve import closed_loop_concurrency

    w = exp.workload
    n = closed_loop_concurrency(exp)
    if n is not None:
        think = f", think time {w.think_time_s:g} s" if w.think_time_s else ""
        return f"closed loop, concurrency {n}{think}"
    if w.source == "sessions":
        think = f", think time {w.think_time_s:g} s" if w.think_time_s else ""
        return f"{w.num_requests} multi-turn sessions starting at {w.rate:g} sessions/s{think}"
    if w.source == "synthetic":
        if w.rate == float("inf"):
            return f"all {w.num_requests} requests at t = 0 (request rate inf)"
        kind = "Poisson" if w.cv == 1.0 else f"Gamma (cv {w.cv:g})"
        return f"{kind} arrivals at {w.rate:g} req/s"
    scale = f", time_scale {w.time_scale:g}" if w.time_scale != 1.0 else ""
    return f"{w.source} trace arrivals{scale}"
