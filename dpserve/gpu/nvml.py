"""The NVML boundary: the few nvidia-ml-py (`pynvml`) calls dpserve makes, and reading them into samples.

Everything GPU-specific goes through an `Nvml` object; in production it is the `pynvml` module itself,
in unit tests a fake with the same calls (these machines have no GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dpserve.gpu.sample import GpuProcess, GpuSample, int_or_none

NO_GPU = "no NVIDIA GPU found"


class Nvml(Protocol):
    """The subset of the `pynvml` module dpserve uses (same names, same meaning)."""

    NVMLError: type[Exception]
    NVMLError_NotSupported: type[Exception]
    NVMLError_GpuIsLost: type[Exception]
    NVMLError_Timeout: type[Exception]
    NVMLError_FunctionNotFound: type[Exception]
    NVMLError_NoPermission: type[Exception]
    NVML_TEMPERATURE_GPU: int
    NVML_CLOCK_SM: int
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED: int
    NVML_VOLATILE_ECC: int
    nvmlEventTypeXidCriticalError: int
    NVML_P2P_CAPS_INDEX_NVLINK: int
    NVML_P2P_STATUS_OK: int

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    # What tells a sick GPU from a healthy one (gpu/health.py reads them).
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int: ...
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int: ...
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int: ...
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any: ...
    def nvmlEventSetFree(self, event_set: Any) -> None: ...
    # How the GPUs are linked (gpu/topology.py groups a tensor-parallel replica's GPUs by it).
    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int: ...
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int: ...


def load_nvml() -> Nvml:
    """The real library. Raises ImportError when nvidia-ml-py is not installed."""
    import pynvml

    nvml: Nvml = pynvml  # the module is the library: it has every function the protocol names
    return nvml


MAX_EVENTS_PER_READ = 64
"""Xid events drained per GPU per reading: a storm of them must not stall the sampler."""


@dataclass
class XidWatch:
    """One GPU's Xid event set (one per GPU, so each event's GPU is known without comparing handles)."""

    event_set: Any
    """None where Xid events cannot be had (not supported, no permission): not asked again."""
    count: int = 0
    last: int | None = None


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used at all: no library, no driver, or no GPU. str() is the one-line reason."""


class NvmlReader:
    """Opens NVML once and reads every GPU on each `read()`. Blocking calls: run it off the event loop."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self._open = False
        self._names: dict[int, tuple[str, str]] = {}
        """index -> (uuid, name), remembered so a GPU that is lost later is still named."""
        self._xids: dict[int, XidWatch] = {}

    @property
    def nvml(self) -> Nvml:
        """The library it reads through (opened by `open`)."""
        return self._nvml

    def open(self) -> None:
        """Initialise NVML; raises NvmlUnavailable with `no NVIDIA GPU found: ...` when it cannot."""
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            raise NvmlUnavailable(f"{NO_GPU}: {exc}") from exc
        self._open = True
        try:
            count = self._nvml.nvmlDeviceGetCount()
        except Exception as exc:
            self.close()
            raise NvmlUnavailable(f"{NO_GPU}: {exc}") from exc
        if count == 0:
            self.close()
            raise NvmlUnavailable(f"{NO_GPU}: NVML reports 0 devices")

    def close(self) -> None:
        if self._open:
            self._open = False
            for watch in self._xids.values():
                if watch.event_set is not None:
                    try:
                        self._nvml.nvmlEventSetFree(watch.event_set)
                    except Exception:  # the library may already be gone: nothing to free then
                        pass
            self._xids.clear()
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down a library that already failed: nothing left to do
                pass

    def read(self) -> tuple[GpuSample, ...]:
        """One sample per GPU. A GPU that fails (lost, say) yields a sample with `error`; the others
        are still read. Raises NVMLError only when NVML as a whole fails (the caller re-opens it)."""
        count = self._nvml.nvmlDeviceGetCount()
        return tuple(self._read_one(index) for index in range(count))

    def _read_one(self, index: int) -> GpuSample:
        nvml = self._nvml
        uuid, name = self._names.get(index, ("", ""))
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if not uuid:
                uuid, name = str(nvml.nvmlDeviceGetUUID(handle)), str(nvml.nvmlDeviceGetName(handle))
                self._names[index] = (uuid, name)
            utilization = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._optional(nvml.nvmlDeviceGetMemoryInfo, handle)
            power_mw = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
            limit_mw = self._optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            temperature = self._optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            sm_clock = self._optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
            processes = self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
            uncorrected, volatile = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            ecc = self._optional(nvml.nvmlDeviceGetTotalEccErrors, handle, uncorrected, volatile)
            throttle = self._optional(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
            pcie = [
                self._optional(call, handle)
                for call in (
                    nvml.nvmlDeviceGetCurrPcieLinkGeneration,
                    nvml.nvmlDeviceGetMaxPcieLinkGeneration,
                    nvml.nvmlDeviceGetCurrPcieLinkWidth,
                    nvml.nvmlDeviceGetMaxPcieLinkWidth,
                )
            ]
            pending = self._pages_pending(handle)
            xids = self._read_xids(index, handle)
        except nvml.NVMLError as exc:
            # GPU lost, unknown error, ...: this GPU only. Its next read tries again.
            return GpuSample(index=index, uuid=uuid, name=name, error=str(exc) or type(exc).__name__)
        return GpuSample(
            index=index,
            uuid=uuid,
            name=name,
            utilization_gpu=None if utilization is None else utilization.gpu / 100.0,
            utilization_memory=None if utilization is None else utilization.memory / 100.0,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            power_limit_watts=None if limit_mw is None else limit_mw / 1000.0,
            temperature_celsius=None if temperature is None else float(temperature),
            sm_clock_mhz=int_or_none(sm_clock),
            processes=tuple(GpuProcess(int(p.pid), int_or_none(getattr(p, "usedGpuMemory", None))) for p in processes),
            xid_errors=None if xids.event_set is None else xids.count,
            last_xid=xids.last,
            ecc_uncorrected=int_or_none(ecc),
            throttle_reasons=int_or_none(throttle),
            pcie_gen=int_or_none(pcie[0]),
            pcie_gen_max=int_or_none(pcie[1]),
            pcie_width=int_or_none(pcie[2]),
            pcie_width_max=int_or_none(pcie[3]),
            pages_pending=pending,
        )

    def _pages_pending(self, handle: Any) -> bool | None:
        """Memory a reset must fix: row remapping pending or failed (Ampere and newer), else dynamic page
        retirement pending (older boards). None where the board has neither."""
        remapped = self._optional(self._nvml.nvmlDeviceGetRemappedRows, handle)
        if remapped is not None:
            _corrected, _uncorrected, pending, failed = remapped
            return bool(pending) or bool(failed)
        retired = self._optional(self._nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        return None if retired is None else bool(retired)

    def _read_xids(self, index: int, handle: Any) -> XidWatch:
        """Xid errors since this reader opened: NVML queues them as events; drained without waiting."""
        nvml = self._nvml
        watch = self._xids.get(index)
        if watch is None:
            try:
                event_set = nvml.nvmlEventSetCreate()
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            except nvml.NVMLError:  # NotSupported, NoPermission (containers without it): no Xid reading
                event_set = None
            watch = self._xids[index] = XidWatch(event_set)
        if watch.event_set is None:
            return watch
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                event = nvml.nvmlEventSetWait_v2(watch.event_set, 0)
            except nvml.NVMLError_Timeout:  # none left
                break
            if int(event.eventType) & nvml.nvmlEventTypeXidCriticalError:
                watch.count += 1
                watch.last = int(event.eventData)
        return watch

    def _optional(self, call: Any, *args: Any) -> Any:
        """A reading some GPUs, drivers or containers do not give (power on some boards, ECC with ECC off,
        a call older drivers lack): None instead of failing."""
        nvml = self._nvml
        try:
            return call(*args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound, nvml.NVMLError_NoPermission):
            return None


def open_reader(load: Callable[[], Nvml] = load_nvml) -> NvmlReader:
    """An opened reader; raises NvmlUnavailable (`no NVIDIA GPU found: ...`) when there is no GPU,
    no driver, or no NVML library."""
    try:
        reader = NvmlReader(load())
    except ImportError as exc:
        raise NvmlUnavailable(f"{NO_GPU}: nvidia-ml-py is not installed ({exc})") from exc
    reader.open()
    return reader


def count_nvidia_gpus(load: Callable[[], Nvml] = load_nvml) -> tuple[int, str | None]:
    """(count, None), or (0, `no NVIDIA GPU found: ...`) when there is no GPU or no NVML library."""
    try:
        reader = open_reader(load)
    except NvmlUnavailable as exc:
        return 0, str(exc)
    try:
        return len(reader.read()), None
    finally:
        reader.close()
