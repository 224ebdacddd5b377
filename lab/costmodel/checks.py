"""Accuracy checks of the operator cost model against the shared measurements (``servelab costcheck``).

* **cross-source**: the same Llama-3.1-8B / H100 / TP1 / bf16 steps costed three times, each time from one data
  family only (its tables and curves fitted on it alone): AIConfigurator per-op tables, Vidur's H100 profiles
  (Llama-2 shapes, so its curves carry the Llama-3.1 shapes), LLMServingSim's H100 layer profile of this very model.
  Operators a family did not measure fall back to the plain roofline; the table says which.
* **splitwise**: SplitwiseSim's measured Llama-2-70B prefill (``prompt_time``, one iteration over the whole batch)
  and decode iteration (``token_time``) on DGX-A100 and DGX-H100 at TP 2/4/8, against the operator model built
  from that GPU's tables (H100: AIConfigurator + Vidur; A100: Vidur). Splitwise's engine ran without CUDA graphs,
  so its host cost per kernel launch and per step are unknown: they are fitted (least squares on log time) on a
  deterministic half of the configurations and the error is reported on the other half. Host-bound kernels are
  costed per call (max of GPU time and launch time), so small kernels at wide TP become host-bound first.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from lab.core.batch import BatchShape
from lab.costmodel.fit import calibrate as fit_all, fit_plan, fit_weight, mape
from lab.costmodel.hardware import load_hardware
from lab.costmodel.model_arch import load_model
from lab.costmodel.operator import OperatorCostModel
from lab.costmodel.parallel import Parallelism
from lab.costmodel.profiles import Observations
from lab.costmodel.roofline import Efficiency
from lab.costmodel.tables import TableSet, load_tables

CROSS_SHAPES: list[tuple[str, list[int], list[int]]] = [
    ("decode 1 x 1k", [1], [1024]),
    ("decode 32 x 1k", [1] * 32, [1024] * 32),
    ("decode 128 x 2k", [1] * 128, [2048] * 128),
    ("prefill 512", [512], [0]),
    ("prefill 2048", [2048], [0]),
    ("mixed 512 (+1k cached) + 64 x 1k", [512] + [1] * 64, [1024] + [1024] * 64),
]

CROSS_SOURCES = {
    "aiconfigurator": ["calibration/aiconfigurator/perf_db/h100_sxm"],
    "vidur": ["calibration/vidur/compute/h100", "calibration/vidur/network/h100_dgx"],
    "llmservingsim": ["calibration/llmservingsim/v1.0.0/H100"],
}

GROUPS = {"gemm": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"),
          "attention": ("attention_prefill", "attention_decode"),
          "elementwise": ("norms", "rope", "act", "embedding", "final_norm", "sampler")}


def _need(data_dir: Path, rel: str) -> Path:
    p = data_dir / rel
    if not p.exists():
        raise FileNotFoundError(f"shared data not found: {p} (set --data-dir or $SERVELAB_DATA_DIR)")
    return p


def _model_for(obs: Observations, gpu: str, model, par: Parallelism, eff: Efficiency, progress=None,
               **kw) -> OperatorCostModel:
    curves = fit_all(obs.only(gpu=gpu), progress=progress)
    return OperatorCostModel(model, load_hardware(gpu), par, tables=TableSet(obs, gpu), curves=curves,
                             efficiency=eff, **kw)


CROSS_GPU = "H100-SXM5-80GB"
# the progress weight (expected seconds, as lab/costmodel/fit.py fit_weight) of costing Splitwise's configurations
# and fitting the host overhead on one GPU, beside its curve fits: 4.3 s and 0.3 s in the run FIT_SECONDS is from
SPLITWISE_HOST_FIT_WEIGHT = 2.3


def load_cross_source(data_dir: Path) -> dict[str, Observations]:
    """Each cross-source family's tables. Raises FileNotFoundError: a folder is missing."""
    return {fam: load_tables([_need(data_dir, r) for r in rels]) for fam, rels in CROSS_SOURCES.items()}


def load_splitwise(data_dir: Path) -> dict[str, Observations]:
    """The tables of each Splitwise GPU (SPLITWISE_TABLES key). Raises FileNotFoundError: a folder is missing."""
    return {hw: load_tables([_need(data_dir, r) for r in rels]) for hw, (_, rels) in SPLITWISE_TABLES.items()}


def cross_source(data_dir: Path, log=None, progress=None,
                 loaded: dict[str, Observations] | None = None) -> pd.DataFrame:
    """Per shape and family: total step time (ms, no CPU overhead) and the GEMM / attention / elementwise parts,
    with the source of the attention part. ``loaded``: :func:`load_cross_source`'s tables (read here otherwise);
    ``progress``: each curve fit is an item (lab/costmodel/fit.py ``calibrate``)."""
    model = load_model("Llama-3.1-8B")
    eff = Efficiency(step_overhead_s=0.0)
    rows = []
    tables = loaded if loaded is not None else load_cross_source(data_dir)
    for fam in CROSS_SOURCES:
        obs = tables[fam]
        cm = _model_for(obs, CROSS_GPU, model, Parallelism(), eff, progress)
        if log and progress is None:
            log(f"cross-source: built the {fam} model")
        for label, new, ctx in CROSS_SHAPES:
            sh = BatchShape.from_requests(new, ctx)
            br = cm.breakdown(sh)
            ex = {r.op: r.source for r in cm.explain(sh)}
            row = {"shape": label, "family": fam, "total_ms": cm.step_time(sh) * 1e3}
            for g, names in GROUPS.items():
                row[f"{g}_ms"] = sum(br.get(n, 0.0) for n in names) * 1e3
            row["attention_source"] = "; ".join(sorted({_short(ex[n]) for n in GROUPS["attention"] if n in ex}))
            row["gemm_source"] = "; ".join(sorted({_short(ex[n]) for n in GROUPS["gemm"] if n in ex}))
            rows.append(row)
    return pd.DataFrame(rows)


def _short(src: str) -> str:
    if src.startswith("table:"):
        return "table"
    if src.startswith("fit:"):
        return "fit"
    return src.split(" ")[0]


def cross_source_markdown(df: pd.DataFrame) -> str:
    fams = list(CROSS_SOURCES)
    lines = ["| step | " + " | ".join(f"{f} ms (GEMM / attn / elem; attn src)" for f in fams) +
             " | spread total | spread GEMM+elem |", "|---|" + "---:|" * (len(fams) + 2)]
    for shape, g in df.groupby("shape", sort=False):
        g = g.set_index("family")
        cells = []
        for f in fams:
            r = g.loc[f]
            cells.append(f"{r.total_ms:.2f} ({r.gemm_ms:.2f} / {r.attention_ms:.2f} / {r.elementwise_ms:.2f}; "
                         f"{r.attention_source})")
        tot = g["total_ms"]
        ge = g["gemm_ms"] + g["elementwise_ms"]
        lines.append(f"| {shape} | " + " | ".join(cells) +
                     f" | {100 * (tot.max() / tot.min() - 1):.1f} % | {100 * (ge.max() / ge.min() - 1):.1f} % |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ Splitwise
SPLITWISE_TABLES = {
    "h100-80gb": ("H100-SXM5-80GB", ["calibration/aiconfigurator/perf_db/h100_sxm",
                                     "calibration/vidur/compute/h100/meta-llama/Llama-2-70b-hf",
                                     "calibration/vidur/network/h100_dgx"]),
    "a100-80gb": ("A100-80GB-SXM4", ["calibration/vidur/compute/a100/meta-llama/Llama-2-70b-hf",
                                     "calibration/vidur/historical_acb95f6/a100/attention.csv",
                                     "calibration/vidur/network/a100_dgx"]),
}


def splitwise_rows(data_dir: Path) -> pd.DataFrame:
    """Median measured prompt and token times (and output length) per (hardware, TP, prompt size, batch size)
    for Llama-2-70B."""
    df = pd.read_csv(_need(data_dir, "calibration/splitwise_sim/perf_model.csv"))
    df = df[(df["model"] == "llama2-70b") & df["hardware"].isin(list(SPLITWISE_TABLES))]
    return df.groupby(["hardware", "tensor_parallel", "prompt_size", "batch_size"], as_index=False)[
        ["prompt_time", "token_time", "token_size"]].median()


def splitwise(data_dir: Path, log=None, progress=None,
              loaded: dict[str, Observations] | None = None) -> tuple[pd.DataFrame, dict]:
    """Predicted vs measured prefill and decode times. Splitwise's engine ran without CUDA graphs, so the model
    runs in eager mode; its host time per kernel launch and per step are fitted per GPU (least squares on log
    time) on a deterministic half of the configurations (every other one in (TP, prompt, batch) order) and the
    error is reported on both halves. Measurements faster than the GPU's FLOP bound (2 x parameters x tokens /
    TP / peak) cannot be right and are left out (listed in the returned parameters). ``loaded``:
    :func:`load_splitwise`'s tables (read here otherwise); ``progress``: each curve fit is an item, then costing the
    configurations and fitting the host overhead (weight :data:`SPLITWISE_HOST_FIT_WEIGHT`)."""
    meas = splitwise_rows(data_dir)
    model = load_model("Llama-2-70B")
    out = []
    params: dict = {}
    tables = loaded if loaded is not None else load_splitwise(data_dir)
    for hwkey, (gpu, rels) in SPLITWISE_TABLES.items():
        hw = load_hardware(gpu)
        obs = tables[hwkey]
        curves = fit_all(obs.only(gpu=gpu), progress=progress)
        if progress is not None:
            progress.start(f"splitwise {gpu}: cost the configurations, fit the host overhead",
                           SPLITWISE_HOST_FIT_WEIGHT)
        ts = TableSet(obs, gpu)
        m = meas[meas["hardware"] == hwkey].sort_values(["tensor_parallel", "prompt_size", "batch_size"]).reset_index(drop=True)
        cms = {int(tp): OperatorCostModel(model, hw, Parallelism(int(tp)), tables=ts, curves=curves,
                                          efficiency=Efficiency(step_overhead_s=0.0))
               for tp in sorted(m["tensor_parallel"].unique())}
        recs, calls, dropped = [], [], []
        for i, r in enumerate(m.itertuples()):
            cm = cms[int(r.tensor_parallel)]
            bs, prompt = int(r.batch_size), int(r.prompt_size)
            pre = BatchShape.from_requests([prompt] * bs, [0] * bs)
            ctx = int(prompt + r.token_size // 2)
            dec = BatchShape.from_requests([1] * bs, [ctx] * bs)
            for phase, sh, measured in (("prefill", pre, r.prompt_time), ("decode", dec, r.token_time)):
                bound_ms = 2.0 * model.params_total() * sh.num_tokens / r.tensor_parallel / hw.bf16_flops * 1e3
                if measured < 0.9 * bound_ms:
                    dropped.append(f"{hwkey} tp{r.tensor_parallel} prompt {prompt} batch {bs} {phase}: measured "
                                   f"{measured:.0f} ms < FLOP bound {bound_ms:.0f} ms")
                    continue
                recs.append({"hardware": hwkey, "tp": int(r.tensor_parallel), "prompt": prompt, "batch": bs,
                             "config": i, "phase": phase, "tokens": sh.num_tokens, "gpu_ms": cm.step_time(sh) * 1e3,
                             "measured_ms": float(measured)})
                calls.append(np.array(cm.op_calls(sh)))
        rec = pd.DataFrame(recs)
        train = (rec["config"] % 2 == 0).to_numpy()

        tokens = rec["tokens"].to_numpy(float)

        def predict(x, idx):
            launch, overhead, per_tok = math.exp(x[0]) * 1e-6, math.exp(x[1]) * 1e-3, math.exp(x[2]) * 1e-6
            return np.array([(c[:, 1] * np.maximum(c[:, 0], c[:, 2] * launch)).sum() + overhead + per_tok * tokens[i]
                             for i, c in ((i, calls[i]) for i in idx)]) * 1e3

        idx_train = np.flatnonzero(train)
        y = np.log(rec["measured_ms"].to_numpy())

        def resid(x):
            return np.log(predict(x, idx_train)) - y[idx_train]

        from scipy.optimize import least_squares  # noqa: PLC0415 - 0.25 s to import; only fitting needs it
        sol = least_squares(resid, [math.log(20.0), math.log(2.0), math.log(5.0)], loss="soft_l1", f_scale=0.1)
        launch_us, overhead_ms, per_tok_us = (math.exp(v) for v in sol.x)
        params[gpu] = {"cpu_launch_us": round(launch_us, 2), "step_overhead_ms": round(overhead_ms, 3),
                       "per_token_us": round(per_tok_us, 2), "dropped": dropped}
        rec["predicted_ms"] = predict(sol.x, np.arange(len(rec)))
        rec["split"] = np.where(train, "fit", "held-out")
        out.append(rec)
        msg = (f"splitwise {gpu}: fitted {launch_us:.1f} us per kernel launch, {overhead_ms:.2f} ms per step, "
               f"{per_tok_us:.1f} us per token; {len(dropped)} impossible measurements left out")
        if progress is not None:
            progress.done(msg)
        elif log:
            log(msg)
    res = pd.concat(out, ignore_index=True)
    res["error_pct"] = 100 * (res["predicted_ms"] / res["measured_ms"] - 1)
    return res, params


def splitwise_markdown(res: pd.DataFrame, params: dict) -> str:
    lines = ["Host overhead fitted on the 'fit' half: " + "; ".join(
        f"{g}: {p['cpu_launch_us']} µs per kernel launch, {p['step_overhead_ms']} ms per step, {p['per_token_us']} µs per "
        "token" for g, p in params.items()),
        "", "Left out (faster than the FLOP bound): " + ("; ".join(d for p in params.values() for d in p["dropped"]) or "none"),
        "", "| GPU | phase | split | configurations | MAPE % | within 15 % | worst error % |", "|---|---|---|---:|---:|---:|---:|"]
    for (hw, phase, split), g in res.groupby(["hardware", "phase", "split"]):
        err = g["error_pct"].abs()
        lines.append(f"| {hw} | {phase} | {split} | {len(g)} | {mape(g.predicted_ms.to_numpy(), g.measured_ms.to_numpy()):.1f} | "
                     f"{(err <= 15).mean() * 100:.0f} % | {g['error_pct'].iloc[err.argmax()]:+.1f} |")
    return "\n".join(lines)


def plan(what: str, data_dir: Path) -> tuple[dict, dict, int, float]:
    """The tables the checks read (``(cross-source tables or {}, Splitwise tables or {})``) and the work they take:
    the number of progress items (curve fits, and per Splitwise GPU the host-overhead fit) and their weight.

    Raises:
        FileNotFoundError: a folder of the shared data is missing.
    """
    cross = load_cross_source(data_dir) if what in ("cross-source", "all") else {}
    split = load_splitwise(data_dir) if what in ("splitwise", "all") else {}
    fits = [f for obs in cross.values() for f in fit_plan(obs.only(gpu=CROSS_GPU))]
    fits += [f for hw, obs in split.items() for f in fit_plan(obs.only(gpu=SPLITWISE_TABLES[hw][0]))]
    items = len(fits) + len(split)
    weight = sum(fit_weight(cls, fam, len(d)) for _, cls, _, fam, d in fits)
    return cross, split, items, weight + SPLITWISE_HOST_FIT_WEIGHT * len(split)


def run(what: str, data_dir: Path, out: Path | None, log=None, progress=None) -> dict[str, str]:
    """Run the checks (``cross-source``, ``splitwise`` or ``all``); write CSV and Markdown under ``out``.

    ``progress`` (lab/cli/progress.py ``ItemProgress``): the tables are read first (one item of no weight), then
    every curve fit and each Splitwise GPU's host-overhead fit is an item (:func:`plan`), so the display has the
    total from the start.

    Raises:
        FileNotFoundError: a folder of the shared data is missing.
    """
    results = {}
    cross: dict | None = None
    split: dict | None = None
    if progress is not None:
        progress.add(1, 0.0)
        progress.start("read the measured tables", 0.0)
        cross, split, items, weight = plan(what, data_dir)
        progress.add(items, weight)
        progress.done(f"read the measured tables: {items - len(split)} curves to fit"
                      + (f", {len(split)} host-overhead fits" if split else ""))
    if what in ("cross-source", "all"):
        df = cross_source(data_dir, log, progress, cross)
        md = cross_source_markdown(df)
        results["cross-source (Llama-3.1-8B, H100, TP1, bf16; ms per step without CPU overhead)"] = md
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            df.to_csv(out / "cross_source.csv", index=False)
            (out / "cross_source.md").write_text(md + "\n")
    if what in ("splitwise", "all"):
        res, params = splitwise(data_dir, log, progress, split)
        md = splitwise_markdown(res, params)
        results["splitwise (Llama-2-70B end to end, A100 and H100, TP 2/4/8)"] = md
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            res.to_csv(out / "splitwise.csv", index=False)
            (out / "splitwise.md").write_text(md + "\n")
    return results
