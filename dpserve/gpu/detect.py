"""How many NVIDIA GPUs this host has, through NVML (nvidia-ml-py, imported as pynvml)."""

from __future__ import annotations


def count_nvidia_gpus() -> tuple[int, str | None]:
    """(count, None), or (0, a one-line reason) when there is no GPU or no NVML library."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML raises its own error types, and ImportError when absent
        return 0, f"no NVIDIA GPU found: {exc}"
    if count == 0:
        return 0, "no NVIDIA GPU found: NVML reports 0 devices"
    return count, None
