"""Closed-loop HTTP load for the benchmarks, run as child processes whose own CPU use is measured.

Two generators, both closed loop (each connection sends its next POST when the previous answer is in):
  * `wrk` (when on PATH) with a Lua script that sets the POST body and prints the result from `done()`;
  * a Python generator (aiohttp on uvloop), this module run as a script:

        python -m benchmarks.loadgen URL BODY CONNECTIONS DURATION [--expect-chunks N]

Both print one line `RESULT {"requests": ..., "seconds": ..., "p50_ms": ..., "p99_ms": ..., "errors": ...}`.
`Generator` reaps its child with `os.wait4`, so every result also carries the generator's CPU seconds:
a generator near one core is itself the bottleneck, whatever the server under test could do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks.fleet import child_env
from benchmarks.stats import percentile

JSON_HEADERS = {"content-type": "application/json"}
SSE_DONE = b"data: [DONE]\n\n"

WRK_LUA = """\
wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {{"requests": %d, "seconds": %f, "p50_ms": %f, "p99_ms": %f, "errors": %d}}\\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50) / 1e3,
    latency:percentile(99) / 1e3, e.connect + e.read + e.write + e.status + e.timeout))
end
"""


@dataclass
class LoadResult:
    requests: int
    seconds: float  # the measured window, as the generator reports it
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_s: float  # the generator's CPU time (user + system, all its threads), from its rusage
    wall_s: float  # from its start to its exit

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_cores(self) -> float:
        """Cores the generator kept busy on average: start-up included, so a little high on short runs."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


# -- commands ------------------------------------------------------------------------------------------


def write_wrk_script(directory: Path, name: str, body: bytes) -> Path:
    """A Lua script for wrk that POSTs `body`; the body lands in a Lua single-quoted literal."""
    if b"'" in body or b"\\" in body or b"\n" in body:
        raise ValueError("the wrk body must not contain quotes, backslashes or newlines")
    path = directory / f"{name}.lua"
    path.write_text(WRK_LUA.format(body=body.decode()))
    return path


def wrk_command(script: Path, url: str, connections: int, duration_s: float, threads: int = 1) -> list[str]:
    threads = max(1, min(threads, connections))
    # wrk takes whole seconds.
    duration = f"-d{max(1, round(duration_s))}s"
    return ["wrk", f"-t{threads}", f"-c{connections}", duration, "--timeout", "30s", "-s", str(script), url]


def python_command(url: str, body: bytes, connections: int, duration_s: float, expect_chunks: int = 0) -> list[str]:
    """The Python generator; `expect_chunks` > 0: an answer counts only with that many SSE events and [DONE]."""
    command = [sys.executable, "-m", "benchmarks.loadgen", url, body.decode(), str(connections), str(duration_s)]
    return [*command, "--expect-chunks", str(expect_chunks)]


# -- running generators ----------------------------------------------------------------------------------


def die_with_parent() -> None:
    """Linux: have the kernel SIGTERM the child if we die, even by SIGKILL (wrk does not watch its parent)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class Generator:
    """One load generator child, started on construction; `result()` reaps it and reads its RESULT line."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.command = command
        # Files, not pipes: nothing to drain while we wait, and a chatty child cannot stall on a full pipe.
        self._out: IO[bytes] = tempfile.TemporaryFile()
        self._err: IO[bytes] = tempfile.TemporaryFile()
        preexec = die_with_parent if sys.platform.startswith("linux") else None
        self.started = time.perf_counter()
        # New session: a terminal's Ctrl-C reaches only the benchmark, which then stops its children.
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=self._err,
            env=child_env() if env is None else env,
            start_new_session=True,
            preexec_fn=preexec,
        )

    def result(self, timeout_s: float) -> LoadResult:
        reaped = _reap(self.process, timeout_s)
        if reaped is None:
            raise RuntimeError(f"{self.command[0]} still running after {timeout_s:.0f}s")
        wall_s = time.perf_counter() - self.started
        cpu_s = reaped.ru_utime + reaped.ru_stime
        out, err = self._read(self._out), self._read(self._err)
        for line in out.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT ") :])
                return LoadResult(
                    r["requests"], r["seconds"], r["p50_ms"], r["p99_ms"], r["errors"], cpu_s=cpu_s, wall_s=wall_s
                )
        raise RuntimeError(
            f"{self.command[0]} gave no result (rc={self.process.returncode}): {out[-500:]} {err[-500:]}"
        )

    def stop(self) -> None:
        """Kill it if it still runs (we are unwinding), and close its output files."""
        if self.process.returncode is None and _reap(self.process, 0) is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            _reap(self.process, 10)
        self._out.close()
        self._err.close()

    @staticmethod
    def _read(handle: IO[bytes]) -> str:
        handle.seek(0)
        return handle.read().decode("utf-8", "replace")


def _reap(process: subprocess.Popen[bytes], timeout_s: float) -> Any | None:
    """Wait for `process` with wait4, which also gives its rusage (Popen.wait does not); None on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits for it again
            return usage
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def run_all(commands: Sequence[list[str]], duration_s: float, env: dict[str, str] | None = None) -> list[LoadResult]:
    """Run the generators at the same time and return their results; every one is stopped on any exit."""
    generators: list[Generator] = []
    try:
        for command in commands:
            generators.append(Generator(command, env))
        return [g.result(duration_s + 60) for g in generators]
    finally:
        for generator in generators:
            generator.stop()


# -- the Python generator ---------------------------------------------------------------------------------


def complete(data: bytes, expect_chunks: int) -> bool:
    """A full answer: any body for JSON; for SSE exactly `expect_chunks` events, then [DONE]."""
    if expect_chunks <= 0:
        return bool(data)
    # Events start lines; JSON escapes newlines, so a token's text cannot fake one.
    events = data.count(b"\ndata: ") + data.startswith(b"data: ")
    return events == expect_chunks + 1 and data.endswith(SSE_DONE)


def closed_loop(url: str, body: bytes, connections: int, duration_s: float, expect_chunks: int) -> dict[str, Any]:
    import aiohttp
    import uvloop

    latencies: list[float] = []
    errors = 0

    async def worker(session: aiohttp.ClientSession, deadline: float) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
                    data = await resp.read()
                ok = resp.status == 200 and complete(data, expect_chunks)
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

    async def drive() -> float:
        connector = aiohttp.TCPConnector(limit=connections)  # one connection per worker, like wrk
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            started = time.perf_counter()
            await asyncio.gather(*(worker(session, started + duration_s) for _ in range(connections)))
            return time.perf_counter() - started

    elapsed = uvloop.run(drive())
    latencies.sort()
    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__)
    parser.add_argument("url")
    parser.add_argument("body", help="the JSON request body")
    parser.add_argument("connections", type=int)
    parser.add_argument("duration", type=float, help="seconds")
    parser.add_argument("--expect-chunks", type=int, default=0, help="SSE events a full answer has (0: not SSE)")
    args = parser.parse_args(argv)
    result = closed_loop(args.url, args.body.encode(), args.connections, args.duration, args.expect_chunks)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
