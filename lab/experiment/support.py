"""Which features compose: the support matrix, written once, and the check that applies it before simulating.

A feature is a mechanism an experiment turns on (speculative decoding, pipeline parallelism, prefill/decode
disaggregation, ...). Every pair of features composes unless a :class:`Refusal` below says otherwise, and every
scheduler supports a feature unless the feature needs a capability the scheduler does not declare
(lab/core/sched_api.py ``SchedulerBase``: ``supports_speculation``, ``supports_kv_offload``, ...). Each refusal names
the fields involved and whose rule it is: the engine's (vLLM or SGLang refuses the combination; file and version
given) or servelab's (the combination exists in the engine but servelab cannot model it yet).

:func:`check_composition` applies the matrix to an experiment, pool by pool, and raises :class:`ConfigError` with
a one-line reason; ``simulate`` calls it before it builds anything, so a run never stops mid-way for a combination
the matrix refuses. :func:`markdown_tables` renders the matrix for docs/composition.md (``servelab support``);
tests/test_composition_matrix.py checks that the page holds the current tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lab.experiment.schema import ConfigError, Experiment, pool_experiments, scheduler_name

# A feature's test: (the whole experiment, one pool's view of it) -> on or off in that pool.
Test = Callable[[Experiment, Experiment], bool]


@dataclass(frozen=True)
class Feature:
    """A mechanism an experiment turns on.

    Attributes:
        key: short name used in the matrix and in refusals.
        title: what the docs call it.
        fields: the experiment fields that turn it on.
        present: whether it is on in one pool of an experiment.
        needs: the scheduler capability it needs (a ``SchedulerBase`` attribute), or None.
    """

    key: str
    title: str
    fields: str
    present: Test
    needs: str | None = None


@dataclass(frozen=True)
class Refusal:
    """A combination of features (two, or one under a condition) that is refused before simulating.

    Attributes:
        features: the feature keys (one or two).
        reason: one sentence naming the fields and what to do instead.
        rule: whose rule it is: ``vLLM <version>: <file>`` / ``SGLang ...`` (the engine refuses it) or
            ``servelab`` (not modelled yet).
        when: a narrower condition than both features being on (None: both on is enough).
        about_workload: the condition reads the workload section (skipped when a caller brings its own requests).
    """

    features: tuple[str, ...]
    reason: str
    rule: str
    when: Test | None = None
    about_workload: bool = False


def _spec(method: str | None = None) -> Test:
    def test(exp: Experiment, sub: Experiment) -> bool:
        s = sub.speculative
        return s is not None and (method is None or s.method == method)
    return test


def _async_requested(exp: Experiment, sub: Experiment) -> bool:
    return sub.engine.async_scheduling is True


def _swap(exp: Experiment, sub: Experiment) -> bool:
    return sub.policy.preemption.mode == "swap"


def _kv_offload(exp: Experiment, sub: Experiment) -> bool:
    return bool(sub.engine.kv_offloading_size)


def _pd(exp: Experiment, sub: Experiment) -> bool:
    return exp.deployment.mode == "disaggregated"


def _hand_off(exp: Experiment, sub: Experiment) -> bool:
    return exp.deployment.mode != "disaggregated" and bool(exp.pools) and len(exp.pools) > 1


def _pp(exp: Experiment, sub: Experiment) -> bool:
    return sub.hardware.pipeline_parallel_size > 1


def _lock_step(exp: Experiment, sub: Experiment) -> bool:
    h = sub.hardware
    if h.data_parallel_size == 1:
        return False
    return h.data_parallel_lock_step if h.data_parallel_lock_step is not None else h.expert_parallel_size > 1


def _closed_loop(exp: Experiment, sub: Experiment) -> bool:
    return exp.workload.concurrency is not None or exp.workload.source == "vllm_bench"


def _sessions(exp: Experiment, sub: Experiment) -> bool:
    return exp.workload.source == "sessions"


def _priority(exp: Experiment, sub: Experiment) -> bool:
    return sub.policy.queue == "priority"


def _prefix_caching(exp: Experiment, sub: Experiment) -> bool:
    return sub.engine.prefix_caching()


def _no_chunking(exp: Experiment, sub: Experiment) -> bool:
    return sub.engine.enable_chunked_prefill is False


def _v0(exp: Experiment, sub: Experiment) -> bool:
    return sub.engine.vllm_version == "0.6"


def _partial_prefills(exp: Experiment, sub: Experiment) -> bool:
    return sub.engine.max_num_partial_prefills > 1


def _skip_blocked(exp: Experiment, sub: Experiment) -> bool:
    return sub.engine.skip_blocked_waiting > 0


def _pd_first_token(exp: Experiment, sub: Experiment) -> bool:
    return _pd(exp, sub) and exp.deployment.transfer.first_token != "decode_recomputes"


def _pd_parallel_router(exp: Experiment, sub: Experiment) -> bool:
    return _pd(exp, sub) and exp.deployment.transfer.router == "parallel"


def _priority_preemption(exp: Experiment, sub: Experiment) -> bool:
    """A waiting request may preempt running ones: the priority queue with priority_preemption other than none
    (V0's rule is the default for vllm_version 0.6)."""
    p = sub.engine.priority_preemption
    if p is None:
        p = "v0" if sub.engine.vllm_version == "0.6" else "none"
    return sub.policy.queue == "priority" and p != "none"


def _frontend(exp: Experiment, sub: Experiment) -> bool:
    from lab.cluster.frontend import FRONTEND_DEFAULTS  # noqa: PLC0415

    d = FRONTEND_DEFAULTS.get(exp.engine.vllm_version) or FRONTEND_DEFAULTS["0.11"]
    f = exp.frontend
    return any((getattr(f, k) if getattr(f, k) is not None else d[k]) for k in d)


def _session_router(exp: Experiment, sub: Experiment) -> bool:
    return sub.cluster.router == "session_affinity"


def _model(sub: Experiment):
    """The pool's model, or None when it cannot be loaded (the build names that error)."""
    from lab.costmodel.model_arch import load_model  # noqa: PLC0415

    m = sub.model
    try:
        return load_model(m.name, sub.path(m.hf_config, "model.hf_config") if m.hf_config else None)
    except (ValueError, OSError):
        return None


def _hybrid(exp: Experiment, sub: Experiment) -> bool:
    model = _model(sub)
    return model is not None and model.is_hybrid


def _recurrent(exp: Experiment, sub: Experiment) -> bool:
    """A hybrid with Mamba / linear-attention layers (recurrent state)."""
    model = _model(sub)
    return model is not None and model.count_layers("linear_attention", "mamba") > 0


FEATURES: tuple[Feature, ...] = (
    Feature("spec", "speculative decoding (any method)", "speculative", _spec(), needs="supports_speculation"),
    Feature("ngram", "n-gram speculative decoding", "speculative.method: ngram", _spec("ngram"),
            needs="supports_speculation"),
    Feature("async", "async scheduling, asked for explicitly", "engine.async_scheduling: true", _async_requested,
            needs="supports_async"),
    Feature("pp", "pipeline parallelism", "hardware.pipeline_parallel_size > 1", _pp),
    Feature("lockstep", "DP ranks in lock-step (DP + EP)", "hardware.data_parallel_size, expert_parallel_size, "
            "data_parallel_lock_step", _lock_step),
    Feature("pd", "prefill/decode disaggregation", "deployment.mode: disaggregated", _pd, needs="admits_kv_holding"),
    Feature("handoff", "pools chained by hand_off", "pools[].hand_off", _hand_off),
    Feature("offload", "CPU tier of the KV cache", "engine.kv_offloading_size", _kv_offload,
            needs="supports_kv_offload"),
    Feature("swap", "swap preemption (vLLM V0)", "policy.preemption.mode: swap", _swap),
    Feature("prefix", "prefix caching", "engine.enable_prefix_caching", _prefix_caching),
    Feature("nochunk", "chunked prefill off", "engine.enable_chunked_prefill: false", _no_chunking),
    Feature("priority", "priority queue", "policy.queue: priority", _priority),
    Feature("closed", "closed-loop clients", "workload.concurrency", _closed_loop),
    Feature("sessions", "multi-turn sessions", "workload.source: sessions", _sessions),
    Feature("frontend", "API-server front end", "frontend", _frontend),
    Feature("affinity", "session-affinity router", "cluster.router / pools[].router: session_affinity",
            _session_router),
    Feature("hybrid", "hybrid model (sliding window, chunked, linear attention / Mamba layers; vLLM's hybrid KV "
            "cache manager)", "model: a hybrid (layer_types)", _hybrid),
    Feature("v0", "vLLM V0 engine (prefill-only steps, batch-expansion scoring; policies/vllm_v0.py)",
            "engine.vllm_version: \"0.6\"", _v0),
    Feature("partial", "concurrent partial prefills (vLLM V0)", "engine.max_num_partial_prefills > 1",
            _partial_prefills),
    Feature("skiphol", "admission past a blocked waiting request", "engine.skip_blocked_waiting > 0", _skip_blocked,
            needs="skips_blocked_waiting"),
    Feature("pdtoken", "PD: the first token from P (with the KV, SGLang; or as the first output, DistServe)",
            "deployment.transfer.first_token: with_kv / from_prefill", _pd_first_token),
    Feature("pdrouter", "PD: the router sends to P and D at once (SGLang's bootstrap)",
            "deployment.transfer.router: parallel", _pd_parallel_router),
    Feature("prioritypre", "a waiting request preempting running ones for priority",
            "policy.queue: priority with engine.priority_preemption (v0: the 0.6 default)", _priority_preemption,
            needs="preempts_for_priority"),
)

_BY_KEY = {f.key: f for f in FEATURES}


REFUSALS: tuple[Refusal, ...] = (
    Refusal(("ngram", "async"),
            "engine.async_scheduling: true with speculative.method ngram: vLLM's async scheduling supports EAGLE, "
            "EAGLE-3, MTP, draft models and the GPU n-gram proposer only (the CPU n-gram proposer needs the sampled "
            "tokens on the host); leave async_scheduling unset (off) or false",
            "vLLM 0.33: vllm/config/vllm.py (async_scheduling and speculative_config)"),
    Refusal(("offload", "swap"),
            "engine.kv_offloading_size with policy.preemption.mode swap: the CPU tier is vLLM V1's "
            "OffloadingConnector, swap preemption is V0's swap space, and no vLLM has both; use mode recompute",
            "vLLM 0.33: V1 has recompute preemption only (vllm/v1/core/sched/scheduler.py)"),
    Refusal(("offload", "pd"),
            "engine.kv_offloading_size with deployment.mode disaggregated: a CPU tier beside a P->D KV connector "
            "(vLLM's MultiConnector) is not modelled; remove kv_offloading_size or run colocated",
            "servelab"),
    Refusal(("affinity",),
            "router session_affinity with workload.source synthetic: generated requests carry no session_id, token "
            "ids or prefix ids, so every request would be a session of its own and the router would only balance "
            "load; use workload.source sessions (or a trace with session_id), or router least_requests",
            "servelab (nothing to be affine to)",
            when=lambda exp, sub: exp.workload.source == "synthetic", about_workload=True),
    Refusal(("hybrid", "swap"),
            "policy.preemption.mode swap with a hybrid model: swap preemption is vLLM V0's, and V0 has no hybrid KV "
            "cache manager (V1 preempts by recompute only); use mode recompute",
            "vLLM 0.33: vllm/v1/core/sched/scheduler.py (recompute only), vllm/v1/core/kv_cache_coordinator.py"),
    Refusal(("hybrid", "offload"),
            "engine.kv_offloading_size with a hybrid model: a CPU tier holding each KV cache group's blocks (sliding "
            "windows, Mamba state) is not modelled; remove kv_offloading_size",
            "servelab"),
    Refusal(("hybrid", "pp"),
            "hardware.pipeline_parallel_size > 1 with a hybrid model: the KV cache groups of each pipeline stage "
            "(vLLM projects the model's groups onto each stage's layers) are not modelled; use tensor parallelism",
            "servelab"),
    Refusal(("hybrid", "pd"),
            "deployment.mode disaggregated with a Mamba / linear-attention hybrid before vLLM 0.33: a KV connector "
            "turns the hybrid KV cache manager off, and recurrent state cannot be folded into full-attention blocks, "
            "so vLLM does not start; use engine.vllm_version 0.33 (NIXL keeps the hybrid manager) or run colocated",
            "vLLM 0.19: vllm/config/vllm.py (HMA off with --kv-transfer-config), vllm/v1/core/kv_cache_utils.py "
            "(unify_hybrid_kv_cache_specs)",
            when=lambda exp, sub: _recurrent(exp, sub) and sub.engine.vllm_version != "0.33"),
    Refusal(("hybrid", "spec"),
            "speculative.method draft_model with a hybrid model: a separate draft model's KV in the hybrid model's "
            "KV cache groups (one page size across both models) is not modelled; use eagle, eagle3, mtp or ngram",
            "servelab",
            when=lambda exp, sub: sub.speculative is not None and sub.speculative.method == "draft_model"),
    Refusal(("hybrid",),
            "cost_model.kind other than roofline with a hybrid model: sliding-window, chunked, linear-attention and "
            "Mamba layers are priced by the roofline only (lab/costmodel/hybrid_cost.py); use cost_model.kind "
            "roofline",
            "servelab",
            when=lambda exp, sub: sub.cost_model.kind != "roofline"),
    Refusal(("hybrid",),
            "engine.disable_hybrid_kv_cache_manager with a Mamba / linear-attention hybrid: without the hybrid manager "
            "recurrent state cannot be folded into full-attention blocks and vLLM does not start; leave it false",
            "vLLM 0.33: vllm/v1/core/kv_cache_utils.py (unify_hybrid_kv_cache_specs)",
            when=lambda exp, sub: _recurrent(exp, sub) and sub.engine.disable_hybrid_kv_cache_manager),
    Refusal(("hybrid",),
            "policy.scheduler sglang with a Mamba / linear-attention hybrid: SGLang keeps recurrent state in a pool "
            "of its own with its own radix cache (MambaRadixCache), which is not modelled; use vllm_v1 (or a "
            "sliding-window hybrid with sglang)",
            "servelab",
            when=lambda exp, sub: _recurrent(exp, sub) and sub.policy.scheduler == "sglang"),
    Refusal(("spec", "async"),
            "engine.async_scheduling: true with speculative.disable_padded_drafter_batch: true: vLLM's async "
            "scheduling needs the padded drafter batch (the serial proposer reads the sampled tokens on the host); "
            "leave async_scheduling unset (off) or false",
            "vLLM 0.33: vllm/config/vllm.py (async_scheduling and disable_padded_drafter_batch)",
            when=lambda exp, sub: sub.speculative is not None and sub.speculative.disable_padded_drafter_batch),
    Refusal(("v0", "hybrid"),
            "engine.vllm_version 0.6 with a hybrid model: V0 has no hybrid KV cache manager (sliding-window, chunked "
            "and Mamba layers in one block pool); use a V1 version",
            "vLLM 0.6: vllm/core/block_manager.py (one block table per sequence, full attention)"),
    Refusal(("v0", "async"),
            "engine.async_scheduling: true with engine.vllm_version 0.6: V0 schedules synchronously; leave "
            "async_scheduling unset",
            "vLLM 0.6: vllm/engine/llm_engine.py (step: schedule, execute, process outputs in turn)"),
    Refusal(("v0", "pp"),
            "hardware.pipeline_parallel_size > 1 with engine.vllm_version 0.6: V0's virtual engines (one scheduler "
            "per pipeline stage) are not modelled; use a V1 version",
            "servelab"),
    Refusal(("v0", "lockstep"),
            "DP ranks in lock-step with engine.vllm_version 0.6: V0 has no data-parallel engine; use a V1 version",
            "vLLM 0.6: vllm/engine/arg_utils.py (no data_parallel_size)"),
    Refusal(("v0", "spec"),
            "speculative decoding with chunked prefill and engine.vllm_version 0.6: V0 0.6 refuses the pair; turn "
            "chunked prefill off (engine.enable_chunked_prefill: false, V0's default up to a 32K max_model_len)",
            "vLLM 0.6.0: vllm/config.py SpeculativeConfig.maybe_create_spec_config (mutually exclusive)",
            when=lambda exp, sub: sub.engine.chunked_prefill(_max_model_len(sub))),
    Refusal(("partial",),
            "engine.max_num_partial_prefills > 1 with a V1 version: vLLM V1 never enforced concurrent partial "
            "prefills (it fell back to V0 for them, then removed the field); use engine.vllm_version 0.6",
            "vLLM 0.8: vllm/engine/arg_utils.py _is_v1_supported_oracle (\"Concurrent Partial Prefill\"); removed "
            "in 0.33",
            when=lambda exp, sub: sub.engine.vllm_version != "0.6"),
    Refusal(("partial",),
            "engine.max_num_partial_prefills > 1 with chunked prefill off: partial prefills are chunks; turn "
            "engine.enable_chunked_prefill on",
            "vLLM 0.7: vllm/config.py SchedulerConfig (partial prefills need chunked prefill)",
            when=lambda exp, sub: not sub.engine.chunked_prefill(_max_model_len(sub))),
    Refusal(("prioritypre",),
            "engine.priority_preemption v0 with a V1 version: V0's rule is V0's; use none or max_num_seqs",
            "vLLM 0.8+: vllm/v1/core/sched/scheduler.py (a waiting request never preempts)",
            when=lambda exp, sub: sub.engine.priority_preemption == "v0" and sub.engine.vllm_version != "0.6"),
    Refusal(("prioritypre", "v0"),
            "engine.priority_preemption max_num_seqs with engine.vllm_version 0.6: V0 has its own rule (v0)",
            "servelab",
            when=lambda exp, sub: sub.engine.priority_preemption == "max_num_seqs"),
)


def _max_model_len(sub: Experiment) -> int:
    """The pool's ``max_model_len`` (the model's when unset; 0 when the model cannot be loaded)."""
    if sub.engine.max_model_len:
        return sub.engine.max_model_len
    model = _model(sub)
    return model.max_position_embeddings if model is not None else 0


def _capability_refusal(feature: Feature, name: str) -> str:
    from policies import scheduler_class, scheduler_names  # noqa: PLC0415

    able = [n for n in scheduler_names() if getattr(scheduler_class(n), feature.needs or "")]
    return (f"{feature.fields}: scheduler {name!r} does not support {feature.title} (it does not declare "
            f"{feature.needs}); schedulers that do: {', '.join(able)}")


def refusals(exp: Experiment, own_requests: bool = False) -> list[str]:
    """Every reason the experiment cannot run, pool by pool (one line each; empty when it composes).

    Args:
        exp: the experiment.
        own_requests: the caller brings its own requests (the workload section is not used).

    Raises:
        ConfigError: a pool's merged sections are invalid (from :func:`pool_experiments`).
    """
    from policies import make_scheduler  # noqa: PLC0415  (policies sit beside the stack; resolved on use)

    out: list[str] = []
    for pool, sub in pool_experiments(exp):
        where = f"pools[{exp.pools.index(pool)}] {pool.name}: " if pool is not None else ""
        on = {f.key for f in FEATURES if f.present(exp, sub)}
        for r in REFUSALS:
            if own_requests and r.about_workload:
                continue
            if all(k in on for k in r.features) and (r.when is None or r.when(exp, sub)):
                out.append(f"{where}{r.reason} [{r.rule}]")
        name = scheduler_name(sub)
        scheduler = make_scheduler(name, sub.base_dir, sub.policy.options, sub.seed)
        for key in sorted(on):
            f = _BY_KEY[key]
            if f.needs is not None and not getattr(scheduler, f.needs):
                out.append(where + _capability_refusal(f, name))
    return list(dict.fromkeys(out))


def check_composition(exp: Experiment, own_requests: bool = False) -> None:
    """Refuse an experiment whose features do not compose (the matrix above), before anything is simulated;
    ``own_requests``: the caller brings its own requests (see :func:`refusals`).

    Raises:
        ConfigError: ``<file>: <reason> [<whose rule>]``, the first refusal (one line).
    """
    found = refusals(exp, own_requests)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConfigError(f"{exp.source}: {found[0]}{more}")


# ---- the matrix as documentation (docs/composition.md; servelab support) ----
def feature_pairs() -> dict[tuple[str, str], Refusal]:
    """The refused pairs, both orders, keyed by feature keys."""
    out: dict[tuple[str, str], Refusal] = {}
    for r in REFUSALS:
        if len(r.features) == 2:
            a, b = r.features
            out[(a, b)] = out[(b, a)] = r
    return out


def markdown_tables(scheduler_classes: dict[str, type]) -> str:
    """The support matrix as Markdown: features x features (a number points at the refusal listed under the
    table; in parentheses when the refusal has a narrower condition than the two features), schedulers x features
    (the capability each feature needs), and the list of refusals with whose rule each is.

    Args:
        scheduler_classes: scheduler name -> class (``policies.scheduler_class`` of each registered name).
    """
    refused = feature_pairs()
    numbers = {id(r): i for i, r in enumerate(REFUSALS, 1)}
    keys = [f.key for f in FEATURES]
    lines = ["| feature | " + " | ".join(f"`{k}`" for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for f in FEATURES:
        cells = []
        for k in keys:
            r = refused.get((f.key, k))
            cells.append("—" if k == f.key else "✓" if r is None else
                         f"✗{numbers[id(r)]}" if r.when is None else f"(✗{numbers[id(r)]})")
        lines.append(f"| `{f.key}` | " + " | ".join(cells) + " |")
    lines += ["", "| feature | what | turned on by | scheduler capability needed |", "|---|---|---|---|"]
    lines += [f"| `{f.key}` | {f.title} | `{f.fields}` | {f'`{f.needs}`' if f.needs else '—'} |" for f in FEATURES]
    needing = [f for f in FEATURES if f.needs]
    lines += ["", "| scheduler | " + " | ".join(f"`{f.key}`" for f in needing) + " |",
              "|---" * (len(needing) + 1) + "|"]
    for name, cls in scheduler_classes.items():
        cells = ["✓" if getattr(cls, f.needs) else "✗" for f in needing]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += ["", "Refused combinations (in the first table, `(✗n)`: refused only under refusal n's condition):", ""]
    lines += [f"{i}. {' + '.join(f'`{k}`' for k in r.features)}: {r.reason}. Rule: {r.rule}."
              for i, r in enumerate(REFUSALS, 1)]
    return "\n".join(lines) + "\n"
