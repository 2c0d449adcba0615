"""Grouping GPUs into tensor-parallel replicas by NVML's topology (gpu/topology.py), over `nvidia-smi topo -m`
matrices in tests/data/gpu_topology/ read through the fake NVML."""

from __future__ import annotations

import pynvml
import pytest

from dpserve.gpu.topology import (
    NVLINK,
    UNKNOWN,
    GpuTopology,
    GroupingError,
    group_gpus,
    read_topology,
    read_topology_with,
)
from tests.fake_nvml import FakeGpu, FakeNvml, gpus_of_topology


def topology_of(name: str) -> GpuTopology:
    nvml = gpus_of_topology(name)
    nvml.nvmlInit()
    return read_topology_with(nvml, len(nvml.gpus))


def test_nvml_topology_reads_nvlink_and_pcie_levels() -> None:
    topology = topology_of("nvlink-bridges-8")
    assert topology.count == 8
    assert topology.distance[0][2] == NVLINK
    assert topology.distance[0][1] == 2  # one PCIe switch (PIX)
    assert topology.distance[0][3] == 5  # one NUMA node (NODE)
    assert topology.distance[0][4] == 6  # across sockets (SYS)
    assert all(topology.distance[a][b] == topology.distance[b][a] for a in range(8) for b in range(8))
    assert topology.describe((0, 2)) == "0,2 (NVLink)"
    assert topology.describe((0, 1)) == "0,1 (one PCIe switch)"


def test_eight_gpus_in_pairs_take_the_nvlink_bridges_not_the_index_pairs() -> None:
    groups = group_gpus(topology_of("nvlink-bridges-8"), 2)
    assert groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    # Index pairs would share a PCIe switch but no NVLink: every all-reduce over PCIe.
    assert group_gpus(GpuTopology.unknown(8, "no topology"), 2) == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_fours_stay_on_one_socket() -> None:
    assert group_gpus(topology_of("nvlink-bridges-8"), 4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # GPUs numbered alternately across sockets: the naive 0-3 would straddle the socket interconnect.
    interleaved = topology_of("pcie-interleaved-8")
    assert group_gpus(interleaved, 4) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert all(interleaved.cost(group) < 6 for group in group_gpus(interleaved, 4))


def test_pairs_where_index_pairs_cross_sockets_follow_the_pcie_switches() -> None:
    topology = topology_of("pcie-interleaved-8")
    assert topology.cost((0, 1)) == 6  # GPU 0 and GPU 1: a socket apart
    groups = group_gpus(topology, 2)
    assert groups == ((0, 6), (1, 3), (2, 4), (5, 7))
    assert [topology.describe(group) for group in groups] == [
        "0,6 (one PCIe switch)",
        "1,3 (one PCIe switch)",
        "2,4 (one PCIe switch)",
        "5,7 (one PCIe switch)",
    ]


def test_nvswitch_everything_linked_keeps_index_order() -> None:
    topology = topology_of("nvswitch-8")
    assert group_gpus(topology, 2) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert group_gpus(topology, 8) == ((0, 1, 2, 3, 4, 5, 6, 7),)


def test_search_beats_the_greedy_pick() -> None:
    # GPU 0 has NVLink to 1 and 2, GPU 1 also to 3, but 2-3 only across sockets: taking 0-1 first (the
    # greedy, lowest-index pick) strands 2 and 3; 0-2 and 1-3 are both NVLink.
    sys_ = 6
    rows = (
        (0, NVLINK, NVLINK, sys_),
        (NVLINK, 0, sys_, NVLINK),
        (NVLINK, sys_, 0, sys_),
        (sys_, NVLINK, sys_, 0),
    )
    assert group_gpus(GpuTopology(rows), 2) == ((0, 2), (1, 3))


def test_search_settles_within_its_budget() -> None:
    # 16 GPUs, no two linked alike: far more groupings than the budget lets it look at, still a whole answer.
    rows = tuple(tuple(0 if a == b else 1 + (a * 7 + b * 7) % 6 for b in range(16)) for a in range(16))
    groups = group_gpus(GpuTopology(rows), 2, budget=500)
    assert sorted(gpu for group in groups for gpu in group) == list(range(16))
    assert all(len(group) == 2 for group in groups)


def test_size_not_dividing_the_gpus_is_an_error() -> None:
    with pytest.raises(
        GroupingError, match=r"--tensor-parallel-size 3 does not divide the 8 GPU\(s\) found.*1, 2, 4, 8"
    ):
        group_gpus(topology_of("nvlink-bridges-8"), 3)
    with pytest.raises(GroupingError, match="at least 1"):
        group_gpus(topology_of("nvlink-bridges-8"), 0)
    assert group_gpus(GpuTopology.unknown(3, "none"), 1) == ((0,), (1,), (2,))


def test_read_topology_without_topology_calls_is_unknown_not_a_failure() -> None:
    nvml = FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b")])  # topology None: NotSupported, as on some boards
    topology, why = read_topology(lambda: nvml)
    assert why is None and topology is not None
    assert topology.distance == ((0, UNKNOWN), (UNKNOWN, 0))
    assert nvml.shutdowns == 1


def test_read_topology_without_a_gpu_says_why() -> None:
    nvml = FakeNvml([])
    nvml.init_error = pynvml.NVMLError_LibraryNotFound()
    topology, why = read_topology(lambda: nvml)
    assert topology is None and why is not None and why.startswith("no NVIDIA GPU found")


def test_read_topology_from_the_library() -> None:
    nvml = gpus_of_topology("pcie-interleaved-8")
    topology, why = read_topology(lambda: nvml)
    assert why is None and topology is not None
    assert group_gpus(topology, 2) == ((0, 6), (1, 3), (2, 4), (5, 7))
