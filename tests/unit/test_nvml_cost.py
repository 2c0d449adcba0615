"""`python -m benchmarks.nvml_cost` over the fake NVML (the real one needs a GPU: run on the lent machine)."""

from __future__ import annotations

import pytest

from benchmarks.nvml_cost import measure
from tests.fake_nvml import two_gpus


def test_every_gpu_is_read_and_the_times_are_reported() -> None:
    lines = measure(50, two_gpus)
    assert "GPUs read: 2" in lines
    assert any(line.startswith("open NVML: ") and line.endswith(" ms (once)") for line in lines)
    assert any(line.startswith("one reading of every GPU, 50 readings: p50 ") for line in lines)


def test_a_failed_reading_fails_the_run() -> None:
    nvml = two_gpus()
    nvml.gpus[1].lost = True
    with pytest.raises(SystemExit, match="a reading failed"):
        measure(5, lambda: nvml)
