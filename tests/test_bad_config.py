"""Bad experiment files: each is refused with one line naming the file and the field, and what was expected."""

import pytest

from lab.experiment.config import ConfigError, parse_experiment
from lab.experiment.simulation import build_deployment, simulate

BASE = {"name": "bad", "workload": {"source": "synthetic", "num_requests": 5, "rate": 5.0},
        "model": {"name": "Llama-3.1-8B"}, "simulation": {"progress": False}}


def _with(over: dict) -> dict:
    import copy

    data = copy.deepcopy(BASE)
    for path, value in over.items():
        node = data
        *head, last = path.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return data


# (overrides, a fragment the error must contain): refused when the file is read
AT_LOAD = [
    ({"seed": -1}, "seed"),
    ({"seed": "abc"}, "seed"),
    ({"workload.rate": -2}, "workload.rate"),
    ({"workload.rate": 0}, "workload.rate"),
    ({"workload.num_requests": 0}, "workload.num_requests"),
    ({"workload.cv": 0}, "workload.cv"),
    ({"workload.source": "azure"}, "needs 'path'"),
    ({"workload.time_scale": 0}, "workload.time_scale"),
    ({"workload.bogus": 1}, "workload.bogus"),
    ({"model.name": "NoSuchModel"}, "not in the catalog"),
    ({"model.dtype": "int3"}, "model.dtype"),
    ({"hardware.gpu": "TPU-v9"}, "hardware.gpu"),
    ({"hardware.tensor_parallel_size": 0}, "hardware.tensor_parallel_size"),
    ({"hardware.expert_parallel_size": 3}, "expert_parallel_size"),
    ({"hardware.data_parallel_lock_step": True}, "data_parallel_lock_step"),
    ({"engine.max_num_seqs": 0}, "engine.max_num_seqs"),
    ({"engine.block_size": 0}, "engine.block_size"),
    ({"engine.watermark": 1.5}, "engine.watermark"),
    ({"engine.gpu_memory_utilization": 0}, "engine.gpu_memory_utilization"),
    ({"engine.cudagraph_capture_sizes": [0, 8]}, "engine.cudagraph_capture_sizes"),
    ({"engine.cudagraph_capture_sizes": [-4]}, "engine.cudagraph_capture_sizes"),
    ({"engine.vllm_version": "0.1"}, "engine.vllm_version"),
    ({"policy": "no_such_policy"}, "no_such_policy"),
    ({"policy.preemption.mode": "teleport"}, "policy.preemption.mode"),
    ({"cluster.num_instances": 0}, "cluster.num_instances"),
    ({"cluster.router": "nope"}, "nope"),
    ({"cost_model.kind": "llmservingsim_profile"}, "profile_dir"),
    ({"simulation.horizon_s": -1}, "simulation.horizon_s"),
    ({"slo.ttft_s": 0}, "slo.ttft_s"),
    ({"workload.prompt_tokens": {"kind": "uniform", "low": 100, "high": 10}}, "low"),
    ({"speculative": {"method": "eagle9", "num_speculative_tokens": 2}}, "speculative.method"),
    ({"speculative": {"method": "eagle", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
    ({"speculative": {"method": "draft_model", "num_speculative_tokens": 2}}, "needs 'model'"),
    ({"speculative": {"method": "eagle", "num_speculative_tokens": 2, "model": "Qwen3-8B"}}, "draft model"),
    ({"speculative": {"method": "eagle", "num_speculative_tokens": 2,
                      "acceptance": {"kind": "per_position"}}}, "needs 'rates'"),
    ({"speculative": {"method": "eagle", "num_speculative_tokens": 2,
                      "acceptance": {"kind": "per_position", "rates": [1.2]}}}, "probabilities"),
    ({"speculative": {"method": "eagle", "num_speculative_tokens": 2, "acceptance": {"kind": "iid"}}}, "needs 'rate'"),
    ({"deployment": {"mode": "disaggregated", "prefill": {"count": 1}}}, "needs both"),
    ({"deployment": {"mode": "colocated", "prefill": {"count": 1}}}, "disaggregated"),
    ({"deployment": {"mode": "disaggregated", "prefill": {"count": 0}, "decode": {"count": 1}}}, "count"),
    ({"deployment": {"mode": "disaggregated", "prefill": {}, "decode": {},
                     "transfer": {"protocol": "carrier_pigeon"}}}, "protocol"),
    ({"deployment": {"mode": "disaggregated", "prefill": {}, "decode": {},
                     "transfer": {"bandwidth_gbps": 0}}}, "bandwidth_gbps"),
    ({"deployment": {"mode": "disaggregated", "prefill": {}, "decode": {}}, "cluster.num_instances": 2},
     "deployment.prefill.count"),
    ({"workload.turns": {"kind": "constant", "value": 3}}, "for source 'sessions'"),
]

# refused when the deployment is built (needs the model and GPU facts)
AT_BUILD = [
    ({"hardware.tensor_parallel_size": 3}, "hardware.tensor_parallel_size (3) must divide"),
    ({"hardware.tensor_parallel_size": 64}, "must divide"),
    ({"engine.max_model_len": 10_000_000}, "engine.max_model_len"),
    ({"engine.max_num_batched_tokens": 64, "engine.max_num_seqs": 256}, "max_num_batched_tokens (64) must be >="),
    ({"engine.enable_chunked_prefill": False, "engine.max_num_batched_tokens": 4096,
      "engine.max_num_seqs": 64}, "enable_chunked_prefill false"),
    ({"model.name": "Llama-3.1-70B", "engine.num_gpu_blocks": 1000}, "does not fit"),
    ({"model.name": "Llama-3.1-70B"}, "does not fit"),
    ({"hardware.pipeline_parallel_size": 40}, "pipeline_parallel_size"),
    ({"speculative": {"method": "mtp", "num_speculative_tokens": 1}}, "has no MTP layers"),
]


@pytest.mark.parametrize("over,fragment", AT_LOAD, ids=[f"load{i}" for i in range(len(AT_LOAD))])
def test_refused_when_read(over, fragment):
    with pytest.raises(ConfigError) as e:
        parse_experiment(_with(over), source="bad.yaml")
    msg = str(e.value)
    assert msg.startswith("bad.yaml") and fragment in msg


@pytest.mark.parametrize("over,fragment", AT_BUILD, ids=[f"build{i}" for i in range(len(AT_BUILD))])
def test_refused_when_built(over, fragment):
    exp = parse_experiment(_with(over), source="bad.yaml")
    with pytest.raises(ValueError) as e:
        build_deployment(exp)
    msg = str(e.value)
    assert fragment in msg and "\n" not in msg


def test_a_horizon_before_the_first_arrival_is_refused():
    exp = parse_experiment(_with({"workload.arrival_times": None, "simulation.horizon_s": 0.5}), source="bad.yaml")
    from lab.core.request import Request

    with pytest.raises(ValueError, match="simulation.horizon_s .* before the first arrival"):
        simulate(exp, requests=[Request(0, 2.0, 10, 5)])


def test_zero_attention_heads_in_a_config_json_is_a_one_line_error(tmp_path):
    import json

    cfg = {"num_attention_heads": 0, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
           "vocab_size": 128256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    exp = parse_experiment(_with({"model": {"name": "mine", "hf_config": str(path)}}), source="bad.yaml",
                           base_dir=tmp_path)
    with pytest.raises(ValueError) as e:
        build_deployment(exp)
    assert f"{path}: num_attention_heads must be a positive integer, got 0" in str(e.value)


@pytest.mark.parametrize("section, typo, suggestion", [
    ({"engine": {"max_num_seq": 16}}, "engine.max_num_seq", "'max_num_seqs'"),
    ({"workload": {"sourc": "synthetic"}}, "workload.sourc", "'source'"),
    ({"workload": {"prompt_tokens": {"kind": "lognormal", "medain": 300}}}, "workload.prompt_tokens.medain",
     "'median'"),
])
def test_a_typo_in_a_field_name_is_one_line_naming_the_closest_field(section, typo, suggestion):
    with pytest.raises(ConfigError) as e:
        parse_experiment({"name": "t", **section}, "t.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"t.yaml: {typo}: unknown field; did you mean") and suggestion in msg
