"""GPU facts from the project's hardware catalog (lab/catalog/hardware.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lab.costmodel.catalog import read_catalog


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one GPU.

    Attributes:
        name: catalog name.
        bf16_flops: dense BF16 tensor-core peak, FLOP/s.
        fp8_flops: dense FP8 peak, FLOP/s (None where the GPU has no FP8 tensor cores).
        memory_bytes: device memory as the CUDA runtime reports it, bytes.
        memory_bandwidth: peak HBM/GDDR bandwidth, B/s.
        link_bandwidth: scale-up interconnect per GPU, one direction, B/s.
        pcie_bandwidth: host link, one direction, B/s.
        num_sms: streaming multiprocessors (AMD: compute units) a GEMM's output tiles are spread over.
        pcie_latency_s: fixed seconds of one host-link copy (catalog ``pcie_latency_us``, optional; default
            :data:`DEFAULT_PCIE_LATENCY_S`).
    """

    name: str
    bf16_flops: float
    fp8_flops: float | None
    memory_bytes: int
    memory_bandwidth: float
    link_bandwidth: float
    pcie_bandwidth: float
    num_sms: int
    pcie_latency_s: float = 10e-6  # = DEFAULT_PCIE_LATENCY_S

    def peak_flops(self, dtype: str) -> float:
        """Dense peak for a GEMM dtype; fp8 falls back to bf16 on GPUs without FP8 tensor cores."""
        if dtype.startswith("fp8") and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


# Fixed cost of one cudaMemcpyAsync over PCIe (launch plus link round trip): an order-of-magnitude figure of several
# microseconds, not a measurement of this project; a catalog entry may set its own ``pcie_latency_us``.
DEFAULT_PCIE_LATENCY_S = 10e-6


@lru_cache(maxsize=1)
def _catalog() -> dict[str, dict[str, Any]]:
    return read_catalog("hardware")


def hardware_names() -> list[str]:
    return sorted(_catalog())


def load_hardware(name: str) -> Hardware:
    """Look a GPU up by catalog name or alias.

    Raises:
        ValueError: unknown name; the message lists the catalog.
    """
    cat = _catalog()
    for key, e in cat.items():
        if name == key or name in (e.get("aliases") or []):
            return Hardware(
                name=key,
                bf16_flops=float(e["bf16_tflops"]) * 1e12,
                fp8_flops=float(e["fp8_tflops"]) * 1e12 if e.get("fp8_tflops") else None,
                memory_bytes=int(e["memory_bytes"]),
                memory_bandwidth=float(e["memory_bandwidth_tbps"]) * 1e12,
                link_bandwidth=float(e["link_gbps"]) * 1e9,
                pcie_bandwidth=float(e["pcie_gbps"]) * 1e9,
                num_sms=int(e["num_sms"]),
                pcie_latency_s=float(e.get("pcie_latency_us", DEFAULT_PCIE_LATENCY_S * 1e6)) * 1e-6,
            )
    raise ValueError(f"hardware {name!r} is not in the catalog; known: {', '.join(sorted(cat))}")


def fit_proxy(name: str) -> Hardware | None:
    """The GPU whose fitted efficiency curves ``name`` borrows (catalog field ``fit_proxy``: same silicon, e.g.
    H800 -> H100), or None."""
    key = load_hardware(name).name
    proxy = _catalog()[key].get("fit_proxy")
    return load_hardware(proxy) if proxy else None
