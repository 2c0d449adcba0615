"""What the benchmarks share for the fleets they start: free loopback ports, spawning with a log, waiting for
an endpoint to answer, starting a fleet with `dpserve up`, the routers' command lines (dpserve's, vllm-router's
and sglang-router's), the CPU time a process tree used, stopping children, and progress lines."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import psutil

from dpserve.config import RouterSettings
from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.up.launcher import busy_ports
from dpserve.up.plan import RouterTarget, router_flags
from dpserve.up.process import terminate

HOST = "127.0.0.1"  # everything the benchmarks start listens on loopback only
ROUTERS = ("dpserve", "vllm-router", "sglang-router")

BENCHMARKS = Path(__file__).resolve().parent
CHECKOUT = BENCHMARKS.parent
"""The repository checkout the benchmarks run from: they are the package `benchmarks/` at its top, beside
`dpserve/` and `loadtests/`."""


def child_env() -> dict[str, str]:
    """The environment for a child that runs a benchmark module (`python -m benchmarks.NAME`): this checkout
    first on PYTHONPATH, so the child imports the benchmarks and dpserve as this process did, from any directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
    return env


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def first_ephemeral_port() -> int:
    """Where the ports the kernel hands to outgoing connections begin (Linux's default: 32768)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_block(count: int, rng: random.Random) -> int:
    """The first of `count` consecutive free loopback ports, below the ephemeral range: a port found free
    there can be taken by any outgoing connection before the process meant for it binds (seen in CI: a
    soak router exited with "address already in use")."""
    high = first_ephemeral_port()
    if high - count <= 20000:  # an unusual range: take what is free anywhere
        high = 60000
    for _ in range(200):
        start = rng.randrange(20000, high - count)
        if not busy_ports(range(start, start + count)):
            return start
    raise RuntimeError("no block of free ports found")


def spawn(
    command: list[str], log_path: Path | None, env: dict[str, str], cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """`cwd`: where `python -m` looks first for the package (another commit's worktree, say)."""
    if log_path is None:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)


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
            head = process.args[:4] if isinstance(process.args, list) else process.args
            raise RuntimeError(f"{head!r} exited with {process.returncode} while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


@dataclass(frozen=True)
class UpPorts:
    """Where `dpserve up` puts `count` replicas: replicas, then their KV-event ports, then the router, in
    one block of free loopback ports."""

    count: int
    base: int

    @classmethod
    def free(cls, count: int) -> UpPorts:
        return cls(count, port_block(2 * count + 1, random.Random()))

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.base + 2 * self.count}"

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.base + i}" for i in range(self.count)]

    @property
    def kv_endpoints(self) -> list[str]:
        return [f"tcp://127.0.0.1:{self.base + self.count + i}" for i in range(self.count)]

    def command(self, run_dir: Path, policy: str) -> list[str]:
        """`dpserve up` on these ports; the caller adds the replicas (`--sim N` or `--replicas N`)."""
        command = [sys.executable, "-m", "dpserve", "up", "--port", str(self.base + 2 * self.count)]
        command += ["--base-port", str(self.base), "--kv-events-base-port", str(self.base + self.count)]
        # Other gateways and the benchmarks' own clients call the replicas directly, without a key.
        command.append("--no-replica-key")
        return [*command, "--run-dir", str(run_dir), "--policy", policy, "--log-level", "warning"]


async def start_up(
    session: aiohttp.ClientSession,
    ports: UpPorts,
    command: list[str],
    log_path: Path,
    env: dict[str, str],
    timeout_s: float,
) -> subprocess.Popen[bytes]:
    """Run `command` (a `dpserve up`) until its router and every replica answer; stopped if they never do."""
    process = spawn(command, log_path, env)
    try:
        await wait_ok(session, f"{ports.router_url}/ready", timeout_s, process)
        # /ready answers once one replica is up: wait for all of them.
        for url in ports.replica_urls:
            await wait_ok(session, f"{url}/v1/models", timeout_s, process)
    except BaseException:
        terminate(process, 60)
        raise
    return process


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def stop_all(processes: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Stop every child, the last started first (a router before its replicas)."""
    for process in reversed(processes):
        terminate(process, grace_s)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM unwinds like Ctrl-C, so every `finally` stops the children it
    started. Signal handlers can only be set from the main thread: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- the routers -------------------------------------------------------------------------------------


def bench_tool(name: str) -> str | None:
    """A program of the bench extra (vllm-router, py-spy): the one installed beside this Python (its venv, the
    version pinned in pyproject.toml) first, then one on PATH; None when there is neither."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def router_command(
    router: str,
    policy: str,
    replicas: Sequence[str],
    port: int,
    *,
    kv_events: Sequence[str] = (),
    tokenizer: str | None = None,
    settings: Mapping[str, Any] | None = None,
    extra: Sequence[str] = (),
    block_size: int = 16,
    engines: int = 1,
) -> list[str]:
    """One router (`router`, of ROUTERS) with `policy` over `replicas` (base URLs), listening on HOST:`port`.

    `kv_events`: each replica's KV-event endpoint, in the same order. dpserve subscribes to them all
    (`--kv-events`); vllm-router only with its kv_aware policy (`--kv-event-source`, with the tiny model's name
    and `block_size`). dpserve's flags are `dpserve up`'s own (`dpserve.up.plan.router_flags`), from RouterSettings
    with `settings` (field: value) over the defaults, at log level warning; `extra` comes last, so it wins. The
    Rust routers also get `port + 1` for Prometheus (sglang-router panics with "Address already in use" when
    two of anything share its default). `engines`: each replica is a vLLM data-parallel server of that many
    engines (`URL@dp=N`), which dpserve routes one by one (the Rust routers see each server as one worker)."""
    if router == "dpserve":
        values = {"policy": policy, "host": HOST, "port": port, "log_level": "warning", **(settings or {})}
        targets = [
            RouterTarget(url, None, events, engines=engines)
            for url, events in zip(replicas, kv_events or [""] * len(replicas), strict=True)
        ]
        flags = router_flags(RouterSettings(**values), targets, tokenizer, events=bool(kv_events))
        return [sys.executable, "-m", "dpserve", "router", *flags, *extra]
    if router == "vllm-router":
        command = [bench_tool("vllm-router") or "vllm-router"]
    elif router == "sglang-router":
        command = [sys.executable, "-m", "sglang_router.launch_router"]
    else:
        raise ValueError(f"unknown router {router!r}, not one of {ROUTERS}")
    command += ["--worker-urls", *replicas, "--policy", policy, "--host", HOST, "--port", str(port)]
    command += ["--prometheus-port", str(port + 1), "--log-level", "error"]
    if router == "vllm-router" and policy == "kv_aware" and kv_events:
        for url, endpoint in zip(replicas, kv_events, strict=True):
            command += ["--kv-event-source", f"{url}={endpoint}"]
        command += ["--kv-event-model", TINY_MODEL_NAME, "--kv-event-block-size", str(block_size)]
    return [*command, *extra]


# -- measuring processes -----------------------------------------------------------------------------


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    """User + system CPU seconds so far of these processes and of all their descendants (recursively: a
    router's or a replica's workers, Locust's worker processes), read now to the nanosecond. A process or child
    that has exited is left out, so take the difference of two readings over a window in which the tree's
    members stay alive."""
    total = 0.0
    for process in processes:
        try:
            family = [process, *process.children(recursive=True)]
        except psutil.Error:
            continue
        for member in family:
            with contextlib.suppress(psutil.Error):
                total += process_cpu_seconds(member)
    return total


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def process_cpu_seconds(process: psutil.Process) -> float:
    """One process's CPU seconds, all its threads (exited ones too), from its CPU-time clock: the kernel's
    tick counts (psutil's `cpu_times`) move in steps of 10 ms, which a dozen tiny requests or an idle router's
    two seconds never fill (the cost and scale smoke tests read 0.0 from them in CI)."""
    if _LIBC is not None:
        clock = ctypes.c_int()
        if _LIBC.clock_getcpuclockid(process.pid, ctypes.byref(clock)) == 0:
            with contextlib.suppress(OSError):  # exited since
                return time.clock_gettime(clock.value)
    times = process.cpu_times()
    return float(times.user + times.system)


def relative_source_paths(text: str, checkout: Path = CHECKOUT) -> str:
    """A profile's paths without this machine's: the checkout's files relative to it (`dpserve/router/relay.py`),
    installed packages from `site-packages/`, the standard library from `python3.X/`, and the interpreter in a
    process's command line as `python`."""
    path = r"[^\"\s()\\]*"  # up to a quote (JSON's, escaped or not), a space or a bracket
    text = re.sub(path + r"/site-packages/", "site-packages/", text)
    text = re.sub(path + r"/lib/(python3\.\d+)/", r"\1/", text)
    text = re.sub(path + r"/bin/(python[\d.]*)(?=[\s\\\"])", r"\1", text)
    return text.replace(f"{checkout}{os.sep}", "")


async def reset_prefix_caches(session: aiohttp.ClientSession, urls: Iterable[str]) -> None:
    """Every replica's prefix cache emptied (`POST /reset_prefix_cache`, which vLLM serves with
    VLLM_SERVER_DEV_MODE=1; a data-parallel server resets all its engines)."""
    for url in urls:
        for _ in range(100):
            try:
                async with session.post(f"{url}/reset_prefix_cache") as resp:
                    await resp.read()
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass  # a kept-alive connection the replica closed as the POST went out: sent again on a new one
            await asyncio.sleep(0.2)  # a replica still finishing a request refuses the reset
        else:
            raise RuntimeError(f"{url}/reset_prefix_cache kept failing (is VLLM_SERVER_DEV_MODE set?)")
