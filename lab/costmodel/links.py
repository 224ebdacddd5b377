"""GPU-to-GPU link types: their latency and bandwidth for collectives and point-to-point sends, fitted on measured
NCCL tables (lab/costmodel/comm_fit.py refits them), and the lookup by name that the GPU catalog's ``link`` and
``internode_link`` fields use (lab/costmodel/comm.py prices the collectives over them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

@dataclass(frozen=True)
class LinkSpec:
    """One GPU-to-GPU link type.

    Attributes:
        name: key in :data:`LINKS` (the catalog's ``link`` / ``internode_link`` value).
        kind: "nvlink", "pcie" or "rdma".
        latency_s: alpha of one NCCL call, seconds.
        bus_bandwidth: NCCL large-message bus bandwidth per GPU, B/s.
        p2p: GPUs address each other's memory (vLLM's custom all-reduce is possible).
        custom_latency_s: alpha of one custom all-reduce pass, seconds (None: no custom all-reduce).
        peer_bandwidth: bytes/s one GPU reads from its peers in the custom all-reduce.
        source: where the constants come from.
    """

    name: str
    kind: str
    latency_s: float
    bus_bandwidth: float
    p2p: bool = False
    custom_latency_s: float | None = None
    peer_bandwidth: float = 0.0
    source: str = ""

    def with_bandwidth(self, bus_bandwidth: float) -> "LinkSpec":
        """This link with another NCCL bus bandwidth (B/s); the custom all-reduce's peer bandwidth scales with it
        (``hardware.link_gbps`` override)."""
        scale = bus_bandwidth / self.bus_bandwidth
        return replace(self, bus_bandwidth=bus_bandwidth, peer_bandwidth=self.peer_bandwidth * scale,
                       source=f"{self.source}; bus bandwidth overridden to {bus_bandwidth / 1e9:g} GB/s")

    def with_latency(self, latency_s: float) -> "LinkSpec":
        """This link with another NCCL latency (``hardware.link_latency_us`` override), seconds."""
        return replace(self, latency_s=latency_s, source=f"{self.source}; latency overridden to {latency_s * 1e6:g} us")


_GB = 1e9
_US = 1e-6

# Calibrated constants: `.venv/bin/python -m lab.costmodel.comm_fit` refits them from the measured tables
# (shared/data/calibration; log-space least squares of the formulas above) and prints the held-out error.
LINKS: dict[str, LinkSpec] = {
    # NVLink 3 + NVSwitch (DGX A100): NCCL fitted on Vidur a100_dgx all_reduce.csv (2-8 GPUs in one node).
    # Custom all-reduce: the NVLink-4 fit, peer bandwidth scaled by the link rate 300 / 450 (no A100 table).
    "nvlink3": LinkSpec("nvlink3", "nvlink", 41.7 * _US, 159.5 * _GB, True, 4.47 * _US, 301.3 * 300 / 450 * _GB,
                        "fit: Vidur network/a100_dgx/all_reduce.csv (NCCL, intra-node)"),
    # NVLink 4 + NVSwitch (H100/H200 SXM): NCCL fitted on Vidur h100_dgx all_reduce.csv; custom all-reduce fitted
    # on AIConfigurator h100_sxm custom_allreduce_perf (vLLM 0.19, CUDA graph) below 8 MiB.
    "nvlink4": LinkSpec("nvlink4", "nvlink", 26.4 * _US, 306.4 * _GB, True, 4.47 * _US, 301.3 * _GB,
                        "fit: Vidur network/h100_dgx/all_reduce.csv (NCCL); AIConfigurator perf_db/h100_sxm "
                        "custom_allreduce_perf.parquet (vLLM custom, graph)"),
    # NVLink 4 cut to 400 GB/s bidirectional (H800): nvlink4 scaled by 200 / 450 (documented fallback, no table).
    "nvlink4_h800": LinkSpec("nvlink4_h800", "nvlink", 26.4 * _US, 306.4 * 200 / 450 * _GB, True, 4.47 * _US,
                             301.3 * 200 / 450 * _GB, "fallback: nvlink4 fit scaled by the H800 link rate 200/450"),
    # NVLink 5 + NVSwitch (B200): no table; nvlink4 fit with bandwidths scaled by the link rate 900 / 450.
    "nvlink5": LinkSpec("nvlink5", "nvlink", 26.4 * _US, 2 * 306.4 * _GB, True, 4.47 * _US, 2 * 301.3 * _GB,
                        "fallback: nvlink4 fit, bandwidths scaled by the NVLink-5 rate 900/450 GB/s"),
    # AMD Infinity Fabric (MI300X, 8 GPUs fully connected): no table; RCCL treated like nvlink4 at the same
    # per-GPU rate (448 vs 450 GB/s), documented fallback.
    "xgmi_mi300x": LinkSpec("xgmi_mi300x", "nvlink", 26.4 * _US, 306.4 * 448 / 450 * _GB, True, 4.47 * _US,
                            301.3 * 448 / 450 * _GB, "fallback: nvlink4 fit at the MI300X link rate 448/450"),
    # PCIe 5.0 x16 with P2P (RTX PRO 6000 with IOMMU off / ACS off): NCCL 37.6-41.1 GB/s busbw (8 GPUs, tuned
    # channels) and ~24 us small-message all-reduce; P2P writes 53-56 GB/s; custom all-reduce 7.5 us at 256 B-1 KB.
    "pcie5_p2p": LinkSpec("pcie5_p2p", "pcie", 24.0 * _US, 40.0 * _GB, True, 7.5 * _US, 54.0 * _GB,
                          "published: github.com/voipmonitor/rtx6kpro hardware/pcie-bandwidth.md (commit 070506f: "
                          "NCCL AllReduce busbw, NCCL vs custom all-reduce latency, P2P bandwidth on RTX PRO 6000)"),
    # PCIe 5.0 x16 without P2P: NCCL's SHM transport stages every chunk through pinned host memory. Latency: the
    # untuned-NCCL all-reduce of 32-256 KB on RTX PRO 6000 (48.2-56.5 us; SIMPLE protocol, 2 channels, as with
    # vLLM's default environment). Bandwidth: SHM all-reduce busbw 18 GB/s (4 x RTX 4090, NVIDIA/nccl issue
    # #1603); no PCIe-5 SHM figure is published, and the SHM path at NCCL's default channel count is bound by the
    # host-memory staging, not the link rate (rtx6kpro optimization/nccl-tuning.md: P2P-disabled throughput needs
    # 16-64 channels and 32-64 MB buffers), so the PCIe-4 figure is used unscaled.
    "pcie5_no_p2p": LinkSpec("pcie5_no_p2p", "pcie", 48.2 * _US, 18.0 * _GB, False, None, 0.0,
                             "published: rtx6kpro optimization/nccl-tuning.md (commit 1306de8, untuned NCCL 32 KB "
                             "all-reduce 48.2 us); NVIDIA/nccl#1603 (SHM all-reduce busbw 18 GB/s, RTX 4090)"),
    # PCIe 4.0 x16 with P2P (e.g. RTX 4090 with the patched driver, A40/L40S): NCCL busbw 22 GB/s (NVIDIA/nccl
    # #1603, 4 x RTX 4090 P2P); latency as pcie5_p2p; P2P copy ~25 GB/s (half the PCIe-5 figure).
    "pcie4_p2p": LinkSpec("pcie4_p2p", "pcie", 24.0 * _US, 22.0 * _GB, True, 7.5 * _US, 25.0 * _GB,
                          "published: NVIDIA/nccl#1603 (P2P all-reduce busbw 22 GB/s, 4 x RTX 4090); latencies as "
                          "pcie5_p2p"),
    # PCIe 4.0 x16 without P2P (stock RTX 4090 driver: no peer access): SHM busbw 18 GB/s (NVIDIA/nccl#1603).
    "pcie4_no_p2p": LinkSpec("pcie4_no_p2p", "pcie", 48.2 * _US, 18.0 * _GB, False, None, 0.0,
                             "published: NVIDIA/nccl#1603 (SHM all-reduce busbw 18 GB/s, 4 x RTX 4090); latency as "
                             "pcie5_no_p2p"),
    # InfiniBand HDR 200 Gb/s per GPU (Azure NDm A100 v4, Vidur's A100 cluster): fitted on the cross-node rows of
    # Vidur a100_dgx all_reduce.csv (devices_per_node < num_workers).
    "ib_hdr200": LinkSpec("ib_hdr200", "rdma", 140.9 * _US, 10.3 * _GB, False, None, 0.0,
                          "fit: Vidur network/a100_dgx/all_reduce.csv cross-node rows (NCCL over IB)"),
    # 400 Gb/s IB/RoCE per GPU (ConnectX-7, DGX H100/H200): fitted on Vidur h100_dgx send_recv.csv cross-node
    # rows (the only H100-class inter-node table); 35.9 GB/s sits below DeepEP's 43-58 GB/s internode RDMA
    # bottleneck bandwidth on the same NIC class (calibration/published_benchmarks).
    "ib_ndr400": LinkSpec("ib_ndr400", "rdma", 19.9 * _US, 35.9 * _GB, False, None, 0.0,
                          "fit: Vidur network/h100_dgx/send_recv.csv cross-node rows (NCCL over IB)"),
}


def get_link(name: str, where: str = "link") -> LinkSpec:
    """The link called ``name``.

    Raises:
        ValueError: unknown name (one line naming ``where`` and the known links).
    """
    spec = LINKS.get(name)
    if spec is None:
        raise ValueError(f"{where}: {name!r} is not a known link type; expected one of {', '.join(sorted(LINKS))}")
    return spec
