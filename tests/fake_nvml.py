"""A stand-in for the `pynvml` module at the NVML boundary (these machines have no GPU).

It raises pynvml's own error classes, so the code under test handles exactly what the real library
raises; everything else is plain data a test sets and changes mid-run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM

    def __init__(self, gpus: list[FakeGpu], call_delay_s: float = 0.0) -> None:
        self.gpus = gpus
        self.call_delay_s = call_delay_s
        self.init_error: Exception | None = None
        self.driver_error: Exception | None = None
        """Raised by every call while set, as NVML does when the driver goes away."""
        self.inits = 0
        self.shutdowns = 0
        self.initialised = False

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


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu("GPU-aaaa", util_gpu=87, util_memory=41, memory_used=60 << 30, processes=[(4242, 59 << 30)]),
            FakeGpu("GPU-bbbb", util_gpu=12, util_memory=3, power_mw=95_500, temperature=41),
        ]
    )
