"""Shared helpers: a tiny engine with a constant step time, so hand-worked timings are easy to check."""

from __future__ import annotations

from pathlib import Path

import pytest
import simpy

from lab.core.batch import BatchShape
from lab.costmodel.base import CostModelBase
from lab.core import native
from lab.engine.instance import EngineOptions, Instance
from lab.core.kv_cache import KVCacheManager
from lab.experiment.paths import default_data_dir
from lab.core.request import Request
from lab.core.samples import WeightedSamples
from lab.core.sched_api import SchedulerConfig
from policies.vllm_v1 import VLLMV1Scheduler

DATA_DIR = default_data_dir()
# The hot core runs compiled in this process (lab/core/native.py): the compiled modules call their own functions
# directly and their classes take no interpreted subclass, so a test that patches one to watch it, or subclasses
# one, runs on the sources only.
CORE_COMPILED = bool(native.compiled_modules())


def pytest_configure(config):
    config.addinivalue_line("markers", "instruments_core: patches or subclasses hot-core code; runs on the "
                            "pure-Python sources (make test runs these again with SERVELAB_PURE_PYTHON=1)")
    config.addinivalue_line("markers", "calibration_check: a slow accuracy check of the cost model against "
                            "held-out measured profiles (about a minute each); make test leaves these to "
                            "make calibration-checks, which .ci/run runs too")


def pytest_collection_modifyitems(config, items):
    if not CORE_COMPILED:
        return
    skip = pytest.mark.skip(reason="patches or subclasses hot-core code, which the compiled core calls directly or "
                            "does not let subclass: make test runs it again with SERVELAB_PURE_PYTHON=1")
    for item in items:
        if "instruments_core" in item.keywords:
            item.add_marker(skip)


def needs_data(*parts: str):
    """Skip a test when the shared data file it reads is not present."""
    path = DATA_DIR.joinpath(*parts)
    return pytest.mark.skipif(not path.exists(), reason=f"shared data not found: {path}")


class ConstantCost(CostModelBase):
    """Every step takes ``dt`` seconds; records the shapes it saw."""

    name = "constant"

    def __init__(self, dt: float = 1.0) -> None:
        self.dt = dt
        self.shapes: list[BatchShape] = []

    def step_time(self, shape: BatchShape) -> float:
        self.shapes.append(shape)
        return self.dt

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        return {"total": self.dt}


def make_engine(num_gpu_blocks: int = 64, block_size: int = 4, dt: float = 1.0, scheduler=None,
                record_events: bool = True, prefix_caching: bool = True, fast_forward: bool = False,
                options: EngineOptions | None = None, **cfg) -> tuple[simpy.Environment, Instance, ConstantCost]:
    env = simpy.Environment()
    config = SchedulerConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 8, "max_model_len": 1024, **cfg})
    kv = KVCacheManager(num_gpu_blocks, block_size, config.max_model_len, enable_prefix_caching=prefix_caching)
    cost = ConstantCost(dt)
    inst = Instance(env, 0, config, scheduler or VLLMV1Scheduler(), kv, cost, WeightedSamples(),
                    record_events=record_events, options=options or EngineOptions(fast_forward=fast_forward))
    return env, inst, cost


def submit(env: simpy.Environment, inst: Instance, reqs: list[Request]) -> None:
    def arrivals():
        for r in sorted(reqs, key=lambda r: r.arrival_time):
            if r.arrival_time > env.now:
                yield env.timeout(r.arrival_time - env.now)
            inst.add_request(r)

    env.process(arrivals())


def req(i: int, prompt: int, output: int, t: float = 0.0, **kw) -> Request:
    return Request(i, t, prompt, output, **kw)
