"""Printed benchmark of the operator cost model's hot path (``step_time``); no test asserts on it.

    .venv/bin/python bench/costmodel_speed.py

Prints microseconds per call for decode-only steps (the common case: new lengths every call, so only the
token-count terms are cached) and for mixed prefill + decode steps, for a dense and an MLA/MoE model, and the same
for ``stage_times`` (what the engine calls instead of ``step_time`` under pipeline parallelism).
"""

import time

from lab.core.batch import BatchShape
from lab.costmodel.hardware import load_hardware
from lab.costmodel.model_arch import load_model
from lab.costmodel.operator import OperatorCostModel, load_curves
from lab.costmodel.parallel import Parallelism


def bench(label: str, cm: OperatorCostModel, n: int = 20000) -> None:
    ctx = list(range(500, 500 + 128))
    if cm.par.pp > 1:
        stages = cm.par.stage_layers(cm.model.num_layers)
        price = lambda shape: cm.stage_times(shape, stages)  # noqa: E731
    else:
        price = cm.step_time
    t0 = time.perf_counter()
    for i in range(n):
        price(BatchShape.decode_only(ctx, sum(ctx) + len(ctx) * i, max(ctx) + i, min(ctx) + i))
    dec = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for i in range(n // 4):
        price(BatchShape.from_requests([512, 256] + [1] * 64, [i, 2 * i] + ctx[:64]))
    mix = (time.perf_counter() - t0) / (n // 4) * 1e6
    print(f"{label:40s} decode-only {dec:6.1f} us/step   mixed {mix:6.1f} us/step")


if __name__ == "__main__":
    curves = load_curves()
    bench("Llama-3.1-8B H100 (fitted curves)",
          OperatorCostModel(load_model("Llama-3.1-8B"), load_hardware("H100"), curves=curves))
    bench("DeepSeek-V3 H200 TP8 (fitted curves)",
          OperatorCostModel(load_model("DeepSeek-V3"), load_hardware("H200"), Parallelism(tp=8), weight_dtype="fp8",
                            curves=curves))
    bench("Llama-3.1-70B H100 TP4 PP2 (stage_times)",
          OperatorCostModel(load_model("Llama-3.1-70B"), load_hardware("H100"), Parallelism(tp=4, pp=2),
                            curves=curves))
