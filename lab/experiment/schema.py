"""The experiment's schema (part 2) and all of its validation: the root :class:`Experiment` with the checks across
sections, ``parse_experiment`` (a dict -> a validated experiment, policies resolved), ``pool_experiments`` (each
pool's merged view, validated) and ``format_errors`` (pydantic's errors as one line per field). The sections are
in lab/experiment/sections.py; reading files and ``--set`` options is lab/experiment/config.py.
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from lab.experiment.paths import default_data_dir, expand_path
from lab.experiment.sections import (ClusterConfig, CostModelConfig, DeploymentConfig, EngineConfig, FrontendConfig,
                                     HandOffConfig, HardwareConfig, ModelConfig, OutputConfig, PolicyConfig,
                                     PoolConfig, SimulationConfig, SLOConfig, SpeculativeConfig, StrictModel,
                                     ValidationConfig, WorkloadConfig)
from policies import PolicyError, check_router, check_scheduler


class ConfigError(ValueError):
    """An experiment file is missing, not YAML, or fails validation."""


class UnknownFieldError(ConfigError):
    """A field name that is not an experiment field (a typo, or a field of another section): always the user's
    file to fix, never a deployment that merely cannot run (``servelab search`` reports those and goes on)."""


class Experiment(StrictModel):
    """One experiment: a workload through one deployment with one policy."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    seed: int = Field(0, ge=0, description="random seed (a non-negative integer)")
    data_dir: str | None = None
    workload: WorkloadConfig = WorkloadConfig()
    model: ModelConfig = ModelConfig()
    hardware: HardwareConfig = HardwareConfig()
    engine: EngineConfig = EngineConfig()
    policy: PolicyConfig = PolicyConfig()
    cluster: ClusterConfig = ClusterConfig()
    pools: list[PoolConfig] | None = Field(None, min_length=1, description="at least one pool; leave it out for "
                                           "one pool of cluster.num_instances instances")
    deployment: DeploymentConfig = DeploymentConfig()
    cost_model: CostModelConfig = CostModelConfig()
    speculative: SpeculativeConfig | None = None
    simulation: SimulationConfig = SimulationConfig()
    frontend: FrontendConfig = FrontendConfig()
    validation: ValidationConfig | None = None
    slo: SLOConfig = SLOConfig()
    output: OutputConfig = OutputConfig()

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_shorthand(cls, v: Any) -> Any:
        """``policy: NAME`` or ``policy: path/to/file.py:Class`` is short for ``policy: {scheduler: ...}``."""
        return {"scheduler": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _parallelism(self) -> "Experiment":
        h = self.hardware
        tp, pp, ep, dp = h.tensor_parallel_size, h.pipeline_parallel_size, h.expert_parallel_size, h.data_parallel_size
        if ep > 1 and ep != tp * dp:
            raise ValueError(f"hardware.expert_parallel_size ({ep}) must equal tensor_parallel_size x "
                             f"data_parallel_size ({tp} x {dp}), as vLLM requires, or be 1")
        if h.data_parallel_lock_step and dp == 1:
            raise ValueError("hardware.data_parallel_lock_step: lock-step needs data_parallel_size > 1 (the DP ranks "
                             "that step together), got 1")
        if dp > 1 and self.cluster.num_instances % dp:
            raise ValueError(f"cluster.num_instances ({self.cluster.num_instances}) must be a multiple of "
                             f"hardware.data_parallel_size ({dp}): each DP rank is one instance")
        if ep > 1 and self.cost_model.kind != "operator":
            raise ValueError("hardware.expert_parallel_size > 1 needs cost_model.kind 'operator' (the roofline and "
                             "LLMServingSim models know only TP)")
        return self

    @model_validator(mode="after")
    def _disaggregated_pools(self) -> "Experiment":
        """``deployment.mode: disaggregated`` is two pools: ``prefill`` hands every request to ``decode`` after its
        first token (lab/cluster/cluster.py does the transfer)."""
        d = self.deployment
        if d.mode != "disaggregated":
            return self
        if self.pools:
            raise ValueError("deployment.mode 'disaggregated' builds its own pools; remove 'pools'")
        if "num_instances" in self.cluster.model_fields_set and self.cluster.num_instances != 1:
            raise ValueError("cluster.num_instances does not apply with deployment.mode 'disaggregated': set "
                             "deployment.prefill.count and deployment.decode.count")
        roles = []
        for name, role in (("prefill", d.prefill), ("decode", d.decode)):
            assert role is not None
            hand_off = HandOffConfig(to="decode", after_output_tokens=1, delay_s=d.transfer.hand_off_s()) \
                if name == "prefill" else None
            roles.append(PoolConfig(name=name, num_instances=role.count, hand_off=hand_off, hardware=role.hardware,
                                    engine=role.engine, policy=role.policy, cost_model=role.cost_model,
                                    router=role.router, router_options=role.router_options))
        self.pools = roles
        return self

    @model_validator(mode="after")
    def _pool_names(self) -> "Experiment":
        if self.pools:
            names = [p.name for p in self.pools]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"pools: duplicate pool name(s) {dup}")
            for i, p in enumerate(self.pools):
                if p.hand_off is not None and p.hand_off.to not in names:
                    raise ValueError(f"pools[{i}].hand_off.to: unknown pool {p.hand_off.to!r}; pools: "
                                     f"{', '.join(names)}")
                if p.hand_off is not None and p.hand_off.to == p.name:
                    raise ValueError(f"pools[{i}].hand_off.to: a pool cannot hand off to itself")
        return self

    # Set by load_experiment: where relative paths resolve.
    base_dir: Path = Field(default_factory=Path.cwd, exclude=True)
    _source: str = PrivateAttr("<experiment>")  # the file it was read from, for error messages
    resolved_data_dir: Path = Field(default_factory=default_data_dir, exclude=True)

    @property
    def source(self) -> str:
        """The experiment file this was read from (``<experiment>`` when built from a dict)."""
        return self._source

    def path(self, value: str, field: str) -> Path:
        """Resolve a path field (``{data_dir}`` expanded, relative to the experiment file)."""
        return expand_path(value, self.resolved_data_dir, self.base_dir, field)


def _model_at(model: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the last element of ``path`` (a validation error's ``loc``), or None when
    the path leaves the typed sections (a policy's free-form ``options``)."""
    for part in path[:-1]:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            return None
        inner = [a for a in typing.get_args(info.annotation) or (info.annotation,)]
        for a in list(inner):
            inner += list(typing.get_args(a))
        found = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if found is None:
            return None
        model = found
    return model


def _unknown_field_message(loc: tuple, root: type[BaseModel]) -> str:
    """"unknown field; did you mean 'max_num_seqs'?" (the closest field names of that section, difflib)."""
    holder = _model_at(root, loc)
    names = sorted(holder.model_fields) if holder is not None else []
    close = difflib.get_close_matches(str(loc[-1]), names, n=2, cutoff=0.6)
    if close:
        return "unknown field; did you mean " + " or ".join(repr(c) for c in close) + "?"
    if names:
        return "unknown field; expected one of " + ", ".join(names)
    return "unknown field"


def format_errors(source: str, err: ValidationError, root: type[BaseModel] | None = None) -> str:
    """One line per bad field, ``<source>: <field.path>: <what was expected> (got <value>)``; with several, a
    header line first. Unknown fields name the closest known ones."""
    root = root or Experiment
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        got = e.get("input")
        got_s = "" if isinstance(got, dict) or (isinstance(got, str) and got and got in e["msg"]) else f" (got {got!r})"
        if e["type"] == "extra_forbidden":
            msg, got_s = _unknown_field_message(tuple(e["loc"]), root), ""
        else:
            msg = e["msg"].removeprefix("Value error, ")  # our own validators' messages, without pydantic's prefix
        lines.append(f"{loc}: {msg}{got_s}")
    if len(lines) == 1:
        return f"{source}: {lines[0]}"
    return "\n".join([f"{source}: invalid experiment"] + [f"  {line}" for line in lines])


def parse_experiment(data: dict, source: str = "<experiment>", base_dir: Path | None = None,
                     data_dir: str | Path | None = None) -> Experiment:
    """Validate a dict as an experiment.

    Raises:
        ConfigError: with one line per bad field (field path, message, offending value).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a YAML mapping at the top level, got {type(data).__name__}")
    try:  # the context resolves hardware.gpu_catalog and names the file of an inline GPU
        exp = Experiment.model_validate(data, context={"base_dir": base_dir, "data_dir": data_dir, "source": source})
    except ValidationError as e:
        unknown = any(x["type"] == "extra_forbidden" for x in e.errors())
        raise (UnknownFieldError if unknown else ConfigError)(format_errors(source, e)) from None
    exp.base_dir = base_dir or Path.cwd()
    exp._source = source
    if data_dir is not None:
        exp.resolved_data_dir = Path(data_dir)
    elif exp.data_dir and not os.environ.get("SERVELAB_DATA_DIR"):
        exp.resolved_data_dir = expand_path(exp.data_dir, default_data_dir(), exp.base_dir, "data_dir")
    check_policies(exp, source)
    return exp


def pool_experiments(exp: Experiment) -> list[tuple[PoolConfig | None, Experiment]]:
    """The experiment as seen by each pool: its sections with the pool's changes merged in, validated, with the
    pool's instance count in ``cluster.num_instances``. Without ``pools``: one entry, ``(None, exp)``.

    Raises:
        ConfigError: a pool's merged sections are invalid (the message names the pool and the field).
    """
    if not exp.pools:
        return [(None, exp)]
    base = exp.model_dump(exclude={"pools", "deployment"})
    base["workload"] = exp.workload.model_dump(exclude_unset=True)  # its checks read which fields were set
    out: list[tuple[PoolConfig | None, Experiment]] = []
    for i, pool in enumerate(exp.pools):
        data = dict(base)
        for section in ("hardware", "engine", "policy", "cost_model"):
            data[section] = deep_merge(base[section], getattr(pool, section))
        cluster = dict(base["cluster"], num_instances=pool.num_instances)
        if pool.router is not None:
            cluster["router"] = pool.router
        if pool.router_options is not None:
            cluster["router_options"] = pool.router_options
        data["cluster"] = cluster
        try:
            sub = Experiment.model_validate(data, context={"base_dir": exp.base_dir, "data_dir": exp.resolved_data_dir,
                                                           "source": exp.source})
        except ValidationError as e:
            raise ConfigError(format_errors(f"{exp.source} [pools[{i}] {pool.name}]", e)) from None
        sub.base_dir = exp.base_dir
        sub._source = f"{exp.source} [pools[{i}] {pool.name}]"
        sub.resolved_data_dir = exp.resolved_data_dir
        out.append((pool, sub))
    return out


def check_policies(exp: Experiment, source: str) -> None:
    """Resolve the scheduler and router names (or user files) and validate their options now, so a typo or a
    broken policy file fails at load time with the experiment file named.

    Raises:
        ConfigError: unknown name, unloadable file, or bad options.
    """
    try:
        check_scheduler(exp.policy.scheduler, exp.base_dir, exp.policy.options)
        check_router(exp.cluster.router, exp.base_dir, exp.cluster.router_options)
    except PolicyError as e:
        raise ConfigError(f"{source}: {e}") from None
    if exp.pools:
        for i, (pool, sub) in enumerate(pool_experiments(exp)):
            try:
                check_scheduler(sub.policy.scheduler, sub.base_dir, sub.policy.options)
                check_router(sub.cluster.router, sub.base_dir, sub.cluster.router_options)
            except PolicyError as e:
                msg = str(e)
                if pool is not None and pool.router is not None:  # the pool's own router field, not cluster.router
                    msg = msg.replace("cluster.router_options", f"pools[{i}].router_options").replace(
                        "cluster.router", f"pools[{i}].router")
                raise ConfigError(f"{sub.source}: {msg}") from None


def deep_merge(base: dict, over: dict) -> dict:
    """Return ``base`` with ``over`` merged in recursively (``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def scheduler_name(exp: Experiment) -> str:
    """The scheduler an experiment (or one pool's view of it) runs: ``policy.scheduler``, where ``vllm_v1`` under
    ``engine.vllm_version: "0.6"`` is vLLM V0's scheduler (``vllm_v0``, policies/vllm_v0.py): the era selects it."""
    name = exp.policy.scheduler
    return "vllm_v0" if name == "vllm_v1" and exp.engine.vllm_version == "0.6" else name
