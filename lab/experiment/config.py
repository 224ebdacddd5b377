"""Experiment files: a YAML file (and ``--set`` options) read into a validated :class:`Experiment`.

Every field is documented in docs/experiments.md. Unknown fields are errors (a typo never passes silently), and
an error message names the file, the field path and what was expected. The schema and every check are in
lab/experiment/sections.py (one model per section) and lab/experiment/schema.py (the root model, the checks across
sections, pools); their names are importable from here too.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from lab.experiment.schema import (ConfigError, Experiment, UnknownFieldError, check_policies, deep_merge,
                                   format_errors, parse_experiment, pool_experiments, scheduler_name)
from lab.experiment.sections import (DEFAULT_MODEL, PERCENTILE_METRICS, SLO_PLAUSIBLE_S,
                                     AcceptanceConfig, AcceptanceDistribution, ArrivalOverride, ClusterConfig,
                                     CostModelConfig, CPUOverheadConfig, DeploymentConfig, EfficiencyConfig,
                                     EngineConfig, FrontendConfig, HandOffConfig, HardwareConfig, LengthSpec,
                                     ModelConfig, OutputConfig, PDRoleConfig, PolicyConfig, PoolConfig,
                                     PreemptionConfig, SimulationConfig, SLOConfig, SpeculativeConfig,
                                     TransferConfig, ValidationConfig, WorkloadConfig, implausible_slo_bounds)

# the experiment's names, wherever they are defined (users and the rest of the code import them from here)
__all__ = ["ConfigError", "Experiment", "UnknownFieldError", "check_policies", "deep_merge", "format_errors",
           "parse_experiment", "pool_experiments", "scheduler_name", "DEFAULT_MODEL", "PERCENTILE_METRICS",
           "SLO_PLAUSIBLE_S", "AcceptanceConfig", "AcceptanceDistribution", "ArrivalOverride", "ClusterConfig",
           "CostModelConfig", "CPUOverheadConfig", "DeploymentConfig", "EfficiencyConfig", "EngineConfig",
           "FrontendConfig", "HandOffConfig", "HardwareConfig", "LengthSpec", "ModelConfig", "OutputConfig",
           "PDRoleConfig", "PolicyConfig", "PoolConfig", "PreemptionConfig", "SimulationConfig", "SLOConfig",
           "SpeculativeConfig", "TransferConfig", "ValidationConfig", "WorkloadConfig", "implausible_slo_bounds",
           "load_experiment", "read_yaml", "parse_set_option"]


def load_experiment(path: str | Path, data_dir: str | Path | None = None,
                    overrides: dict | None = None) -> Experiment:
    """Read and validate an experiment YAML file.

    Args:
        path: the YAML file.
        data_dir: overrides the data directory.
        overrides: nested dict merged over the file (used by the CLI's ``--set a.b=value``).

    Raises:
        ConfigError: missing file, YAML syntax error, or invalid fields.
    """
    p = Path(path)
    data = read_yaml(p, "experiment file")
    kind = _other_file_kind(data)
    if kind is not None:
        name, key, command = kind
        raise ConfigError(f"{p}: this is a {name} file (it has {key!r}), not one experiment: run it with "
                          f"servelab {command} {p}")
    if overrides:
        data = deep_merge(data or {}, overrides)
    return parse_experiment(data, str(p), p.resolve().parent, data_dir)


# Top-level keys that only a sweep, search or comparison file has (lab/report/sweep.py, search.py, compare.py; no
# experiment field has these names), with what the file is and the servelab command that runs it.
_OTHER_FILE_KEYS = (("axes", "sweep", "sweep"), ("find", "search", "search"), ("groups", "comparison", "compare"))


def _other_file_kind(data) -> tuple[str, str, str] | None:
    """(what the file is, the key that shows it, the command) when ``data`` is a sweep, search or comparison
    file rather than an experiment, else None."""
    if not isinstance(data, dict):
        return None
    for key, name, command in _OTHER_FILE_KEYS:
        if key in data:
            return name, key, command
    return None


def read_yaml(path: Path, what: str):
    """Parse a YAML file.

    Raises:
        ConfigError: the file does not exist or is not valid YAML (the message names the file).
    """
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not an {what}" if what[0] in "aeiou" else
                          f"{path}: is a directory, not a {what}")
    if not path.is_file():
        raise ConfigError(f"{path}: {what} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def parse_set_option(items: list[str]) -> dict:
    """Turn ``["engine.max_num_seqs=64", ...]`` into a nested dict; values are parsed as YAML scalars.

    Raises:
        ConfigError: an item without ``=``, a value that is not valid YAML, or a field path under a field an
            earlier item set to a plain value (``--set workload=5 --set workload.rate=2``).
    """
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected FIELD.PATH=VALUE, e.g. engine.max_num_seqs=64")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({_one_line_yaml(e)})") from None
        node = out
        parts = key.strip().split(".")
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[:depth + 1])} was set to a value by an earlier "
                                  "--set, so it has no fields")
        node[parts[-1]] = value
    return out


def _one_line_yaml(e: yaml.YAMLError) -> str:
    return " ".join(str(e).split())
