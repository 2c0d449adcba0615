"""GPU telemetry in the router: /status, /metrics and /dashboard, with no GPU (these machines, real
NVML library) and with GPUs faked at the NVML boundary (mapping by hint and by process, a GPU lost
mid-run while requests stream)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pynvml
import pytest

from benchmarks.screenshot import rendered_dom, screenshot
from dpserve.config import RouterSettings
from dpserve.router.app import create_app
from tests.chromium import require_chromium
from tests.conftest import free_port, serving
from tests.fake_nvml import FakeGpu, FakeNvml, two_gpus
from tests.integration.conftest import (
    Fleet,
    RouterFactory,
    running_sim,
    start_router,
    stop_router,
)

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def in_process_router(specs: list[str], nvml: FakeNvml) -> AsyncIterator[str]:
    settings = RouterSettings(
        replicas=tuple(f"r{i}={spec}" for i, spec in enumerate(specs)),
        policy="round_robin",
        probe_interval_s=0.2,
        gpu_interval_s=0.05,
    )
    async with serving(create_app(settings, nvml=lambda: nvml)) as url:
        yield url


async def stream_chat(client: httpx.AsyncClient, url: str) -> str:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "stream": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        return "".join([chunk async for chunk in response.aiter_text()])


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_gpus_are_tied_to_replicas_and_a_lost_gpu_does_not_disturb_requests() -> None:
    nvml = two_gpus()
    with running_sim("--decode-ms-per-token", "5") as hinted, running_sim("--decode-ms-per-token", "5") as by_pid:
        # r0 is said to run on GPU 1; r1 is found on GPU 0 by its process id, as NVML lists it there.
        nvml.gpus[0].processes = [(by_pid.process.pid, 2 << 30)]
        async with in_process_router([f"{hinted.url}@gpu=1", by_pid.url], nvml) as url, httpx.AsyncClient() as client:

            async def ready() -> bool:
                return (await client.get(f"{url}/ready")).status_code == 200

            async def gpu_devices() -> list[dict[str, Any]]:
                return (await client.get(f"{url}/status")).json()["gpus"]["devices"]

            async def gpu_1_lost() -> bool:
                return (await gpu_devices())[1]["error"] == "GPU is lost"

            async def no_gpus() -> bool:
                return await gpu_devices() == []

            await until(ready)
            status = (await client.get(f"{url}/status")).json()
            assert status["gpus"]["available"] is True and status["gpus"]["reason"] is None
            assert [(g["index"], g["replica"]) for g in status["gpus"]["devices"]] == [(0, "r1"), (1, "r0")]
            r0, r1 = status["replicas"]
            assert [g["uuid"] for g in r0["gpus"]] == ["GPU-bbbb"] and [g["uuid"] for g in r1["gpus"]] == ["GPU-aaaa"]
            assert r1["gpus"][0]["utilization_gpu"] == pytest.approx(0.87)
            assert r1["model"] == "dpserve-tiny" and r1["healthy"] is True
            metrics = (await client.get(f"{url}/metrics")).text
            r1_labels = 'gpu="0",host="",replica="r1",uuid="GPU-aaaa"'
            assert 'dpserve_gpu_utilization_ratio{gpu="0",host="",replica="r1",uuid="GPU-aaaa"} 0.87' in metrics
            assert f"dpserve_gpu_memory_used_bytes{{{r1_labels}}} 6.442450944e+10" in metrics
            assert 'dpserve_gpu_power_watts{gpu="1",host="",replica="r0",uuid="GPU-bbbb"} 95.5' in metrics
            assert 'dpserve_gpu_temperature_celsius{gpu="1",host="",replica="r0",uuid="GPU-bbbb"} 41.0' in metrics
            assert 'dpserve_gpu_sm_clock_hertz{gpu="0",host="",replica="r1",uuid="GPU-aaaa"} 1.98e+09' in metrics

            # GPU 1 is lost while streams run on both replicas: every stream still completes.
            streams = [asyncio.create_task(stream_chat(client, url)) for _ in range(8)]
            await asyncio.sleep(0.03)
            nvml.gpus[1].lost = True
            bodies = await asyncio.gather(*streams)
            assert all(body.rstrip().endswith("data: [DONE]") for body in bodies)
            await until(gpu_1_lost)
            status = (await client.get(f"{url}/status")).json()
            assert [r["healthy"] for r in status["replicas"]] == [True, True]
            assert status["replicas"][0]["gpus"][0]["readable"] is False
            metrics = (await client.get(f"{url}/metrics")).text
            assert 'dpserve_gpu_up{gpu="1",host="",replica="r0",uuid="GPU-bbbb"} 0.0' in metrics
            assert 'dpserve_gpu_up{gpu="0",host="",replica="r1",uuid="GPU-aaaa"} 1.0' in metrics
            assert 'dpserve_gpu_power_watts{gpu="1"' not in metrics

            # Then the driver fails as a whole: the GPU section says why, routing carries on.
            nvml.driver_error = pynvml.NVMLError_Unknown()
            await until(no_gpus)
            assert (await client.get(f"{url}/status")).json()["gpus"]["reason"].endswith("Unknown Error")
            assert (await stream_chat(client, url)).rstrip().endswith("data: [DONE]")
            assert "dpserve_gpus 0.0" in (await client.get(f"{url}/metrics")).text
            dashboard = await client.get(f"{url}/dashboard")
            assert dashboard.status_code == 200 and dashboard.headers["content-type"].startswith("text/html")


def test_router_without_a_gpu_says_so_once_and_reports_its_replicas(fleet: Fleet) -> None:
    router = start_router(fleet.replica_urls, "least_loaded", "--gpu-interval", "0.2")
    try:
        status = httpx.get(f"{router.url}/status", timeout=5).json()
        gpus = status["gpus"]
        assert gpus["available"] is False and gpus["devices"] == []
        assert gpus["reason"].startswith("no NVIDIA GPU found: ")
        for replica, url in zip(status["replicas"], fleet.replica_urls, strict=True):
            assert replica["url"] == url and replica["healthy"] is True
            assert replica["model"] == "dpserve-tiny"
            assert {"id", "in_flight", "waiting", "running", "kv_cache_usage", "prefix_cache_hit_rate"} <= set(replica)
            assert replica["gpus"] == []
        metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
        assert "dpserve_gpus 0.0" in metrics
        assert "dpserve_gpu_utilization_ratio{" not in metrics
        time.sleep(1)  # several sampling ticks pass (0.2 s each): still one line
    finally:
        log = stop_router(router)
    assert len(re.findall(r"no NVIDIA GPU found: ", log)) == 1, log
    # `dpserve up` (the shared fleet: launcher, replicas, router in one output) says it once too.
    assert fleet.log_path.read_text(errors="replace").count("no NVIDIA GPU found: ") == 1


def test_dashboard_renders_both_replicas_in_headless_chromium(
    fleet: Fleet, router_factory: RouterFactory, tmp_path: Path
) -> None:
    require_chromium()
    router = router_factory("least_loaded")
    for _ in range(4):
        body = {"model": "dpserve-tiny", "prompt": "hello", "max_tokens": 4}
        asked = {"x-dpserve-receipt": "1"}
        assert httpx.post(f"{router.url}/v1/completions", json=body, headers=asked, timeout=60).status_code == 200
    dom = rendered_dom(f"{router.url}/dashboard", tmp_path / "profile")
    # The table body is empty in the HTML sent; these rows exist only if the page's script rendered them.
    rows = re.findall(r'<tr data-replica="(r\d)">(.*?)</tr>', dom, re.S)
    assert [rid for rid, _ in rows] == ["r0", "r1"]
    for (_, row), url in zip(rows, fleet.replica_urls, strict=True):
        assert url in row and "dpserve-tiny" in row and "healthy" in row
    served = sum(int(n) for n in re.findall(r'<td class="num">(\d+)</td>\s*<td>[^<]*</td>\s*</tr>', dom))
    assert served >= 4
    assert re.search(r'id="no-gpu">None\. no NVIDIA GPU found: ', dom)
    # The routing-quality panel: 4 receipts asked for, unscored (least_loaded predicts no cache).
    assert re.search(r"receipts <b>4</b>", dom) and '<span data-class="unscored">unscored 4</span>' in dom
    # The batches panel: none in progress on this router's own store, and what this router ran.
    assert "No batch in progress." in dom and "this router: running 0 · ran 0" in dom
    # The elastic replicas panel: the signal for the model, its inputs, and desired against ready over time.
    assert re.search(r'<div class="meta" data-scale="dpserve-tiny">dpserve-tiny: desired <b>\d+</b> · ready 2', dom)
    assert "desired (orange) and ready (blue)" in dom and "<polyline" in dom
    # It refreshed itself (every 2 s, within the 5 s of virtual time) without losing the router.
    refreshes = re.search(r'<body data-refreshes="(\d+)">', dom)
    assert refreshes is not None and int(refreshes.group(1)) >= 1
    assert 'class="stale"' not in dom
    png = screenshot(f"{router.url}/dashboard", tmp_path / "dashboard.png", tmp_path / "profile2")
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replica", "http://127.0.0.1:1@gpu="], "`@gpu=` needs a GPU index or UUID after it"),
        (
            ["--replica", "http://127.0.0.1:1", "--kv-events", "http://127.0.0.1:2=tcp://127.0.0.1:3"],
            "--kv-events names http://127.0.0.1:2, which is not one of the router's --replica URLs",
        ),
        (
            ["--replica", "http://127.0.0.1:1", "--receipts-sample", "2"],
            "argument --receipts-sample: '2' must be at most 1",
        ),
        (
            ["--replica", "http://127.0.0.1:1", "--receipts-log", "/nowhere/receipts.jsonl"],
            "--receipts-log /nowhere/receipts.jsonl: No such file or directory",
        ),
        (
            ["--replica", "http://127.0.0.1:1", "--shadow-policy", "prefix"],
            "--shadow-policy prefix: a shadow reads load or KV blocks only",
        ),
        (["--replica", "http://127.0.0.1:1", "--shadow-policy", "fastest"], "unknown policy 'fastest'"),
    ],
)
def test_bad_router_flags_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    command = [sys.executable, "-m", "dpserve", "router", "--port", str(free_port()), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    # One line that says it: argparse's `error:` line after the usage (a flag's value checked as it is parsed),
    # or the router's own line (a check across flags, made as the router is built).
    last = done.stderr.strip().splitlines()[-1]
    assert message in last and (last.startswith("dpserve router: ") or "error: router: " in last), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 or "usage: dpserve" in done.stderr


async def test_a_tensor_parallel_replicas_gpus_show_as_one_and_either_drains_it() -> None:
    """`--replica URL@gpu=0,1`, as `dpserve up --tensor-parallel-size 2` writes it: /status lists both GPUs
    under the replica and their reading combined; one of them throttled drains the whole replica."""
    gib = 1 << 30
    nvml = FakeNvml(
        [
            FakeGpu("GPU-0", util_gpu=80, memory_used=60 * gib),
            FakeGpu("GPU-1", util_gpu=20, memory_used=58 * gib),
            FakeGpu("GPU-2", util_gpu=5, memory_used=10 * gib),
            FakeGpu("GPU-3", util_gpu=7, memory_used=11 * gib),
        ]
    )
    with running_sim() as wide, running_sim() as other:
        specs = [f"{wide.url}@gpu=0,1", f"{other.url}@gpu=2,3"]
        async with in_process_router(specs, nvml) as url, httpx.AsyncClient() as client:

            async def status() -> dict[str, Any]:
                return (await client.get(f"{url}/status")).json()

            async def ready() -> bool:
                return all(r["healthy"] and r["gpus"] for r in (await status())["replicas"])

            await until(ready)
            r0, r1 = (await status())["replicas"]
            assert [g["index"] for g in r0["gpus"]] == [0, 1] and [g["index"] for g in r1["gpus"]] == [2, 3]
            assert r0["gpu"]["gpus"] == 2 and r0["gpu"]["utilization_gpu"] == pytest.approx(0.8)
            assert r0["gpu"]["memory_used_bytes"] == 118 * gib
            metrics = (await client.get(f"{url}/metrics")).text
            assert 'dpserve_replica_gpu_utilization_ratio{replica="r0"} 0.8' in metrics
            assert 'dpserve_replica_gpus{replica="r1"} 2.0' in metrics

            nvml.gpus[1].throttle_reasons = pynvml.nvmlClocksEventReasonHwSlowdown

            async def r0_degraded() -> bool:
                return (await status())["replicas"][0]["state"] == "degraded"

            await until(r0_degraded, 10)
            r0, r1 = (await status())["replicas"]
            assert r1["state"] == "healthy"
            answered = [
                (await client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})).headers[
                    "x-dpserve-replica"
                ]
                for _ in range(6)
            ]
            assert set(answered) == {"r1"}  # round robin, yet none to the replica on the throttled GPU
