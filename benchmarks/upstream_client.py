"""Benchmark: which HTTP client should the router use on its hot path?

Starts, each in its own process on loopback:
  * a fast fake OpenAI backend (aiohttp.web): ``POST /v1/completions`` answers a small fixed
    JSON completion, or 32 SSE chunks plus ``data: [DONE]`` when ``"stream": true``;
  * minimal FastAPI relays on uvicorn (uvloop, httptools, no access log) that forward the body
    to the backend through one shared client: ``httpx.AsyncClient`` or ``aiohttp.ClientSession``;
  * a load generator: ``wrk`` (with a Lua script for the POST body) when it is on PATH,
    otherwise a closed-loop aiohttp generator.

For every target (backend directly, each relay) and mode (JSON, SSE) it measures C connections
(throughput) and 1 connection (added latency), prints a table and writes it as CSV.

    python -m benchmarks.upstream_client [--duration S] [--connections C] [--out DIR]

Every process shares the machine's cores, so the figures compare clients against each other
on the same box; they are not absolute capacities.
"""

import argparse
import asyncio
import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from benchmarks.fleet import child_env
from benchmarks.loadgen import die_with_parent, python_command, run_all, write_wrk_script, wrk_command
from benchmarks.report import format_table, shown, write_csv
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE

HOST = "127.0.0.1"  # loopback only: nothing here should be reachable from outside
PATH = "/v1/completions"
N_STREAM_CHUNKS = 32
READY_TIMEOUT_S = 30.0

# Targets: the backend itself (the ceiling), then one relay per client under test.
# "aiohttp-chunked" (streaming relayed with iter_chunked instead of iter_any) is opt-in.
DEFAULT_TARGETS = ("direct", "httpx", "aiohttp", "httpcore", "dpserve")
RELAY_KINDS = ("httpx", "aiohttp", "aiohttp-chunked", "httpcore", "dpserve")
MODES = ("json", "sse")

COMPLETION = {
    "id": "cmpl-bench",
    "object": "text_completion",
    "created": 0,
    "model": "bench",
    "choices": [{"index": 0, "text": " hello world", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}
COMPLETION_BYTES = orjson.dumps(COMPLETION)


def _sse_chunk(i: int) -> bytes:
    # Shaped like a vLLM completion chunk so relays handle realistic sizes (~170 bytes each).
    chunk = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "text": f" tok{i}", "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


SSE_CHUNKS = [_sse_chunk(i) for i in range(N_STREAM_CHUNKS)]
SSE_DONE = b"data: [DONE]\n\n"
SSE_BODY = b"".join(SSE_CHUNKS) + SSE_DONE

# Request bodies: no quotes or backslashes beyond JSON's, so they embed as Lua string literals.
REQUEST_BODIES = {
    "json": b'{"model":"bench","prompt":"Hello, my name is","max_tokens":32,"stream":false}',
    "sse": b'{"model":"bench","prompt":"Hello, my name is","max_tokens":32,"stream":true}',
}
FORWARD_HEADERS = {"content-type": "application/json"}


# ---------------------------------------------------------------------------------------------
# Child-process plumbing


def _watch_parent() -> None:
    """Exit when the parent dies, even by SIGKILL, so no server outlives the benchmark."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _listen_socket() -> socket.socket:
    # The child binds port 0 itself and reports the port: no race for a "free" port.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen(4096)
    sock.set_inheritable(False)
    return sock


def _announce_port(sock: socket.socket) -> None:
    sys.stdout.write(f"PORT {sock.getsockname()[1]}\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# The fake backend


def run_backend() -> None:
    import uvloop
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=COMPLETION_BYTES, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        # One write per event, as a token-by-token engine would do.
        try:
            await resp.prepare(request)
            for chunk in SSE_CHUNKS:
                await resp.write(chunk)
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the load generator hung up at the end of a run: not worth a traceback
        return resp

    async def serve() -> None:
        app = web.Application()
        app.router.add_post(PATH, completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = _listen_socket()
        await web.SockSite(runner, sock).start()
        _announce_port(sock)
        await asyncio.Event().wait()

    uvloop.run(serve())


# ---------------------------------------------------------------------------------------------
# The relays: deliberately minimal, so the difference is the client and nothing else


def build_relay_app(kind: str, backend_url: str) -> Any:
    # No `from __future__ import annotations` in this module: FastAPI must see the real
    # `Request` class on these locally defined endpoints, not a string it cannot resolve.
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import StreamingResponse
    from starlette.background import BackgroundTask

    url = backend_url + PATH
    state: dict[str, Any] = {}

    if kind == "httpx":
        import httpx

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            # Generous limits so the pool itself is not what we measure as a cap.
            limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096, keepalive_expiry=60)
            async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0)) as client:
                state["client"] = client
                yield

        app = FastAPI(lifespan=lifespan)

        @app.post(PATH)
        async def relay_httpx(request: Request) -> Response:
            client: httpx.AsyncClient = state["client"]
            body = await request.body()
            stream = bool(orjson.loads(body).get("stream"))  # the router parses the body anyway
            upstream = await client.send(
                client.build_request("POST", url, content=body, headers=FORWARD_HEADERS), stream=True
            )
            media = upstream.headers.get("content-type")
            if not stream:
                content = await upstream.aread()
                await upstream.aclose()
                return Response(content, status_code=upstream.status_code, media_type=media)
            # aiter_raw: relay bytes untouched, no decoding work.
            return StreamingResponse(
                upstream.aiter_raw(),
                status_code=upstream.status_code,
                media_type=media,
                background=BackgroundTask(upstream.aclose),
            )

        return app

    if kind in ("aiohttp", "aiohttp-chunked"):
        import aiohttp

        use_iter_any = kind == "aiohttp"

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            # limit=0: no connection cap; sessions must be created inside the running loop.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                state["session"] = session
                yield

        app = FastAPI(lifespan=lifespan)

        @app.post(PATH)
        async def relay_aiohttp(request: Request) -> Response:
            session: aiohttp.ClientSession = state["session"]
            body = await request.body()
            stream = bool(orjson.loads(body).get("stream"))
            upstream = await session.post(url, data=body, headers=FORWARD_HEADERS)
            media = upstream.headers.get("content-type")
            if not stream:
                async with upstream:
                    content = await upstream.read()
                return Response(content, status_code=upstream.status, media_type=media)

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    it = upstream.content.iter_any() if use_iter_any else upstream.content.iter_chunked(1024)
                    async for chunk in it:
                        yield chunk
                finally:
                    upstream.release()

            return StreamingResponse(chunks(), status_code=upstream.status, media_type=media)

        return app

    if kind == "httpcore":
        import httpcore

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            async with httpcore.AsyncConnectionPool(max_connections=4096, keepalive_expiry=60) as pool:
                state["pool"] = pool
                yield

        app = FastAPI(lifespan=lifespan)
        # httpcore is the wire alone: Host and Content-Length are the caller's to send.
        core_headers = [(b"host", urllib.parse.urlsplit(url).netloc.encode())]
        core_headers += [(name.encode(), value.encode()) for name, value in FORWARD_HEADERS.items()]

        @app.post(PATH)
        async def relay_httpcore(request: Request) -> Response:
            pool: httpcore.AsyncConnectionPool = state["pool"]
            body = await request.body()
            stream = bool(orjson.loads(body).get("stream"))
            upstream = await pool.handle_async_request(
                httpcore.Request(
                    "POST",
                    url,
                    headers=[*core_headers, (b"content-length", str(len(body)).encode())],
                    content=body,
                    extensions={"timeout": {}},
                )
            )
            media = dict(upstream.headers).get(b"content-type", b"").decode() or None
            if not stream:
                content = b"".join([part async for part in upstream.aiter_stream()])
                await upstream.aclose()
                return Response(content, status_code=upstream.status, media_type=media)

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for part in upstream.aiter_stream():
                        yield part
                finally:
                    await upstream.aclose()

            return StreamingResponse(chunks(), status_code=upstream.status, media_type=media)

        return app

    if kind == "dpserve":
        # The router's own hot-path client (dpserve/router/http/upstream_client.py), behind the same FastAPI relay.
        from dpserve.router.http.upstream_client import Address, UpstreamPool

        address = Address.from_url(backend_url)

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            pool = UpstreamPool()
            state["pool"] = pool
            yield
            pool.close()

        app = FastAPI(lifespan=lifespan)

        @app.post(PATH)
        async def relay_dpserve(request: Request) -> Response:
            pool: UpstreamPool = state["pool"]
            body = await request.body()
            stream = bool(orjson.loads(body).get("stream"))
            upstream = await pool.post(address, PATH, body, FORWARD_HEADERS)
            if not stream:
                content = await upstream.read()
                return Response(content, status_code=upstream.status, media_type=upstream.content_type)

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    while part := await upstream.readany():
                        yield part
                finally:
                    upstream.release()

            return StreamingResponse(chunks(), status_code=upstream.status, media_type=upstream.content_type)

        return app

    raise ValueError(f"unknown relay kind {kind!r}")


def run_relay(kind: str, backend_url: str) -> None:
    import uvicorn

    app = build_relay_app(kind, backend_url)
    config = uvicorn.Config(app, loop="uvloop", http="httptools", access_log=False, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    sock = _listen_socket()
    _announce_port(sock)  # the socket already listens, so connections queue until uvicorn accepts
    server.run(sockets=[sock])


# ---------------------------------------------------------------------------------------------
# Load generation


@dataclass
class Result:
    target: str
    mode: str
    connections: int
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    loadgen: str
    load1: float  # 1-minute load average when the run started: other work on the box skews figures

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# The orchestrator


class Processes:
    """Every subprocess we start, so that all of them die with us (also on Ctrl-C / SIGTERM)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, args: list[str], **kw: Any) -> subprocess.Popen[str]:
        # New session: a terminal Ctrl-C reaches only us, and we stop the children in order.
        preexec = die_with_parent if sys.platform.startswith("linux") else None
        proc = subprocess.Popen(args, text=True, start_new_session=True, preexec_fn=preexec, **kw)
        self.procs = [p for p in self.procs if p.poll() is None]  # forget finished load generators
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        # Newest first: load generator, then relays, then the backend, so that no relay logs
        # a failed upstream request because its backend went away under it.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        self.procs.clear()


def _self_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.upstream_client", *args]


def _start_server(procs: Processes, args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = procs.start(_self_cmd(*args), stdout=subprocess.PIPE, env=child_env())
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=READY_TIMEOUT_S):
        raise RuntimeError(f"{args} did not report a port within {READY_TIMEOUT_S} s")
    line = proc.stdout.readline()
    sel.close()
    if not line.startswith("PORT "):
        raise RuntimeError(f"{args} failed to start (rc={proc.poll()}): {line!r}")
    return proc, f"http://{HOST}:{int(line.split()[1])}"


def _post(url: str, body: bytes, timeout: float = 10.0) -> bytes:
    req = urllib.request.Request(url + PATH, data=body, headers=FORWARD_HEADERS, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: bytes = resp.read()  # urlopen is typed to return Any
        return answer


def _check_target(name: str, url: str) -> None:
    """Relays must return exactly what the backend sends; also waits until the app is ready."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            got_json = _post(url, REQUEST_BODIES["json"])
            break
        except urllib.error.HTTPError:
            raise  # the app answered: retrying will not help
        except OSError:  # not accepting yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    got_sse = _post(url, REQUEST_BODIES["sse"])
    if orjson.loads(got_json) != COMPLETION or got_sse != SSE_BODY:
        raise RuntimeError(f"{name} relayed a wrong answer")


def _measure(
    loadgen: str,
    lua_dir: Path,
    target: str,
    url: str,
    mode: str,
    connections: int,
    duration: float,
    wrk_threads: int,
) -> Result:
    if loadgen == "wrk":
        command = wrk_command(lua_dir / f"{mode}.lua", url + PATH, connections, duration, wrk_threads)
    else:
        expect_chunks = N_STREAM_CHUNKS if mode == "sse" else 0
        command = python_command(url + PATH, REQUEST_BODIES[mode], connections, duration, expect_chunks)
    load1 = os.getloadavg()[0]
    r = run_all([command], duration, env=child_env())[0]
    return Result(target, mode, connections, r.requests, r.seconds, r.p50_ms, r.p99_ms, r.errors, loadgen, load1)


COLUMNS = ["target", "mode", "connections", "req_s", "p50_ms", "p99_ms", "errors", "p50_added_ms", "loadgen", "load1"]


def _rows(results: list[Result]) -> list[dict[str, Any]]:
    # Added latency: a relay's 1-connection p50 minus the backend's, same mode.
    base = {r.mode: r.p50_ms for r in results if r.target == "direct" and r.connections == 1}
    rows = []
    for r in results:
        added = r.p50_ms - base[r.mode] if r.connections == 1 and r.target != "direct" and r.mode in base else None
        rows.append(
            {
                "target": r.target,
                "mode": r.mode,
                "connections": r.connections,
                "req_s": round(r.rps),
                "p50_ms": round(r.p50_ms, 2),
                "p99_ms": round(r.p99_ms, 2),
                "errors": r.errors,
                "p50_added_ms": "" if added is None else round(added, 2),
                "loadgen": r.loadgen,
                "load1": round(r.load1, 2),
            }
        )
    return rows


def _raise_on_sigterm(signum: int, _frame: Any) -> None:
    # Turn SIGTERM into an exception so the finally-block stops every child.
    raise KeyboardInterrupt(f"signal {signum}")


def _iter_runs(targets: list[str], connections: int) -> Iterator[tuple[str, str, int]]:
    for mode in MODES:
        for conns in (connections, 1):
            for target in targets:
                if target == "aiohttp-chunked" and mode != "sse":
                    continue  # identical to "aiohttp" without streaming
                yield target, mode, conns


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="dpserve bench upstream-client",
        description="Compare httpx, aiohttp, httpcore and dpserve's own client as the router's upstream client "
        "behind FastAPI/uvicorn.",
    )
    p.add_argument("--duration", type=POSITIVE, default=10.0, help="seconds per measurement (default 10)")
    p.add_argument("--connections", type=COUNT, default=32, help="concurrent connections (default 32)")
    p.add_argument("--out", default="out/bench", help="output directory (default out/bench)")
    p.add_argument("--warmup", type=NON_NEGATIVE, default=1.0, help="seconds of unrecorded load before each run")
    p.add_argument(
        "--loadgen",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="auto: wrk when on PATH, else the aiohttp closed-loop generator",
    )
    p.add_argument(
        "--wrk-threads",
        type=COUNT,
        default=1,
        help="wrk threads (default 1: leave the cores to the servers under test)",
    )
    p.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma list of direct,{','.join(RELAY_KINDS)} (default %(default)s)",
    )
    args = p.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(args.targets) - {"direct", *RELAY_KINDS}
    if unknown:
        p.error(f"unknown targets: {sorted(unknown)}")
    if args.connections < 1 or args.duration <= 0:
        p.error("--connections must be >= 1 and --duration > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Hidden roles: the same module is the backend, the relays and the Python load generator.
    if argv and argv[0] == "_backend":
        _watch_parent()
        run_backend()
        return 0
    if argv and argv[0] == "_relay":
        _watch_parent()
        run_relay(argv[1], argv[2])
        return 0

    args = parse_args(argv)
    loadgen = args.loadgen
    if loadgen == "auto":
        loadgen = "wrk" if shutil.which("wrk") else "python"
    elif loadgen == "wrk" and not shutil.which("wrk"):
        print("wrk is not on PATH", file=sys.stderr)
        return 2

    procs = Processes()
    old_term = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    results: list[Result] = []
    try:
        with tempfile.TemporaryDirectory(prefix="dpserve-bench-") as tmp:
            lua_dir = Path(tmp)
            for mode, body in REQUEST_BODIES.items():
                write_wrk_script(lua_dir, mode, body)

            _, backend_url = _start_server(procs, ["_backend"])
            urls = {"direct": backend_url}
            for target in args.targets:
                if target != "direct":
                    urls[target] = _start_server(procs, ["_relay", target, backend_url])[1]
            for target in args.targets:
                _check_target(target, urls[target])

            print(
                f"# {os.cpu_count()} CPUs shared by backend, relay and load generator ({loadgen}); "
                f"{args.duration:g} s per run; load average before: {os.getloadavg()[0]:.2f}"
                " (anything else running skews the figures)",
                flush=True,
            )
            for target, mode, conns in _iter_runs(args.targets, args.connections):
                if args.warmup > 0:
                    _measure(
                        loadgen,
                        lua_dir,
                        target,
                        urls[target],
                        mode,
                        conns,
                        args.warmup,
                        args.wrk_threads,
                    )
                r = _measure(
                    loadgen,
                    lua_dir,
                    target,
                    urls[target],
                    mode,
                    conns,
                    args.duration,
                    args.wrk_threads,
                )
                results.append(r)
                print(
                    f"  {target:>15} {mode:>4} c={conns:<3} {r.rps:9.0f} req/s  p50 {r.p50_ms:7.2f} ms  "
                    f"p99 {r.p99_ms:7.2f} ms  errors {r.errors}",
                    flush=True,
                )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, old_term)

    rows = _rows(results)
    print()
    print(format_table(COLUMNS, [[row[c] for c in COLUMNS] for row in rows], align="right"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "upstream_client.csv"
    write_csv(out_file, rows, COLUMNS)
    print(f"\nwrote {shown(out_file)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
