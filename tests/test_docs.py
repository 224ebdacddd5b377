"""The experiment reference documents every field of the schema."""

from pathlib import Path

from lab import config

DOC = (Path(__file__).resolve().parent.parent / "docs" / "experiments.md").read_text()


def fields(model):
    return [n for n, f in model.model_fields.items() if not f.exclude]


def test_every_experiment_field_is_documented():
    sections = {"workload": config.WorkloadConfig, "model": config.ModelConfig, "hardware": config.HardwareConfig,
                "engine": config.EngineConfig, "policy": config.PolicyConfig, "cluster": config.ClusterConfig, "cost_model": config.CostModelConfig,
                "simulation": config.SimulationConfig, "slo": config.SLOConfig, "validation": config.ValidationConfig,
                "output": config.OutputConfig}
    missing = []
    for sec, model in sections.items():
        assert f"## {sec}" in DOC, sec
        body = DOC.split(f"## {sec}", 1)[1].split("\n## ", 1)[0]
        missing += [f"{sec}.{f}" for f in fields(model) if f"`{f}`" not in body]
    missing += [f for f in fields(config.Experiment) if f not in config.Experiment.model_fields
                or (f not in DOC)]
    assert not missing, missing
