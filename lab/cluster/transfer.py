"""KV transfer between a prefill (P) and a decode (D) instance: links that concurrent transfers share, and the
cost of one transfer (shared/specs/vllm-v1-scheduling.md §5).

A transfer of B bytes over ``links`` parallel GPU links takes ``handshake_s + per_block_s · blocks + latency_s``
(fixed) and then B bytes at the link's bandwidth, shared fairly with every other transfer on the same link at the
same moment (processor sharing: two transfers that start together take twice as long as one). Each decode
instance has one ingress link (NIXL: D pulls); its bandwidth is the per-GPU link bandwidth times
min(P's TP, D's TP), the GPU pairs that move shards at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import simpy

_EPS = 1e-12


class Link:
    """A link whose bandwidth is shared equally by the transfers on it at any moment.

    Args:
        env: the SimPy environment.
        bandwidth: bytes per second (> 0).
        name: for reports.

    Attributes:
        bytes_sent: bytes completed so far; ``busy_s``: seconds with at least one transfer on the link.

    Raises:
        ValueError: a bandwidth that is not positive.
    """

    def __init__(self, env: simpy.Environment, bandwidth: float, name: str = "link") -> None:
        if not bandwidth > 0:
            raise ValueError(f"{name}: link bandwidth must be > 0 B/s, got {bandwidth}")
        self.env = env
        self.bandwidth = float(bandwidth)
        self.name = name
        self._active: dict[simpy.Event, float] = {}  # completion event -> bytes left
        self._size: dict[simpy.Event, float] = {}  # completion event -> bytes of the transfer
        self._last = 0.0
        self._generation = 0
        self.bytes_sent = 0.0
        self.busy_s = 0.0
        self.peak_concurrent = 0

    def send(self, nbytes: float) -> simpy.Event:
        """An event that fires when ``nbytes`` have crossed the link."""
        done = self.env.event()
        if nbytes <= 0:
            done.succeed()
            return done
        self._advance()
        self._active[done] = float(nbytes)
        self._size[done] = float(nbytes)
        self.peak_concurrent = max(self.peak_concurrent, len(self._active))
        self._reschedule()
        return done

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        self._last = now
        active = self._active
        if not active or dt <= 0:
            return
        self.busy_s += dt
        moved = dt * self.bandwidth / len(active)
        for ev in active:
            active[ev] -= moved

    def _reschedule(self) -> None:
        self._generation += 1
        active = self._active
        if not active:
            return
        left = min(active.values())
        delay = max(0.0, left) * len(active) / self.bandwidth
        gen = self._generation
        self.env.timeout(delay).callbacks.append(lambda _e: self._fire(gen))

    def _fire(self, generation: int) -> None:
        if generation != self._generation:
            return  # the set of transfers changed since this timer was set
        self._advance()
        active = self._active
        tol = max(_EPS, 1e-9 * self.bandwidth)
        for ev in [e for e, left in active.items() if left <= tol]:
            del active[ev]
            self.bytes_sent += self._size.pop(ev)
            ev.succeed()
        self._reschedule()


@dataclass(frozen=True)
class TransferCost:
    """What one KV transfer costs besides the bytes on the wire (seconds), and what it moves.

    Attributes:
        bytes_per_token: KV bytes of one token in P's layout, every layer of the model (2·layers·kv_heads·head_dim
            ·dtype for MHA/GQA, layers·(kv_lora_rank + rope_dim)·dtype for MLA), plus the drafter's layers when
            they are sent.
        drafter_bytes_per_token: the drafter's part of ``bytes_per_token``.
        block_size: tokens per block (per-block overhead).
        handshake_s: per-request setup (metadata exchange, notification).
        per_block_s: per-block descriptor overhead.
        latency_s: one-way link latency.
        lease_s: how long P keeps the blocks pinned waiting for D to start reading (vLLM ``kv_lease_duration``).
        first_token: where the first output token comes from (``TransferConfig.first_token``): D recomputes it
            (``decode_recomputes``, vLLM NIXL), P's travels with the KV and D emits it when the read ends
            (``with_kv``, SGLang), or P's is the request's first output (``from_prefill``, DistServe).
        bytes_for: a hybrid model's bytes for a prompt of n tokens (every full-attention layer's KV of all of them,
            a windowed layer's KV of its window, one recurrent state per Mamba / linear-attention layer:
            lab/core/kv_groups.py ``HybridKV.bytes_to_send``), used instead of ``bytes_per_token`` for the target's
            layers; None for a full-attention model.
    """

    bytes_per_token: float
    drafter_bytes_per_token: float = 0.0
    block_size: int = 16
    handshake_s: float = 1e-3
    per_block_s: float = 2e-6
    latency_s: float = 5e-6
    lease_s: float = 30.0
    bytes_for: Callable[[int], float] | None = None
    first_token: str = "decode_recomputes"

    def per_token_bytes(self, num_tokens: int) -> float:
        """KV bytes per token of a transfer of a ``num_tokens``-token prompt (the drafter's layers included)."""
        if self.bytes_for is None or num_tokens <= 0:
            return self.bytes_per_token
        return self.bytes_for(num_tokens) / num_tokens + self.drafter_bytes_per_token

    def fixed_s(self, num_tokens: int) -> float:
        """Seconds of a transfer of ``num_tokens`` tokens that do not depend on the bandwidth."""
        blocks = -(-num_tokens // self.block_size)
        return self.handshake_s + self.per_block_s * blocks + self.latency_s
