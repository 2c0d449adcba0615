"""The files one streamed chat request runs through in the router, in the order it first enters them.

Starts a `dpserve sim` replica, serves the router's app in this process (uvicorn, the router's own HTTP
protocol), sends one streamed chat completion to warm it up, then a second with a profiler on, and prints
each dpserve file the second one entered, with its functions and the dpserve files that called into it (the
event loop's callbacks, from outside dpserve, are not listed): a request that walks one way is called
from the file before it on its path, and calls back up nowhere.

    python -m benchmarks.request_path [--policy kv_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import httpx
import uvicorn

import dpserve
from benchmarks.fleet import child_env, spawn, stop_all, wait_ok
from benchmarks.report import format_table
from dpserve.config import RouterSettings
from dpserve.router.app import create_app
from dpserve.router.http.protocol import bounded_protocol

PACKAGE = Path(dpserve.__file__).resolve().parent
CHAT = {
    "model": "dpserve-tiny",
    "messages": [{"role": "user", "content": "walk me through the router, one file at a time"}],
    "max_tokens": 8,
    "stream": True,
}


@dataclass
class Visits:
    """Which dpserve files ran, in first-entry order, and the functions called in each."""

    order: list[str] = field(default_factory=list)
    functions: dict[str, list[str]] = field(default_factory=dict)
    callers: dict[str, list[str]] = field(default_factory=dict)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = _dpserve_file(frame)
        if name is None or not _on_the_request():
            return
        if frame.f_code.co_name == "__init__" and dataclasses.is_dataclass(frame.f_locals.get("self")):
            # Making a value object is not a step into its file: the __init__ the dataclass decorator makes
            # never showed here (its code is `<string>`'s); the per-request ones now write theirs out.
            return
        if name not in self.functions:
            self.order.append(name)
            self.functions[name] = []
            self.callers[name] = []
        function = frame.f_code.co_qualname
        if function not in self.functions[name]:
            self.functions[name].append(function)
        caller = _dpserve_file(frame.f_back) if frame.f_back is not None else None
        if caller is not None and caller != name and caller not in self.callers[name]:
            self.callers[name].append(caller)


REQUEST_TASKS = frozenset({"ProxiedCycle.run_asgi", "RequestResponseCycle.run_asgi", "_Exchange._watch_disconnect"})
"""The tasks a request runs in: the router's protocol's for a proxied path (uvicorn's for the others), the
router's watching for the client leaving."""


def _on_the_request() -> bool:
    """A call in one of the request's tasks, or in a callback outside any task (the protocols reading the
    sockets); not a background task's that happened to run meanwhile (a probe, the held-request watch)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no loop running in this thread
        return True
    if task is None:
        return True
    coro = task.get_coro()
    return getattr(coro, "__qualname__", "") in REQUEST_TASKS


def _dpserve_file(frame: FrameType) -> str | None:
    path = Path(frame.f_code.co_filename)
    return str(path.relative_to(PACKAGE.parent)) if path.is_relative_to(PACKAGE) else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def trace_one_request(policy: str) -> Visits:
    sim_port, kv_port, router_port = free_port(), free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    argv = [sys.executable, "-m", "dpserve", "sim", "--port", str(sim_port), "--speed", "0"]
    argv += ["--kv-events", f"tcp://127.0.0.1:{kv_port}", "--log-level", "warning"]
    sim = spawn(argv, None, child_env())
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ok(session, f"{sim_url}/v1/models", 60, sim)
        settings = RouterSettings(
            replicas=(sim_url,),
            policy=policy,
            kv_events=(f"{sim_url}=tcp://127.0.0.1:{kv_port}",) if policy == "kv_aware" else (),
            tokenizer="remote",
            gpu_interval_s=0,
            probe_interval_s=60,
        )
        app = create_app(settings)
        protocol = bounded_protocol(settings.max_header_bytes, app.proxied())  # as `dpserve router` serves
        config = uvicorn.Config(app, host="127.0.0.1", port=router_port, http=protocol, log_level="error")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{router_port}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as client:
            await _stream(client, url)  # warm: connections, caches, the tokenizer
            visits = Visits()
            sys.setprofile(visits.profile)
            threading.setprofile(visits.profile)
            try:
                await _stream(client, url)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
        server.should_exit = True
        await task
        return visits
    finally:
        stop_all([sim], 5)


async def _stream(client: httpx.AsyncClient, url: str) -> None:
    # With its receipt, as a sampled request gets one: the walk includes what a receipt costs.
    async with client.stream("POST", url, json=CHAT, headers={"x-dpserve-receipt": "1"}) as response:
        response.raise_for_status()
        async for _ in response.aiter_bytes():
            pass


def report(visits: Visits, policy: str) -> str:
    number = {name: str(n) for n, name in enumerate(visits.order, 1)}
    rows = [
        (number[name], name, " ".join(number[c] for c in visits.callers[name]) or "-", len(visits.functions[name]))
        for name in visits.order
    ]
    table = format_table(("#", "file", "called from", "functions"), rows)
    functions = "\n".join(f"  {number[name]}: {', '.join(visits.functions[name])}" for name in visits.order)
    return (
        f"one streamed chat completion through the router, policy {policy}:\n{table}\n"
        f"{len(visits.order)} files\nfunctions, by file:\n{functions}"
    )


def trace_in_source(policy: str) -> Visits:
    """`trace_one_request` in a process of its own that runs the source (DPSERVE_PURE_PYTHON=1): a profiler
    sees no compiled function, and the walk is the source's, the same in either build."""
    program = (
        "import asyncio, dataclasses, json, sys; from benchmarks.request_path import trace_one_request; "
        "print(json.dumps(dataclasses.asdict(asyncio.run(trace_one_request(sys.argv[1])))))"
    )
    env = {**child_env(), "DPSERVE_PURE_PYTHON": "1"}
    done = subprocess.run(
        [sys.executable, "-c", program, policy],
        env=env,
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"tracing a request failed: {done.stderr[-2000:]}")
    return Visits(**json.loads(done.stdout.splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.request_path", description=__doc__)
    parser.add_argument("--policy", default="least_loaded")
    args = parser.parse_args(argv)
    started = time.monotonic()
    visits = trace_in_source(args.policy)
    print(report(visits, args.policy))
    print(f"({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
