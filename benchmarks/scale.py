"""`dpserve bench scale`: the control plane at hundreds to a thousand replicas, set up as an operator would.

For each replica count N of `--counts` (default 256, 1024) it starts N simulated replicas as
`dpserve sim --count 256 --kv-events ...` processes (`--per-process`; speed 0), a small router over the
first `--small` (8) of them for the latency baseline, and for each router count R of `--routers` (default
1, 4), `--runs` times, R routers over all of them started as an operator starts one: every `--replica` and
its `--kv-events`, the model's `--tokenizer DIR`, default policy and telemetry (several: each a `--peer`
of the others). Each run reports:
- ready: seconds from the routers' launch until each one's /ready counts all N healthy;
- control-plane CPU: each router's CPU time (user + system, from /proc) over `--idle-seconds` with no
  traffic, `--settle-seconds` after ready (the probe schedule's slowest cycle, 30 s, has then come round),
  as % of one core (the mean over the routers, and the highest), per replica, and split by part from the
  router's own meters (/status `control_plane_cpu_s`): probes, scrapes, KV events (on the event loop, and
  libzmq's threads), peers, and the rest (the event loop itself, timers, GPU sampling, ...);
- memory: each router's RSS idle, and after the hit-rate traffic;
- hit rate: `--groups` prefix groups x `--prompts` prompts (the policies benchmark's shared_prefix
  workload, dealt over the routers in turn), the replicas' own prefix-cache hits over queries, against the
  same workload sent straight to a perfect partition (group g always on replica g mod N);
- latency of a tiny request (a 1-token chat), through the routers and through the small router,
  interleaved one request at a time: median and p99, and their ratios;
- decision time: one routing decision in process (`benchmarks/decision_time.py`) at 8, 256 and 1024
  replicas.
Before each figure the load average; the machine is shared. Writes `scale.csv` and `scale.md` under --out.
Exit 1 when a sanity check fails (a replica never healthy, failed requests, no hits at all); the goals of
docs/benchmarks/scale.md are printed for each run, MET or NOT MET, never asserted.

    dpserve bench scale [--counts 256,1024] [--routers 1,4] [--runs 3] [--settle-seconds 60]
                        [--idle-seconds 30] [--checkout PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import aiohttp
import psutil

from benchmarks.decision_time import time_policy
from benchmarks.fleet import CHECKOUT, cpu_seconds, port_block, progress, stop_all, wait_ok
from benchmarks.policy_workloads import BenchRequest, shared_prefix
from benchmarks.report import format_table, shown, write_csv
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE, counts, existing_folder
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

MIB = 2**20
PARALLEL = 32
"""Requests in flight at once when reading every replica, or sending the hit-rate traffic."""
TINY = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
GOALS = {"cpu_pct": 10.0, "cpu_stretch_pct": 3.0, "p50_ratio": 1.25, "hit_ratio": 0.95, "rss_mib": 512.0}
"""At 1024 replicas behind one router (issue [1b/5]): idle control plane at most 10% of a core (stretch 3%),
median tiny latency at most 1.25x a router over 8, hit rate at least 0.95x a perfect partition, RSS at most
512 MB."""
PARTS = ("probes", "scrapes", "kv_events", "kv_events_io", "peers")
"""The router's own CPU meters (/status `control_plane_cpu_s`); the rest is its whole CPU less these."""


@dataclass
class ScaleRow:
    replicas: int
    routers: int
    run: int
    ready_s: float
    healthy: int
    """The fewest healthy replicas any router counted (N when all are)."""
    idle_cpu_pct: float
    """Mean over the routers, % of one core."""
    idle_cpu_max_pct: float
    cpu_per_replica_pct: float
    probes_pct: float
    """This and the next five: the idle CPU split by part, % of a core, the mean over the routers."""
    scrapes_pct: float
    kv_events_pct: float
    kv_events_io_pct: float
    peers_pct: float
    rest_pct: float
    rss_idle_mib: float
    """Mean over the routers."""
    rss_after_mib: float
    hit_rate: float
    partition_hit_rate: float
    hit_ratio: float
    p50_ms: float
    p99_ms: float
    small_p50_ms: float
    small_p99_ms: float
    p50_ratio: float
    errors: int
    load_avg: float


@dataclass(frozen=True)
class Fleet:
    urls: list[str]
    kv: list[str]
    router_base: int
    processes: list[subprocess.Popen[bytes]]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dpserve bench scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=counts, default="256,1024", help="replica counts")
    parser.add_argument("--routers", type=counts, default="1,4", help="router counts (several: peered)")
    parser.add_argument("--per-process", type=COUNT, default=256, help="replicas per `dpserve sim --count` process")
    parser.add_argument("--runs", type=COUNT, default=3, help="runs of each router count, each with new routers")
    parser.add_argument("--settle-seconds", type=NON_NEGATIVE, default=60.0, help="from ready to reading idle CPU")
    parser.add_argument("--idle-seconds", type=POSITIVE, default=30.0, help="how long idle CPU is read")
    parser.add_argument("--small", type=COUNT, default=8, help="replicas behind the latency baseline's router")
    parser.add_argument("--groups", type=COUNT, default=128, help="prefix groups of the hit-rate traffic")
    parser.add_argument("--prompts", type=COUNT, default=4, help="prompts per group")
    parser.add_argument("--latency-requests", type=COUNT, default=200, help="tiny requests each way")
    parser.add_argument(
        "--decision-counts", type=counts, default="8,256,1024", help="fleet sizes of the decision timing"
    )
    parser.add_argument("--checkout", type=existing_folder, default=CHECKOUT, help="the checkout whose router runs")
    parser.add_argument("--router-args", default="", help="more flags for every router (space-separated)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--out", type=Path, default=Path("out/bench/scale"))
    return parser.parse_args(argv)


# -- processes ---------------------------------------------------------------------------------------


def start_sims(count: int, per_process: int, log_dir: Path) -> Fleet:
    """`count` replicas as `dpserve sim --count` processes of at most `per_process` each; ports: the replicas,
    then their KV-event ports, then 16 for routers."""
    base = port_block(2 * count + 16, random.Random())
    urls = [f"http://127.0.0.1:{base + i}" for i in range(count)]
    kv = [f"tcp://127.0.0.1:{base + count + i}" for i in range(count)]
    processes = []
    for first in range(0, count, per_process):
        size = min(per_process, count - first)
        command = [sys.executable, "-m", "dpserve", "sim", "--count", str(size), "--port", str(base + first)]
        command += ["--kv-events", kv[first], "--speed", "0", "--log-level", "warning"]
        processes.append(_spawn(command, log_dir / f"sim-{first}.log", CHECKOUT))
    return Fleet(urls, kv, base + 2 * count, processes)


def _spawn(command: list[str], log_path: Path, checkout: Path) -> subprocess.Popen[bytes]:
    """A child that imports dpserve from `checkout` (run from there, so `-m dpserve` finds it first)."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=checkout)


async def wait_sims(session: aiohttp.ClientSession, fleet: Fleet, per_process: int) -> None:
    for index, process in enumerate(fleet.processes):
        last = min(len(fleet.urls), (index + 1) * per_process) - 1
        await wait_ok(session, f"{fleet.urls[last]}/health", 300, process)


def start_routers(
    urls: list[str], kv: list[str], count: int, port: int, args: argparse.Namespace, log_dir: Path
) -> list[subprocess.Popen[bytes]]:
    """`count` routers over `urls` on ports port, port+2, ...; each a --peer of the others."""
    tokenizer = str(ensure_tiny_model(args.cache_dir))
    ports = [port + 2 * i for i in range(count)]
    routers = []
    for own in ports:
        peers = [f"--peer=http://127.0.0.1:{other}" for other in ports if other != own]
        command = operator_command(urls, kv, own, tokenizer, [*peers, *args.router_args.split()])
        routers.append(_spawn(command, log_dir / f"router-{own}-{time.time():.0f}.log", args.checkout))
    return routers


def operator_command(urls: Sequence[str], kv: Sequence[str], port: int, tokenizer: str, extra: list[str]) -> list[str]:
    """A router as an operator starts one: each replica and its KV events, the model's tokenizer; the policy,
    probes and telemetry left at their defaults (not `dpserve up`'s flags: a stand-alone router's)."""
    command = [sys.executable, "-m", "dpserve", "router", "--port", str(port), "--tokenizer", tokenizer]
    for url, endpoint in zip(urls, kv, strict=True):
        command += ["--replica", url, "--kv-events", f"{url}={endpoint}"]
    return [*command, "--log-level", "warning", *extra]


async def wait_healthy(session: aiohttp.ClientSession, url: str, want: int, timeout_s: float) -> int:
    """How many replicas the router at `url` counts healthy once all `want` are, or at `timeout_s`."""
    deadline, healthy = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{url}/ready", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                healthy = int((await resp.json())["healthy_replicas"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            pass
        if healthy >= want:
            return healthy
        await asyncio.sleep(0.2)
    return healthy


# -- measuring ---------------------------------------------------------------------------------------


def idle_cpu(processes: Sequence[subprocess.Popen[bytes]], seconds: float) -> list[float]:
    """Each process's CPU over `seconds`, % of one core (user + system from /proc, through psutil)."""
    tree = [psutil.Process(p.pid) for p in processes]
    before = [cpu_seconds([p]) for p in tree]
    time.sleep(seconds)
    return [(cpu_seconds([p]) - b) / seconds * 100 for p, b in zip(tree, before, strict=True)]


async def control_cpu(session: aiohttp.ClientSession, url: str) -> tuple[float, dict[str, float]]:
    """When, and the router's CPU seconds so far by part (its /status), with `process` its whole CPU."""
    async with session.get(f"{url}/status") as resp:
        parts = (await resp.json())["control_plane_cpu_s"]
    return time.monotonic(), {part: float(parts.get(part, 0.0)) for part in (*PARTS, "process")}


def split_pcts(before: tuple[float, dict[str, float]], after: tuple[float, dict[str, float]]) -> dict[str, float]:
    """The parts' share of one core between two readings, and the rest (the whole less the parts)."""
    seconds = after[0] - before[0]
    spent = {part: (after[1][part] - before[1][part]) / seconds * 100 for part in (*PARTS, "process")}
    spent["rest"] = spent.pop("process") - sum(spent[part] for part in PARTS)
    return spent


def rss_mib(processes: Sequence[subprocess.Popen[bytes]]) -> list[float]:
    return [float(psutil.Process(p.pid).memory_info().rss) / MIB for p in processes]


async def cache_totals(session: aiohttp.ClientSession, urls: Sequence[str]) -> tuple[float, float]:
    """Prefix-cache hits and queries summed over the replicas, as their /metrics say now."""
    gate = asyncio.Semaphore(PARALLEL)

    async def one(url: str) -> tuple[float, float]:
        async with gate, session.get(f"{url}/metrics") as resp:
            samples = parse_samples(await resp.text(), frozenset({HITS, QUERIES}))
        return samples.total(HITS) or 0.0, samples.total(QUERIES) or 0.0

    pairs = await asyncio.gather(*(one(url) for url in urls))
    return sum(h for h, _ in pairs), sum(q for _, q in pairs)


async def send_all(session: aiohttp.ClientSession, requests: Sequence[BenchRequest], targets: Sequence[str]) -> int:
    """Each request to its target (`targets[i]`, a base URL), PARALLEL at a time in order of issue; each round
    of the workload (every group once) waits for the round before. Returns how many failed."""
    gate = asyncio.Semaphore(PARALLEL)
    errors = 0

    async def one(request: BenchRequest, target: str) -> None:
        nonlocal errors
        async with gate:
            try:
                body = request.body(TINY_MODEL_NAME, 1, False)
                async with session.post(f"{target}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    errors += resp.status != 200
            except (aiohttp.ClientError, TimeoutError):
                errors += 1

    per_round = len({r.group for r in requests})
    for start in range(0, len(requests), per_round):
        batch = range(start, min(len(requests), start + per_round))
        await asyncio.gather(*(one(requests[i], targets[i]) for i in batch))
        await asyncio.sleep(0.2)  # the round's KV events reach the routers
    return errors


async def hit_rate(
    session: aiohttp.ClientSession, urls: Sequence[str], requests: Sequence[BenchRequest], targets: Sequence[str]
) -> tuple[float, int]:
    hits0, queries0 = await cache_totals(session, urls)
    errors = await send_all(session, requests, targets)
    hits1, queries1 = await cache_totals(session, urls)
    return (hits1 - hits0) / max(1.0, queries1 - queries0), errors


async def latencies(session: aiohttp.ClientSession, big: Sequence[str], small: str, count: int) -> list[list[float]]:
    """Tiny requests one at a time, alternating: through the routers in turn, then through the small router.
    (seconds through the routers, seconds through the small one, failures as [count])."""
    times: list[list[float]] = [[], [], [0.0]]
    for i in range(count):
        for which, url in ((0, big[i % len(big)]), (1, small)):
            started = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/chat/completions", json=TINY) as resp:
                    await resp.read()
                    times[2][0] += resp.status != 200
            except (aiohttp.ClientError, TimeoutError):
                times[2][0] += 1
            times[which].append(time.perf_counter() - started)
    return times


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] * 1000


# -- one fleet ---------------------------------------------------------------------------------------


async def measure_routers(
    session: aiohttp.ClientSession, fleet: Fleet, count: int, run: int, small_url: str, args: argparse.Namespace,
    work: Path,
) -> ScaleRow:  # fmt: skip
    """`count` routers over the whole fleet: ready, idle CPU (split by part) and memory, hit rate, tiny
    latency; stopped after."""
    n = len(fleet.urls)
    started = time.monotonic()
    routers = start_routers(fleet.urls, fleet.kv, count, fleet.router_base, args, work)
    urls = [f"http://127.0.0.1:{fleet.router_base + 2 * i}" for i in range(count)]
    try:
        for url, process in zip(urls, routers, strict=True):
            await wait_ok(session, f"{url}/ready", 300, process)
        healthy = min([await wait_healthy(session, url, n, 120) for url in urls])
        ready_s = time.monotonic() - started
        progress(f"{n} replicas, {count} router(s), run {run}: {healthy} healthy after {ready_s:.1f} s")
        await asyncio.sleep(args.settle_seconds)  # past the start: every probe cycle has come round
        load = os.getloadavg()[0]
        before = [await control_cpu(session, url) for url in urls]
        cpu = await asyncio.to_thread(idle_cpu, routers, args.idle_seconds)
        splits = [split_pcts(b, await control_cpu(session, url)) for b, url in zip(before, urls, strict=True)]
        split = {part: statistics_mean([s[part] for s in splits]) for part in (*PARTS, "rest")}
        rss_idle = rss_mib(routers)
        progress(
            f"idle: CPU {', '.join(f'{c:.2f}%' for c in cpu)} of a core ("
            + ", ".join(f"{part} {pct:.2f}%" for part, pct in split.items())
            + f"); RSS {statistics_mean(rss_idle):.0f} MiB"
        )
        seed = int(time.time())
        workload = shared_prefix(args.groups, args.prompts, 300, 8, seed).requests
        hit, errors = await hit_rate(session, fleet.urls, workload, [urls[i % count] for i in range(len(workload))])
        oracle = shared_prefix(args.groups, args.prompts, 300, 8, seed + 1).requests
        perfect, oracle_errors = await hit_rate(session, fleet.urls, oracle, [fleet.urls[r.group % n] for r in oracle])
        rss_after = rss_mib(routers)
        times = await latencies(session, urls, small_url, args.latency_requests)
    finally:
        stop_all(routers, 10)
    p50, small_p50 = pct(times[0], 0.5), pct(times[1], 0.5)
    return ScaleRow(
        replicas=n, routers=count, run=run, ready_s=round(ready_s, 2), healthy=healthy,
        idle_cpu_pct=round(statistics_mean(cpu), 2), idle_cpu_max_pct=round(max(cpu), 2),
        cpu_per_replica_pct=round(statistics_mean(cpu) / n, 4),
        probes_pct=round(split["probes"], 2), scrapes_pct=round(split["scrapes"], 2),
        kv_events_pct=round(split["kv_events"], 2), kv_events_io_pct=round(split["kv_events_io"], 2),
        peers_pct=round(split["peers"], 2), rest_pct=round(split["rest"], 2),
        rss_idle_mib=round(statistics_mean(rss_idle), 1), rss_after_mib=round(statistics_mean(rss_after), 1),
        hit_rate=round(hit, 3), partition_hit_rate=round(perfect, 3), hit_ratio=round(hit / max(perfect, 1e-9), 3),
        p50_ms=round(p50, 2), p99_ms=round(pct(times[0], 0.99), 2),
        small_p50_ms=round(small_p50, 2), small_p99_ms=round(pct(times[1], 0.99), 2),
        p50_ratio=round(p50 / small_p50, 3), errors=errors + oracle_errors + int(times[2][0]), load_avg=round(load, 2),
    )  # fmt: skip


def statistics_mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


async def measure_count(n: int, args: argparse.Namespace, work: Path) -> list[ScaleRow]:
    """N replicas: the sims, the small router over `--small` of them, then each router count in turn."""
    fleet = start_sims(n, args.per_process, work)
    small: list[subprocess.Popen[bytes]] = []
    rows = []
    try:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            started = time.monotonic()
            await wait_sims(session, fleet, args.per_process)
            progress(f"{n} replicas in {len(fleet.processes)} process(es): ready in {time.monotonic() - started:.1f} s")
            small_port, size = fleet.router_base + 14, min(args.small, n)
            small = start_routers(fleet.urls[:size], fleet.kv[:size], 1, small_port, args, work)
            small_url = f"http://127.0.0.1:{small_port}"
            await wait_ok(session, f"{small_url}/ready", 300, small[0])
            await wait_healthy(session, small_url, size, 60)
            for count in (int(text) for text in args.routers.split(",")):
                for run in range(1, args.runs + 1):
                    rows.append(await measure_routers(session, fleet, count, run, small_url, args, work))
                    print(one_line(rows[-1], size), flush=True)
    finally:
        stop_all([*fleet.processes, *small], 10)
    return rows


def one_line(row: ScaleRow, small: int) -> str:
    return (
        f"{row.replicas} replicas, {row.routers} router(s), run {row.run}: {row.healthy} healthy in "
        f"{row.ready_s:.1f} s; idle CPU {row.idle_cpu_pct:.2f}% of a core (max {row.idle_cpu_max_pct:.2f}%), "
        f"{row.cpu_per_replica_pct:.4f}% per replica: {split_text(row)}; RSS {row.rss_idle_mib:.0f} MiB idle, "
        f"{row.rss_after_mib:.0f} after traffic; hit rate "
        f"{row.hit_rate:.3f} vs {row.partition_hit_rate:.3f} partitioned ({row.hit_ratio:.2f}x); tiny p50 "
        f"{row.p50_ms:.2f} ms vs {row.small_p50_ms:.2f} over {small} ({row.p50_ratio:.2f}x), p99 {row.p99_ms:.2f} vs "
        f"{row.small_p99_ms:.2f}; errors {row.errors}; load {row.load_avg:.1f}"
    )


def split_text(row: ScaleRow) -> str:
    return (
        f"probes {row.probes_pct:.2f}%, scrapes {row.scrapes_pct:.2f}%, KV events {row.kv_events_pct:.2f}% "
        f"(+ libzmq {row.kv_events_io_pct:.2f}%), peers {row.peers_pct:.2f}%, rest {row.rest_pct:.2f}%"
    )


# -- the report --------------------------------------------------------------------------------------


def decision_lines(counts: Sequence[int]) -> list[str]:
    lines = ["decision time, microseconds (in process, best of 5 x 500):"]
    for policy in ("kv_aware", "least_loaded"):
        best = time_policy(policy, counts, 500, 5)
        cells = ", ".join(f"{count}: {seconds * 1e6:.1f}" for count, seconds in best.items())
        lines.append(
            f"  {policy}: {cells} ({best[counts[-1]] / best[counts[0]]:.2f}x from {counts[0]} to {counts[-1]})"
        )
    return lines


def sanity(rows: Sequence[ScaleRow]) -> list[str]:
    """What makes the figures meaningless: a replica never healthy, failed requests, no hits at all."""
    problems = []
    for row in rows:
        where = f"{row.replicas} replicas, {row.routers} router(s)"
        if row.healthy < row.replicas:
            problems.append(f"{where}: only {row.healthy} healthy")
        if row.errors:
            problems.append(f"{where}: {row.errors} failed requests")
        if row.partition_hit_rate <= 0 or row.hit_rate <= 0:
            problems.append(f"{where}: no prefix-cache hits")
        if row.idle_cpu_pct <= 0 or row.rss_idle_mib <= 0:
            problems.append(f"{where}: no CPU or memory read")
    return problems


def goal_lines(rows: Sequence[ScaleRow]) -> list[str]:
    lines = []
    for row in (r for r in rows if r.routers == 1 and r.replicas >= 1024):
        checks = [
            ("every replica healthy", row.healthy == row.replicas),
            (f"idle CPU {row.idle_cpu_pct:.2f}% <= {GOALS['cpu_pct']:g}% of a core", row.idle_cpu_pct <= GOALS["cpu_pct"]),  # noqa: E501
            (f"idle CPU {row.idle_cpu_pct:.2f}% <= {GOALS['cpu_stretch_pct']:g}% (stretch)", row.idle_cpu_pct <= GOALS["cpu_stretch_pct"]),  # noqa: E501
            (f"tiny p50 {row.p50_ratio:.2f}x <= {GOALS['p50_ratio']}x", row.p50_ratio <= GOALS["p50_ratio"]),
            (f"hit rate {row.hit_ratio:.2f}x >= {GOALS['hit_ratio']}x", row.hit_ratio >= GOALS["hit_ratio"]),
            (f"RSS {row.rss_after_mib:.0f} MiB <= {GOALS['rss_mib']:g}", row.rss_after_mib <= GOALS["rss_mib"]),
        ]  # fmt: skip
        for text, met in checks:
            lines.append(f"{row.replicas} replicas, 1 router, run {row.run}: {text}: {'MET' if met else 'NOT MET'}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dpserve-bench-scale-"))
    print(f"# {os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.2f}; logs in {work}", flush=True)
    rows: list[ScaleRow] = []
    for n in (int(text) for text in args.counts.split(",")):
        rows += asyncio.run(measure_count(n, args, work))
    decisions = decision_lines([int(text) for text in args.decision_counts.split(",")])
    header = tuple(f.name for f in fields(ScaleRow))
    table = format_table(header, [tuple(str(v) for v in asdict(row).values()) for row in rows])
    problems = sanity(rows)
    report = "\n".join([table, "", *decisions, "", *goal_lines(rows), *(f"SANITY: {p}" for p in problems)])
    write_csv(args.out / "scale.csv", [asdict(row) for row in rows], list(header))
    (args.out / "scale.md").write_text("```\n" + report + "\n```\n")
    print("\n" + report)
    print(f"wrote {shown(args.out)}/scale.md and scale.csv")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
