"""The communication model (lab/costmodel/comm.py): hand-computed collective times per link type, vLLM's
all-reduce algorithm switch points, inter-node link selection and catalog errors."""

import pytest

from lab.costmodel import comm, hardware
from lab.costmodel.hardware import load_hardware
from lab.costmodel.model_arch import load_model
from lab.costmodel.operator import OperatorCostModel
from lab.costmodel.parallel import Parallelism

L = comm.LINKS
MiB = 1024 * 1024


def test_allreduce_per_link_type_against_hand_computation():
    # NVLink 4, 8 GPUs, 1 MiB: custom two-shot = 2 x 4.47 us + 2 * 7/8 * 1 MiB / 301.3 GB/s
    assert comm.allreduce(L["nvlink4"], 8, MiB) == pytest.approx(2 * 4.47e-6 + 1.75 * MiB / 301.3e9)
    assert comm.allreduce(L["nvlink4"], 8, MiB) == pytest.approx(15.03e-6, rel=1e-3)
    # NVLink 4, 2 GPUs, 16 MiB (above the custom buffer): NCCL ring = 26.4 us + 16 MiB / 306.4 GB/s
    assert comm.allreduce(L["nvlink4"], 2, 16 * MiB) == pytest.approx(81.16e-6, rel=1e-3)
    # NVLink 3, 4 GPUs, 128 KiB: one-shot = 4.47 us + 3 * 128 KiB / (301.3 * 300/450 GB/s)
    assert comm.allreduce(L["nvlink3"], 4, 131072) == pytest.approx(4.47e-6 + 3 * 131072 / 200.8667e9)
    # PCIe 5 without P2P, 2 GPUs, Qwen3-32B decode of 128 tokens (128 x 5120 x 2 B): ring 48.2 us + B / 18 GB/s
    assert comm.allreduce(L["pcie5_no_p2p"], 2, 1310720) == pytest.approx(121.02e-6, rel=1e-4)
    # PCIe 5 with P2P, 2 GPUs, 64 KiB: one-shot custom 7.5 us + 64 KiB / 54 GB/s
    assert comm.allreduce(L["pcie5_p2p"], 2, 65536) == pytest.approx(8.714e-6, rel=1e-3)
    # PCIe 4 without P2P (RTX 4090), 4 GPUs, 1 MiB: ring 48.2 us + 1.5 MiB / 18 GB/s
    assert comm.allreduce(L["pcie4_no_p2p"], 4, MiB) == pytest.approx(48.2e-6 + 1.5 * MiB / 18e9)
    # 400 Gb/s IB, 16 GPUs, 1 MiB: ring 19.9 us + 2 * 15/16 MiB / 35.9 GB/s
    assert comm.allreduce(L["ib_ndr400"], 16, MiB) == pytest.approx(74.67e-6, rel=1e-3)
    assert comm.allreduce(L["nvlink4"], 1, MiB) == 0.0


def test_alltoall_per_link_type_against_hand_computation():
    for name, lat, bw in (("nvlink4", 26.4e-6, 306.4e9), ("pcie5_no_p2p", 48.2e-6, 18e9),
                          ("ib_ndr400", 19.9e-6, 35.9e9), ("pcie4_p2p", 24e-6, 22e9)):
        assert comm.alltoall(L[name], 8, 1e6) == pytest.approx(lat + 1e6 / bw), name


# DeepSeek-V3 MoE layer: hidden 7168, top-8, fp8 dispatch (1 B), bf16 combine (2 B); uneven per-rank tokens (eager
# mode: vLLM does not pad across DP), a 1-token dummy batch on the 8-rank group's last rank
H, K = 7168, 8
NV = (26.4e-6, 306.4e9)   # nvlink4 NCCL latency / busbw
IB = (19.9e-6, 35.9e9)    # ib_ndr400
TWO = [300, 20]
EIGHT = [1000, 300, 200, 100, 64, 16, 4, 1]   # sum 1685, min 1, max 1000


@pytest.mark.parametrize("link,lat_bw", [("nvlink4", NV), ("ib_ndr400", IB)])
def test_ep_dispatch_combine_two_ranks_per_backend_against_hand_computation(link, lat_bw):
    lat, bw = lat_bw
    f = lambda backend: comm.ep_dispatch_combine(L[link], TWO, H, K, 1.0, backend)
    # all-gather: the 20-token rank receives 300 rows (fp8); reduce-scatter: the same 300 rows in bf16
    assert f("allgather_reducescatter") == pytest.approx(2 * lat + 300 * H * 3 / bw)
    # naive: one broadcast per rank (300 and 20 rows, fp8), then an all-reduce of all 320 rows in bf16 (4,587,520 B:
    # vLLM's one-shot custom all-reduce on NVLink, 4.47 us + B / 301.3 GB/s; NCCL ring over IB, 2(n-1)/n = 1)
    ar = 4.47e-6 + 320 * H * 2 / 301.3e9 if link == "nvlink4" else lat + 320 * H * 2 / bw
    assert f("naive") == pytest.approx(2 * lat + 320 * H / bw + ar)
    # DeepEP high-throughput: P(a token hits the other GPU) = 1 - (1/2)^8; the busiest GPU sends 300 x that
    p = 1 - 0.5 ** 8
    assert f("deepep_high_throughput") == pytest.approx(2 * lat + 300 * p * H * 3 / bw)
    # DeepEP low-latency: rounds of 256 tokens per rank -> ceil(300/256) = 2; every (token, expert) pair is a
    # message, half of them remote: round 1 moves 256 x 8 / 2 = 1024 rows, round 2 44 x 4 = 176 rows, each way
    assert f("deepep_low_latency") == pytest.approx(4 * lat + (1024 + 176) * H * 3 / bw)


@pytest.mark.parametrize("link,lat_bw", [("nvlink4", NV), ("ib_ndr400", IB)])
def test_ep_dispatch_combine_eight_ranks_per_backend_against_hand_computation(link, lat_bw):
    lat, bw = lat_bw
    f = lambda backend: comm.ep_dispatch_combine(L[link], EIGHT, H, K, 1.0, backend)
    # all-gather / reduce-scatter: the dummy rank (1 token) receives the other 1,684 rows
    assert f("allgather_reducescatter") == pytest.approx(2 * lat + 1684 * H * 3 / bw)
    # naive: 8 broadcasts (1,685 rows in all), then a ring all-reduce of 1,685 x 7168 x 2 B (> 8 MiB: NCCL on
    # NVLink too): latency + 2 x 7/8 x B / busbw
    assert f("naive") == pytest.approx(8 * lat + 1685 * H / bw + lat + 1.75 * 1685 * H * 2 / bw)
    # high-throughput: remote GPUs per token = 8 p 7/8 = 7p, p = 1 - (7/8)^8; the 1000-token rank sends 7000p rows,
    # more than any GPU receives (at most 1684p)
    p = 1 - (7 / 8) ** 8
    assert f("deepep_high_throughput") == pytest.approx(2 * lat + 7000 * p * H * 3 / bw)
    # low-latency: ceil(1000/256) = 4 rounds; the 1000-token rank sends 7/8 x 8 = 7 rows per token in each:
    # 256 x 7 = 1792 rows in rounds 1-3 (more than any GPU receives: 896, 300, 256) and 232 x 7 = 1624 in round 4
    assert f("deepep_low_latency") == pytest.approx(8 * lat + (3 * 1792 + 1624) * H * 3 / bw)


def test_ep_dispatch_combine_with_equal_ranks_matches_the_uniform_formulas():
    rows = 8 * 128
    t = comm.ep_dispatch_combine(L["nvlink4"], [128] * 8, 7168, 8, 1.0, "allgather_reducescatter")
    assert t == pytest.approx(comm.allgather(L["nvlink4"], 8, rows * 7168) + comm.reducescatter(
        L["nvlink4"], 8, rows * 7168 * 2))
    remote = 8 * (1 - (7 / 8) ** 8) * 7 / 8
    t = comm.ep_dispatch_combine(L["ib_ndr400"], [128] * 8, 7168, 8, 1.0, "deepep_high_throughput")
    assert t == pytest.approx(comm.alltoall(L["ib_ndr400"], 8, 128 * remote * 7168)
                              + comm.alltoall(L["ib_ndr400"], 8, 128 * remote * 7168 * 2))
    assert comm.ep_dispatch_combine(L["nvlink4"], [512], 7168, 8) == 0.0   # one GPU: nothing to move
    with pytest.raises(ValueError, match="all2all_backend 'pplx': expected one of allgather_reducescatter, naive"):
        comm.ep_dispatch_combine(L["nvlink4"], [128] * 8, 7168, 8, 1.0, "pplx")
    with pytest.raises(ValueError, match="ll_max_tokens must be >= 1"):
        comm.ep_dispatch_combine(L["nvlink4"], [128] * 8, 7168, 8, 1.0, "deepep_low_latency", ll_max_tokens=0)


def test_allreduce_algorithm_switch_points_follow_vllm():
    nv, p2p, shm = L["nvlink4"], L["pcie5_p2p"], L["pcie5_no_p2p"]
    assert comm.allreduce_algorithm(nv, 2, 8 * MiB - 16) == "one_shot"
    assert comm.allreduce_algorithm(nv, 2, 8 * MiB) == "ring"          # custom buffer is 8 MiB
    assert comm.allreduce_algorithm(nv, 4, 512 * 1024 - 16) == "one_shot"
    assert comm.allreduce_algorithm(nv, 4, 512 * 1024) == "two_shot"
    assert comm.allreduce_algorithm(nv, 8, 256 * 1024 - 16) == "one_shot"
    assert comm.allreduce_algorithm(nv, 8, 256 * 1024) == "two_shot"
    assert comm.allreduce_algorithm(nv, 3, 1024) == "ring"              # custom all-reduce: 2/4/6/8 GPUs only
    assert comm.allreduce_algorithm(p2p, 2, 1024) == "one_shot"
    assert comm.allreduce_algorithm(p2p, 4, 1024) == "ring"             # never more than 2 PCIe GPUs
    assert comm.allreduce_algorithm(shm, 2, 1024) == "ring"             # no P2P: NCCL
    with pytest.raises(ValueError, match="no P2P"):
        comm.allreduce(shm, 2, 1024, "one_shot")


def test_groups_larger_than_a_node_use_the_internode_link():
    assert comm.group_link("H100-SXM5-80GB", 8).name == "nvlink4"
    assert comm.group_link("H100-SXM5-80GB", 16).name == "ib_ndr400"
    assert comm.group_link("A100-80GB-SXM4", 16).name == "ib_hdr200"
    assert comm.group_link("RTXPRO6000", 2).name == "pcie5_no_p2p"
    m, h = load_model("Llama-3.1-70B"), load_hardware("H100-SXM5-80GB")
    one_node = OperatorCostModel(m, h, Parallelism(tp=8, pp=1))
    two_nodes = OperatorCostModel(m, h, Parallelism(tp=8, pp=2))
    assert (one_node.tp_link.name, one_node.pp_link.name) == ("nvlink4", "nvlink4")
    assert (two_nodes.tp_link.name, two_nodes.pp_link.name) == ("nvlink4", "ib_ndr400")
    wide = OperatorCostModel(m, h, Parallelism(tp=16))
    T = 256
    byts = T * m.hidden_size * 2
    assert wide._allreduce_fn(16)[0](byts) == pytest.approx(comm.ring_allreduce(L["ib_ndr400"], 16, byts))


def test_bad_link_names_in_the_catalog_give_a_one_line_error(monkeypatch):
    cat = dict(hardware._catalog())
    cat["RTXPRO6000"] = {**cat["RTXPRO6000"], "link": "pcie9", "internode_link": "carrier_pigeon"}
    monkeypatch.setattr(hardware, "_catalog", lambda: cat)
    with pytest.raises(ValueError, match=r"RTXPRO6000\.link: 'pcie9' is not a known link type") as e:
        comm.scale_up_link("RTXPRO6000")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"internode_link: 'carrier_pigeon'"):
        comm.group_link("RTXPRO6000", 16)


def test_every_catalog_gpu_names_known_links():
    for name in hardware.hardware_names():
        assert comm.scale_up_link(name).name in comm.LINKS
        assert comm.internode_link(name).name in comm.LINKS
