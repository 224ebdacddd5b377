"""Record or check the figures every shipped experiment gives (a refactor must not change them).

    python bench/figures.py record [--out bench/figures_baseline.json]   # before a change
    python bench/figures.py check  [--baseline bench/figures_baseline.json]

For each experiment under ``experiments/`` (and each run of ``policy_comparison.yaml``) the script simulates the
run and keeps, per column, a SHA-256 of ``requests.parquet``'s and ``steps.parquet``'s contents (as
``servelab run`` builds them) plus the summary's figures (wall times left out). ``check`` re-runs and lists every
column and figure that differs; columns added since the baseline are ignored, so new outputs do not count as a
change. Needs the shared data folder (``--data-dir`` or ``$SERVELAB_DATA_DIR``, default ``../shared/data``).
Exit status: 0 when everything matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ["demo", "azure_conv_llama8b_h100", "llmservingsim_rtx4090_llama8b", "llmservingsim_rtxpro6000_llama8b",
               "user_policy", "deepseek_v3_h200_tp8", "deepseek_v3_h200_dp8_ep8", "qwen3_32b_h100_tp2",
               "qwen3_32b_h100_tp4"]
VOLATILE = {"wall_time_s"}


def _column_hashes(df) -> dict[str, str]:
    out = {}
    for c in df.columns:
        text = df[c].to_json(orient="values", double_precision=15)
        out[c] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def _flatten(d, prefix=""):
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, dict):
                    flat.update(_flatten(x, f"{key}[{i}]."))
                else:
                    flat[f"{key}[{i}]"] = x
        elif k not in VOLATILE:
            flat[key] = v
    return flat


def _figures(exp) -> dict:
    from lab.report.run_summary import collect
    from lab.report.run_tables import steps_frame
    from lab.experiment.simulation import simulate

    result = simulate(exp)
    steps = steps_frame(result)
    req, summary = collect(result, steps)
    return {"requests": _column_hashes(req), "steps": _column_hashes(steps),
            "summary": json.loads(json.dumps(_flatten(summary), default=str))}


def _one(job: tuple[str, dict | None, str, str | None]) -> tuple[str, dict]:
    name, data, source, data_dir = job
    from lab.experiment.config import load_experiment, parse_experiment

    if data is None:
        exp = load_experiment(ROOT / "experiments" / f"{name}.yaml", data_dir, {})
    else:
        exp = parse_experiment(data, source, ROOT / "experiments", data_dir)
    return name, _figures(exp)


def _jobs(data_dir: str | None) -> list:
    from lab.report.compare import load_comparison

    jobs = [(n, None, n, data_dir) for n in EXPERIMENTS]
    _, runs = load_comparison(ROOT / "experiments" / "policy_comparison.yaml", data_dir)
    jobs += [(r.data["name"], r.data, r.source, data_dir) for r in runs]
    return jobs


def run_all(data_dir: str | None, workers: int) -> dict:
    jobs = _jobs(data_dir)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(_one, jobs))


def compare(baseline: dict, current: dict) -> list[str]:
    """Every difference, one line each."""
    diffs = []
    for name, base in baseline.items():
        cur = current.get(name)
        if cur is None:
            diffs.append(f"{name}: not run")
            continue
        for table in ("requests", "steps"):
            for col, h in base[table].items():
                if cur[table].get(col) != h:
                    diffs.append(f"{name}: {table}.{col} differs")
        for key, v in base["summary"].items():
            w = cur["summary"].get(key, "<missing>")
            if w != v:
                diffs.append(f"{name}: summary {key}: {v} -> {w}")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["record", "check"])
    ap.add_argument("--baseline", "--out", dest="baseline", default=str(ROOT / "bench" / "figures_baseline.json"))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    current = run_all(args.data_dir, args.jobs)
    if args.mode == "record":
        Path(args.baseline).write_text(json.dumps(current, indent=1, sort_keys=True))
        print(f"recorded {len(current)} runs in {args.baseline}")
        return 0
    baseline = json.loads(Path(args.baseline).read_text())
    diffs = compare(baseline, current)
    for d in diffs:
        print(d)
    print(f"{len(baseline)} runs checked, {len(diffs)} differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
