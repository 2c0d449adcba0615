"""What one NVML reading says about the GPUs: plain data, shared by the sampler, router and CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None
    """None where the driver does not say (NVML's "not available")."""
    listens: tuple[str, ...] = ()
    """`ADDRESS:PORT`s the process or one of its parents listens on (a replica's API server is the
    parent of the engine process that holds the GPU): how a GPU agent's reading is tied to a replica URL.
    Filled by `dpserve agent`; empty where not looked up."""
    container: str | None = None
    """The container id from the process's cgroup, where it runs in one."""
    pod: str | None = None
    """The Kubernetes pod UID from the process's cgroup, where it runs in one."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuProcess:
        return cls(
            pid=int(data["pid"]),
            used_memory_bytes=int_or_none(data.get("used_memory_bytes")),
            listens=tuple(str(item) for item in data.get("listens") or ()),
            container=data.get("container"),
            pod=data.get("pod"),
        )


def int_or_none(value: Any) -> int | None:
    """A count NVML or an agent's JSON may leave out (None) as an int."""
    return None if value is None else int(value)


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
    # What tells a sick GPU from a healthy one (gpu/health.py); None where the GPU or driver does not say.
    xid_errors: int | None = None
    """Xid errors NVML reported since the reader opened (DCGM XID_ERRORS counts the same events)."""
    last_xid: int | None = None
    """The code of the latest of them (79: fallen off the bus, 48: double-bit ECC, ...)."""
    ecc_uncorrected: int | None = None
    """Uncorrected ECC errors since the driver loaded (volatile counter; DCGM ECC_DBE_VOL_TOTAL)."""
    throttle_reasons: int | None = None
    """NVML's clocks-event reasons bitmask (HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, ...)."""
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pages_pending: bool | None = None
    """Memory rows or pages waiting for a reset to be remapped or retired (or remapping failed)."""
    error: str | None = None
    """Why this GPU could not be read this time (e.g. "GPU is lost"); other fields are then None."""

    @property
    def readable(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "readable": self.readable}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuSample:
        """The inverse of `to_dict` (a GPU agent's JSON); unknown keys are ignored, missing ones unset.
        Raises KeyError, TypeError or ValueError on a malformed reading."""
        known = {f.name for f in fields(cls)} - {"processes"}
        values = {key: value for key, value in data.items() if key in known}
        processes = tuple(GpuProcess.from_dict(p) for p in data.get("processes") or ())
        sample = cls(**values, processes=processes)
        if not isinstance(sample.index, int) or not isinstance(sample.uuid, str):
            raise ValueError("a GPU reading needs an integer index and a string uuid")
        return sample


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
