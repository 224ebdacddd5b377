"""``servelab calibrate``: read profile folders, fit the efficiency curves, write the coefficients file and the
held-out accuracy report.

The coefficients file is JSON: ``{"note": {...}, "curves": {gpu: {class: {variant: curve}}}}``. The note records
what it was derived from (every source file with its sha256 and size), how (fit method, servelab version), when,
and the exact command, so the file can be regenerated and checked.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from importlib.metadata import version
from pathlib import Path

import pandas as pd

from lab.costmodel.families import drop_impossible
from lab.costmodel.fit import CurveSet, calibrate as fit_all, fit_plan, fit_weight, holdout, holdout_plan
from lab.costmodel.profiles import Observations, read_profiles

FIT_METHOD = ("t = t0 + (tc^p + tm^p)^(1/p); tc = F / (peak * sigmoid(a_c + sum_i f_i(log2 x_i))), "
              "tm = B / (bandwidth * cap * sigmoid(a_m + sum_j g_j(log2 y_j))); f, g piecewise linear in log2 of "
              "the class features (knots every 2 octaves; GEMM 128-wide tile and wave-quantization features only from "
              "grids of at least 16 weight shapes); scipy.optimize.least_squares on log time, soft-L1 loss, "
              "second-difference penalty 0.05, at most 100 evaluations; at most 4000 rows per curve (pandas sample, random_state 0); one "
              "profile family per curve (servelab > aiconfigurator > vidur > llmservingsim)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _display(path: str, data_dir: Path | None) -> str:
    if data_dir is not None:
        try:
            return "{data_dir}/" + str(Path(path).resolve().relative_to(data_dir.resolve()))
        except ValueError:
            pass
    return str(path)


def read_for_calibration(paths: list[str | Path]) -> Observations:
    """Profiles under ``paths`` with tables that contradict the roofline dropped (see ``obs.notes``)."""
    return drop_impossible(read_profiles(paths))


def run_calibration(paths: list[str | Path], out: Path | None, report_dir: Path | None, command: str,
                    data_dir: Path | None = None, gpus: list[str] | None = None, log=print,
                    progress=None) -> tuple[CurveSet, pd.DataFrame | None]:
    """Fit every curve the profiles under ``paths`` support; write ``out`` (coefficients JSON) and, with
    ``report_dir``, ``heldout.csv`` and ``heldout.md`` (held-out MAPE per GPU, class, variant and family).

    ``progress`` (lab/cli/progress.py ``ItemProgress``): reading the profiles is an item of no weight; then, with the
    total known, every curve fit (lab/costmodel/fit.py ``fit_plan``) and every held-out table (``holdout_plan``)
    is an item weighted by its expected seconds (``fit_weight``).

    Raises:
        lab.costmodel.profiles.ProfileError: a path that holds no readable profile.
    """
    if progress is not None:
        progress.add(1, 0.0)
        progress.start(f"read the profiles under {len(paths)} path(s)", 0.0)
    obs = read_for_calibration(paths)
    if gpus:
        keep = Observations(notes=obs.notes)
        for g in gpus:
            keep.extend(obs.only(gpu=g))
        obs = keep
    if progress is not None:
        fits = fit_plan(obs)
        held = holdout_plan(obs) if report_dir is not None else []
        progress.add(len(fits) + len(held), sum(fit_weight(cls, fam, len(d)) for _, cls, _, fam, d in fits)
                     + sum(fit_weight(cls, fam, int((~test).sum())) for _, cls, _, fam, d, test in held))
        rows = sum(len(df) for df in obs.tables.values())
        progress.done(f"read {rows:,} profile rows: {len(fits)} curves to fit"
                      + (f", {len(held)} tables to score held out" if report_dir is not None else ""))
    for n in obs.notes:
        log(f"note: {n}")
    curves = fit_all(obs, log=log, progress=progress)
    files = sorted({s.split(":")[0] for df in obs.tables.values() for s in df["source"].unique()})
    curves.note = {
        "what": "fitted efficiency curves over the roofline for servelab's operator cost model (derived data)",
        "command": command,
        "date": _dt.date.today().isoformat(),
        "fit_method": FIT_METHOD,
        "sources": [{"path": _display(f, data_dir), "sha256": _sha256(Path(f)), "bytes": Path(f).stat().st_size}
                    for f in files],
        "dropped": [n for n in obs.notes],
        "servelab_version": _version(),
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(dumps_coefficients(curves.to_json()))
        log(f"wrote {out} ({len(curves.curves)} curves, {out.stat().st_size / 1024:.0f} KiB)")
    rep = None
    if report_dir is not None:
        rep = holdout(obs, log=log, progress=progress)
        write_holdout(rep, report_dir, command)
        log(f"wrote {report_dir}/heldout.csv and heldout.md")
    return curves, rep


def dumps_coefficients(data: dict) -> str:
    """The coefficients JSON with the note indented and one line per curve (small and diff-friendly)."""
    lines = ["{", ' "note": ' + json.dumps(data["note"], indent=1).replace("\n", "\n ") + ",", ' "curves": {']
    gpus = list(data["curves"].items())
    for gi, (gpu, classes) in enumerate(gpus):
        lines.append(f"  {json.dumps(gpu)}: {{")
        cls_items = list(classes.items())
        for ci, (cls, variants) in enumerate(cls_items):
            lines.append(f"   {json.dumps(cls)}: {{")
            v_items = list(variants.items())
            for vi, (v, curve) in enumerate(v_items):
                comma = "," if vi < len(v_items) - 1 else ""
                lines.append(f"    {json.dumps(v)}: {json.dumps(curve, separators=(',', ':'))}{comma}")
            lines.append("   }" + ("," if ci < len(cls_items) - 1 else ""))
        lines.append("  }" + ("," if gi < len(gpus) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def write_holdout(rep: pd.DataFrame, folder: Path, command: str) -> None:
    """Write the held-out report as CSV and a Markdown table."""
    folder.mkdir(parents=True, exist_ok=True)
    rep.to_csv(folder / "heldout.csv", index=False)
    lines = [f"Held-out accuracy (`{command}`): each table's distinct shapes split 80/20 (numpy seed 0); the curve "
             "is fitted on 80 % and scored on 20 %; 'table' interpolates the 20 % from the 80 % inside the grid.", "",
             "| GPU | operator class | variant | family | rows | test rows | fitted curve MAPE % | table interpolation MAPE % (rows) |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rep.itertuples():
        tab = "–" if pd.isna(r.table_mape_pct) else f"{r.table_mape_pct:.1f} ({int(r.table_test_rows)})"
        lines.append(f"| {r.gpu} | {r.op_class} | {r.variant} | {r.family} | {r.rows} | {r.test_rows} | "
                     f"{r.fit_mape_pct:.1f} | {tab} |")
    (folder / "heldout.md").write_text("\n".join(lines) + "\n")


def _version() -> str:
    try:
        return version("servelab")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"
