"""`dpserve bench sim-count`: what `dpserve sim --count N` costs, N replicas in one process.

For each N of `--counts` (default 1, 256, 1024) it starts one `dpserve sim --count N` (speed 0, KV events on,
the defaults otherwise: 8192 blocks of 16 tokens, the tiny model's tokenizer) and reports:
- ready: seconds from launch until the last replica's port answers /health (they listen in order);
- idle: the process's resident memory, and its CPU over `--idle-seconds` with nothing talking to it;
- after a scrape of each replica's /metrics (which builds that replica's HTTP app), its memory again;
- after one short chat on each (4 tokens, non-streamed), its memory, and its idle CPU once more.
Per replica: (RSS at N - RSS at 1) / (N - 1), when 1 is among the counts. Prints a table and writes
`sim_count.csv`. Nothing is asserted: the figures are for docs/benchmarks/sim.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import psutil

from benchmarks.fleet import child_env, cpu_seconds, port_block, spawn, stop_all, wait_ok
from benchmarks.report import shown, write_csv
from dpserve.flag_types import POSITIVE, WHOLE, counts

MIB = 2**20
CHAT = {"messages": [{"role": "user", "content": "Hello from the benchmark"}], "max_tokens": 4}
PARALLEL = 32
"""Requests in flight at once while scraping or chatting."""


@dataclass
class CountRow:
    count: int
    ready_s: float
    idle_rss_mib: float
    idle_cpu_pct: float
    scraped_rss_mib: float
    scrape_all_s: float
    chatted_rss_mib: float
    chat_all_s: float
    after_cpu_pct: float
    errors: int


async def each(urls: list[str], path: str, body: dict[str, object] | None) -> tuple[float, int]:
    """One request to `path` on every replica, PARALLEL at a time: (seconds for all, how many failed)."""
    gate = asyncio.Semaphore(PARALLEL)
    errors = 0

    async def one(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal errors
        async with gate:
            try:
                method = session.post if body is not None else session.get
                async with method(f"{url}{path}", json=body) as resp:
                    await resp.read()
                    errors += resp.status != 200
            except aiohttp.ClientError:
                errors += 1

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(one(session, url) for url in urls))
    return time.monotonic() - started, errors


def idle_cpu_pct(process: psutil.Process, seconds: float) -> float:
    """The process's CPU over `seconds` of nothing, as % of one core."""
    before = cpu_seconds([process])
    time.sleep(seconds)
    return (cpu_seconds([process]) - before) / seconds * 100


def rss_mib(process: psutil.Process) -> float:
    return float(process.memory_info().rss) / MIB


def measure(count: int, idle_s: float, rng: random.Random) -> CountRow:
    base = port_block(2 * count, rng)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(count)]
    command = [sys.executable, "-m", "dpserve", "sim", "--count", str(count), "--port", str(base)]
    command += ["--kv-events", f"tcp://127.0.0.1:{base + count}", "--speed", "0", "--log-level", "warning"]
    started = time.monotonic()
    child = spawn(command, None, child_env())
    try:
        process = psutil.Process(child.pid)

        async def ready() -> None:
            async with aiohttp.ClientSession() as session:
                await wait_ok(session, f"{urls[-1]}/health", 300, child)

        asyncio.run(ready())
        ready_s = time.monotonic() - started
        time.sleep(1.0)
        idle_rss, idle_cpu = rss_mib(process), idle_cpu_pct(process, idle_s)
        scrape_s, scrape_errors = asyncio.run(each(urls, "/metrics", None))
        scraped_rss = rss_mib(process)
        chat_s, chat_errors = asyncio.run(each(urls, "/v1/chat/completions", CHAT))
        chatted_rss = rss_mib(process)
        time.sleep(1.0)  # the client closed its connections on the way out of `each`
        after_cpu = idle_cpu_pct(process, idle_s)
    finally:
        stop_all([child], 10)
    errors = scrape_errors + chat_errors
    return CountRow(count, ready_s, idle_rss, idle_cpu, scraped_rss, scrape_s, chatted_rss, chat_s, after_cpu, errors)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dpserve bench sim-count", description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=counts, default="1,256,1024", help="replica counts to start, one process each")
    parser.add_argument("--idle-seconds", type=POSITIVE, default=10.0, help="how long idle CPU is sampled")
    parser.add_argument("--seed", type=WHOLE, default=0, help="seed for picking the free ports")
    parser.add_argument("--out", default="out/bench", help="folder for sim_count.csv")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print(f"# {os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rng = random.Random(args.seed)
    rows: list[CountRow] = []
    for count in (int(text) for text in args.counts.split(",")):
        row = measure(count, args.idle_seconds, rng)
        rows.append(row)
        print(
            f"--count {count:5d}: ready {row.ready_s:5.2f} s; RSS idle {row.idle_rss_mib:6.1f} MiB, "
            f"after a scrape of each {row.scraped_rss_mib:6.1f} ({row.scrape_all_s:.2f} s), after a chat on each "
            f"{row.chatted_rss_mib:6.1f} ({row.chat_all_s:.2f} s); idle CPU {row.idle_cpu_pct:.2f}% of a core, "
            f"{row.after_cpu_pct:.2f}% after; errors {row.errors}",
            flush=True,
        )
    lone = next((row for row in rows if row.count == 1), None)
    for row in rows:
        if lone is not None and row.count > 1:
            idle = (row.idle_rss_mib - lone.idle_rss_mib) / (row.count - 1) * 1024
            used = (row.chatted_rss_mib - lone.chatted_rss_mib) / (row.count - 1) * 1024
            print(f"--count {row.count:5d}: per added replica {idle:.0f} KiB idle, {used:.0f} KiB after traffic")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounded = [{k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(row).items()} for row in rows]
    write_csv(out_dir / "sim_count.csv", rounded)
    print(f"wrote {shown(out_dir / 'sim_count.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
