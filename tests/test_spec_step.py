"""A speculative step from its mechanism (lab/costmodel/spec_step.py): the proposer's passes launched by the host
(serial: each pass max(GPU, host); padded: the host runs ahead and its time is CPU work the engine overlaps),
EAGLE-3's fusion on the first pass only, the rejection sampler, vLLM's capture sizes rounded to multiples of
1 + k, and the config rules of ``disable_padded_drafter_batch``."""

import pytest

from lab.core.batch import BatchShape
from lab.costmodel.base import CostModelBase
from lab.costmodel.hardware import load_hardware
from lab.costmodel.spec_step import SpecDecodeCostModel
from lab.experiment.config import ConfigError, parse_experiment
from lab.costmodel.spec_step import spec_capture_sizes

H100 = load_hardware("H100-SXM5-80GB")


class Fixed(CostModelBase):
    """Every non-empty step takes ``dt``; an empty one ``overhead``."""

    name = "fixed"

    def __init__(self, dt: float, overhead: float = 0.0) -> None:
        self.dt, self.overhead = dt, overhead

    def step_time(self, shape: BatchShape) -> float:
        return self.dt if shape.num_tokens else self.overhead


def _verify(batch=1, k=3, ctx=500):
    return BatchShape.from_requests([1 + k] * batch, [ctx] * batch, [k] * batch)


def _model(serial, async_scheduling, k=3, g=0.2e-3, h=1.0e-3, hs=0.5e-3, target=7e-3):
    return SpecDecodeCostModel(Fixed(target), Fixed(g), "eagle", k, H100, 4096, 1000, serial=serial,
                               async_scheduling=async_scheduling, host_pass_s=h, host_step_s=hs)


def test_serial_proposer_waits_for_the_verify_and_pays_the_host_per_pass():
    m = _model(serial=True, async_scheduling=False)
    shape = _verify()
    verify = 7e-3 + m.rejection_time(shape)
    # host-bound passes (0.2 ms of GPU each, 1 ms of host): the last ends 0.5 + 3 x 1 ms + 0.2 ms after the verify
    assert m.step_time(shape) == pytest.approx(verify + 0.5e-3 + 3 * 1e-3 + 0.2e-3)
    assert m.host_time(shape) == 0.0  # all of it is in the step
    gpu_bound = _model(serial=True, async_scheduling=False, g=2e-3)
    assert gpu_bound.step_time(shape) == pytest.approx(verify + 0.5e-3 + 1e-3 + 3 * 2e-3)


def test_padded_proposer_hides_its_host_behind_the_target_and_hands_it_to_the_engine_under_async():
    m = _model(serial=False, async_scheduling=True)
    shape = _verify()
    assert m.step_time(shape) == pytest.approx(7e-3 + m.rejection_time(shape) + 3 * 0.2e-3)
    assert m.host_time(shape) == pytest.approx(0.5e-3 + 3 * 1e-3)  # CPU work the engine overlaps
    short = _model(serial=False, async_scheduling=True, target=1e-3)  # the host outruns a short verify
    assert short.step_time(shape) == pytest.approx(3 * 1e-3 + 0.2e-3)
    sync = _model(serial=False, async_scheduling=False)  # sync scheduling: the metadata before the launch
    assert sync.step_time(shape) == pytest.approx(m.step_time(shape) + 0.5e-3) and sync.host_time(shape) == 0.0


def test_eagle3_fuses_the_three_hidden_states_on_the_first_pass_only():
    def model(first):
        return SpecDecodeCostModel(Fixed(7e-3), Fixed(0.2e-3), "eagle3", 3, H100, 4096, 1000,
                                   projections_first_pass=first, host_pass_s=0.0, host_step_s=0.0)
    shape = _verify(batch=8)
    with_fc, without = model(((3 * 4096, 4096),)).pass_times(shape), model(()).pass_times(shape)
    assert with_fc[0] > without[0] and with_fc[1:] == without[1:]
    assert model(()).aux_time(shape) > 0  # the three auxiliary hidden states


def test_the_rejection_sampler_reads_a_vocabulary_row_per_draft():
    m = _model(serial=False, async_scheduling=True)
    assert m.rejection_time(BatchShape.from_requests([1], [10])) == 0.0
    assert m.rejection_time(_verify(batch=4)) > m.rejection_time(_verify(batch=1)) > 0.0


def test_capture_sizes_round_up_to_multiples_of_one_plus_k_as_vllm_does():
    base = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    sizes = spec_capture_sizes(base, 3, 256, 8192)  # top = min(256 x 4 x 2, 512)
    assert all(s % 4 == 0 for s in sizes) and sizes[0] == 4 and sizes[-1] == 512
    assert spec_capture_sizes(base, 2, 1, 8192) == (3, 6)  # top = 1 x 3 x 2
    assert spec_capture_sizes((1, 2, 4), 7, 1, 8192) == (8, 16)
    assert spec_capture_sizes(base, 3, 256, 32) == (4, 8, 16, 24, 32)  # capped by max_num_batched_tokens


def _spec_exp(**spec):
    return parse_experiment({"name": "s", "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
                             "speculative": {"method": "eagle3", "num_speculative_tokens": 3, **spec}})


def test_disable_padded_drafter_batch_turns_async_off_and_refuses_it_asked_for():
    from lab.experiment.simulation import build_deployment
    from lab.experiment.support import check_composition

    dep = build_deployment(_spec_exp(disable_padded_drafter_batch=True))
    assert not dep.engine_options.async_scheduling and dep.cost_model.serial
    dep = build_deployment(_spec_exp())
    assert dep.engine_options.async_scheduling and not dep.cost_model.serial
    assert all(s % 4 == 0 for s in dep.engine_options.cudagraph_sizes)
    exp = parse_experiment({"name": "s", "model": {"name": "Llama-3.1-8B"}, "hardware": {"gpu": "H100-SXM5-80GB"},
                            "engine": {"async_scheduling": True},
                            "speculative": {"method": "eagle3", "num_speculative_tokens": 3,
                                            "disable_padded_drafter_batch": True}})
    with pytest.raises(ConfigError, match="disable_padded_drafter_batch: true: vLLM's async scheduling needs the "
                                          "padded drafter batch"):
        check_composition(exp)
    with pytest.raises(ConfigError, match="disable_padded_drafter_batch is for model drafters"):
        parse_experiment({"name": "s", "speculative": {"method": "ngram", "num_speculative_tokens": 3,
                                                       "disable_padded_drafter_batch": True}})
