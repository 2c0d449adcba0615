"""What the benchmarks share for their child processes: free loopback ports, spawning with a log,
waiting for an endpoint to answer, and progress lines."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from pathlib import Path

import aiohttp

from dpserve.replicas.launcher import busy_ports


def port_block(count: int, rng: random.Random) -> int:
    """The first of `count` consecutive free loopback ports."""
    for _ in range(200):
        start = rng.randrange(20000, 60000 - count)
        if not busy_ports(range(start, start + count)):
            return start
    raise RuntimeError("no block of free ports found")


def spawn(command: list[str], log_path: Path | None, env: dict[str, str]) -> subprocess.Popen[bytes]:
    if log_path is None:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


async def get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def wait_ok(session: aiohttp.ClientSession, url: str, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while await get_text(session, url) is None:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:4]} exited with {process.returncode} while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
