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


def test_alltoall_and_ep_dispatch_per_link_type_against_hand_computation():
    for name, lat, bw in (("nvlink4", 26.4e-6, 306.4e9), ("pcie5_no_p2p", 48.2e-6, 18e9),
                          ("ib_ndr400", 19.9e-6, 35.9e9), ("pcie4_p2p", 24e-6, 22e9)):
        assert comm.alltoall(L[name], 8, 1e6) == pytest.approx(lat + 1e6 / bw), name
    # EP8, 128 tokens per rank, hidden 7168, fp8 dispatch, allgather/reduce-scatter backend on NVLink 4:
    # all-gather of 8 x 128 x 7168 x 1 B and reduce-scatter of the bf16 outputs, each (7/8) of the buffer
    t = comm.ep_dispatch_combine(L["nvlink4"], 8, 128, 7168, 8, 1.0, "allgather_reducescatter")
    rows = 8 * 128
    assert t == pytest.approx(2 * 26.4e-6 + 7 / 8 * rows * 7168 * (1 + 2) / 306.4e9)
    # all2all backend: 128 tokens x expected remote ranks (top-8 of 8 ranks) each way
    remote = 8 * (1 - (7 / 8) ** 8) * 7 / 8
    t = comm.ep_dispatch_combine(L["ib_ndr400"], 8, 128, 7168, 8, 1.0, "all2all")
    assert t == pytest.approx(2 * 19.9e-6 + 128 * remote * 7168 * 3 / 35.9e9)
    with pytest.raises(ValueError, match="all2all backend 'nixl'"):
        comm.ep_dispatch_combine(L["nvlink4"], 8, 128, 7168, 8, 1.0, "nixl")


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
