"""The experiment reference documents every field of the schema."""

from pathlib import Path

from lab.experiment import config

DOC = (Path(__file__).resolve().parent.parent / "docs" / "experiments.md").read_text()


def fields(model):
    return [n for n, f in model.model_fields.items() if not f.exclude]


def test_every_experiment_field_is_documented():
    sections = {"workload": config.WorkloadConfig, "model": config.ModelConfig, "hardware": config.HardwareConfig,
                "engine": config.EngineConfig, "policy": config.PolicyConfig, "cluster": config.ClusterConfig, "cost_model": config.CostModelConfig,
                "simulation": config.SimulationConfig, "slo": config.SLOConfig, "validation": config.ValidationConfig,
                "output": config.OutputConfig, "pools": config.PoolConfig,
                "speculative": config.SpeculativeConfig, "deployment": config.DeploymentConfig}
    missing = []
    for sec, model in sections.items():
        assert f"## {sec}" in DOC, sec
        body = DOC.split(f"## {sec}", 1)[1].split("\n## ", 1)[0]
        missing += [f"{sec}.{f}" for f in fields(model) if f"`{f}`" not in body]
    missing += [f for f in fields(config.Experiment) if f not in config.Experiment.model_fields
                or (f not in DOC)]
    assert not missing, missing


def test_preemption_and_comparison_fields_are_documented():
    from lab.report.compare import ComparisonSpec, GroupSpec

    policy = DOC.split("## policy", 1)[1].split("\n## ", 1)[0]
    missing = [f"policy.preemption.{f}" for f in fields(config.PreemptionConfig) if f"`{f}`" not in policy]
    comparison = DOC.split("## Comparison files", 1)[1]
    missing += [f"comparison.{f}" for f in fields(ComparisonSpec) if f"`{f}`" not in comparison]
    missing += [f"comparison.groups.{f}" for f in fields(GroupSpec) if f not in comparison]
    assert not missing, missing


def test_every_policy_and_option_is_documented_in_policies_md():
    import policies

    doc = (Path(__file__).resolve().parent.parent / "docs" / "policies.md").read_text()
    missing = []
    for names, get in ((policies.scheduler_names(), policies.scheduler_class),
                       (policies.router_names(), policies.router_class)):
        for name in names:
            if f"### {name}\n" not in doc:
                missing.append(name)
                continue
            body = doc.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
            missing += [f"{name}.{opt}" for opt in policies.options_of(get(name)) if f"`{opt}`" not in body]
    assert not missing, missing
