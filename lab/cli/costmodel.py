"""Cost-model commands of the ``servelab`` CLI: ``calibrate``, ``profile``, ``cost`` and ``costcheck``.

Registered on the main typer app by :func:`register` (lab/cli/main.py).

Like lab/cli/main.py, each command imports what it needs in its own body (fast ``--help``).
"""

from __future__ import annotations

import sys

import json
import shlex
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 160)  # piped: wide enough that tables are not truncated
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _fail(msg: str) -> None:
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False)
    raise typer.Exit(2)


def calibrate(paths: list[Path] = typer.Argument(..., help="profile folders or files (any supported format)"),
              out: Optional[Path] = typer.Option(None, "--out", "-o", help="coefficients JSON to write"),
              report: Optional[Path] = typer.Option(None, "--report", help="folder for heldout.csv / heldout.md"),
              gpu: Optional[list[str]] = typer.Option(None, "--gpu", help="only these GPUs (repeatable)"),
              data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="shown as {data_dir} in the note")) -> None:
    """Fit efficiency curves from measured profiles (AIConfigurator parquet, Vidur CSV, LLMServingSim CSV or
    servelab profile folders) and write a coefficients file and a held-out accuracy report. Progress on stderr: the
    fits and held-out tables done out of the total, the current one, elapsed time and ETA (a line per fit off a
    terminal)."""
    from lab.costmodel.calibrate import run_calibration
    from lab.costmodel.profiles import ProfileError
    from lab.experiment.paths import default_data_dir

    if out is None and report is None:
        _fail("give --out FILE (coefficients) and/or --report DIR (held-out accuracy)")
    dd = data_dir or default_data_dir()

    def show(p: Path) -> str:
        try:
            return "{data_dir}/" + str(Path(p).resolve().relative_to(dd.resolve()))
        except ValueError:
            return str(p)

    command = " ".join(["servelab calibrate", *(shlex.quote(show(p)) for p in paths),
                        *([f"--out {shlex.quote(str(out))}"] if out else []),
                        *([f"--report {shlex.quote(str(report))}"] if report else []),
                        *(f"--gpu {shlex.quote(g)}" for g in (gpu or []))])
    from lab.cli.progress import ItemProgress

    try:
        with ItemProgress(err_console, "calibrate") as show:
            _, rep = run_calibration([str(p) for p in paths], out, report, command, dd, gpu, log=show.line,
                                     progress=show)
    except (ProfileError, ValueError) as e:
        _fail(str(e))
    if rep is not None and len(rep):
        t = Table(title="held-out MAPE % (fitted curve / table interpolation)")
        for c in ("GPU", "class", "variant", "family", "test rows", "curve", "table"):
            t.add_column(c)
        for r in rep.itertuples():
            t.add_row(r.gpu, r.op_class, r.variant, r.family, str(r.test_rows), f"{r.fit_mape_pct:.1f}",
                      "–" if r.table_mape_pct != r.table_mape_pct or r.table_mape_pct is None else f"{r.table_mape_pct:.1f}")
        console.print(t)


def _parse_prefill(items: list[str]) -> tuple[list[int], list[int]]:
    qs, cs = [], []
    for it in items:
        try:
            if ":" in it:
                q, c = it.split(":", 1)
                qs.append(int(q))
                cs.append(int(c))
            else:
                qs.append(int(it))
                cs.append(0)
        except ValueError:
            _fail(f"--prefill {it!r}: expected NEW[:CACHED] token counts, e.g. 2048 or 512:4096")
        if qs[-1] < 2 or cs[-1] < 0:
            _fail(f"--prefill {it!r}: a prefill chunk has at least 2 new tokens (1 is a decode)")
    return qs, cs


def _parse_decode(items: list[str]) -> list[int]:
    out: list[int] = []
    for it in items:
        try:
            n, length = it.split(":", 1) if ":" in it else ("1", it)
            out += [int(length)] * int(n)
        except ValueError:
            _fail(f"--decode {it!r}: expected COUNT:KV_LENGTH, e.g. 64:2048")
    return out


def cost(experiment: Optional[Path] = typer.Argument(None, help="experiment YAML (its model, GPU and cost model)"),
         model: Optional[str] = typer.Option(None, "--model", help="catalog model (without an experiment)"),
         hf_config: Optional[Path] = typer.Option(None, "--hf-config", help="a Hugging Face config.json"),
         gpu: Optional[str] = typer.Option(None, "--gpu", help="catalog GPU (without an experiment)"),
         tp: int = typer.Option(1, "--tp", help="tensor-parallel size"),
         pp: int = typer.Option(1, "--pp", help="pipeline stages"),
         ep: int = typer.Option(1, "--ep", help="expert-parallel size"),
         dp: int = typer.Option(1, "--dp", help="attention data-parallel ranks"),
         dtype: str = typer.Option("bf16", "--dtype", help="weight dtype: bf16 or fp8"),
         kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto (= dtype), bf16 or fp8"),
         tables: Optional[list[Path]] = typer.Option(None, "--tables", help="measured profile folder (repeatable)"),
         coefficients: Optional[Path] = typer.Option(None, "--coefficients", help="fitted curves (default shipped)"),
         prefill: Optional[list[str]] = typer.Option(None, "--prefill", help="prefill chunk NEW[:CACHED] (repeatable)"),
         decode: Optional[list[str]] = typer.Option(None, "--decode", help="decodes COUNT:KV_LENGTH (repeatable)"),
         data_dir: Optional[Path] = typer.Option(None, "--data-dir",
                                                  help="shared data folder (default $SERVELAB_DATA_DIR or ../shared/data)"),
         attention_backend: Optional[list[str]] = typer.Option(
             None, "--attention-backend", help="vLLM attention back-end (repeatable: side by side)"),
         moe_backend: Optional[list[str]] = typer.Option(
             None, "--moe-backend", help="vLLM fused-MoE back-end (repeatable: side by side)"),
         vllm_version: str = typer.Option("0.33", "--vllm-version", help="vLLM whose default back-ends to use "
                                          "(without an experiment)"),
         spec: Optional[list[str]] = typer.Option(
             None, "--spec", help="METHOD:K[,K...]: a verify step (1 + K tokens per decode) with the drafter, "
             "against the plain decode step (repeatable; see docs/speculative.md)"),
         as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Print the step time of one batch shape, operator by operator, with each operator's source; with several
    --attention-backend / --moe-backend values, one column per back-end combination."""
    from lab.core.batch import BatchShape

    qs, cs = _parse_prefill(prefill or [])
    dec = _parse_decode(decode or [])
    if not qs and not dec and not spec:
        _fail("give the batch: --prefill NEW[:CACHED] and/or --decode COUNT:KV_LENGTH")
    shape = BatchShape.from_requests(qs + [1] * len(dec), cs + dec)
    args = (experiment, model, hf_config, gpu, tp, pp, ep, dp, dtype, kv_dtype, tables, coefficients, data_dir)
    if spec:
        from lab.cli.spec_cost import spec_report

        try:
            spec_report(console, args, spec, dec, vllm_version, as_json)
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
        return
    if len(attention_backend or []) > 1 or len(moe_backend or []) > 1:
        try:
            _compare_backends(shape, args, attention_backend or [None], moe_backend or [None], vllm_version, as_json,
                              data_dir)
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
        return
    try:
        cm, label = _cost_model(*args, attention=(attention_backend or [None])[0],
                                moe=(moe_backend or [None])[0], vllm_version=vllm_version)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    total = cm.step_time(shape)
    from lab.costmodel.operator import OperatorCostModel  # noqa: PLC0415 (pandas: only when asked)

    if isinstance(cm, OperatorCostModel):  # the one cost model that prices operator by operator
        rows = [r.__dict__ for r in cm.explain(shape)]
    else:
        rows = [{"op": k, "group": "", "calls": 1, "time_s": v, "source": cm.name, "flops": float("nan"),
                 "bytes": float("nan")} for k, v in cm.breakdown(shape).items()]
    from lab.experiment.paths import default_data_dir

    dd = str((data_dir or default_data_dir()).resolve())
    for r in rows:
        r["source"] = str(r["source"]).replace(dd, "{data_dir}")
    if as_json:
        print(json.dumps({"model": label, "tokens": shape.num_tokens, "sequences": shape.num_seqs,
                          "step_time_s": total, "operators": rows}, indent=1, default=float))
        return
    t = Table(title=f"{label}: {shape.num_tokens} tokens, {shape.num_seqs} sequences "
                    f"({len(qs)} prefill chunks, {len(dec)} decodes) -> {total * 1e3:.3f} ms")
    for c in ("operator", "calls", "ms", "%", "TFLOP", "GB", "source"):
        t.add_column(c, justify="right" if c not in ("operator", "source") else "left")
    for r in rows:
        fl = r["flops"]
        by = r["bytes"]
        t.add_row(r["op"], str(r["calls"]), f"{r['time_s'] * 1e3:.3f}", f"{100 * r['time_s'] / total:.1f}",
                  "" if fl != fl or not fl else f"{fl / 1e12:.3f}", "" if by != by or not by else f"{by / 1e9:.3f}",
                  r["source"])
    console.print(t)


_TABLE_CACHE: dict = {}


def _cost_model(experiment, model, hf_config, gpu, tp, pp, ep, dp, dtype, kv_dtype, tables, coefficients, data_dir,
                attention=None, moe=None, vllm_version="0.33"):
    from lab.costmodel.hardware import load_hardware
    from lab.costmodel.model_arch import load_model
    from lab.costmodel.operator import OperatorCostModel, load_curves, weight_variant
    from lab.costmodel.backends import (check_attention_backend, check_moe_backend, default_attention_backend,
                                        default_moe_backend)
    from lab.costmodel.parallel import Parallelism
    from lab.costmodel.tables import TableSet, load_tables
    from lab.experiment.build import build_cost_model

    if experiment is not None:
        from lab.cli.spec_cost import load_experiment_for_cost

        exp = load_experiment_for_cost(experiment, data_dir, attention, moe)
        m = exp.model
        arch = load_model(m.name, exp.path(m.hf_config, "model.hf_config") if m.hf_config else None)
        hw = load_hardware(exp.hardware.gpu)
        return build_cost_model(exp, arch, hw), f"{arch.name} on {hw.name} ({exp.cost_model.kind})"
    if not (model or hf_config) or not gpu:
        raise ValueError("give an experiment file, or --model (or --hf-config) and --gpu")
    arch = load_model(model, hf_config)
    hw = load_hardware(gpu)
    key = (tuple(str(p) for p in tables or ()), hw.name)
    ts = _TABLE_CACHE.get(key)
    if ts is None and tables:
        ts = _TABLE_CACHE[key] = TableSet(load_tables([str(p) for p in tables]), hw.name)
    kv = dtype if kv_dtype == "auto" else kv_dtype
    variant = weight_variant(arch, dtype)
    attention = attention or default_attention_backend(arch.is_mla, hw, vllm_version)
    moe = moe or default_moe_backend(variant, hw, vllm_version)
    check_attention_backend(attention, arch.is_mla, hw, arch.name)
    if arch.is_moe:
        check_moe_backend(moe, variant, hw)
    cm = OperatorCostModel(arch, hw, Parallelism(tp, pp, ep, dp), weight_dtype=dtype, kv_dtype=kv, tables=ts,
                           curves=load_curves(coefficients), attention_backend=attention, moe_backend=moe)
    return cm, f"{arch.name} on {hw.name} tp{tp} pp{pp} ep{ep} dp{dp} {dtype}/kv {kv}"


def _compare_backends(shape, args, attentions, moes, vllm_version, as_json, data_dir) -> None:
    """One step under every (attention, MoE) back-end combination, operator by operator, side by side."""
    from lab.costmodel.operator import OperatorCostModel
    from lab.experiment.paths import default_data_dir

    dd = str((data_dir or default_data_dir()).resolve())
    cols = []
    label = ""
    for a in attentions:
        for mo in moes:
            cm, label = _cost_model(*args, attention=a, moe=mo, vllm_version=vllm_version)
            if not isinstance(cm, OperatorCostModel):
                raise ValueError("kernel back-ends are priced by the operator cost model only")
            rows = {r.op: r for r in cm.explain(shape)}
            name = cm.attention_backend + (f" / {cm.moe_backend}" if cm.model.is_moe else "")
            cols.append((name, cm.step_time(shape), rows))
    ops = []
    for _, _, rows in cols:
        for op in rows:
            if op not in ops:
                ops.append(op)
    if as_json:
        print(json.dumps({"model": label, "tokens": shape.num_tokens, "sequences": shape.num_seqs,
                          "backends": [{"backends": n, "step_time_s": t,
                                        "operators": {op: {"time_s": r.time_s, "source": str(r.source).replace(dd, "{data_dir}")}
                                                      for op, r in rows.items()}} for n, t, rows in cols]},
                         indent=1, default=float))
        return
    t = Table(title=f"{label}: {shape.num_tokens} tokens, {shape.num_seqs} sequences, ms per step by back-end")
    t.add_column("operator")
    for n, _, _ in cols:
        t.add_column(n, justify="right")
    for op in ops:
        vals = [rows[op].time_s if op in rows else None for _, _, rows in cols]
        t.add_row(op, *["" if v is None else f"{v * 1e3:.3f}" for v in vals])
    t.add_row("[bold]step[/]", *[f"[bold]{tot * 1e3:.3f}[/]" for _, tot, _ in cols])
    console.print(t)
    differing = [op for op in ops if len({str(rows[op].source) if op in rows else "" for _, _, rows in cols}) > 1]
    for op in differing:
        console.print(f"{op}:", highlight=False)
        for n, _, rows in cols:
            if op in rows:
                console.print(f"  {n}: {str(rows[op].source).replace(dd, '{data_dir}')}", highlight=False,
                              markup=False)


def profile(out: Path = typer.Option(..., "--out", "-o", help="folder to write (servelab profile format)"),
            device: str = typer.Option("cuda", "--device", help="torch device (cuda, cuda:1, cpu for a smoke test)"),
            dtype: str = typer.Option("bf16", "--dtype", help="bf16 or fp16"),
            model: Optional[str] = typer.Option(None, "--model", help="measure this catalog model's shapes"),
            tp: int = typer.Option(1, "--tp", help="TP degree of the model's per-GPU shapes"),
            ops: str = typer.Option("gemm,attention,elementwise", "--ops", help="comma list: gemm, attention, elementwise"),
            quick: bool = typer.Option(False, "--quick", help="a small grid (smoke test)"),
            repeats: int = typer.Option(20, "--repeats", help="timed runs per shape (median kept)"),
            gpu: Optional[str] = typer.Option(None, "--gpu", help="catalog name to record (default: the device's name)")) -> None:
    """Measure operator tables on this machine's GPU with PyTorch (needs the optional extra: pip install
    'servelab\\[profile]'), in the format `servelab calibrate` and `cost_model.tables` read."""
    from lab.costmodel.profiler import ProfilerUnavailable, run_profile

    try:
        written = run_profile(out, device=device, dtype=dtype, model=model, tp=tp, ops=[o.strip() for o in ops.split(",")],
                              quick=quick, repeats=repeats, gpu=gpu, log=lambda s: err_console.print(s, highlight=False))
    except ProfilerUnavailable as e:
        _fail(str(e))
    except ValueError as e:
        _fail(str(e))
    console.print(f"wrote {out}/ ({', '.join(p.name for p in written)})")


def costcheck(what: str = typer.Argument("all", help="cross-source, splitwise or all"),
              data_dir: Optional[Path] = typer.Option(None, "--data-dir",
                                                  help="shared data folder (default $SERVELAB_DATA_DIR or ../shared/data)"),
              out: Optional[Path] = typer.Option(None, "--out", "-o", help="folder for the CSV/Markdown results")) -> None:
    """Accuracy checks of the operator cost model against shared measurements: the same Llama-3.1-8B/H100 step
    from AIConfigurator, Vidur and LLMServingSim data, and Splitwise's end-to-end Llama-2-70B prefill/decode.
    Progress on stderr: the curve fits done out of the total, the current one, elapsed time and ETA (a line per fit
    off a terminal)."""
    from lab.costmodel import checks
    from lab.experiment.paths import default_data_dir

    dd = data_dir or default_data_dir()
    if what not in ("cross-source", "splitwise", "all"):
        _fail(f"costcheck {what!r}: expected cross-source, splitwise or all")
    from lab.cli.progress import ItemProgress

    try:
        with ItemProgress(err_console, "costcheck") as show:
            results = checks.run(what, dd, out, log=show.line, progress=show)
    except FileNotFoundError as e:
        _fail(str(e))
    for name, md in results.items():
        console.print(f"[bold]{name}[/]")
        # Markdown tables: one row per line whatever the terminal width (a wrapped row is unreadable and unparsable)
        console.print(md, highlight=False, markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add the cost-model commands to the main app."""
    app.command("calibrate")(calibrate)
    app.command("profile")(profile)
    app.command("cost")(cost)
    app.command("costcheck")(costcheck)
