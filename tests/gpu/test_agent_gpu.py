"""On a real NVIDIA GPU: the health readings NVML gives, and `dpserve agent` serving them, with the busy
replica's GPU process tied to the port its parent listens on; a router reading the agent ties the GPU to
that replica. Skipped without a GPU (marker `gpu`)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dpserve.gpu.health import GpuHealthTracker, throttle_names
from dpserve.gpu.nvml import NvmlReader, count_nvidia_gpus, load_nvml
from tests.conftest import free_port

pytestmark = pytest.mark.gpu

GPUS, WHY_NONE = count_nvidia_gpus()
if not GPUS:
    pytest.skip(f"needs a GPU: {WHY_NONE}", allow_module_level=True)


def test_health_readings_on_a_real_gpu_are_read_or_plainly_unsupported() -> None:
    reader = NvmlReader(load_nvml())
    reader.open()
    try:
        gpus = reader.read()
        time.sleep(0.5)
        again = reader.read()
    finally:
        reader.close()
    tracker = GpuHealthTracker()
    for gpu, later in zip(gpus, again, strict=True):
        print(
            f"GPU {gpu.index} {gpu.name}: xid={later.xid_errors} ecc_uncorrected={later.ecc_uncorrected} "
            f"throttle={throttle_names(later.throttle_reasons or 0)} pcie=gen{later.pcie_gen}/{later.pcie_gen_max} "
            f"x{later.pcie_width}/{later.pcie_width_max} pages_pending={later.pages_pending}"
        )
        assert later.readable
        # A data-centre GPU reports these; None would mean the reader lost them.
        assert later.throttle_reasons is not None and later.pcie_width_max and later.pcie_gen_max
        tracker.update(gpu.uuid, gpu, 0.0)
        print("verdict:", tracker.update(later.uuid, later, 0.5))


@pytest.fixture(scope="module")
def agent() -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "dpserve", "agent", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen([*command, "--interval", "0.5", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def test_the_agent_serves_real_gpus_and_ties_a_busy_process_to_its_port(agent: str) -> None:
    pytest.importorskip("torch", reason="the GPU load is made with PyTorch")
    port = free_port()
    replica = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("gpu_replica.py")), str(port), "60"], stdout=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 90
        listening = f"127.0.0.1:{port}"
        while True:
            body = httpx.get(f"{agent}/gpus", timeout=5).json()
            held = [g for g in body["gpus"] for p in g["processes"] if listening in p["listens"]]
            if held:
                break
            assert replica.poll() is None and time.monotonic() < deadline, f"no GPU process listens on {listening}"
            time.sleep(0.5)
        print(body)
        metrics = httpx.get(f"{agent}/metrics", timeout=5).text
        print("\n".join(line for line in metrics.splitlines() if line.startswith("DCGM_FI_DEV_")))
        assert body["unavailable"] is None and len(body["gpus"]) == GPUS
        assert f'UUID="{held[0]["uuid"]}"' in metrics and "DCGM_FI_DEV_GPU_UTIL{" in metrics
    finally:
        replica.terminate()
        replica.wait(10)
