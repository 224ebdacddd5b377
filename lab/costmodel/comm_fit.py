"""Fit the communication model (lab/costmodel/comm.py) to every measured collective table in the shared data and
report its held-out error by link type and collective.

    .venv/bin/python -m lab.costmodel.comm_fit [--data-dir ../shared/data]

Tables (shared/data/calibration, PROVENANCE.md sections 1 and 3):

* Vidur ``network/<cluster>/{all_reduce,send_recv}.csv`` (NCCL kernel time, median column, ms; ``size`` bytes):
  ``a100_dgx`` rows inside one node -> ``nvlink3``, rows across nodes (``devices_per_node < num_workers``) ->
  ``ib_hdr200``; ``h100_dgx`` -> ``nvlink4`` (its cross-node send/recv -> ``ib_ndr400``);
  ``h100_pairwise_nvlink`` 2 GPUs (an NVLink bridge) -> ``nvlink4``, 4 GPUs (two bridged pairs joined over PCIe 5)
  -> ``pcie5_p2p``.
* AIConfigurator ``perf_db/<gpu>/comm/vllm/0.19.0/custom_allreduce_perf.parquet`` (vLLM's all-reduce under CUDA
  graphs, latency ms, ``message_size`` bf16 elements): ``h100_sxm`` and ``h200_sxm`` -> ``nvlink4``; below 8 MiB
  it is vLLM's custom all-reduce, above it NCCL.

Fit: (alpha, beta) of a link by least squares of log(model) - log(measured) over its tables (NCCL ring for
all-reduce rows, custom one-/two-shot for AIConfigurator rows below 8 MiB). Held out: every (table, GPU count)
group is predicted by the constants fitted on the link's other groups (leave one group out); a link with a single
group is split 2-fold by alternating message sizes. Send/recv tables are never fitted: they are predicted from the
all-reduce fit of the same link (a held-out check of the send/recv formula itself).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from lab.costmodel import comm


def _vidur(data: Path, cluster: str, collective: str) -> pd.DataFrame:
    p = data / "calibration/vidur/network" / cluster / f"{collective}.csv"
    d = pd.read_csv(p)
    col = f"time_stats.{collective}.median"
    return pd.DataFrame({"n": d["num_workers"].astype(int), "dpn": d["devices_per_node"].astype(int),
                         "bytes": d["size"].astype(float), "time_s": d[col].astype(float) * 1e-3})


def load_tables(data: Path) -> pd.DataFrame:
    """Every measured collective row: columns table, link, collective, algo, n, bytes, time_s.

    Raises:
        FileNotFoundError: a table is missing (the path is in the message).
    """
    rows = []

    def add(df: pd.DataFrame, table: str, link: str, collective: str, algo: str) -> None:
        df = df.assign(table=table, link=link, collective=collective, algo=algo)
        rows.append(df[["table", "link", "collective", "algo", "n", "bytes", "time_s"]])

    ar = _vidur(data, "a100_dgx", "all_reduce")
    add(ar[ar.dpn == ar.n], "vidur/a100_dgx/all_reduce", "nvlink3", "all_reduce", "ring")
    add(ar[ar.dpn < ar.n], "vidur/a100_dgx/all_reduce (cross-node)", "ib_hdr200", "all_reduce", "ring")
    sr = _vidur(data, "a100_dgx", "send_recv")
    add(sr[sr.dpn == 2], "vidur/a100_dgx/send_recv", "nvlink3", "send_recv", "sendrecv")
    add(sr[sr.dpn == 1], "vidur/a100_dgx/send_recv (cross-node)", "ib_hdr200", "send_recv", "sendrecv")
    ar = _vidur(data, "h100_dgx", "all_reduce")
    add(ar, "vidur/h100_dgx/all_reduce", "nvlink4", "all_reduce", "ring")
    sr = _vidur(data, "h100_dgx", "send_recv")
    add(sr[sr.dpn == 2], "vidur/h100_dgx/send_recv", "nvlink4", "send_recv", "sendrecv")
    add(sr[sr.dpn == 1], "vidur/h100_dgx/send_recv (cross-node)", "ib_ndr400", "send_recv", "sendrecv")
    pw = _vidur(data, "h100_pairwise_nvlink", "all_reduce")
    add(pw[pw.n == 2], "vidur/h100_pairwise_nvlink/all_reduce", "nvlink4", "all_reduce", "ring")
    add(pw[pw.n == 4], "vidur/h100_pairwise_nvlink/all_reduce (4 GPUs over PCIe)", "pcie5_p2p", "all_reduce", "ring")
    for gpu in ("h100_sxm", "h200_sxm"):
        p = data / f"calibration/aiconfigurator/perf_db/{gpu}/comm/vllm/0.19.0/custom_allreduce_perf.parquet"
        d = pd.read_parquet(p)
        d = d[d["backend"] == "vllm_graph"]
        df = pd.DataFrame({"n": d["num_gpus"].astype(int), "bytes": d["message_size"].astype(float) * 2,
                           "time_s": d["latency"].astype(float) * 1e-3})
        df["algo"] = [comm.allreduce_algorithm(comm.LINKS["nvlink4"], n, b) for n, b in zip(df.n, df.bytes)]
        for algo, g in df.groupby("algo"):
            add(g.drop(columns="algo"), f"aiconfigurator/{gpu}/custom_allreduce_perf", "nvlink4", "all_reduce",
                str(algo))
    out = pd.concat(rows, ignore_index=True)
    return out[out.time_s > 0].reset_index(drop=True)


def predict(link: comm.LinkSpec, algo: str, n: np.ndarray, byts: np.ndarray) -> np.ndarray:
    """Model time (s) of each row under ``link``."""
    if algo == "ring":
        return np.array([comm.ring_allreduce(link, int(k), float(b)) for k, b in zip(n, byts)])
    if algo == "sendrecv":
        return np.array([comm.sendrecv(link, float(b)) for b in byts])
    two = algo == "two_shot"
    return np.array([comm.custom_allreduce(link, int(k), float(b), two) for k, b in zip(n, byts)])


def _with(link: comm.LinkSpec, algo: str, alpha: float, beta: float) -> comm.LinkSpec:
    if algo in ("one_shot", "two_shot"):
        return replace(link, custom_latency_s=alpha, peer_bandwidth=beta)
    return replace(link, latency_s=alpha, bus_bandwidth=beta)


def fit(link: comm.LinkSpec, rows: pd.DataFrame, family: str) -> comm.LinkSpec:
    """``link`` with the (alpha, beta) of ``family`` ("nccl": ring rows, "custom": one/two-shot rows) fitted to
    ``rows`` by log-space least squares."""
    algos = {"nccl": ("ring",), "sendrecv": ("sendrecv",)}.get(family, ("one_shot", "two_shot"))
    r = rows[rows.algo.isin(algos)]
    if r.empty:
        return link
    x0 = (np.log(link.latency_s if family != "custom" else (link.custom_latency_s or 5e-6)),
          np.log(link.bus_bandwidth if family != "custom" else (link.peer_bandwidth or link.bus_bandwidth)))

    def resid(x):
        out = []
        for algo, g in r.groupby("algo"):
            spec = _with(link, str(algo), float(np.exp(x[0])), float(np.exp(x[1])))
            out.append(np.log(predict(spec, str(algo), g.n.values, g.bytes.values)) - np.log(g.time_s.values))
        return np.concatenate(out)

    sol = least_squares(resid, x0)
    algo = "one_shot" if family == "custom" else "ring"
    return _with(link, algo, float(np.exp(sol.x[0])), float(np.exp(sol.x[1])))


def fit_all(tables: pd.DataFrame) -> dict[str, comm.LinkSpec]:
    """Every link that has fitted rows, refitted on all of them (all-reduce rows only)."""
    out = {}
    for name, rows in tables[tables.collective == "all_reduce"].groupby("link"):
        spec = comm.LINKS[str(name)]
        if rows.table.str.startswith("vidur").any() and name != "pcie5_p2p":
            spec = fit(spec, rows[rows.table.str.startswith("vidur")], "nccl")
        if rows.algo.isin(("one_shot", "two_shot")).any():
            spec = fit(spec, rows[rows.table.str.contains("h100_sxm")], "custom")
        out[str(name)] = spec
    sr = tables[(tables.link == "ib_ndr400") & (tables.collective == "send_recv")]
    out["ib_ndr400"] = fit(comm.LINKS["ib_ndr400"], sr, "sendrecv")
    return out


def _mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - meas) / meas) * 100.0)


def held_out(tables: pd.DataFrame) -> pd.DataFrame:
    """Held-out MAPE (%) of every (table, GPU count, algorithm) group: link, collective, table, n, algo, rows,
    mape_pct, and how the constants were obtained (``fitted_on``)."""
    out = []
    groups = tables.groupby(["link", "collective", "table", "n", "algo"])
    for (link, coll, table, n, algo), g in groups:
        base = comm.LINKS[str(link)]
        family = "custom" if algo in ("one_shot", "two_shot") else "nccl"
        calibrated = (family == "nccl" and str(link) in ("nvlink3", "nvlink4", "ib_hdr200")) or family == "custom"
        if str(link) == "ib_ndr400":  # the only H100-class inter-node table: fitted on itself, 2-fold
            g = g.sort_values("bytes")
            idx = np.arange(len(g))
            pred = np.empty(len(g))
            for k in (0, 1):
                spec = fit(base, g[idx % 2 != k], "sendrecv")
                pred[idx % 2 == k] = predict(spec, str(algo), g.n.values[idx % 2 == k], g.bytes.values[idx % 2 == k])
            out.append((link, coll, table, n, algo, len(g), _mape(pred, g.time_s.values),
                        "2-fold over alternating sizes"))
            continue
        if coll == "send_recv" or not calibrated:
            spec, how = base, "shipped constants (send/recv never fitted)" if coll == "send_recv" else \
                "shipped constants (published figures; not fitted)"
            if coll == "send_recv" and str(link) in ("nvlink3", "nvlink4", "ib_hdr200"):
                spec = fit(base, tables[(tables.link == link) & (tables.collective == "all_reduce")
                                        & tables.table.str.startswith("vidur")], "nccl")
                how = "all-reduce fit of the same link"
            pred = predict(spec, str(algo), g.n.values, g.bytes.values)
            out.append((link, coll, table, n, algo, len(g), _mape(pred, g.time_s.values), how))
            continue
        pool = tables[(tables.link == link) & (tables.collective == "all_reduce")]
        pool = pool[pool.algo.isin(("ring",) if family == "nccl" else ("one_shot", "two_shot"))]
        if family == "nccl":
            pool = pool[pool.table.str.startswith("vidur")]
        others = pool[~((pool.table == table) & (pool.n == n))]
        if family == "custom":  # fit on the other GPU's table: H100 predicts H200 and vice versa
            others = pool[pool.table != table]
        if table.startswith("aiconfigurator") and family == "nccl":
            spec = fit(base, pool, "nccl")  # NCCL rows of AIConfigurator are never in the Vidur fit pool
            how = "Vidur NCCL fit of the same link"
            pred = predict(spec, str(algo), g.n.values, g.bytes.values)
        elif len(others):
            spec = fit(base, others, family)
            how = "fit on the other GPU's table" if family == "custom" else "leave this (table, GPU count) out"
            pred = predict(spec, str(algo), g.n.values, g.bytes.values)
        else:
            g = g.sort_values("bytes")
            idx = np.arange(len(g))
            pred = np.empty(len(g))
            for k in (0, 1):
                spec = fit(base, g[idx % 2 != k], family)
                pred[idx % 2 == k] = predict(spec, str(algo), g.n.values[idx % 2 == k], g.bytes.values[idx % 2 == k])
            how = "2-fold over alternating sizes"
        out.append((link, coll, table, n, algo, len(g), _mape(pred, g.time_s.values), how))
    return pd.DataFrame(out, columns=["link", "collective", "table", "n", "algo", "rows", "mape_pct", "fitted_on"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default=os.environ.get("SERVELAB_DATA_DIR", "../shared/data"))
    a = ap.parse_args(argv)
    tables = load_tables(Path(a.data_dir))
    print("fitted constants (all rows):")
    for name, s in fit_all(tables).items():
        cust = f", custom {s.custom_latency_s * 1e6:.2f} us / {s.peer_bandwidth / 1e9:.1f} GB/s" \
            if s.custom_latency_s else ""
        print(f"  {name}: NCCL {s.latency_s * 1e6:.2f} us / {s.bus_bandwidth / 1e9:.1f} GB/s{cust}")
    h = held_out(tables)
    pd.set_option("display.width", 200)
    print(h.to_string(index=False, float_format=lambda v: f"{v:.1f}"))


if __name__ == "__main__":
    main()
