"""`dpserve bench soak`: does the router's memory stay flat under minutes of prompts it has never seen?

For each policy (default kv_aware and prefix) it starts K `dpserve sim` replicas (KV events on, no waits)
and one `dpserve router` over them (`--kv-events` for each, as `dpserve up` gives them: kv_aware keeps the KV
index, prefix its text index and no KV index, since it reads no blocks). The KV index and the text prefix
index are bounded small enough
(DPSERVE_KV_INDEX_MAX_ENTRIES, DPSERVE_PREFIX_INDEX_MAX_CHUNKS) that the bounds are reached early; each sim
caches as many blocks as the KV bound, so together they hold more than the router may index and the
router's own bound, not the sims' evictions, is what limits its index.

A closed-loop aiohttp generator keeps --concurrency requests in flight for --duration seconds. Every
prompt is unique from its first word (a serial number), so no two requests share a block or a chunk:
the indexes only grow until their bounds evict. Requests alternate /v1/completions and
/v1/chat/completions, every other pair streamed. Every --sample-interval seconds it records the router
process's RSS and CPU (psutil) and the index sizes from the router's /metrics.

"Flat": the router's RSS grew by at most --max-growth-pct over the second half of the run, and no index
was ever above its bound. Prints a time series and a summary per policy; writes soak.csv and soak.png
under --out. Exit code 1 if any request failed, else 0 whatever the verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import aiohttp
import orjson
import psutil

from benchmarks.fleet import (
    UpPorts,
    get_text,
    progress,
    router_command,
    sigterm_unwinds,
    spawn,
    stop_all,
    wait_ok,
)
from benchmarks.report import figure, format_table, shown, write_csv
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE, WHOLE, Names
from dpserve.policies import POLICY_NAMES
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.up.process import log_tail

KV_ENTRIES = "dpserve_kv_index_entries"
KV_BOUND = "dpserve_kv_index_max_entries"
KV_EVICTED = "dpserve_kv_index_evicted_entries_total"
PREFIX_CHUNKS = "dpserve_prefix_index_chunks"
TOKEN_CACHE = "dpserve_token_cache_entries"
"""Not exposed by the router when this was written; read if it ever is."""
ROUTER_SERIES = frozenset({KV_ENTRIES, KV_BOUND, KV_EVICTED, PREFIX_CHUNKS, TOKEN_CACHE})
WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are have not but what all were "
    "when we there can one which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right "
    "look think also around another came come work three word must because does part even place well such "
    "router replica cache prefix token block model index memory request stream batch engine kernel tensor"
).split()
JSON_HEADERS = {"content-type": "application/json"}


@dataclass
class Sample:
    policy: str
    elapsed_s: float
    requests: int
    errors: int
    rss_mib: float
    router_cpu_pct: float
    """Of one core, since the previous sample."""
    kv_entries: int | None
    """None when the policy keeps no KV index (prefix: it reads no blocks)."""
    kv_bound: int
    kv_evicted: int | None
    prefix_chunks: int | None
    """None when the policy keeps no text index (kv_aware)."""
    prefix_bound: int
    token_cache_entries: int | None


@dataclass
class Counters:
    done: int = 0
    errors: int = 0
    kinds: Counter[str] = field(default_factory=Counter)


@dataclass
class Summary:
    policy: str
    requests: int
    req_per_s: float
    errors: int
    rss_start_mib: float
    """At the first sample after warm-up."""
    rss_max_mib: float
    rss_end_mib: float
    growth_mib: float
    """From the sample at half the run to the last one."""
    growth_pct: float
    kv_end: int | None
    kv_max: int | None
    kv_bound: int
    kv_reached_s: float | None
    prefix_end: int | None
    prefix_max: int | None
    prefix_bound: int
    prefix_reached_s: float | None
    problems: list[str]

    @property
    def flat(self) -> bool:
        return not self.problems


# -- load --------------------------------------------------------------------------------------------


class PromptMaker:
    """Unique prompts: a serial number and random bits as the first word, then random words."""

    def __init__(self, seed: int, words: int) -> None:
        self._rng = random.Random(seed)
        self._serial = itertools.count()
        self._words = words

    def next(self) -> tuple[int, str]:
        serial = next(self._serial)
        head = f"soak{serial:08d}x{self._rng.getrandbits(32):08x}"
        return serial, " ".join([head, *self._rng.choices(WORDS, k=self._words)])


def request_for(serial: int, text: str, max_tokens: int) -> tuple[str, bytes, bool]:
    """Path, body and whether it streams: endpoints alternate, every other pair streams."""
    stream = (serial // 2) % 2 == 1
    body: dict[str, object] = {"model": TINY_MODEL_NAME, "max_tokens": max_tokens, "stream": stream}
    if serial % 2:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", orjson.dumps(body), stream
    body["prompt"] = text
    return "/v1/completions", orjson.dumps(body), stream


async def send(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> str | None:
    """None when the request succeeded, else what went wrong."""
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
            data = await resp.read()
            if resp.status != 200:
                return f"HTTP {resp.status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__
    if stream and not data.rstrip().endswith(b"data: [DONE]"):
        return "stream cut short"
    if not stream and b'"choices"' not in data:
        return "answer without choices"
    return None


async def worker(
    session: aiohttp.ClientSession,
    router_url: str,
    prompts: PromptMaker,
    counters: Counters,
    deadline: float,
    max_tokens: int,
) -> None:
    while time.monotonic() < deadline:
        serial, text = prompts.next()
        path, body, stream = request_for(serial, text, max_tokens)
        error = await send(session, router_url + path, body, stream)
        if error is None:
            counters.done += 1
        else:
            counters.errors += 1
            counters.kinds[error] += 1


# -- sampling ----------------------------------------------------------------------------------------


class RouterProbe:
    """The router process's RSS and CPU (its pid only) and the index sizes its /metrics reports."""

    def __init__(self, pid: int, router_url: str, policy: str, kv_bound: int, prefix_bound: int) -> None:
        self._process = psutil.Process(pid)
        self._metrics_url = f"{router_url}/metrics"
        self._policy = policy
        self._kv_bound = kv_bound
        self._prefix_bound = prefix_bound
        self._last_cpu = self._cpu_s()
        self._last_at = time.monotonic()

    def _cpu_s(self) -> float:
        times = self._process.cpu_times()
        return float(times.user + times.system)  # psutil ships no types

    def _cpu_pct(self) -> float:
        cpu, now = self._cpu_s(), time.monotonic()
        pct = (cpu - self._last_cpu) / max(now - self._last_at, 1e-6) * 100
        self._last_cpu, self._last_at = cpu, now
        return round(pct, 1)

    async def sample(self, session: aiohttp.ClientSession, elapsed_s: float, counters: Counters) -> Sample:
        text = await get_text(session, self._metrics_url) or ""
        series = parse_samples(text, ROUTER_SERIES)

        def read(name: str) -> int | None:
            value = series.total(name)
            return None if value is None else int(value)

        return Sample(
            policy=self._policy,
            elapsed_s=round(elapsed_s, 1),
            requests=counters.done,
            errors=counters.errors,
            rss_mib=round(self._process.memory_info().rss / 2**20, 1),
            router_cpu_pct=self._cpu_pct(),
            kv_entries=read(KV_ENTRIES),
            # The router's own figure when it reports one: the test then checks what it really used.
            kv_bound=read(KV_BOUND) or self._kv_bound,
            kv_evicted=read(KV_EVICTED),
            prefix_chunks=read(PREFIX_CHUNKS),
            prefix_bound=self._prefix_bound,
            token_cache_entries=read(TOKEN_CACHE),
        )


def sample_line(sample: Sample) -> str:
    prefix = "" if sample.prefix_chunks is None else f", prefix chunks {sample.prefix_chunks}/{sample.prefix_bound}"
    return (
        f"  {sample.policy} t={sample.elapsed_s:5.0f}s: {sample.requests} requests, {sample.errors} errors, "
        f"RSS {sample.rss_mib:.1f} MiB, CPU {sample.router_cpu_pct:.0f}%, "
        f"kv entries {sample.kv_entries}/{sample.kv_bound}{prefix}"
    )


async def drive_and_sample(
    args: argparse.Namespace, router_url: str, probe: RouterProbe
) -> tuple[list[Sample], Counters]:
    """Load for --duration seconds, a sample at every tick and one after the last request."""
    counters = Counters()
    prompts = PromptMaker(args.seed, args.prompt_words)
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as load,
        aiohttp.ClientSession() as control,
    ):
        started = time.monotonic()
        deadline = started + args.duration
        tasks = [
            asyncio.create_task(worker(load, router_url, prompts, counters, deadline, args.max_tokens))
            for _ in range(args.concurrency)
        ]
        try:
            tick = started
            while tick < deadline:
                samples.append(await probe.sample(control, time.monotonic() - started, counters))
                progress(sample_line(samples[-1]))
                tick += args.sample_interval
                await asyncio.sleep(max(0.0, min(tick, deadline) - time.monotonic()))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        samples.append(await probe.sample(control, time.monotonic() - started, counters))
        progress(sample_line(samples[-1]))
    return samples, counters


# -- processes ---------------------------------------------------------------------------------------


def sim_command(args: argparse.Namespace, port: int, kv_endpoint: str) -> list[str]:
    command = [sys.executable, "-m", "dpserve", "sim", "--port", str(port), "--speed", str(args.sim_speed)]
    command += ["--kv-events", kv_endpoint, "--num-blocks", str(args.sim_num_blocks or args.kv_index_max_entries)]
    return [*command, "--tokenizer", args.sim_tokenizer, "--log-level", "warning"]


def soak_router_command(policy: str, ports: UpPorts) -> list[str]:
    port = ports.base + 2 * ports.count  # UpPorts' layout: replicas, their KV-event ports, the router
    # Remote tokens: the router needs no model files; GPU telemetry off: these hosts have none.
    return router_command(
        "dpserve",
        policy,
        ports.replica_urls,
        port,
        kv_events=ports.kv_endpoints,
        tokenizer="remote",
        settings={"gpu_interval_s": 0.0},
    )


def router_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        **os.environ,
        "DPSERVE_KV_INDEX_MAX_ENTRIES": str(args.kv_index_max_entries),
        "DPSERVE_PREFIX_INDEX_MAX_CHUNKS": str(args.prefix_index_max_chunks),
    }


async def wait_started(
    session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes], log_path: Path
) -> None:
    try:
        await wait_ok(session, url, 60, process)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; {log_path}:\n{log_tail(log_path)}") from None


async def soak_policy(
    args: argparse.Namespace, policy: str, processes: list[subprocess.Popen[bytes]]
) -> tuple[list[Sample], Counters]:
    """Start the sims and the router (appended to `processes`, which the caller stops) and soak them."""
    ports = UpPorts.free(args.replicas)
    logs = args.out / "logs"
    async with aiohttp.ClientSession() as session:
        for index, (url, endpoint) in enumerate(zip(ports.replica_urls, ports.kv_endpoints, strict=True)):
            log_path = logs / f"{policy}-sim{index}.log"
            processes.append(spawn(sim_command(args, ports.base + index, endpoint), log_path, dict(os.environ)))
            await wait_started(session, f"{url}/health", processes[-1], log_path)
        # The sims answer before the router starts, so its first probes find every replica healthy.
        log_path = logs / f"{policy}-router.log"
        router = spawn(soak_router_command(policy, ports), log_path, router_env(args))
        processes.append(router)
        await wait_started(session, f"{ports.router_url}/ready", router, log_path)
    await asyncio.sleep(1.0)  # ZMQ subscribers connected: no event lost to a late subscription
    probe = RouterProbe(router.pid, ports.router_url, policy, args.kv_index_max_entries, args.prefix_index_max_chunks)
    return await drive_and_sample(args, ports.router_url, probe)


def run_policy(args: argparse.Namespace, policy: str) -> tuple[list[Sample], Counters]:
    processes: list[subprocess.Popen[bytes]] = []
    try:
        return asyncio.run(soak_policy(args, policy, processes))
    finally:
        stop_all(processes, 30)


# -- summary -----------------------------------------------------------------------------------------


def first_at_or_after(samples: Sequence[Sample], elapsed_s: float) -> Sample:
    return next((s for s in samples if s.elapsed_s >= elapsed_s), samples[-1])


def index_figures(sizes: Sequence[tuple[float, int | None]], bound: int) -> tuple[int | None, int | None, float | None]:
    """Size at the end, largest size, and when it first reached `bound` (None if never)."""
    known = [(t, size) for t, size in sizes if size is not None]
    if not known:
        return None, None, None
    reached = next((t for t, size in known if size >= bound), None)
    return known[-1][1], max(size for _, size in known), reached


def summarize(args: argparse.Namespace, samples: Sequence[Sample], counters: Counters) -> Summary:
    start = first_at_or_after(samples, args.warmup)
    middle = first_at_or_after(samples, args.duration / 2)
    end = samples[-1]
    kv_bound = end.kv_bound
    kv_end, kv_max, kv_reached = index_figures([(s.elapsed_s, s.kv_entries) for s in samples], kv_bound)
    prefix_bound = end.prefix_bound
    prefix_end, prefix_max, prefix_reached = index_figures(
        [(s.elapsed_s, s.prefix_chunks) for s in samples], prefix_bound
    )
    growth = end.rss_mib - middle.rss_mib
    growth_pct = growth / middle.rss_mib * 100 if middle.rss_mib else 0.0
    problems = []
    if growth_pct > args.max_growth_pct:
        problems.append(f"RSS grew {growth_pct:.1f}% > {args.max_growth_pct:g}% over the second half")
    if kv_max is None and prefix_max is None:
        problems.append("no index size read from /metrics")
    if kv_max is not None and kv_max > kv_bound:
        problems.append(f"KV index reached {kv_max} > bound {kv_bound}")
    if prefix_max is not None and prefix_max > prefix_bound:
        problems.append(f"prefix index reached {prefix_max} > bound {prefix_bound}")
    return Summary(
        policy=end.policy,
        requests=counters.done,
        req_per_s=round(counters.done / end.elapsed_s, 1) if end.elapsed_s else 0.0,
        errors=counters.errors,
        rss_start_mib=start.rss_mib,
        rss_max_mib=max(s.rss_mib for s in samples),
        rss_end_mib=end.rss_mib,
        growth_mib=round(growth, 1),
        growth_pct=round(growth_pct, 1),
        kv_end=kv_end,
        kv_max=kv_max,
        kv_bound=kv_bound,
        kv_reached_s=kv_reached,
        prefix_end=prefix_end,
        prefix_max=prefix_max,
        prefix_bound=prefix_bound,
        prefix_reached_s=prefix_reached,
        problems=problems,
    )


# -- output ------------------------------------------------------------------------------------------


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def format_series(samples: Sequence[Sample]) -> str:
    header = ("t_s", "requests", "errors", "rss_MiB", "cpu_%", "kv_entries", "kv_evicted", "prefix_chunks", "tokens")
    lines = []
    for s in samples:
        values = (s.elapsed_s, s.requests, s.errors, s.rss_mib, s.router_cpu_pct, s.kv_entries, s.kv_evicted)
        lines.append(tuple(_cell(v) for v in (*values, s.prefix_chunks, s.token_cache_entries)))
    return format_table(header, lines, align="right")


def _bound_text(end: int | None, largest: int | None, bound: int, reached_s: float | None) -> str:
    when = f"reached at {reached_s:.0f}s" if reached_s is not None else "never reached"
    return f"{_cell(end)}/{bound} (max {_cell(largest)}, {when})"


def summary_line(s: Summary) -> str:
    prefix = ""
    if s.prefix_max is not None:
        prefix = "; prefix chunks " + _bound_text(s.prefix_end, s.prefix_max, s.prefix_bound, s.prefix_reached_s)
    return (
        f"{s.policy}: {s.requests} requests, {s.req_per_s} req/s, {s.errors} errors; router RSS start "
        f"{s.rss_start_mib} MiB, max {s.rss_max_mib} MiB, end {s.rss_end_mib} MiB, second half "
        f"{s.growth_mib:+.1f} MiB ({s.growth_pct:+.1f}%); kv entries "
        f"{_bound_text(s.kv_end, s.kv_max, s.kv_bound, s.kv_reached_s)}{prefix}"
    )


def late_bounds(s: Summary, duration_s: float) -> list[str]:
    """Bounds not reached by half the run: their filling is then part of the second-half growth."""
    late = []
    for name, present, reached in (("KV", s.kv_max, s.kv_reached_s), ("prefix", s.prefix_max, s.prefix_reached_s)):
        if present is not None and (reached is None or reached > duration_s / 2):
            late.append(f"{name} index bound not reached by half the run: lower it or run longer")
    return late


def verdict_line(s: Summary, threshold_pct: float) -> str:
    if s.flat:
        return f"{s.policy}: FLAT (second-half growth {s.growth_pct:+.1f}% <= {threshold_pct:g}%; indexes in bounds)"
    return f"{s.policy}: NOT FLAT ({'; '.join(s.problems)})"


def known(points: Sequence[tuple[float, int | None]]) -> tuple[list[float], list[int]]:
    """Times and values of the points whose value was read."""
    pairs = [(t, value) for t, value in points if value is not None]
    return [t for t, _ in pairs], [value for _, value in pairs]


def plot(samples: Sequence[Sample], path: Path) -> None:
    titles = ("router RSS (MiB)", "router index sizes (from /metrics)")
    with figure(path, titles, (13, 5), xlabel="seconds") as (rss_axis, index_axis):
        for policy in dict.fromkeys(s.policy for s in samples):
            mine = [s for s in samples if s.policy == policy]
            times = [s.elapsed_s for s in mine]
            line = rss_axis.plot(times, [s.rss_mib for s in mine], marker=".", label=policy)[0]
            entries = known([(s.elapsed_s, s.kv_entries) for s in mine])
            index_axis.plot(*entries, color=line.get_color(), label=f"{policy}: KV index entries")
            chunks = known([(s.elapsed_s, s.prefix_chunks) for s in mine])
            if chunks[0]:
                index_axis.plot(*chunks, color=line.get_color(), ls="--", label=f"{policy}: prefix index chunks")
        end = samples[-1]
        index_axis.axhline(end.kv_bound, color="grey", ls=":", label="KV index bound")
        if any(s.prefix_chunks is not None for s in samples):
            index_axis.axhline(end.prefix_bound, color="black", ls=":", label="prefix index bound")
        rss_axis.set_ylim(0, None)


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpserve bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--policies", type=Names(POLICY_NAMES), default="kv_aware,prefix", help="comma-separated router policies"
    )
    parser.add_argument("--replicas", type=COUNT, default=2, help="sims behind each router (2)")
    parser.add_argument("--duration", type=POSITIVE, default=120.0, help="seconds of load per policy (120)")
    parser.add_argument("--sample-interval", type=POSITIVE, default=5.0, help="seconds between samples (5)")
    parser.add_argument("--warmup", type=NON_NEGATIVE, default=10.0, help="seconds before the 'start' RSS figure (10)")
    parser.add_argument("--concurrency", type=COUNT, default=16, help="requests in flight (16)")
    # Small enough that both bounds are reached in the first quarter of a default run (about 200 req/s here).
    parser.add_argument("--kv-index-max-entries", type=COUNT, default=100_000, help="KV index bound (100000)")
    parser.add_argument("--prefix-index-max-chunks", type=COUNT, default=50_000, help="text index bound (50000)")
    parser.add_argument("--sim-num-blocks", type=COUNT, help="each sim's KV cache in blocks (default: the KV bound)")
    parser.add_argument("--sim-speed", type=NON_NEGATIVE, default=0.0, help="sim time scale (0: no waits)")
    parser.add_argument("--sim-tokenizer", choices=("tiny", "fast"), default="fast", help="the sims' tokenizer")
    parser.add_argument("--prompt-words", type=COUNT, default=150, help="random words after the unique first word")
    parser.add_argument("--max-tokens", type=COUNT, default=4)
    parser.add_argument("--max-growth-pct", type=NON_NEGATIVE, default=10.0, help="'flat' threshold (10)")
    parser.add_argument("--seed", type=WHOLE, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/soak"))
    args = parser.parse_args(list(argv))
    args.policy_list = [p for p in args.policies.split(",") if p]
    if not args.policy_list:
        parser.error("--policies names no policy")
    if args.duration <= 0 or args.sample_interval <= 0 or args.replicas < 1 or args.concurrency < 1:
        parser.error("--duration, --sample-interval, --replicas and --concurrency must be positive")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    samples: list[Sample] = []
    summaries: list[Summary] = []
    with sigterm_unwinds():
        for policy in args.policy_list:
            progress(f"{policy}: {args.replicas} sims, {args.duration:g}s at concurrency {args.concurrency} ...")
            mine, counters = run_policy(args, policy)
            samples += mine
            summaries.append(summarize(args, mine, counters))
            if counters.kinds:
                progress(f"{policy}: errors by kind: {dict(counters.kinds)}")
            # After every policy: a cut-short run keeps what it had.
            write_csv(args.out / "soak.csv", [asdict(s) for s in samples], [f.name for f in fields(Sample)])
    plot(samples, args.out / "soak.png")
    for summary in summaries:
        print(f"\n{summary.policy}:")
        print(format_series([s for s in samples if s.policy == summary.policy]))
    print()
    for summary in summaries:
        print(summary_line(summary))
    print()
    for summary in summaries:
        print(verdict_line(summary, args.max_growth_pct))
        for note in late_bounds(summary, args.duration):
            print(f"  note: {note}")
    print(f"\nwrote {shown(args.out / 'soak.csv')}, {shown(args.out / 'soak.png')}")
    return 1 if any(s.errors for s in summaries) else 0
