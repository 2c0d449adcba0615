"""The NVML boundary: the few nvidia-ml-py (`pynvml`) calls dpserve makes, and reading them into samples.

Everything GPU-specific goes through an `Nvml` object; in production it is the `pynvml` module itself,
in unit tests a fake with the same calls (these machines have no GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from dpserve.gpu.sample import GpuProcess, GpuSample

NO_GPU = "no NVIDIA GPU found"


class Nvml(Protocol):
    """The subset of the `pynvml` module dpserve uses (same names, same meaning)."""

    NVMLError: type[Exception]
    NVMLError_NotSupported: type[Exception]
    NVMLError_GpuIsLost: type[Exception]
    NVML_TEMPERATURE_GPU: int
    NVML_CLOCK_SM: int

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


def load_nvml() -> Nvml:
    """The real library. Raises ImportError when nvidia-ml-py is not installed."""
    import pynvml

    nvml: Nvml = pynvml  # the module is the library: it has every function the protocol names
    return nvml


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used at all: no library, no driver, or no GPU. str() is the one-line reason."""


class NvmlReader:
    """Opens NVML once and reads every GPU on each `read()`. Blocking calls: run it off the event loop."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self._open = False
        self._names: dict[int, tuple[str, str]] = {}
        """index -> (uuid, name), remembered so a GPU that is lost later is still named."""

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
            sm_clock_mhz=None if sm_clock is None else int(sm_clock),
            processes=tuple(
                GpuProcess(int(p.pid), None if getattr(p, "usedGpuMemory", None) is None else int(p.usedGpuMemory))
                for p in processes
            ),
        )

    def _optional(self, call: Any, *args: Any) -> Any:
        """A reading some GPUs do not support (power on some boards, say): None instead of failing."""
        try:
            return call(*args)
        except self._nvml.NVMLError_NotSupported:
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
