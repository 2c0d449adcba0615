"""`dpserve bench routers`: several routers in front of one fleet of sims, sharing what they know or not.

Three experiments, on `dpserve sim` replicas started once with `dpserve up --sim N` (KV events on):

1. Tiers. For each workload of `dpserve bench policies` (shared prefixes, multi-turn, and cache pressure on
   sims with a small KV cache) plus a uniform one (every prompt unique), kv_aware behind: one router; R
   routers that peer (`--peer`); R routers alone. The requests are dealt over the routers in turn, the
   worst case for routers that do not share (every group's and conversation's requests reach every
   router). Hit rate is the replicas' own (`vllm:prefix_cache_hits_total / queries_total`), the spread
   their own `vllm:request_success_total`.
2. Restart. R peered routers behind Debian's haproxy (HTTP, round robin, `/ready` checked every 200 ms,
   retries on refused connections, the chosen router named in a response header). Shared-prefix traffic
   runs without pause; one router is killed (SIGKILL) and started again at once: with its warm start
   (a peer's KV index and recent routes); once more without (`--warm-start-timeout 0`: the peers' routes
   only from its start); and once with routers that do not peer at all. Each answer's
   `usage.prompt_tokens_details.cached_tokens` gives its hit rate, per router; failures are split into
   those in flight on the killed router (lost with it) and the rest.
3. Workers. kv_aware (KV events, router-side tokenizer) over fast sims, closed-loop req/s through the port:
   one router process alone; the same with an idle peer it shares with (the cost of sharing per request);
   `--workers 2, 4`.

Writes routers.csv, restart.csv, workers.csv and routers.md under --out and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import aiohttp
import orjson
import psutil

from benchmarks.fleet import (
    UpPorts,
    bench_tool,
    cpu_seconds,
    get_text,
    progress,
    router_command,
    spawn,
    start_up,
    wait_ok,
)
from benchmarks.loadgen import python_command, run_all
from benchmarks.policies import (
    Contender,
    Fleet,
    Outcome,
    _one,
    build_workloads,
    contender_command,
    counter_deltas,
    max_share,
    oracle_for,
    pressure_capacity,
    replica_counters,
    reset_caches,
    start_fleet,
    tokenize_all,
)
from benchmarks.policy_workloads import BenchRequest, Workload, shared_prefix
from benchmarks.report import format_table, goals_status, met, shown, write_csv
from benchmarks.stats import percentile
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE, WHOLE, Names, counts
from dpserve.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
from dpserve.up.launcher import busy_ports
from dpserve.up.process import terminate

HAPROXY = "/usr/sbin/haproxy"
ROUTER_HEADER = "x-dpserve-router"
TIERS = ("one", "shared", "alone", "through_one")
"""through_one: the shared tier's routers all running, every request through the first: one router's
routing with the other routers' processes competing for this machine's cores (what the tiers' TTFT
differences owe to that, not to routing)."""


@dataclass
class TierRow:
    workload: str
    tier: str
    run: int
    """0, 1, ...: the tiers take turns, run after run; -1: the mean of the runs (`summarize`)."""
    routers: int
    requests: int
    errors: int
    hit_rate: float
    oracle: float
    hit_vs_one: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_p99_vs_one: float
    req_per_s: float
    max_share: float
    per_replica: str


@dataclass
class RestartRow:
    start: str
    """warm (loads a peer's snapshot before serving), cold (--warm-start-timeout 0: peers' routes only from
    its start) or alone (routers without peers, as before routers shared anything)."""
    steady_hit_rate: float
    """The killed router's hit rate before the kill."""
    fleet_steady_hit_rate: float
    first_minute_hit_rate: float
    """The restarted router's hit rate over its first `--after` seconds."""
    first_minute_vs_steady: float
    first_requests_hit_rate: float
    """Over its first 20 requests: where a cold start shows most."""
    restarted_after_s: float
    """From the kill to its /ready (haproxy sends it traffic from then)."""
    requests: int
    failed_in_flight: int
    """Requests in flight on the killed router when it died."""
    failed_other: int


@dataclass
class WorkerRow:
    case: str
    workers: int
    run: int
    req_per_s: float
    p50_ms: float
    p99_ms: float
    router_cpu_us: float
    """The measured router's CPU time per answer (the whole window's, start-up excluded)."""
    errors: int


# -- router tiers ------------------------------------------------------------------------------------


async def start_routers(
    session: aiohttp.ClientSession,
    fleet: Fleet,
    count: int,
    peered: bool,
    tokenizer: Path,
    extra: Sequence[str] = (),
    ports: Sequence[int] | None = None,
) -> list[tuple[subprocess.Popen[bytes], str]]:
    """`count` kv_aware routers over the fleet, each a --peer of the others when `peered`, all ready."""
    ports = list(ports or [router_ports(1) for _ in range(count)])
    started: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for port in ports:
            peers = [f"--peer=http://127.0.0.1:{p}" for p in ports if p != port] if peered else []
            command = contender_command(Contender("dpserve", "kv_aware"), fleet, port, tokenizer, [*peers, *extra])
            log = Path(tempfile.gettempdir()) / f"dpserve-bench-router-{port}.log"
            started.append((spawn(command, log, dict(os.environ)), f"http://127.0.0.1:{port}"))
        for process, url in started:
            await wait_ok(session, f"{url}/ready", 60, process)
        if peered and count > 1:
            for process, url in started:
                await wait_for_peers(session, url, count - 1, process)
    except BaseException:
        for process, _ in started:
            terminate(process, 10)
        raise
    return started


async def wait_for_peers(
    session: aiohttp.ClientSession, url: str, peers: int, process: subprocess.Popen[bytes]
) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = await get_text(session, f"{url}/status")
        if text and len(orjson.loads(text).get("peers", {}).get("peers", [])) >= peers:
            return
        if process.poll() is not None:
            raise RuntimeError(f"router {url} exited")
        await asyncio.sleep(0.2)
    raise RuntimeError(f"router {url} did not hear its {peers} peers")


async def drive_spread(
    urls: Sequence[str], workload: Workload, concurrency: int, max_tokens: int
) -> tuple[list[Outcome], float]:
    """As `policies.drive`, the k-th request of the workload through router k mod len(urls)."""
    threads: dict[int, list[tuple[int, BenchRequest]]] = {}
    for index, request in enumerate(workload.requests):
        threads.setdefault(request.thread, []).append((index, request))
    gate = asyncio.Semaphore(concurrency)
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def thread(requests: list[tuple[int, BenchRequest]]) -> None:
            for index, request in requests:
                body = orjson.dumps(request.body(TINY_MODEL_NAME, max_tokens, stream=True))
                url = f"{urls[index % len(urls)]}/v1/chat/completions"
                async with gate:
                    outcomes.append(await _one(session, url, body))

        started = time.perf_counter()
        await asyncio.gather(*(thread(requests) for requests in threads.values()))
        return outcomes, time.perf_counter() - started


async def run_tier(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    fleet: Fleet,
    name: str,
    workload: Workload,
    tier: str,
    oracle: float,
    tokenizer: Path,
    run: int,
) -> TierRow:
    await reset_caches(session, fleet)
    count = 1 if tier == "one" else args.routers
    peered = tier in ("shared", "through_one")
    routers = await start_routers(session, fleet, count, peered, tokenizer, args.dpserve_args.split())
    urls = [url for _, url in routers][: 1 if tier == "through_one" else None]
    try:
        await asyncio.sleep(1.0)  # subscribers connected, first probes done
        before = await replica_counters(session, fleet)
        outcomes, seconds = await drive_spread(urls, workload, args.concurrency, args.max_tokens)
        after = await replica_counters(session, fleet)
    finally:
        for process, _ in routers:
            terminate(process, 30)
    hits, queries, served = counter_deltas(before, after)
    ttfts = sorted(o.ttft_s * 1000 for o in outcomes if o.ok)
    return TierRow(
        workload=name,
        tier=tier,
        run=run,
        routers=count,
        requests=len(outcomes),
        errors=sum(1 for o in outcomes if not o.ok),
        hit_rate=round(hits / queries if queries else 0.0, 4),
        oracle=round(oracle, 4),
        hit_vs_one=math.nan,
        ttft_p50_ms=round(percentile(ttfts, 50), 1),
        ttft_p99_ms=round(percentile(ttfts, 99), 1),
        ttft_p99_vs_one=math.nan,
        req_per_s=round(len(outcomes) / seconds, 2),
        max_share=round(max_share(served), 3),
        per_replica="/".join(str(int(s)) for s in served),
    )


def grouped(workload: Workload) -> Workload:
    """The shared-prefix requests, each group's prompts one after another: a group's prompts reach the
    routers (in turn) within milliseconds of each other, before the replica that takes the first has
    prefilled it and said so in its KV events. What routers that share routes keep together and routers
    alone scatter."""
    requests = sorted(workload.requests, key=lambda r: r.group)
    return Workload("grouped", requests, workload.groups, workload.description.replace("interleaved", "grouped"))


def router_ports(count: int) -> int:
    """The first of `count` free ports below Linux's ephemeral range (32768+), which the many client
    connections of a run draw from: a port picked there can be taken before the router binds it."""
    for _ in range(200):
        start = random.randrange(20000, 32768 - count)
        if not busy_ports(range(start, start + count)):
            return start
    raise RuntimeError("no free ports below 32768")


def uniform_workload(args: argparse.Namespace) -> Workload:
    """Every prompt unique: nothing to keep together, only load to spread."""
    return shared_prefix(args.uniform_requests, 1, args.question_words, args.question_words, args.seed + 7)


PRESSURE_WORKLOADS = ("cache_pressure", "grouped_pressure")
"""Run on sims whose KV cache fits only a perfect partition of the groups."""


async def run_tiers(args: argparse.Namespace, work: Path, rows: list[TierRow], tokenizer: Path) -> None:
    workloads = build_workloads(args, "sim", args.replicas)
    workloads["uniform"] = uniform_workload(args)
    workloads["grouped"] = grouped(workloads["shared_prefix"])
    workloads["grouped_pressure"] = grouped(workloads["cache_pressure"])
    wanted = [w for w in args.workloads.split(",") if w]
    async with aiohttp.ClientSession() as session:
        fleet = await start_fleet(session, args, "sim", work, None, None)
        try:
            await tokenize_all(session, fleet, [workloads[w] for w in wanted])
            for name in (w for w in wanted if w not in PRESSURE_WORKLOADS):
                await run_workload(session, args, fleet, name, workloads[name], rows, tokenizer)
        finally:
            terminate(fleet.process, 60)
        pressured = [w for w in wanted if w in PRESSURE_WORKLOADS]
        if pressured:
            workload = workloads["cache_pressure"]  # grouped_pressure: the same requests, so the same capacity
            blocks = pressure_capacity(workload, fleet.block_size, args.replicas, args.concurrency, args.max_tokens)
            longest = max(len(r.token_ids) for r in workload.requests) + args.max_tokens
            max_len = min(blocks * fleet.block_size, 4096, math.ceil(longest / fleet.block_size + 1) * fleet.block_size)
            small = await start_fleet(session, args, "sim", work, blocks, max_len)
            try:
                for name in pressured:
                    await run_workload(session, args, small, name, workloads[name], rows, tokenizer)
            finally:
                terminate(small.process, 60)


async def run_workload(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    fleet: Fleet,
    name: str,
    workload: Workload,
    rows: list[TierRow],
    tokenizer: Path,
) -> None:
    # grouped: unbounded; grouped_pressure: the partitioned oracle, as cache_pressure's
    kind = "cache_pressure" if name in PRESSURE_WORKLOADS else name
    oracle = oracle_for(kind, workload, fleet, args.max_tokens) if name != "uniform" else 0.0
    progress(f"{name}: {workload.description}; {len(workload.requests)} requests")
    for run in range(args.repeat):
        for tier in (t for t in TIERS if t in args.tiers.split(",")):
            row = await run_tier(session, args, fleet, name, workload, tier, oracle, tokenizer, run)
            rows.append(row)
            one = next((r.hit_rate for r in rows if (r.workload, r.tier, r.run) == (name, "one", run)), 0.0)
            versus = f" ({row.hit_rate / one:.3f}x one)" if tier != "one" and one else ""
            progress(
                f"  run {run} {tier:7} x{row.routers}: hit {row.hit_rate:.3f}{versus}, ttft p50 {row.ttft_p50_ms:.0f} "
                f"p99 {row.ttft_p99_ms:.0f} ms, spread {row.per_replica} (max {row.max_share}), errors {row.errors}"
            )


def relate_runs(rows: Sequence[TierRow]) -> None:
    """Each run's hit rate and TTFT p99 relative to one router's in the same run (the tiers take turns, so
    the runs of one round shared the machine's state)."""
    ones = {(r.workload, r.run): r for r in rows if r.tier == "one" and r.run >= 0}
    for row in rows:
        one = ones.get((row.workload, row.run))
        if row.run < 0 or row.tier == "one" or one is None:
            continue
        row.hit_vs_one = round(row.hit_rate / one.hit_rate, 3) if one.hit_rate else math.nan
        row.ttft_p99_vs_one = round(row.ttft_p99_ms / one.ttft_p99_ms, 3) if one.ttft_p99_ms else math.nan


def summarize(rows: Sequence[TierRow]) -> list[TierRow]:
    """Per workload and tier over its runs: the mean hit rate and req/s, the median TTFT p50 and p99, errors
    and requests summed, the worst max share; hit rate and TTFT p99 relative to one router's."""
    means: list[TierRow] = []
    for workload in dict.fromkeys(r.workload for r in rows):
        one: TierRow | None = None
        for tier in TIERS:
            runs = [r for r in rows if r.workload == workload and r.tier == tier and r.run >= 0]
            if not runs:
                continue
            mean = TierRow(
                workload=workload,
                tier=tier,
                run=-1,
                routers=runs[0].routers,
                requests=sum(r.requests for r in runs),
                errors=sum(r.errors for r in runs),
                hit_rate=round(sum(r.hit_rate for r in runs) / len(runs), 4),
                oracle=runs[0].oracle,
                hit_vs_one=math.nan,
                # Medians: one run's stall on this shared machine moves a mean of three p99s by half.
                ttft_p50_ms=round(statistics.median(r.ttft_p50_ms for r in runs), 1),
                ttft_p99_ms=round(statistics.median(r.ttft_p99_ms for r in runs), 1),
                ttft_p99_vs_one=math.nan,
                req_per_s=round(sum(r.req_per_s for r in runs) / len(runs), 2),
                max_share=max(r.max_share for r in runs),
                per_replica=runs[-1].per_replica,
            )
            if tier == "one":
                one = mean
            elif one is not None:
                mean.hit_vs_one = round(mean.hit_rate / one.hit_rate, 3) if one.hit_rate else math.nan
                mean.ttft_p99_vs_one = round(mean.ttft_p99_ms / one.ttft_p99_ms, 3) if one.ttft_p99_ms else math.nan
            means.append(mean)
    return means


# -- restart behind haproxy --------------------------------------------------------------------------


def haproxy_config(port: int, routers: Sequence[str]) -> str:
    servers = "\n".join(
        f"  server router-{i} {url.removeprefix('http://')} check inter 200ms fall 1 rise 1"
        for i, url in enumerate(routers)
    )
    return f"""global
  maxconn 4096
defaults
  mode http
  timeout connect 2s
  timeout client 300s
  timeout server 300s
  # A connection refused (a router just killed, not yet marked down) goes to another router; a request
  # already sent is never sent twice.
  retries 3
  retry-on conn-failure
  option redispatch 1
frontend routers
  bind 127.0.0.1:{port}
  default_backend routers
backend routers
  balance roundrobin
  option httpchk GET /ready
  http-response set-header {ROUTER_HEADER} %[srv_name]
{servers}
"""


@dataclass
class Answer:
    started: float
    ended: float
    ok: bool
    router: str
    prompt_tokens: int
    cached_tokens: int
    error: str = ""


async def _answer(session: aiohttp.ClientSession, url: str, body: bytes, clock: float) -> Answer:
    started = time.monotonic() - clock
    router, usage = "", None
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            router = resp.headers.get(ROUTER_HEADER, "")
            if resp.status != 200:
                text = (await resp.read())[:200].decode(errors="replace")
                return Answer(started, time.monotonic() - clock, False, router, 0, 0, f"{resp.status}: {text}")
            done = False
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"usage"' in line:
                    found = orjson.loads(line[6:]).get("usage")
                    usage = found or usage
                if line.strip() == b"data: [DONE]":
                    done = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Answer(started, time.monotonic() - clock, False, router, 0, 0, f"{type(exc).__name__}: {exc}")
    ok = done and usage is not None
    prompt = int(usage.get("prompt_tokens", 0)) if usage else 0
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0) if usage else 0
    return Answer(started, time.monotonic() - clock, ok, router, prompt, cached, "" if ok else "incomplete answer")


def hit_rate(answers: Sequence[Answer]) -> float:
    prompt = sum(a.prompt_tokens for a in answers if a.ok)
    return sum(a.cached_tokens for a in answers if a.ok) / prompt if prompt else math.nan


async def run_restart(args: argparse.Namespace, work: Path, tokenizer: Path, rows: list[RestartRow]) -> None:
    workload = shared_prefix(args.restart_groups, 1000, args.prefix_words, args.question_words, args.seed + 3)
    async with aiohttp.ClientSession() as session:
        fleet = await start_fleet(session, args, "sim", work, None, None)
        try:
            for start in ("warm", "cold", "alone"):
                rows.append(await restart_once(session, args, fleet, workload, start, tokenizer, work))
                r = rows[-1]
                progress(
                    f"restart ({start}): steady {r.steady_hit_rate:.3f}, first {args.after:.0f} s after restart "
                    f"{r.first_minute_hit_rate:.3f} ({r.first_minute_vs_steady} of steady), first 20 requests "
                    f"{r.first_requests_hit_rate:.3f}; failed: {r.failed_in_flight} in flight on it, "
                    f"{r.failed_other} other, of {r.requests}"
                )
        finally:
            terminate(fleet.process, 60)


async def restart_once(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    fleet: Fleet,
    workload: Workload,
    start: str,
    tokenizer: Path,
    work: Path,
) -> RestartRow:
    await reset_caches(session, fleet)
    ports = [router_ports(1) for _ in range(args.routers)]
    peered = start != "alone"
    routers = await start_routers(session, fleet, args.routers, peered, tokenizer, args.dpserve_args.split(), ports)
    balancer_port = router_ports(1)
    config = work / f"haproxy-{start}.cfg"
    config.write_text(haproxy_config(balancer_port, [url for _, url in routers]))
    balancer = spawn([HAPROXY, "-f", str(config), "-db"], work / f"haproxy-{start}.log", dict(os.environ))
    victim = 1
    name = f"router-{victim}"
    answers: list[Answer] = []
    clock = time.monotonic()
    kill_at = args.steady
    restarted_at = math.nan
    try:
        await wait_ok(session, f"http://127.0.0.1:{balancer_port}/ready", 30, balancer)
        url = f"http://127.0.0.1:{balancer_port}/v1/chat/completions"
        stop_at = args.steady + args.after + 5
        requests = workload.requests
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as client:
            counter = iter(range(10**9))

            async def user() -> None:
                while time.monotonic() - clock < stop_at:
                    request = requests[next(counter) % len(requests)]
                    body = request.body(TINY_MODEL_NAME, args.max_tokens, stream=True)
                    body["stream_options"] = {"include_usage": True}
                    answers.append(await _answer(client, url, orjson.dumps(body), clock))

            users = [asyncio.create_task(user()) for _ in range(args.concurrency)]
            await asyncio.sleep(kill_at)
            process, router_url = routers[victim]
            kill_at = time.monotonic() - clock
            process.kill()
            process.wait()
            # Started again at once on its port, as a supervisor (systemd, Kubernetes) would.
            extra = [*args.dpserve_args.split(), *(["--warm-start-timeout", "0"] if start == "cold" else [])]
            peers = [f"--peer=http://127.0.0.1:{p}" for p in ports if p != ports[victim]] if peered else []
            command = contender_command(
                Contender("dpserve", "kv_aware"), fleet, ports[victim], tokenizer, [*peers, *extra]
            )
            routers[victim] = (spawn(command, None, dict(os.environ)), router_url)
            await wait_ok(session, f"{router_url}/ready", 60, routers[victim][0])
            restarted_at = time.monotonic() - clock
            await asyncio.gather(*users)
    finally:
        terminate(balancer, 10)
        for process, _ in routers:
            terminate(process, 30)
    before = [a for a in answers if a.router == name and args.steady / 3 <= a.started < kill_at]
    fleet_before = [a for a in answers if args.steady / 3 <= a.started < kill_at]
    after = sorted((a for a in answers if a.router == name and a.started >= restarted_at), key=lambda a: a.started)
    window = [a for a in after if a.started < restarted_at + args.after]
    failed = [a for a in answers if not a.ok]
    # In flight on the killed router: started before the kill, ended by it; one cut before its headers came
    # back through haproxy names no router, and counts as the killed router's when it ended with the kill.
    in_flight = [
        a
        for a in failed
        if a.started < kill_at <= a.ended and (a.router == name or (not a.router and a.ended < kill_at + 1.0))
    ]
    for answer in [a for a in failed if a not in in_flight][:5]:
        progress(
            f"  failed ({answer.router or 'no router'}, {answer.started:.2f}-{answer.ended:.2f} s): {answer.error}"
        )
    steady = hit_rate(before)
    first = hit_rate(window)
    return RestartRow(
        start=start,
        steady_hit_rate=round(steady, 4),
        fleet_steady_hit_rate=round(hit_rate(fleet_before), 4),
        first_minute_hit_rate=round(first, 4),
        first_minute_vs_steady=round(first / steady, 3) if steady else math.nan,
        first_requests_hit_rate=round(hit_rate(after[:20]), 4),
        restarted_after_s=round(restarted_at - kill_at, 2),
        requests=len(answers),
        failed_in_flight=len(in_flight),
        failed_other=len(failed) - len(in_flight),
    )


# -- workers -----------------------------------------------------------------------------------------


async def run_workers(args: argparse.Namespace, work: Path, rows: list[WorkerRow], tokenizer: Path) -> None:
    """kv_aware with KV events and the router-side tokenizer: the full per-request path, sharing included."""
    count = args.worker_sims
    ports = UpPorts.free(count)
    command = ports.command(work / "workers-sims", "least_loaded")
    command += ["--sim", str(count), "--", "--decode-ms-per-token", "0", "--prefill-ms-per-token", "0"]
    body = orjson.dumps({"model": TINY_MODEL_NAME, "prompt": "hi there, a short prompt", "max_tokens": 4})
    cases = [("alone", 1)] + [("peered", 1)] * ("peered" in args.worker_cases)
    cases += [("workers", int(w)) for w in args.workers.split(",") if w and int(w) > 1]
    if "vllm-router" in args.worker_cases and bench_tool("vllm-router"):
        cases.append(("vllm-router", 0))
    async with aiohttp.ClientSession() as session:
        up = await start_up(session, ports, command, work / "workers-up.log", dict(os.environ), 120)
        try:
            for run in range(args.repeat):
                for case, workers in cases:
                    rows.append(await measure_workers(session, args, ports, case, workers, body, tokenizer, run))
                    r = rows[-1]
                    progress(f"  run {run} {case} x{workers}: {r.req_per_s:.0f} req/s, p50 {r.p50_ms:.1f} ms")
        finally:
            terminate(up, 60)


async def measure_workers(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    ports: UpPorts,
    case: str,
    workers: int,
    body: bytes,
    tokenizer: Path,
    run: int,
) -> WorkerRow:
    """`case` alone: one router process; peered: the same with an idle peer router it shares with (what
    sharing costs per request); workers: `--workers N` behind the one port; vllm-router: the Rust router
    (cache_aware) on the same sims, for scale."""
    port, peer_port = router_ports(2), router_ports(1)  # vllm-router: +1 metrics
    urls, events = ports.replica_urls, ports.kv_endpoints

    def command(own: int, other: int | None) -> list[str]:
        if case == "vllm-router":  # its own cache-aware policy (no tokenizer), its own threads
            return router_command("vllm-router", "cache_aware", urls, own)
        extra = [f"--workers={workers}", "--gpu-interval=0", *([f"--peer=http://127.0.0.1:{other}"] if other else [])]
        return router_command("dpserve", "kv_aware", urls, own, kv_events=events, tokenizer=str(tokenizer), extra=extra)

    processes = [spawn(command(port, peer_port if case == "peered" else None), None, dict(os.environ))]
    if case == "peered":
        processes.append(spawn(command(peer_port, port), None, dict(os.environ)))
    url = f"http://127.0.0.1:{port}"
    try:
        for process, process_port in zip(processes, (port, peer_port), strict=False):
            ready = "/v1/models" if case == "vllm-router" else "/ready"
            await wait_ok(session, f"http://127.0.0.1:{process_port}{ready}", 60, process)
        await asyncio.sleep(2.0)  # every worker up and peered
        load = python_command(f"{url}/v1/completions", body, args.worker_connections, args.worker_seconds)
        measured = [psutil.Process(processes[0].pid)]
        cpu_before = cpu_seconds(measured)
        result = (await asyncio.to_thread(run_all, [load], args.worker_seconds))[0]
        # The measured router's own CPU (its workers included) per answer: what sharing adds to a request,
        # apart from the idle peer's process competing for this machine's cores.
        cpu_us = (cpu_seconds(measured) - cpu_before) / max(1, result.requests) * 1e6
    finally:
        for process in processes:
            terminate(process, 30)
    return WorkerRow(
        case,
        workers,
        run,
        round(result.rps, 1),
        round(result.p50_ms, 2),
        round(result.p99_ms, 2),
        round(cpu_us, 1),
        result.errors,
    )


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpserve bench routers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts",
        type=Names(("tiers", "restart", "workers")),
        default="tiers,restart,workers",
        help="of tiers, restart, workers",
    )
    parser.add_argument("--replicas", type=COUNT, default=8, help="sims")
    parser.add_argument("--routers", type=COUNT, default=4)
    parser.add_argument(
        "--workloads",
        type=Names(("shared_prefix", "grouped", "multi_turn", "cache_pressure", "grouped_pressure", "uniform")),
        default="shared_prefix,grouped,multi_turn,cache_pressure,grouped_pressure,uniform",
        help="tiers' workloads",
    )
    parser.add_argument("--groups", type=COUNT, help="shared-prefix groups (default 4 per replica)")
    parser.add_argument("--prompts", type=COUNT, default=6, help="prompts per group")
    parser.add_argument("--conversations", type=COUNT, help="multi-turn conversations (default 4 per replica)")
    parser.add_argument("--turns", type=COUNT, default=5)
    parser.add_argument("--prefix-words", type=COUNT, default=350)
    parser.add_argument("--question-words", type=COUNT, default=30)
    parser.add_argument("--uniform-requests", type=COUNT, default=512)
    parser.add_argument("--tiers", type=Names(TIERS), default=",".join(TIERS), help="of " + ", ".join(TIERS))
    parser.add_argument("--repeat", type=COUNT, default=3, help="runs of every tier, taking turns")
    parser.add_argument("--max-tokens", type=COUNT, default=8)
    parser.add_argument("--concurrency", type=COUNT, default=16)
    parser.add_argument("--sim-block-size", type=COUNT, default=16)
    parser.add_argument("--sim-speed", type=NON_NEGATIVE, default=1.0)
    parser.add_argument("--seed", type=WHOLE, default=0)
    parser.add_argument("--restart-groups", type=COUNT, default=32, help="restart: shared-prefix groups")
    parser.add_argument("--steady", type=POSITIVE, default=30.0, help="restart: seconds before the kill")
    parser.add_argument("--after", type=POSITIVE, default=60.0, help="restart: seconds measured after the restart")
    parser.add_argument("--workers", type=counts, default="1,2,4", help="worker counts to measure")
    parser.add_argument("--worker-sims", type=COUNT, default=2)
    parser.add_argument(
        "--worker-cases",
        type=Names(("peered", "vllm-router"), empty=True),
        default="peered,vllm-router",
        help="`peered`: also one router with an idle peer; `vllm-router`: also vllm-router cache_aware",
    )
    parser.add_argument("--worker-connections", type=COUNT, default=32)
    parser.add_argument("--worker-seconds", type=POSITIVE, default=10.0)
    parser.add_argument("--dpserve-args", default="", help="extra flags for every dpserve router")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--out", type=Path, default=Path("bench-results/routers"))
    args = parser.parse_args(list(argv))
    args.dpserve_args += " --probe-interval 0.5"
    return args


TIER_HEADER = (  # the mean of the runs per workload and tier
    "workload", "tier", "routers", "requests", "errors", "hit rate", "oracle", "vs one",
    "ttft p50 ms", "ttft p99 ms", "p99 vs one", "req/s", "max share", "per replica",
)  # fmt: skip


def worker_means(rows: Sequence[WorkerRow]) -> list[tuple[str, ...]]:
    """Per case and worker count: the mean req/s and latencies of its runs."""
    means = []
    for case, workers in dict.fromkeys((r.case, r.workers) for r in rows):
        runs = [r for r in rows if r.case == case and r.workers == workers]
        keys = ("req_per_s", "p50_ms", "p99_ms", "router_cpu_us")
        mean = {k: round(sum(getattr(r, k) for r in runs) / len(runs), 2) for k in keys}
        errors = sum(r.errors for r in runs)
        means.append((case, str(workers), str(len(runs)), *(str(v) for v in mean.values()), str(errors)))
    return means


EVERY_RUN = ("grouped_pressure",)
"""Workloads whose goal holds run by run, not on the mean: new prefixes in bursts under cache pressure,
where routers that disagree on one group's replica lose its hits in that run."""


def verdicts(tiers: Sequence[TierRow], restarts: Sequence[RestartRow]) -> list[tuple[str, bool]]:
    """The stated goals on this run's figures (the means, run -1; for EVERY_RUN workloads each run too): a
    line each, and whether it met them all."""
    lines = [run_verdict(row) for row in tiers if row.run >= 0 and row.tier == "shared" and row.workload in EVERY_RUN]
    for row in (r for r in tiers if r.run < 0):
        if row.tier == "shared" and row.workload != "uniform":
            alone = next((r for r in tiers if r.workload == row.workload and r.tier == "alone"), None)
            ok = row.hit_vs_one >= 0.95
            lines.append(
                (
                    f"{row.workload}: {row.routers} sharing routers hit {row.hit_vs_one:.2f}x one router's rate "
                    f"(goal >= 0.95){'' if alone is None else f'; alone {alone.hit_vs_one:.2f}x'}: {met(ok)}",
                    ok,
                )
            )
        if row.tier == "shared" and row.workload == "uniform":
            through = next((r for r in tiers if r.workload == "uniform" and r.tier == "through_one"), None)
            ok = row.max_share <= 1.25 and row.ttft_p99_vs_one <= 1.1
            lines.append(
                (
                    f"uniform: max replica share {row.max_share:.2f}x the mean (goal <= 1.25), TTFT p99 "
                    f"{row.ttft_p99_vs_one:.2f}x one router's (goal <= 1.1)"
                    + ("" if through is None else f"; all through one of them {through.ttft_p99_vs_one:.2f}x")
                    + f": {met(ok)}",
                    ok,
                )
            )
    for r in restarts:
        ok = r.failed_other == 0 and (r.start != "warm" or r.first_minute_vs_steady >= 0.9)
        lines.append(
            (
                f"restart ({r.start}): first minute {r.first_minute_vs_steady:.2f}x the steady hit rate "
                f"(goal >= 0.9 warm); {r.failed_other} failed requests not in flight on the killed router "
                f"(goal 0): {met(ok)}",
                ok,
            )
        )
    return lines


def run_verdict(row: TierRow) -> tuple[str, bool]:
    """One run of the sharing routers against one router in the same round: the hit rate kept, the load guard
    holding (no replica served over 1.5x the mean), nothing failed."""
    ok = row.hit_vs_one >= 0.95 and row.max_share <= 1.5 and row.errors == 0
    return (
        f"{row.workload} run {row.run}: {row.routers} sharing routers hit {row.hit_vs_one:.3f}x one router's rate "
        f"(goal >= 0.95), max replica share {row.max_share:.2f}x the mean (goal <= 1.5), {row.errors} errors "
        f"(goal 0): {met(ok)}",
        ok,
    )


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dpserve-bench-routers-"))
    tokenizer = ensure_tiny_model(args.cache_dir)
    tiers: list[TierRow] = []
    restarts: list[RestartRow] = []
    workers: list[WorkerRow] = []
    if "tiers" in parts:
        asyncio.run(run_tiers(args, work, tiers, tokenizer))
        relate_runs(tiers)
        tiers += summarize(tiers)
        write_csv(args.out / "routers.csv", [asdict(r) for r in tiers], [f.name for f in fields(TierRow)])
    if "restart" in parts and not Path(HAPROXY).exists():
        progress(f"restart: skipped, no {HAPROXY} (apt-get install haproxy; `make test` installs it)")
    elif "restart" in parts:
        asyncio.run(run_restart(args, work, tokenizer, restarts))
        write_csv(args.out / "restart.csv", [asdict(r) for r in restarts], [f.name for f in fields(RestartRow)])
    if "workers" in parts:
        asyncio.run(run_workers(args, work, workers, tokenizer))
        write_csv(args.out / "workers.csv", [asdict(r) for r in workers], [f.name for f in fields(WorkerRow)])
    tables = []
    if tiers:
        means = [r for r in tiers if r.run < 0]
        tables.append(
            format_table(TIER_HEADER, [tuple(str(v) for k, v in asdict(r).items() if k != "run") for r in means])
        )
    if restarts:
        header = tuple(f.name for f in fields(RestartRow))
        tables.append(format_table(header, [tuple(str(v) for v in asdict(r).values()) for r in restarts]))
    if workers:
        header = ("case", "workers", "runs", "req/s", "p50 ms", "p99 ms", "router CPU us/req", "errors")
        tables.append(format_table(header, worker_means(workers)))
    goals = verdicts(tiers, restarts)
    report = "\n\n".join(tables) + "\n\n" + "\n".join(line for line, _ in goals) + "\n"
    (args.out / "routers.md").write_text("```\n" + report + "```\n")
    print()
    print(report)
    print(f"wrote {shown(args.out)}/routers.md and its CSVs")
    return goals_status("routers", goals)
