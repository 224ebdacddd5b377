"""Compare a simulated run with measured per-request timings.

Measured formats:

- ``llmservingsim``: the ``requests.jsonl`` of an LLMServingSim bench run (vLLM ``AsyncLLM`` engine timestamps):
  TTFT = first_token_ts − queued_ts, TPOT = (last_token_ts − first_token_ts)/(output_toks − 1),
  E2EL = last_token_ts − queued_ts (``queued_ts`` stands for arrival: ``arrival_time`` is another clock;
  shared/data/validation/llmservingsim/PROVENANCE.md §1).

The error of a statistic is (simulated − measured) / measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd


class ValidationError(ValueError):
    """A measured file is missing or malformed."""


def load_measured(path: str | Path, fmt: str = "llmservingsim") -> pd.DataFrame:
    """Measured per-request table with columns request_id, prompt_tokens, output_tokens, arrival_time, ttft, tpot,
    e2el (seconds; arrival relative to the first request).

    Raises:
        ValidationError: missing file, bad JSON, missing keys, or an unknown format.
    """
    path = Path(path)
    if not path.is_file():
        raise ValidationError(f"validation.measured: {path} does not exist")
    if fmt != "llmservingsim":
        raise ValidationError(f"validation.format: unknown format {fmt!r}; expected 'llmservingsim'")
    rows = []
    need = ("request_id", "input_toks", "output_toks", "queued_ts", "first_token_ts", "last_token_ts")
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValidationError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
            missing = [k for k in need if k not in r]
            if missing:
                raise ValidationError(f"{path}: line {lineno}: missing key(s) {missing}")
            rows.append(r)
    df = pd.DataFrame(rows)
    t0 = df["queued_ts"].min()
    out = pd.DataFrame({
        "request_id": df["request_id"].astype(str),
        "prompt_tokens": df["input_toks"].astype(int),
        "output_tokens": df["output_toks"].astype(int),
        "arrival_time": df["queued_ts"] - t0,
        "first_token_time": df["first_token_ts"] - t0,
        "finish_time": df["last_token_ts"] - t0,
    })
    out["ttft"] = out["first_token_time"] - out["arrival_time"]
    out["e2el"] = out["finish_time"] - out["arrival_time"]
    out["tpot"] = np.where(out["output_tokens"] > 1,
                           (out["finish_time"] - out["first_token_time"]) / (out["output_tokens"] - 1).clip(lower=1),
                           np.nan)
    return out


STATS = ("mean", "p50", "p90", "p99")


def _stat(a: np.ndarray, s: str) -> float:
    a = a[np.isfinite(a)]
    if a.size == 0:
        return float("nan")
    return float(a.mean()) if s == "mean" else float(np.percentile(a, int(s[1:])))


def compare(measured: pd.DataFrame, simulated: pd.DataFrame) -> dict:
    """Errors of mean and p50/p90/p99 of TTFT, TPOT and E2EL, over the requests both tables hold
    (matched by ``request_id``; only requests finished in the simulation count).

    Returns:
        {"num_compared", "num_measured", "num_simulated_finished", "metrics": {metric: {stat: {measured,
        simulated, error_pct}}}, "per_request": DataFrame-able dict of per-request errors}.
    """
    sim = simulated[simulated["status"] == "finished"]
    j = measured.merge(sim[["request_id", "ttft", "tpot", "e2el"]], on="request_id", suffixes=("_meas", "_sim"))
    metrics = {}
    for m in ("ttft", "tpot", "e2el"):
        a, b = j[f"{m}_meas"].to_numpy(float), j[f"{m}_sim"].to_numpy(float)
        metrics[m] = {}
        for s in STATS:
            mv, sv = _stat(a, s), _stat(b, s)
            metrics[m][s] = {"measured": mv, "simulated": sv,
                             "error_pct": (sv - mv) / mv * 100 if mv else float("nan")}
    return {
        "num_compared": int(len(j)),
        "num_measured": int(len(measured)),
        "num_simulated_finished": int(len(sim)),
        "metrics": metrics,
        "per_request": j,
    }


def write_validation(report: dict, out_dir: Path) -> None:
    """Write validation.json (statistics) and validation_requests.csv (per-request measured vs simulated)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in report.items() if k != "per_request"}
    (out_dir / "validation.json").write_text(json.dumps(data, indent=2))
    report["per_request"].to_csv(out_dir / "validation_requests.csv", index=False)
