"""Shared test plumbing: free loopback ports, process helpers, and ordering of disruptive tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.types import ASGIApp

from dpserve.up.launcher import busy_ports


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that kill or stop the shared replicas run after everything that needs them healthy; the one
    # that stops the whole fleet runs last of all.
    items.sort(
        key=lambda item: (
            item.get_closest_marker("disruptive") is not None,
            item.get_closest_marker("stops_fleet") is not None,
        )
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(count: int, start: int = 20000, stop: int = 60000) -> int:
    """The first of `count` consecutive ports that are all free on loopback."""
    for base in range(start, stop, count + 7):
        if not busy_ports(range(base, base + count)):
            return base
    raise RuntimeError("no free port range")


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
