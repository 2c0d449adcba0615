"""The router app's own CPU per request, without uvicorn, a client or wrk sharing the machine's 2 cores.

Starts a `dpserve sim` (its own process, so its CPU is not counted), runs the router's app in this
process with its lifespan, and calls it as an ASGI app for N sequential completions (JSON or streamed);
prints this process's CPU time and the wall time per request. Run it against two checkouts, alternating,
to compare versions of the hot path with far less noise than `dpserve bench overhead`:

    python -m benchmarks.app_cpu json     # or sse; --requests N
    cd OTHER_CHECKOUT && PYTHONPATH=. python THIS_CHECKOUT/benchmarks/app_cpu.py json

It imports nothing else from the benchmarks, and of dpserve only `create_app` and the router's settings
class, so it runs as a plain script against older checkouts too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import sys
import time
from typing import Any

import httpx

from dpserve.router.app import create_app

try:
    from dpserve.config import RouterSettings as Settings
except ImportError:  # a checkout from before settings were grouped per command
    from dpserve.config import Settings  # type: ignore[attr-defined,no-redef]

WARMUP = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def measure(requests: int, stream: bool, tokens: int = 16) -> tuple[float, float]:
    """(CPU µs, wall µs) per request of the router app in this process."""
    port = free_port()
    argv = [sys.executable, "-m", "dpserve", "sim", "--port", str(port), "--speed", "0", "--log-level", "warning"]
    sim = await asyncio.create_subprocess_exec(*argv)
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        settings = Settings(
            replicas=(f"http://127.0.0.1:{port}",), policy="least_loaded", gpu_interval_s=0, probe_interval_s=60
        )
        app = create_app(settings)
        body = {"model": "dpserve-tiny", "prompt": "hello", "max_tokens": tokens if stream else 4, "stream": stream}
        raw = json.dumps(body).encode()
        async with app.router.lifespan_context(app):
            for _ in range(WARMUP):
                await _one(app, raw)
            gc.collect()
            gc.freeze()  # as the router does once it serves
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(requests):
                await _one(app, raw)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        return cpu / requests * 1e6, wall / requests * 1e6
    finally:
        sim.terminate()
        await sim.wait()


async def _one(app: Any, body: bytes) -> None:
    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await asyncio.sleep(3600)  # the client stays until the answer is sent (the task is cancelled then)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await app(scope, receive, send)
    if sent[0]["status"] != 200:
        raise RuntimeError(f"the router answered {sent[0]['status']}: {sent[1:2]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.app_cpu", description=__doc__)
    parser.add_argument("mode", choices=("json", "sse"))
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=16, help="sse: events per streamed answer (16)")
    args = parser.parse_args(argv)
    cpu, wall = asyncio.run(measure(args.requests, args.mode == "sse", args.tokens))
    print(f"{args.mode}: router app CPU {cpu:.1f} us/request, wall {wall:.1f} us/request ({args.requests} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
