"""Static (request-level) batching as in NVIDIA FasterTransformer: a batch is formed from the waiting queue and
runs to completion before the next one is admitted (FasterTransformer's batched ``generate``; the FT baseline of
Orca OSDI'22 §6 and of microsoft/sarathi-serve ``sarathi/core/scheduler/faster_transformer_scheduler.py``).

When nothing is running, up to ``max_num_seqs`` waiting requests are admitted in queue order, each with KV
reserved for its whole sequence (prompt + ``max_tokens``; FasterTransformer allocates the batch's KV for the
maximum sequence length up front), and their prompts are computed whole in one step. Then the batch decodes one
token per request per step; a request that finishes leaves the batch (its tokens are streamed as generated) but
nothing is admitted until every request of the batch has finished.

Simplifications (documented in docs/policies.md): prompts are not padded to the batch's longest prompt and
finished requests are not kept in the batch as padding, so step times are those of the live requests only — an
optimistic FasterTransformer; there is no batching delay (a batch starts as soon as the engine is idle).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from lab.core.sched_api import EngineView, SchedulerBase, SchedulerConfig, SchedulerOutput
from policies.common import admit_whole_prompts


class StaticBatchingScheduler(SchedulerBase):
    """Static batching (FasterTransformer): admit a batch only when the previous one has drained."""

    def max_step_tokens(self, config: SchedulerConfig) -> int | None:
        """No engine-side cap: a static batch holds whole prompts, whatever their length."""
        return None

    name = "static"
    admits_kv_holding = True  # requests holding remote KV first (policies/common.py next_waiting)

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        max_batch_tokens: int | None = Field(None, ge=1, description="cap on the batch's prompt tokens (None = no cap)")

    def __init__(self, options: "StaticBatchingScheduler.Options | None" = None) -> None:
        self.options = options or self.Options()

    def schedule(self, engine: EngineView) -> SchedulerOutput:
        out = SchedulerOutput()
        if engine.running:
            for r in engine.running:
                n = r.num_tokens - r.num_computed_tokens
                if n > 0:
                    # KV for the whole sequence was reserved at admission: this never needs a new block.
                    if not engine.kv.allocate_slots(r, n):
                        raise RuntimeError(f"static batching: request {r.request_id} ran out of its reserved KV")
                    out.add(r, n)
            return out
        # KV for prompt + max_tokens - 1 (the last token is never fed back), reserved now
        admit_whole_prompts(engine, out, 0, self.options.max_batch_tokens,
                            lambda r: max(0, r.max_tokens - r.num_output_tokens - 1))
        return out
