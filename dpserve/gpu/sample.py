"""What one NVML reading says about the GPUs: plain data, shared by the sampler, router and CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None
    """None where the driver does not say (NVML's "not available")."""


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    name: str
    utilization_gpu: float | None = None
    """Fraction of the last sample period in which a kernel ran (0..1), as DCGM's GPU_UTIL."""
    utilization_memory: float | None = None
    """Fraction of the period in which device memory was read or written (0..1)."""
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_mhz: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    error: str | None = None
    """Why this GPU could not be read this time (e.g. "GPU is lost"); other fields are then None."""

    @property
    def readable(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "readable": self.readable}


@dataclass(frozen=True)
class GpuSnapshot:
    gpus: tuple[GpuSample, ...] = ()
    unavailable: str | None = None
    """One line when there is nothing to read: `no NVIDIA GPU found: ...`, or why NVML stopped."""
    taken_at: float | None = None
    """time.time() of the reading."""
    replica_gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Replica id -> the indices of the GPUs it runs on (absent: not known)."""

    def replica_of(self, gpu_index: int) -> str | None:
        return next((rid for rid, indices in self.replica_gpus.items() if gpu_index in indices), None)
