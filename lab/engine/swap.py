"""Swap preemption's CPU copy of a request's KV (vLLM V0 ``swap_space``): capacity, occupancy and PCIe time."""

from __future__ import annotations

from lab.core.request import Request


class SwapSpace:
    """CPU memory holding swapped-out KV of one instance, and the host-link time its copies take.

    Args:
        kv_bytes_per_token: KV bytes per token on one GPU of the instance.
        pcie_bandwidth: host-link bytes per second, one direction.
        capacity_bytes: CPU swap space per GPU (bytes).
    """

    __slots__ = ("bytes_per_token", "bandwidth", "capacity_tokens", "used_tokens", "pending_s")

    def __init__(self, kv_bytes_per_token: float = 0.0, pcie_bandwidth: float = 0.0,
                 capacity_bytes: float = 0.0) -> None:
        self.bytes_per_token = float(kv_bytes_per_token)
        self.bandwidth = float(pcie_bandwidth)
        self.capacity_tokens = int(capacity_bytes // kv_bytes_per_token) if kv_bytes_per_token else 0
        self.used_tokens = 0
        self.pending_s = 0.0  # copies scheduled with the step being built

    def transfer_time(self, num_tokens: int) -> float:
        """Seconds to copy ``num_tokens`` tokens of KV over the host link, one direction."""
        return num_tokens * self.bytes_per_token / self.bandwidth if self.bandwidth else 0.0

    def swap_out(self, request: Request) -> bool:
        """Copy a running request's computed KV to CPU memory (C keeps the copied tokens); False (recompute
        instead) when it has none or the space cannot hold it. The PCIe time goes to the step being built."""
        c = request.num_computed_tokens - request.inflight_tokens  # tokens of steps still running are not kept
        if c <= 0 or self.used_tokens + c > self.capacity_tokens:
            return False
        self.used_tokens += c
        request.num_computed_tokens = c
        request.swapped_tokens = c
        request.num_swaps += 1
        self.pending_s += self.transfer_time(c)
        return True

    def swap_in(self, request: Request) -> str:
        """Copy a swapped request's KV back (its blocks were just allocated); returns the event detail."""
        c = request.swapped_tokens
        self.used_tokens -= c
        request.swapped_tokens = 0
        dt = self.transfer_time(c)
        self.pending_s += dt
        return f"swap-in {c} tokens ({dt * 1e3:.3f} ms over PCIe)"

    def drop(self, request: Request) -> None:
        """Forget a request's CPU copy (it was rejected)."""
        self.used_tokens -= request.swapped_tokens
        request.swapped_tokens = 0

    def take_pending(self) -> float:
        """Host-link seconds accumulated while scheduling this step; resets them."""
        t = self.pending_s
        self.pending_s = 0.0
        return t
