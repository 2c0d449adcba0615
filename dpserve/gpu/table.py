"""`dpserve gpus`: one reading of every GPU, printed as a table (or JSON) with what runs on each."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import psutil

from dpserve.gpu.nvml import Nvml, NvmlUnavailable, load_nvml, open_reader
from dpserve.gpu.sample import GpuSample
from dpserve.text_table import format_table

GIB = 2**30
COMMAND_WIDTH = 80


def describe_process(pid: int) -> str:
    """The process's command line with paths cut to their last part, shortened; `?` for a process
    this host cannot see (NVML's pids may belong to another container or user)."""
    try:
        process = psutil.Process(pid)
        parts = [part.rsplit("/", 1)[-1] if part.startswith("/") else part for part in process.cmdline()]
        command = " ".join(parts) or process.name()
    except psutil.Error:
        return "?"
    return command if len(command) <= COMMAND_WIDTH else command[: COMMAND_WIDTH - 3] + "..."


def _value(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_gpus(gpus: Sequence[GpuSample], describe: Callable[[int], str] = describe_process) -> str:
    header = ("GPU", "name", "util", "mem util", "memory used / total", "power", "temp", "SM clock")
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    for gpu in gpus:
        if not gpu.readable:
            rows.append((str(gpu.index), gpu.name or "?", "cannot be read:", gpu.error or "", "", "", "", ""))
            continue
        memory = "-"
        if gpu.memory_used_bytes is not None and gpu.memory_total_bytes is not None:
            memory = f"{gpu.memory_used_bytes / GIB:.1f} / {gpu.memory_total_bytes / GIB:.1f} GiB"
        power = _value(gpu.power_watts, ".0f") + " W"
        if gpu.power_limit_watts is not None:
            power += f" / {gpu.power_limit_watts:.0f} W"
        rows.append(
            (
                str(gpu.index),
                gpu.name,
                _value(None if gpu.utilization_gpu is None else 100 * gpu.utilization_gpu, ".0f") + " %",
                _value(None if gpu.utilization_memory is None else 100 * gpu.utilization_memory, ".0f") + " %",
                memory,
                power,
                _value(gpu.temperature_celsius, ".0f") + " C",
                _value(gpu.sm_clock_mhz, "d") + " MHz",
            )
        )
        notes.append(f"GPU {gpu.index}  {gpu.uuid}")
        if not gpu.processes:
            notes.append("  no processes")
        for process in gpu.processes:
            used = "-" if process.used_memory_bytes is None else f"{process.used_memory_bytes / GIB:.1f} GiB"
            notes.append(f"  pid {process.pid:>7}  {used:>9}  {describe(process.pid)}")
    return "\n".join([format_table(header, rows), "", *notes])


def print_gpus(as_json: bool = False, load: Callable[[], Nvml] = load_nvml) -> int:
    """Exit status 0 with the table, or 1 with the single line `no NVIDIA GPU found: ...`."""
    try:
        reader = open_reader(load)
    except NvmlUnavailable as exc:
        print(exc)
        return 1
    try:
        gpus = reader.read()
    finally:
        reader.close()
    if as_json:
        print(json.dumps([gpu.to_dict() for gpu in gpus], indent=2))
    else:
        print(format_gpus(gpus))
    return 0
