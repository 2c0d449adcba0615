"""Which GPUs make one tensor-parallel replica: NVML's topology read once (`read_topology`), then the GPUs
cut into groups of K (`group_gpus`), each as close together as the machine allows.

How close two GPUs are, best first: an NVLink path between them (NVML's NVLink P2P status: a bridge, a
direct link or an NVSwitch), then the nearest PCIe ancestor they share (NVML's common ancestor: the
same board, one PCIe switch, several switches, one host bridge, one NUMA node, across sockets). A
group costs its worst pair: every step of a tensor-parallel model waits on all-reduces among all K, so
the slowest link paces the replica. The grouping minimises the worst group's cost, then their sum; ties
go to the lowest indices (with no topology at all, GPUs 0..K-1, K..2K-1, ...).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpserve.gpu.nvml import Nvml, NvmlUnavailable, load_nvml, open_reader

NVLINK = 0
"""The distance of a pair with an NVLink path."""
UNKNOWN = 7
"""The distance of a pair NVML said nothing about: worse than any PCIe path."""
LINK_NAMES = {
    NVLINK: "NVLink",
    1: "same board",
    2: "one PCIe switch",
    3: "PCIe switches",
    4: "one host bridge",
    5: "one NUMA node",
    6: "across sockets",
    UNKNOWN: "unknown link",
}
SEARCH_BUDGET = 200_000
"""Partial groupings the search looks at before it settles for the best so far (16 GPUs in pairs have 2
million groupings; 8 have 105)."""


def pcie_distance(level: int) -> int:
    """NVML's NVML_TOPOLOGY_* level (0 internal, 10 single switch, ..., 50 system) as a distance, 1 to 6."""
    return min(1 + max(level, 0) // 10, UNKNOWN - 1)


@dataclass(frozen=True)
class GpuTopology:
    distance: tuple[tuple[int, ...], ...]
    """distance[a][b]: NVLINK, a PCIe distance (1..6), or UNKNOWN; symmetric, 0 on the diagonal."""
    source: str = "NVML"
    """Where it was read ("NVML"), or why it is not known (then every distance is UNKNOWN)."""

    @property
    def count(self) -> int:
        return len(self.distance)

    @classmethod
    def unknown(cls, count: int, why: str) -> GpuTopology:
        return cls(tuple(tuple(0 if a == b else UNKNOWN for b in range(count)) for a in range(count)), why)

    def cost(self, group: Sequence[int]) -> int:
        """The group's worst pair (0 for one GPU)."""
        return max((self.distance[a][b] for a, b in itertools.combinations(group, 2)), default=0)

    def describe(self, group: Sequence[int]) -> str:
        """`0,1 (NVLink)`: the GPUs and their worst link."""
        gpus = ",".join(map(str, group))
        return gpus if len(group) == 1 else f"{gpus} ({LINK_NAMES[self.cost(group)]})"


class GroupingError(ValueError):
    pass


def group_gpus(topology: GpuTopology, size: int, budget: int = SEARCH_BUDGET) -> tuple[tuple[int, ...], ...]:
    """Every GPU in a group of `size`, groups ordered by their first GPU. A GroupingError when `size` does
    not divide the GPU count."""
    count = topology.count
    if size < 1:
        raise GroupingError(f"--tensor-parallel-size {size}: at least 1")
    if count % size:
        divisors = ", ".join(str(k) for k in range(1, count + 1) if count % k == 0)
        raise GroupingError(
            f"--tensor-parallel-size {size} does not divide the {count} GPU(s) found: each replica needs exactly "
            f"{size}, so {count} GPU(s) take a size among {divisors}"
        )
    search = _Search(topology, size, budget)
    search.run(tuple(range(count)), (), 0, 0)
    assert search.best is not None  # the first descent always reaches a whole grouping
    return tuple(sorted(search.best))


class _Search:
    """Depth first: the lowest GPU left takes each set of partners, cheapest first, so the first grouping
    found is the greedy one; then only branches that can still beat the best are followed."""

    def __init__(self, topology: GpuTopology, size: int, budget: int) -> None:
        self.topology = topology
        self.size = size
        self.budget = budget
        self.best: tuple[tuple[int, ...], ...] | None = None
        self.best_score = (UNKNOWN + 1, 0)

    def run(self, left: tuple[int, ...], groups: tuple[tuple[int, ...], ...], worst: int, total: int) -> None:
        if (worst, total) >= self.best_score:
            return  # costs only grow: this branch cannot do better
        if not left:
            self.best, self.best_score = groups, (worst, total)
            return
        first, rest = left[0], left[1:]
        options = sorted(
            (
                (self.topology.cost((first, *partners)), partners)
                for partners in itertools.combinations(rest, self.size - 1)
            ),
        )
        for cost, partners in options:
            if self.budget <= 0 and self.best is not None:
                return
            self.budget -= 1
            remaining = tuple(gpu for gpu in rest if gpu not in partners)
            self.run(remaining, (*groups, (first, *partners)), max(worst, cost), total + cost)


def _pair_distance(nvml: Nvml, a: object, b: object) -> int:
    try:
        if nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK:
            return NVLINK
    except nvml.NVMLError:  # no NVLink reading (old driver, no permission): the PCIe path still tells
        pass
    try:
        return pcie_distance(int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)))
    except nvml.NVMLError:
        return UNKNOWN


def read_topology_with(nvml: Nvml, count: int) -> GpuTopology:
    """Every pair's distance through an initialised NVML (count² / 2 pairs: a few dozen calls for 8 GPUs)."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
    rows = [[0] * count for _ in range(count)]
    for a, b in itertools.combinations(range(count), 2):
        rows[a][b] = rows[b][a] = _pair_distance(nvml, handles[a], handles[b])
    return GpuTopology(tuple(tuple(row) for row in rows))


def read_topology(load: Callable[[], Nvml] = load_nvml) -> tuple[GpuTopology | None, str | None]:
    """(this host's GPUs and how they are linked, None), or (None, `no NVIDIA GPU found: ...`). A GPU NVML
    cannot place (lost, say) gets UNKNOWN distances rather than failing the whole reading."""
    try:
        reader = open_reader(load)
    except NvmlUnavailable as exc:
        return None, str(exc)
    try:
        count = len(reader.read())
        try:
            return read_topology_with(reader.nvml, count), None
        except reader.nvml.NVMLError as exc:
            return GpuTopology.unknown(count, f"NVML gave no topology ({exc})"), None
    finally:
        reader.close()
