"""Shared test plumbing: free loopback ports, process helpers, and ordering of disruptive tests."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.types import ASGIApp

from benchmarks.fleet import first_ephemeral_port
from dpserve.up.launcher import busy_ports
from dpserve.version import compiled_check, compiled_sources


def pytest_configure(config: pytest.Config) -> None:
    # Routers keep their batch stores under the data directory: the suite's in a folder of its own.
    if "XDG_DATA_HOME" not in os.environ:
        data = tempfile.mkdtemp(prefix="dpserve-test-data-")
        os.environ["XDG_DATA_HOME"] = data
        atexit.register(shutil.rmtree, data, ignore_errors=True)
    # A compiled module older than its source would test code the source no longer says.
    built = [p for p in (s.parent for s in compiled_sources()) for p in p.glob("*.so")]
    problem = compiled_check()
    if built and problem and os.environ.get("DPSERVE_PURE_PYTHON") != "1":
        raise pytest.UsageError(
            f"the compiled build is out of date: {problem}, or DPSERVE_PURE_PYTHON=1 for the source"
        )


def pytest_report_header(config: pytest.Config) -> str:
    pure = os.environ.get("DPSERVE_PURE_PYTHON") == "1" or compiled_check() is not None
    return "dpserve build: " + ("pure Python" if pure else f"compiled (mypyc, {len(compiled_sources())} modules)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that kill or stop the shared replicas run after everything that needs them healthy; the one
    # that stops the whole fleet runs after those; the vLLM containers last of all, once the shared fleet's
    # replicas have left the cores and the memory to them.
    items.sort(
        key=lambda item: (
            item.get_closest_marker("vllm_stack") is not None,
            item.get_closest_marker("disruptive") is not None,
            item.get_closest_marker("stops_fleet") is not None,
        )
    )


# Test ports come from below the kernel's ephemeral range: a port picked there (bind to 0) and handed to a
# process that listens minutes later can meanwhile become the source port of one of vLLM's own connections.
# A cursor, started apart per process, so no two callers here get the same port before either listens.
_PORTS_LOW, _PORTS_HIGH = 20000, max(first_ephemeral_port(), 24000)
_cursor = _PORTS_LOW + (os.getpid() * 211) % ((_PORTS_HIGH - _PORTS_LOW) // 2)


def free_port_range(count: int, start: int | None = None, stop: int | None = None) -> int:
    """The first of `count` consecutive ports, all free on loopback, none handed out before by this process.
    `start` and `stop` narrow where to look, when there is room there."""
    global _cursor
    high = stop or _PORTS_HIGH
    for first in (max(start or 0, _cursor), _cursor, _PORTS_LOW):
        for base in range(first, high - count):
            if not busy_ports(range(base, base + count)):
                _cursor = base + count
                return base
    raise RuntimeError("no free port range")


def free_port() -> int:
    return free_port_range(1)


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, log_level: str = "error") -> AsyncIterator[str]:
    """An app (the router's, say) under uvicorn on a free loopback port in this event loop; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
