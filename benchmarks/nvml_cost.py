"""What the router's GPU sampling costs on a real GPU: opening NVML once, then one reading of every GPU (all
the fields `dpserve_gpu_*` export, with each GPU's processes), as `GpuSampler.sample_once` does each
`--gpu-interval`.

    python -m benchmarks.nvml_cost [--readings 2000] [--out FILE]

Prints the GPUs, the open's time and the readings' p50/p99/max in ms; with --out, writes the same there.
Exits 2 without a GPU (nothing to measure), 1 when a reading failed or a figure is nonsense (0 GPUs read, a
time of 0 or below).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.stats import percentile
from dpserve.gpu.nvml import Nvml, NvmlUnavailable, load_nvml, open_reader


def measure(readings: int, load: Callable[[], Nvml] = load_nvml) -> list[str]:
    """The process's first open (the library loaded then, as in a router that starts), then the readings;
    NvmlUnavailable without a GPU."""
    started = time.perf_counter()
    reader = open_reader(load)
    open_ms = (time.perf_counter() - started) * 1000
    try:
        times, gpus = [], 0
        for _ in range(readings):
            started = time.perf_counter()
            samples = reader.read()
            times.append((time.perf_counter() - started) * 1000)
            gpus = len(samples)
            if any(sample.error for sample in samples):
                raise SystemExit(f"a reading failed: {[sample.error for sample in samples if sample.error]}")
    finally:
        reader.close()
    if gpus == 0 or open_ms <= 0 or min(times) <= 0:
        raise SystemExit(f"nonsense: {gpus} GPUs read, open {open_ms} ms, fastest reading {min(times)} ms")
    return [
        f"host: {platform.node()} {platform.machine()}, Python {platform.python_version()}",
        f"GPUs read: {gpus}",
        f"open NVML: {open_ms:.2f} ms (once)",
        f"one reading of every GPU, {readings} readings: p50 {statistics.median(times):.3f} ms, "
        f"p99 {percentile(sorted(times), 99):.3f} ms, max {max(times):.3f} ms",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nvml_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--readings", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        lines = measure(max(1, args.readings))
    except NvmlUnavailable as exc:
        print(f"no GPU to measure: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
