"""`dpserve bench sim`: what simulator replicas cost on this machine.

Starts N `dpserve sim` processes (speed 0, KV events on), then reports:
- start-up: seconds until all N answer /health;
- idle: resident memory and CPU per sim (the router is not running, so nothing probes them);
- load: a closed-loop aiohttp generator against one sim, then against all N, non-streamed (16 tokens)
  and streamed (64 chunks): requests/s, chunks/s, p50/p99 latency, and the sims' own CPU time per
  request (read from /proc, so it does not depend on how fast the generator is).
The generator shares the machine's cores with the sims: req/s is a floor, CPU per request is the cost.
Prints a table and writes `sim_cost.csv`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import psutil

from benchmarks.fleet import cpu_seconds
from benchmarks.report import shown, write_csv
from benchmarks.stats import percentile
from dpserve.flag_types import COUNT, POSITIVE

BODIES = {
    "json": b'{"model": "dpserve-tiny", "prompt": "Hello from the benchmark", "max_tokens": 16}',
    "sse": b'{"model": "dpserve-tiny", "prompt": "Hello from the benchmark", "max_tokens": 64, "stream": true}',
}
CHUNKS_PER_REQUEST = {"json": 1, "sse": 64}


@dataclass
class LoadRow:
    target: str
    mode: str
    connections: int
    requests: int
    errors: int
    req_per_s: float
    chunks_per_s: float
    p50_ms: float
    p99_ms: float
    sim_cpu_us_per_request: float


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start_sims(count: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    ports = _free_ports(2 * count)
    processes, urls = [], []
    for index in range(count):
        port, kv_port = ports[2 * index], ports[2 * index + 1]
        argv = [sys.executable, "-m", "dpserve", "sim", "--port", str(port), "--speed", "0", "--log-level", "warning"]
        argv += ["--kv-events", f"tcp://127.0.0.1:{kv_port}"]
        processes.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    return processes, urls


async def wait_healthy(urls: list[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        for url in urls:
            while True:
                try:
                    async with session.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not start in {timeout_s:.0f}s")
                await asyncio.sleep(0.1)


async def drive(urls: list[str], mode: str, connections: int, duration_s: float) -> tuple[list[float], int]:
    """Closed loop: worker i sends to urls[i % len(urls)], the next request when the last one is done."""
    body = BODIES[mode]
    latencies: list[float] = []
    errors = 0

    async def worker(session: aiohttp.ClientSession, url: str, deadline: float) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                    data = await resp.read()
                ok = resp.status == 200 and (data.endswith(b"data: [DONE]\n\n") if mode == "sse" else bool(data))
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        deadline = time.perf_counter() + duration_s
        workers = (worker(session, urls[i % len(urls)] + "/v1/completions", deadline) for i in range(connections))
        await asyncio.gather(*workers)
    return latencies, errors


def measure(
    target: str, urls: list[str], sims: list[psutil.Process], mode: str, connections: int, duration_s: float
) -> LoadRow:
    asyncio.run(drive(urls, mode, connections, 0.5))  # warm-up, not recorded
    cpu_before = cpu_seconds(sims)
    started = time.perf_counter()
    latencies, errors = asyncio.run(drive(urls, mode, connections, duration_s))
    elapsed = time.perf_counter() - started
    cpu_used = cpu_seconds(sims) - cpu_before
    latencies.sort()
    done = len(latencies)
    return LoadRow(
        target=target,
        mode=mode,
        connections=connections,
        requests=done,
        errors=errors,
        req_per_s=round(done / elapsed, 1),
        chunks_per_s=round(done * CHUNKS_PER_REQUEST[mode] / elapsed, 1),
        p50_ms=round(percentile(latencies, 50) * 1000, 2),
        p99_ms=round(percentile(latencies, 99) * 1000, 2),
        sim_cpu_us_per_request=round(cpu_used / done * 1e6, 1) if done else float("nan"),
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dpserve bench sim", description=__doc__)
    parser.add_argument("--sims", type=COUNT, default=16, help="how many sims to start (default 16)")
    parser.add_argument("--duration", type=POSITIVE, default=5.0, help="seconds per load run (default 5)")
    parser.add_argument("--connections", type=COUNT, default=32, help="closed-loop connections (default 32)")
    parser.add_argument("--idle-seconds", type=POSITIVE, default=5.0, help="how long idle CPU is sampled")
    parser.add_argument("--out", default="out/bench", help="folder for sim_cost.csv")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print(f"# {os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.2f}", flush=True)
    started = time.monotonic()
    processes, urls = start_sims(args.sims)
    try:
        asyncio.run(wait_healthy(urls))
        startup_s = time.monotonic() - started
        sims = [psutil.Process(p.pid) for p in processes]
        time.sleep(1.0)
        idle_before = cpu_seconds(sims)
        time.sleep(args.idle_seconds)
        idle_cpu_pct = (cpu_seconds(sims) - idle_before) / args.idle_seconds * 100 / args.sims
        rss_mib = sum(p.memory_info().rss for p in sims) / args.sims / 2**20
        print(
            f"{args.sims} sims: all healthy {startup_s:.1f} s after launch; per sim: {rss_mib:.0f} MiB RSS, "
            f"{idle_cpu_pct:.2f}% of one core idle",
            flush=True,
        )
        rows = []
        for target, target_urls, target_sims in (("1 sim", urls[:1], sims[:1]), (f"{args.sims} sims", urls, sims)):
            for mode in BODIES:
                row = measure(target, target_urls, target_sims, mode, args.connections, args.duration)
                rows.append(row)
                print(
                    f"  {target:>8} {mode:>4} c={row.connections}: {row.req_per_s:8.0f} req/s "
                    f"{row.chunks_per_s:9.0f} chunks/s  p50 {row.p50_ms:6.2f} ms  p99 {row.p99_ms:6.2f} ms  "
                    f"sim CPU {row.sim_cpu_us_per_request:6.0f} µs/request  errors {row.errors}",
                    flush=True,
                )
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "sim_cost.csv"
    extra = {"sims": args.sims, "startup_s": round(startup_s, 2), "idle_rss_mib": round(rss_mib, 1)}
    extra["idle_cpu_pct_per_sim"] = round(idle_cpu_pct, 3)
    write_csv(out_file, [{**asdict(row), **extra} for row in rows])
    print(f"wrote {shown(out_file)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
