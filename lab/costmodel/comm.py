"""GPU-to-GPU communication: the time of every collective a serving step uses, on every link type in the catalog.

A link (:class:`LinkSpec`) is described by an alpha-beta pair per transport: ``latency_s`` (alpha, the fixed cost
of one NCCL call: launch, synchronisation, protocol setup) and ``bus_bandwidth`` (beta, NCCL's achievable *bus*
bandwidth per GPU for large messages, as nccl-tests reports ``busbw``), plus, where GPUs can address each other's
memory (NVLink, PCIe with P2P), the constants of vLLM's custom all-reduce (``custom_latency_s``,
``peer_bandwidth``). Times of one call, ``n`` GPUs, ``B`` = bytes of the buffer on each GPU (the NCCL-tests
conventions, NVIDIA/nccl-tests doc/PERFORMANCE.md):

* ring all-reduce (NCCL):            ``latency + 2(n-1)/n · B / bus_bandwidth``
* all-gather / reduce-scatter:       ``latency + (n-1)/n · B_total / bus_bandwidth`` (``B_total`` = the gathered
  buffer, i.e. n x each GPU's share)
* all-to-all:                        ``latency + remote_bytes / bus_bandwidth`` (``remote_bytes`` = what this GPU
  sends to other GPUs; the busiest rank's count when ranks differ)
* send/recv (pipeline stages):       ``latency + B / bus_bandwidth``
* one-shot custom all-reduce (vLLM): ``custom_latency + (n-1) · B / peer_bandwidth`` (every GPU reads the n-1
  peers' buffers and reduces locally)
* two-shot custom all-reduce (vLLM): ``2 · custom_latency + 2(n-1)/n · B / peer_bandwidth`` (reduce-scatter then
  all-gather through peer memory)

Algorithm choice (:func:`allreduce_algorithm`) follows vLLM 0.19 ``vllm/distributed/device_communicators/
custom_all_reduce.py`` and ``csrc/custom_all_reduce.cuh``: the custom all-reduce runs only where the GPUs have P2P
access, for 2 GPUs or a fully connected NVLink group (never more than 2 PCIe GPUs), and only below its buffer size
(``max_size`` 8 MiB); within it, one-shot for 2 GPUs or small buffers (< 512 KiB up to 4 GPUs, < 256 KiB up to 8),
two-shot otherwise; everything else goes to NCCL (ring).

A collective over GPUs of more than one node runs at the pace of the inter-node link (:func:`group_link`:
``gpus > gpus_per_node`` of the catalog selects the GPU's ``internode_link``); NCCL's hierarchical algorithms are
not modelled (a documented simplification: the inter-node NIC is the bottleneck of a ring that crosses nodes).

The link constants and their sources are in :data:`LINKS`; ``lab/costmodel/comm_fit.py`` refits the calibrated
ones from the measured tables and reports the held-out error (docs/costmodel.md, "Communication").
"""

from __future__ import annotations

import math
from typing import Sequence

from lab.costmodel.links import LINKS, LinkSpec, get_link  # (the link types; imported from here too)
from lab.costmodel.ops import expected_remote_ranks

# vLLM custom all-reduce: buffer limit and one-shot thresholds (vllm/distributed/device_communicators/
# custom_all_reduce.py max_size=8192*1024; csrc/custom_all_reduce.cuh one-shot below 512 KiB (<= 4 GPUs) and
# 256 KiB (<= 8 GPUs), always one-shot for 2 GPUs).
CUSTOM_AR_MAX_BYTES = 8 * 1024 * 1024
CUSTOM_AR_SUPPORTED_GPUS = (2, 4, 6, 8)


# ------------------------------------------------------------------------------------------ collectives
def allreduce_algorithm(link: LinkSpec, n: int, byts: float) -> str:
    """The all-reduce vLLM 0.19 runs for a ``byts``-byte buffer over ``n`` GPUs on ``link``: "none" (n = 1),
    "one_shot" / "two_shot" (custom all-reduce) or "ring" (NCCL). See the module docstring for the rules."""
    if n <= 1 or byts <= 0:
        return "none"
    custom = (link.p2p and link.custom_latency_s is not None and n in CUSTOM_AR_SUPPORTED_GPUS
              and byts < CUSTOM_AR_MAX_BYTES and (n == 2 or link.kind == "nvlink"))
    if not custom:
        return "ring"
    if n == 2 or (n <= 4 and byts < 512 * 1024) or (n <= 8 and byts < 256 * 1024):
        return "one_shot"
    return "two_shot"


def ring_allreduce(link: LinkSpec, n: int, byts: float) -> float:
    """NCCL ring all-reduce of a ``byts``-byte buffer over ``n`` GPUs, seconds."""
    if n <= 1 or byts <= 0:
        return 0.0
    return link.latency_s + 2.0 * (n - 1) / n * byts / link.bus_bandwidth


def custom_allreduce(link: LinkSpec, n: int, byts: float, two_shot: bool) -> float:
    """vLLM custom all-reduce (one-shot or two-shot) of ``byts`` bytes over ``n`` GPUs, seconds.

    Raises:
        ValueError: the link has no peer access.
    """
    if link.custom_latency_s is None or not link.p2p:
        raise ValueError(f"link {link.name!r} has no P2P access: vLLM's custom all-reduce cannot run on it")
    if n <= 1 or byts <= 0:
        return 0.0
    if two_shot:
        return 2.0 * link.custom_latency_s + 2.0 * (n - 1) / n * byts / link.peer_bandwidth
    return link.custom_latency_s + (n - 1) * byts / link.peer_bandwidth


def allreduce(link: LinkSpec, n: int, byts: float, algorithm: str | None = None) -> float:
    """All-reduce of a ``byts``-byte buffer over ``n`` GPUs with ``algorithm`` (default: vLLM's choice,
    :func:`allreduce_algorithm`), seconds.

    Raises:
        ValueError: unknown algorithm.
    """
    algo = algorithm or allreduce_algorithm(link, n, byts)
    if algo == "none" or n <= 1 or byts <= 0:
        return 0.0
    if algo == "ring":
        return ring_allreduce(link, n, byts)
    if algo in ("one_shot", "two_shot"):
        return custom_allreduce(link, n, byts, algo == "two_shot")
    raise ValueError(f"all-reduce algorithm {algo!r}: expected ring, one_shot or two_shot")


def allgather(link: LinkSpec, n: int, total_bytes: float) -> float:
    """NCCL all-gather into a ``total_bytes`` buffer (each GPU contributes total/n) over ``n`` GPUs, seconds."""
    if n <= 1 or total_bytes <= 0:
        return 0.0
    return link.latency_s + (n - 1) / n * total_bytes / link.bus_bandwidth


def reducescatter(link: LinkSpec, n: int, total_bytes: float) -> float:
    """NCCL reduce-scatter of a ``total_bytes`` buffer (each GPU keeps total/n) over ``n`` GPUs, seconds."""
    return allgather(link, n, total_bytes)


def alltoall(link: LinkSpec, n: int, remote_bytes: float) -> float:
    """All-to-all in which the busiest GPU sends ``remote_bytes`` to the other ``n - 1`` GPUs, seconds."""
    if n <= 1 or remote_bytes <= 0:
        return 0.0
    return link.latency_s + remote_bytes / link.bus_bandwidth


def sendrecv(link: LinkSpec, byts: float) -> float:
    """Point-to-point send/recv of ``byts`` bytes between two GPUs (pipeline-stage boundary), seconds."""
    if byts <= 0:
        return 0.0
    return link.latency_s + byts / link.bus_bandwidth


# ------------------------------------------------------------------------------------------ expert parallelism
# vLLM's ``--all2all-backend`` values this model prices (vllm/config/parallel.py ``All2AllBackend``; default
# "allgather_reducescatter"). Others vLLM accepts (pplx, mori, nixl_ep, flashinfer_*) are not modelled.
EP_BACKENDS = ("allgather_reducescatter", "naive", "deepep_high_throughput", "deepep_low_latency")
DEFAULT_EP_BACKEND = "allgather_reducescatter"
# Tokens per DP rank one DeepEP low-latency dispatch/combine round takes: vLLM's batched all-to-all kernels run the
# MoE in chunks of VLLM_MOE_DP_CHUNK_SIZE tokens per rank (vllm/envs.py, default 256), the size of the low-latency
# buffer (``num_max_dispatch_tokens_per_rank``); every rank runs as many rounds as the rank with the most tokens.
DEEPEP_LL_MAX_TOKENS_PER_RANK = 256


def allgatherv(link: LinkSpec, contrib_bytes: Sequence[float]) -> float:
    """NCCL all-gather of unequal shares (vLLM ``all_gatherv``): GPU ``r`` contributes ``contrib_bytes[r]`` and
    receives every other share; the GPU that receives the most (the smallest contributor) sets the time:
    ``latency + (Σ B - min B) / bus_bandwidth``, seconds. Equal shares give :func:`allgather`'s (n-1)/n · B_total."""
    n = len(contrib_bytes)
    total = float(sum(contrib_bytes))
    if n <= 1 or total <= 0:
        return 0.0
    return link.latency_s + (total - min(contrib_bytes)) / link.bus_bandwidth


def reducescatterv(link: LinkSpec, keep_bytes: Sequence[float]) -> float:
    """NCCL reduce-scatter into unequal shares (GPU ``r`` keeps ``keep_bytes[r]`` of the reduced buffer): the mirror
    of :func:`allgatherv`, same time, seconds."""
    return allgatherv(link, keep_bytes)


def _sparse_alltoall(link: LinkSpec, send_rows: Sequence[float], recv_rows: Sequence[float],
                     row_bytes: float) -> float:
    """One all-to-all in which GPU ``r`` sends ``send_rows[r]`` and receives ``recv_rows[r]`` rows of ``row_bytes``
    to / from the other GPUs: the busiest GPU's larger direction over the link, seconds."""
    busiest = max(max(s, r) for s, r in zip(send_rows, recv_rows))
    if busiest <= 0:
        return 0.0
    return link.latency_s + busiest * row_bytes / link.bus_bandwidth


def _dedup_rows(tokens: Sequence[float], top_k: int) -> tuple[list[float], list[float]]:
    """(rows each GPU sends, rows each GPU receives) when a token goes once to every other GPU holding one of its
    top-k experts (DeepEP high-throughput; uniform routing): send ``T_r · remote``, receive
    ``Σ_{s≠r} T_s · p`` with p = 1 - (1 - 1/ep)^k the chance that a token hits a given GPU."""
    ep = len(tokens)
    p = 1.0 - (1.0 - 1.0 / ep) ** top_k
    remote = expected_remote_ranks(top_k, ep)
    total = float(sum(tokens))
    return [t * remote for t in tokens], [(total - t) * p for t in tokens]


def _per_expert_rows(tokens: Sequence[float], top_k: int) -> tuple[list[float], list[float]]:
    """(rows sent, rows received) per GPU when every (token, expert) pair is its own message (DeepEP low-latency:
    no per-GPU de-duplication): send ``T_r · k · (ep-1)/ep``, receive ``Σ_{s≠r} T_s · k/ep``."""
    ep = len(tokens)
    total = float(sum(tokens))
    return ([t * top_k * (ep - 1) / ep for t in tokens], [(total - t) * top_k / ep for t in tokens])


def ep_dispatch_combine(link: LinkSpec, tokens: Sequence[float], hidden: int, top_k: int,
                        dispatch_bytes: float = 2.0, backend: str = DEFAULT_EP_BACKEND,
                        ll_max_tokens: int = DEEPEP_LL_MAX_TOKENS_PER_RANK) -> float:
    """Seconds of one MoE layer's token dispatch plus combine over an expert-parallel group, from every GPU's
    token count.

    Args:
        link: the group's link (the inter-node one when the group spans nodes, :func:`group_link`).
        tokens: tokens entering the MoE layer on each GPU of the group, as vLLM's ``num_tokens_across_dp`` holds
            them (padded to the group's largest count under CUDA graphs; a dummy batch counts); len = GPUs.
        hidden: model hidden size.
        top_k: experts per token.
        dispatch_bytes: bytes per dispatched element (2 bf16, 1 fp8); the combine is always bf16 (2).
        backend: vLLM ``--all2all-backend``, one of :data:`EP_BACKENDS`:

            * "allgather_reducescatter" (vLLM's default; ``AgRsAll2AllManager``): dispatch all-gathers every GPU's
              hidden states (``all_gatherv`` with the per-rank sizes), combine reduce-scatters the outputs:
              :func:`allgatherv` of ``T_r·h·b`` + :func:`reducescatterv` of ``T_r·h·2`` (Σ T rows each way);
            * "naive" (``NaiveAll2AllManager``): dispatch broadcasts each GPU's tokens in turn (one NCCL call per
              GPU), combine all-reduces the full ``Σ T x h`` bf16 buffer;
            * "deepep_high_throughput": each token goes once to every other GPU holding one of its experts
              (``T_r · remote`` rows out, ``Σ_{s≠r} T_s · p`` in); one all-to-all each way, paced by the busiest
              GPU;
            * "deepep_low_latency": one message per (token, expert), no de-duplication (``T_r·k·(ep-1)/ep`` out),
              in rounds of ``ll_max_tokens`` tokens per GPU (the low-latency buffer, vLLM's
              ``VLLM_MOE_DP_CHUNK_SIZE``); every GPU runs ``ceil(max T / ll_max_tokens)`` rounds (an idle GPU's
              empty rounds too), each a dispatch and a combine with its own latency.
        ll_max_tokens: the low-latency buffer, tokens per GPU per round.

    Uniform routing is assumed (remote ranks and receive shares are expectations). Sources: vLLM
    vllm/distributed/device_communicators/all2all.py (the managers above); DeepEP README / docs/legacy.md (normal
    kernels de-duplicate per GPU and node; low-latency kernels send per expert from a fixed-size buffer).

    Raises:
        ValueError: unknown backend (one line naming the allowed ones), or ``ll_max_tokens < 1``.
    """
    if backend not in EP_BACKENDS:
        raise ValueError(f"all2all_backend {backend!r}: expected one of {', '.join(EP_BACKENDS)}")
    n = len(tokens)
    if n <= 1 or max(tokens, default=0) <= 0:
        return 0.0
    if backend == "allgather_reducescatter":
        return (allgatherv(link, [t * hidden * dispatch_bytes for t in tokens])
                + reducescatterv(link, [t * hidden * 2.0 for t in tokens]))
    if backend == "naive":
        bcast = sum(sendrecv(link, t * hidden * dispatch_bytes) for t in tokens)
        return bcast + allreduce(link, n, float(sum(tokens)) * hidden * 2.0)
    if backend == "deepep_high_throughput":
        send, recv = _dedup_rows(tokens, top_k)
        return (_sparse_alltoall(link, send, recv, hidden * dispatch_bytes)
                + _sparse_alltoall(link, recv, send, hidden * 2.0))
    if ll_max_tokens < 1:
        raise ValueError(f"deepep_low_latency buffer: ll_max_tokens must be >= 1, got {ll_max_tokens}")
    rounds = math.ceil(max(tokens) / ll_max_tokens)
    t = 0.0
    for j in range(rounds):
        chunk = [min(ll_max_tokens, max(0.0, x - j * ll_max_tokens)) for x in tokens]
        send, recv = _per_expert_rows(chunk, top_k)
        # a round with nothing to move still synchronises every GPU: at least one latency each way
        t += max(link.latency_s, _sparse_alltoall(link, send, recv, hidden * dispatch_bytes))
        t += max(link.latency_s, _sparse_alltoall(link, recv, send, hidden * 2.0))
    return t


# ------------------------------------------------------------------------------------------ catalog
def _entry(hw_name: str) -> dict:
    """The catalog entry of a packaged or user GPU (lab/costmodel/hardware.py ``hardware_entry``)."""
    from lab.costmodel.hardware import hardware_entry

    return hardware_entry(hw_name)


def scale_up_link(hw_name: str) -> LinkSpec:
    """The intra-node link of a catalog GPU (its ``link`` field).

    Raises:
        ValueError: the GPU is unknown, or its ``link`` names no known link type (one line).
    """
    e = _entry(hw_name)
    if "link" not in e:
        raise ValueError(f"lab/catalog/hardware.yaml: {hw_name} has no 'link' field (expected one of "
                         f"{', '.join(sorted(LINKS))})")
    return get_link(str(e["link"]), f"lab/catalog/hardware.yaml: {hw_name}.link")


def gpus_per_node(hw_name: str) -> int:
    """GPUs per node of a catalog GPU's usual server (catalog ``gpus_per_node``, default 8)."""
    return int(_entry(hw_name).get("gpus_per_node", 8))


def internode_link(hw_name: str) -> LinkSpec:
    """The inter-node link of a catalog GPU (its ``internode_link`` field, default ``ib_ndr400``).

    Raises:
        ValueError: the field names no known link type (one line).
    """
    name = str(_entry(hw_name).get("internode_link", "ib_ndr400"))
    return get_link(name, f"lab/catalog/hardware.yaml: {hw_name}.internode_link")


def group_link(hw_name: str, gpus: int) -> LinkSpec:
    """The link a collective over ``gpus`` GPUs of this type runs on: the scale-up link while the group fits in one
    node, the inter-node link when ``gpus > gpus_per_node``."""
    if gpus > gpus_per_node(hw_name):
        return internode_link(hw_name)
    return scale_up_link(hw_name)


def link_for(hw_name: str, gpus: int, bus_gbps: float | None = None, latency_us: float | None = None) -> LinkSpec:
    """:func:`group_link` with an experiment's overrides: ``bus_gbps`` replaces the NCCL bus bandwidth (GB/s),
    ``latency_us`` the NCCL latency (µs); None keeps the catalog link's constants."""
    link = group_link(hw_name, gpus)
    if bus_gbps:
        link = link.with_bandwidth(bus_gbps * 1e9)
    if latency_us is not None:
        link = link.with_latency(latency_us * 1e-6)
    return link
