"""`benchmarks/app_cpu.py` drives the real router app over a real sim and reports per-request figures."""

from __future__ import annotations

import pytest

from benchmarks.app_cpu import measure

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("stream", [False, True])
async def test_app_cpu_measures_requests_that_were_answered(stream: bool) -> None:
    cpu_us, wall_us = await measure(50, stream)
    # Every request got a 200 (measure raises otherwise); a request costs CPU and takes at least that long.
    assert 0 < cpu_us <= wall_us * 1.05
