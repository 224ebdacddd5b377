"""``servelab cost --spec METHOD:K[,K...]``: one speculative step against the plain decode step of the same batch,
per method and k, in vLLM's two drafting modes (lab/costmodel/spec_step.py)."""

from __future__ import annotations

import json

from rich.table import Table


def load_experiment_for_cost(experiment, data_dir, attention=None, moe=None):
    """The experiment of ``servelab cost``, with the back-ends given on the command line in ``engine``."""
    from lab.experiment.config import ConfigError, load_experiment

    try:
        exp = load_experiment(experiment, data_dir)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    over = {k: v for k, v in (("attention_backend", attention), ("moe_backend", moe)) if v is not None}
    if over:
        from lab.experiment.config import EngineConfig

        try:
            engine = EngineConfig.model_validate({**exp.engine.model_dump(exclude_unset=True), **over})
        except Exception as e:  # pydantic's ValidationError: one line naming the value
            raise ValueError(f"{', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in over.items())}: "
                             f"{str(e).splitlines()[-1].strip()}") from None
        exp = exp.model_copy(update={"engine": engine})
    return exp


def _parse(specs: list[str]) -> list[tuple[str, list[int]]]:
    out = []
    for s in specs:
        method, _, ks = s.partition(":")
        method = "mtp" if method.endswith("_mtp") else method
        if method not in ("eagle", "eagle3", "mtp") or not ks:
            raise ValueError(f"--spec {s!r}: expected METHOD:K[,K...] with METHOD eagle, eagle3 or mtp")
        try:
            kk = [int(x) for x in ks.split(",")]
        except ValueError:
            raise ValueError(f"--spec {s!r}: K must be integers, e.g. eagle3:1,2,3") from None
        if any(k < 1 for k in kk):
            raise ValueError(f"--spec {s!r}: K must be >= 1")
        out.append((method, kk))
    return out


def spec_report(console, args, specs: list[str], decodes: list[int], vllm_version: str, as_json: bool) -> None:
    """Print, for each method and k, the plain decode step and the speculative step (verify + rejection sampler +
    proposer, engine CPU included as the engine adds it) at the ``--decode`` batch, for the padded drafter batch
    under async scheduling (vLLM 0.19 / 0.33 defaults) and for the serial proposer under sync scheduling."""
    from lab.costmodel.spec_fit import ENGINE_CPU_S, CONTEXT, setup, step_pair

    (experiment, model, hf_config, gpu, tp, pp, ep, dp, dtype, kv_dtype, tables, coefficients, data_dir) = args
    if experiment is not None:
        exp = load_experiment_for_cost(experiment, data_dir)
        model, gpu = exp.model.name, exp.hardware.gpu
        tp, ep, dp, dtype = (exp.hardware.tensor_parallel_size, exp.hardware.expert_parallel_size,
                             exp.hardware.data_parallel_size, exp.model.dtype)
        tables = [exp.path(t, "cost_model.tables") for t in exp.cost_model.tables]
    if not model or not gpu:
        raise ValueError("--spec needs an experiment file, or --model and --gpu")
    batch, ctx = 1, CONTEXT
    if decodes:
        batch, ctx = len(decodes), int(sum(decodes) / len(decodes))
    cpu = ENGINE_CPU_S + 3.75e-5 * (batch - 1)
    rows = []
    for method, ks in _parse(specs):
        su = setup(model, gpu, method, [str(t) for t in tables] if tables else None, tp, ep, dp, dtype)
        for k in ks:
            pa, sa = step_pair(su, k, batch, ctx, False, True, cpu)
            ps, ss = step_pair(su, k, batch, ctx, True, False, cpu)
            rows.append({"method": method, "k": k, "batch": batch, "context": ctx,
                         "plain_async_ms": pa * 1e3, "spec_async_ms": sa * 1e3, "ratio_async": sa / pa,
                         "plain_sync_ms": ps * 1e3, "spec_serial_ms": ss * 1e3, "ratio_serial": ss / ps})
    if as_json:
        print(json.dumps({"model": model, "gpu": str(gpu), "rows": rows}, indent=1))
        return
    t = Table(title=f"{model} on {gpu}: speculative step vs plain decode step, batch {batch}, context {ctx} "
                    f"(docs/speculative.md)")
    for c in ("method", "k", "plain ms (async)", "spec ms (padded, async)", "ratio", "plain ms (sync)",
              "spec ms (serial proposer, sync)", "ratio"):
        t.add_column(c, justify="right" if c not in ("method",) else "left")
    for r in rows:
        t.add_row(r["method"], str(r["k"]), f"{r['plain_async_ms']:.3f}", f"{r['spec_async_ms']:.3f}",
                  f"{r['ratio_async']:.2f}x", f"{r['plain_sync_ms']:.3f}", f"{r['spec_serial_ms']:.3f}",
                  f"{r['ratio_serial']:.2f}x")
    console.print(t)
