"""A stand-in for the `pynvml` module at the NVML boundary (these machines have no GPU).

It raises pynvml's own error classes, so the code under test handles exactly what the real library
raises; everything else is plain data a test sets and changes mid-run."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    util_gpu: int = 0
    util_memory: int = 0
    memory_used: int = 1 << 30
    memory_total: int = 80 << 30
    power_mw: int = 70_000
    power_limit_mw: int = 700_000
    temperature: int = 35
    sm_clock_mhz: int = 1980
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    """Calls this GPU answers with NVMLError_NotSupported (e.g. "power")."""
    lost: bool = False
    """Every call on this GPU raises NVMLError_GpuIsLost."""
    # Health readings, as NVML gives them.
    ecc_uncorrected: int = 0
    throttle_reasons: int = 0
    """pynvml.nvmlClocksEventReason* bits."""
    pcie_gen: int = 5
    pcie_gen_max: int = 5
    pcie_width: int = 16
    pcie_width_max: int = 16
    remap_pending: bool = False
    remap_failed: bool = False
    retired_pending: bool = False
    xid_queue: list[int] = field(default_factory=list)
    """Xid events NVML has for this GPU's event set, oldest first (`raise_xid` adds one)."""

    def raise_xid(self, code: int) -> None:
        self.xid_queue.append(code)


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_NoPermission = pynvml.NVMLError_NoPermission
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    NVML_P2P_CAPS_INDEX_NVLINK = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK

    def __init__(self, gpus: list[FakeGpu], call_delay_s: float = 0.0) -> None:
        self.gpus = gpus
        self.call_delay_s = call_delay_s
        self.init_error: Exception | None = None
        self.driver_error: Exception | None = None
        """Raised by every call while set, as NVML does when the driver goes away."""
        self.inits = 0
        self.shutdowns = 0
        self.initialised = False
        self.event_sets: dict[int, list[int]] = {}
        """Event set id -> the GPU handles registered on it."""
        self.freed_event_sets = 0
        self.topology: list[list[str]] | None = None
        """`nvidia-smi topo -m`'s cells (`topology_matrix`), GPU by GPU; None: NVML answers NotSupported."""

    def _check(self) -> None:
        if self.call_delay_s:
            time.sleep(self.call_delay_s)  # a slow driver: blocking, as the real calls are
        if self.driver_error is not None:
            raise self.driver_error
        if not self.initialised:
            raise pynvml.NVMLError_Uninitialized()

    def _gpu(self, handle: Any, what: str) -> FakeGpu:
        self._check()
        gpu = self.gpus[handle]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if what in gpu.unsupported:
            raise pynvml.NVMLError_NotSupported()
        return gpu

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check()
        if index >= len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        if self.gpus[index].lost:
            raise pynvml.NVMLError_GpuIsLost()
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle, "uuid").uuid

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle, "name").name

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        gpu = self._gpu(handle, "utilization")
        return SimpleNamespace(gpu=gpu.util_gpu, memory=gpu.util_memory)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        gpu = self._gpu(handle, "memory")
        return SimpleNamespace(used=gpu.memory_used, total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._gpu(handle, "power").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return self._gpu(handle, "power_limit").power_limit_mw

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "temperature").temperature

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._gpu(handle, "clock").sm_clock_mhz

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        gpu = self._gpu(handle, "processes")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu.processes]

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return self._gpu(handle, "ecc").ecc_uncorrected

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._gpu(handle, "throttle").throttle_reasons

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int) -> int:
        return self._gpu(handle, "pcie").pcie_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:
        return self._gpu(handle, "pcie").pcie_gen_max

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: int) -> int:
        return self._gpu(handle, "pcie").pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:
        return self._gpu(handle, "pcie").pcie_width_max

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        gpu = self._gpu(handle, "retired")
        return pynvml.NVML_FEATURE_ENABLED if gpu.retired_pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle, "remap")
        return (0, 0, int(gpu.remap_pending), int(gpu.remap_failed))

    def nvmlEventSetCreate(self) -> int:
        self._check()
        event_set = len(self.event_sets) + 1
        self.event_sets[event_set] = []
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: int, event_types: int, event_set: int) -> None:
        self._gpu(handle, "events")
        assert event_types == pynvml.nvmlEventTypeXidCriticalError
        self.event_sets[event_set].append(handle)

    def nvmlEventSetWait_v2(self, event_set: int, timeout_ms: int) -> Any:
        self._check()
        for handle in self.event_sets[event_set]:
            queue = self.gpus[handle].xid_queue
            if queue:
                return SimpleNamespace(
                    device=handle, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=queue.pop(0)
                )
        raise pynvml.NVMLError_Timeout()

    def nvmlEventSetFree(self, event_set: int) -> None:
        self.freed_event_sets += 1

    def _link(self, device1: int, device2: int) -> str:
        self._gpu(device1, "topology")
        self._gpu(device2, "topology")
        if self.topology is None:
            raise pynvml.NVMLError_NotSupported()
        return self.topology[device1][device2]

    def nvmlDeviceGetP2PStatus(self, device1: int, device2: int, p2pIndex: int) -> int:
        assert p2pIndex == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        nvlink = self._link(device1, device2).startswith("NV")
        return pynvml.NVML_P2P_STATUS_OK if nvlink else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: int, device2: int) -> int:
        return PCIE_LEVELS[self._link(device1, device2).removeprefix("NV").lstrip("0123456789") or "SYS"]


PCIE_LEVELS = {
    "X": pynvml.NVML_TOPOLOGY_INTERNAL,
    "PIX": pynvml.NVML_TOPOLOGY_SINGLE,
    "PXB": pynvml.NVML_TOPOLOGY_MULTIPLE,
    "PHB": pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
    "NODE": pynvml.NVML_TOPOLOGY_NODE,
    "SYS": pynvml.NVML_TOPOLOGY_SYSTEM,
}
"""`nvidia-smi topo -m`'s legend as NVML's common-ancestor levels. An `NV#` cell (# NVLinks) says nothing of the
PCIe path: the fake answers SYS for it, or the level written after it (`NV2PIX`)."""
TOPOLOGY_DIR = Path(__file__).parent / "data" / "gpu_topology"


def topology_matrix(text: str) -> list[list[str]]:
    """The GPU-by-GPU cells of `nvidia-smi topo -m`'s matrix (its CPU and NUMA affinity columns dropped)."""
    rows = [line.split() for line in text.splitlines() if line.startswith("GPU")]
    return [row[1 : len(rows) + 1] for row in rows]


def gpus_of_topology(name: str) -> FakeNvml:
    """A FakeNvml with as many GPUs as tests/data/gpu_topology/NAME.txt has, linked as it says."""
    matrix = topology_matrix((TOPOLOGY_DIR / f"{name}.txt").read_text())
    nvml = FakeNvml([FakeGpu(f"GPU-{index:04d}") for index in range(len(matrix))])
    nvml.topology = matrix
    return nvml


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu("GPU-aaaa", util_gpu=87, util_memory=41, memory_used=60 << 30, processes=[(4242, 59 << 30)]),
            FakeGpu("GPU-bbbb", util_gpu=12, util_memory=3, power_mw=95_500, temperature=41),
        ]
    )


FAKE_NVML_FILE = "DPSERVE_FAKE_NVML_FILE"
"""The environment variable `from_file` reads: a JSON list of FakeGpu fields, one object per GPU."""


class FileNvml(FakeNvml):
    """FakeNvml whose GPUs come from a JSON file, read again whenever it changes: for a process the
    test does not run in (`dpserve agent --nvml tests.fake_nvml:from_file`)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._mtime = -1.0
        super().__init__([])
        self._reload()

    def _reload(self) -> None:
        mtime = self._path.stat().st_mtime
        if mtime != self._mtime:
            self._mtime = mtime
            self.gpus = [FakeGpu(**item) for item in json.loads(self._path.read_text())]

    def nvmlDeviceGetCount(self) -> int:
        self._reload()
        return super().nvmlDeviceGetCount()


def write_gpus(path: Path, gpus: list[FakeGpu]) -> None:
    """Writes what `FileNvml` reads (atomically: a reader never sees half a file)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps([dataclasses.asdict(gpu) for gpu in gpus], default=sorted))
    os.replace(partial, path)


def from_file() -> FakeNvml:
    return FileNvml(Path(os.environ[FAKE_NVML_FILE]))


class StaticAgents:
    """What GpuFleet reads of GpuAgents: fresh readings."""

    def __init__(self, readings: list[tuple[object, object]]) -> None:
        self._readings = readings
        self.agents: dict[str, object] = {}

    def readings(self) -> list[tuple[object, object]]:
        return self._readings
