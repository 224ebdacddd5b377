"""How one simulated instance is split over GPUs: tensor, pipeline, expert and attention-data parallelism.

Conventions follow vLLM (``--tensor-parallel-size``, ``--pipeline-parallel-size``, ``--data-parallel-size``,
``--enable-expert-parallel``):

* TP splits attention heads, the dense MLP width, the vocabulary (embedding and LM head) and, when EP is off, the
  width of every expert (``moe_tp = tp``); two all-reduces per layer.
* PP splits the layers into ``pp`` contiguous stages; activations cross each stage boundary once per step.
* EP (``ep > 1``) spans the ``tp x dp`` GPUs of a data-parallel group: every GPU holds ``num_experts / ep`` whole
  experts (no TP inside an expert) and tokens travel to their experts' GPUs and back (all-to-all dispatch and
  combine). vLLM requires ``ep == tp * dp`` when expert parallelism is enabled.
* DP (attention data parallelism) runs ``dp`` copies of the attention part, each with its own scheduler and KV
  cache; the simulator models each DP rank as one instance (``cluster.num_instances`` a multiple of ``dp``) and
  assumes the other ranks of the EP group carry a similar number of tokens per step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Parallelism:
    """GPU split of one instance (one DP rank).

    Attributes:
        tp: tensor-parallel size (GPUs per attention group).
        pp: pipeline stages.
        ep: expert-parallel size (1 = experts are TP-sharded like the dense MLP).
        dp: attention data-parallel ranks sharing one expert group (each is its own instance).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallelism: {name} must be an integer >= 1, got {v!r}")
        if self.ep > 1 and self.ep != self.tp * self.dp:
            raise ValueError(f"parallelism: expert_parallel_size ({self.ep}) must equal tensor_parallel_size x "
                             f"data_parallel_size ({self.tp} x {self.dp}) as in vLLM, or be 1")

    @property
    def moe_tp(self) -> int:
        """TP degree inside each expert: ``tp`` without EP, 1 with EP."""
        return 1 if self.ep > 1 else self.tp

    @property
    def gpus(self) -> int:
        """GPUs of one instance (one DP rank): tp x pp."""
        return self.tp * self.pp

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers on each pipeline stage (contiguous, sizes differ by at most one, earlier stages larger)."""
        if self.pp > num_layers:
            raise ValueError(f"parallelism: pipeline_parallel_size ({self.pp}) exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.pp)
        return [base + (1 if s < extra else 0) for s in range(self.pp)]
