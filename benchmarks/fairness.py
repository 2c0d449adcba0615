"""`dpserve bench fairness`: does the router's flow control keep a light tenant's latency low beside a heavy
one, without losing throughput, and do priority classes hold under a flood of batch requests?

Each experiment starts its replicas once with `dpserve up` (the up's own router stays idle) and each
contender on a fresh router over them. The clients are asyncio + aiohttp closed loops in this process:
one session per tenant, each of its streams sending a streamed chat completion as its last one ends, the
tenant and class in the `x-dpserve-tenant` and `x-dpserve-priority` headers (no API keys are configured,
so every caller may name its tenant). Every request is recorded: tenant, start, TTFT (to the first content
chunk), end, status and error code. A refused request (any non-200) pauses its stream for `--retry-pause`.

A run is a warm-up (the router learns each replica's capacity from its metrics: two scrapes in a row with
requests waiting), then a measured window. TTFT counts the requests that started in the window, throughput
(answers/s, tokens/s) the answers that ended in it; the loops go on until every request started in the
window has ended, so the slowest ones are counted too. Meanwhile the replicas' `vllm:num_requests_running`
and `vllm:num_requests_waiting`, dpserve's `dpserve_queue_depth` (means over the window) and the capacity
it has learned for each replica (`/status`: the lowest and highest seen) are sampled every 0.5 s, and
dpserve's `GET /admin/usage`, read at both ends, gives each tenant's mean wait in its queue.

1. noisy (sims). 2 `dpserve sim` replicas with `--max-num-seqs 4`, 32-token answers. Tenant A keeps 64
   streams going, tenant B 2, both standard. Contenders: dpserve with flow control (the default, least
   loaded), dpserve `--flow-control off` (first come, first served: requests wait in vLLM's own queue),
   vllm-router (power_of_two). Baselines: A alone (the fleet's throughput) through dpserve, with flow
   control and without, and B alone (B's TTFT, and its service time: the median from an answer's first
   token to its last). Goals, with flow control: B's TTFT p50 <= 0.25x A's in the same window; B's TTFT
   p50 <= B alone's p50 + one service time; fleet tokens/s >= 0.95x A alone's (with flow control; the
   ratio to A alone without it is reported too).
2. vllm. The same on 2 real vLLM CPU replicas of the tiny model (`--max-num-seqs 4`; `ignore_eos`, so every
   answer is max_tokens long), 24-token answers, 10 s warm-up and 30 s window: A 16 streams (its queue
   about one round of the fleet's 8 slots deep), then A 64 (as deep as on the sims), B 2 each time.
3. priority (sims). A tenant sending `critical` requests alone, then beside another tenant's flood of
   `batch` requests (64 streams) with `--queue-size 16`, so that the flood overflows the replicas' capacity
   and the queue: critical TTFT flooded / alone (goal <= 1.2), and what became of the batch requests:
   answered, shed (429 `shed`: dropped from the queue for a more urgent request) or refused (429
   `queue_full`). Twice: 2 critical streams, which the batch reserve (a slot per replica of 4) should
   admit at once, and 8, which fill the fleet and must queue, so they shed batch requests from a full queue.
   Through dpserve with flow control and with `--flow-control off`.

With `--repeat N` every run is done N times, the runs of an experiment taking turns round after round (so
a slow spell on a shared machine hits them all), and the tables show each figure's median over the runs.

The client shares this machine's cores with the replicas and the router: the p99 of its event loop's
lateness over the window (a 10 ms sleep, `client lag`) is reported with each run.

Writes noisy.csv, priority.csv and fairness.md under --out, and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop

from benchmarks import streamed
from benchmarks.fleet import bench_tool, get_text, progress, router_command
from benchmarks.report import met, write_csv
from benchmarks.stats import percentile
from benchmarks.streamed import ms, table, ttft_ms
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE, counts
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.up.process import terminate

EXPERIMENTS = ("noisy", "vllm", "priority")
CONTENDERS = ("dpserve", "dpserve-off", "vllm-router")
TENANT_HEADER, PRIORITY_HEADER = "x-dpserve-tenant", "x-dpserve-priority"
RUNNING, WAITING, QUEUE_DEPTH = "vllm:num_requests_running", "vllm:num_requests_waiting", "dpserve_queue_depth"
SAMPLE_S = 0.5
REQUEST_TIMEOUT_S = 600.0
GOAL_B_OVER_A = 0.25
GOAL_THROUGHPUT = 0.95
GOAL_CRITICAL = 1.2


@dataclass(frozen=True)
class Load:
    """One tenant's closed loop: `streams` requests in flight at all times, of class `priority`."""

    tenant: str
    streams: int
    priority: str = "standard"


@dataclass(frozen=True)
class Window:
    warmup_s: float
    window_s: float

    @property
    def end(self) -> float:
        return self.warmup_s + self.window_s

    def holds(self, t: float) -> bool:
        return self.warmup_s <= t < self.end


@dataclass
class Record(streamed.Outcome):
    tenant: str
    start: float
    """Seconds since the run began."""
    end: float
    ttft: float
    """Seconds from start to the first content chunk; NaN without one."""
    status: int
    """HTTP status; 0: no answer (connection failed or timed out)."""
    code: str
    """Empty for a complete answer; else the error's `code` (shed, queue_full), `http_NNN`, `broken` (the
    stream ended without [DONE]), `stream_error` or `connection`."""
    tokens: int


@dataclass
class Gauges:
    """Means over a window of the fleet's running and waiting requests and the router's queue; the
    capacities dpserve had learned (`/status`), per replica the lowest and highest seen."""

    running: float = math.nan
    waiting: float = math.nan
    router_queue: float = math.nan
    capacity: str = ""


@dataclass
class Measured:
    records: list[Record]
    window: Window
    gauges: Gauges
    queue_ms: dict[str, float]
    """Tenant: mean wait in dpserve's queue over the window's answers (from /admin/usage); empty otherwise."""
    client_lag_ms: float
    """The p99 of how late this process's event loop woke from a 10 ms sleep over the window: what the
    client itself adds to the TTFTs it measures."""
    load_avg: float


@dataclass
class NoisyRow:
    backend: str
    load: str
    """The setup's tenants, `A64+B2`: its baselines run one of them alone."""
    contender: str
    run: int
    """0, 1, ...: the runs take turns, round after round; -1: the median of the runs (`summary`)."""
    a_streams: int
    b_streams: int
    a_answers: int
    a_errors: int
    a_ttft_p50_ms: float
    a_ttft_p99_ms: float
    b_answers: int
    b_errors: int
    b_ttft_p50_ms: float
    b_ttft_p99_ms: float
    b_over_a: float
    """B's TTFT p50 over A's, in the same window."""
    answers_per_s: float
    tokens_per_s: float
    vs_a_alone: float
    """Tokens/s over A alone's (through dpserve with flow control)."""
    vs_a_alone_off: float
    """Tokens/s over A alone's through dpserve with `--flow-control off` (vLLM's queue alone)."""
    vs_off: float
    """Tokens/s over the same tenants' through dpserve with `--flow-control off` in the same round (A alone:
    over A alone's without flow control): the pairing that shared cores disturb least."""
    b_service_ms: float
    """B's median time from first to last token."""
    b_answer_ms: float
    """B's median time from request to last token."""
    a_queue_ms: float
    b_queue_ms: float
    replica_running: float
    replica_waiting: float
    router_queue: float
    capacity: str
    """dpserve's learned capacity per replica over the window (`/status`): `N` or `LOW-HIGH`."""
    client_lag_ms: float
    load_avg: float
    """This machine's 1-minute load average as the run started."""
    errors: str
    """Error codes and counts over the window, every tenant."""


@dataclass
class PriorityRow:
    contender: str
    case: str
    run: int
    critical_streams: int
    batch_streams: int
    critical_answers: int
    critical_errors: int
    critical_ttft_p50_ms: float
    critical_ttft_p99_ms: float
    p50_vs_alone: float
    p99_vs_alone: float
    batch_answers: int
    batch_shed: int
    batch_queue_full: int
    batch_queue_timeout: int
    """Batch requests that waited past --queue-timeout: more urgent ones kept every slot that long."""
    batch_other_errors: int
    batch_ttft_p50_ms: float
    answers_per_s: float
    critical_queue_ms: float
    replica_running: float
    replica_waiting: float
    router_queue: float
    capacity: str
    client_lag_ms: float
    load_avg: float


# -- the clients -------------------------------------------------------------------------------------


def chat_body(tenant: str, number: int, max_tokens: int) -> bytes:
    """A short unique prompt; `ignore_eos` makes vLLM answer exactly `max_tokens` (the sim always does)."""
    prompt = f"{tenant} request {number}: tell me a story about a lighthouse keeper"
    return orjson.dumps(
        {
            "model": TINY_MODEL_NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )


def is_token(chunk: dict[str, Any]) -> bool:
    """A chunk that carries generated text: not the role-only opener (empty content), not a usage chunk."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content or (content is not None and "role" not in delta):
            return True
    return False


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], clock: Callable[[], float]
) -> Record:
    s = await streamed.request(session, url, body, headers, clock, is_token)
    return Record(headers[TENANT_HEADER], s.start, s.end, s.ttft, s.status, s.code, s.tokens)


class Driver:
    """The tenants' closed loops over one router, for one warm-up and window."""

    def __init__(self, url: str, loads: Sequence[Load], max_tokens: int, window: Window, pause_s: float) -> None:
        self.url = f"{url}/v1/chat/completions"
        self.loads = loads
        self.max_tokens = max_tokens
        self.window = window
        self.pause_s = pause_s
        self.records: list[Record] = []
        self.open_in_window = 0
        """Requests started in the window and not yet ended."""
        self.stop = asyncio.Event()
        self.began = time.perf_counter()

    def clock(self) -> float:
        return time.perf_counter() - self.began

    async def tenant(self, load: Load) -> None:
        headers = {"content-type": "application/json", TENANT_HEADER: load.tenant, PRIORITY_HEADER: load.priority}
        numbers = itertools.count()
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=load.streams)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def stream() -> None:
                while not self.stop.is_set():
                    body = chat_body(load.tenant, next(numbers), self.max_tokens)
                    counted = self.window.holds(self.clock())
                    self.open_in_window += counted
                    try:
                        record = await one_request(session, self.url, body, headers, self.clock)
                    finally:
                        self.open_in_window -= counted
                    self.records.append(record)
                    if not record.ok:
                        await asyncio.sleep(self.pause_s)

            await asyncio.gather(*(stream() for _ in range(load.streams)))

    async def run(self, drain_s: float) -> list[Record]:
        """Warm-up and window (from the driver's making); then until the window's requests have all ended
        (at most `drain_s`)."""
        tasks = [asyncio.create_task(self.tenant(load)) for load in self.loads]
        try:
            await asyncio.sleep(self.window.end)
            deadline = self.clock() + drain_s
            while self.open_in_window and self.clock() < deadline:
                if all(task.done() for task in tasks):
                    break
                await asyncio.sleep(0.05)
            if self.open_in_window:
                progress(f"  {self.open_in_window} requests of the window still open after {drain_s:.0f} s")
        finally:
            self.stop.set()
            for task in tasks:
                task.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
        for result in done:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
        return self.records


# -- what the replicas and the router show -----------------------------------------------------------


async def sample_gauges(
    session: aiohttp.ClientSession, replicas: Sequence[str], router: str | None, window: Window, began: float
) -> Gauges:
    """Every SAMPLE_S through the window: the fleet's running and waiting requests, dpserve's queue depth and
    learned capacities."""
    await asyncio.sleep(max(0.0, window.warmup_s - (time.perf_counter() - began)))
    running: list[float] = []
    waiting: list[float] = []
    queued: list[float] = []
    capacities: list[list[int]] = []
    while time.perf_counter() - began < window.end:
        texts = await asyncio.gather(*(get_text(session, f"{url}/metrics") for url in replicas))
        if all(texts):
            samples = [parse_samples(text or "", {RUNNING, WAITING}) for text in texts]
            running.append(sum(s.total(RUNNING) or 0.0 for s in samples))
            waiting.append(sum(s.total(WAITING) or 0.0 for s in samples))
        if router is not None:
            text = await get_text(session, f"{router}/metrics")
            depth = parse_samples(text or "", {QUEUE_DEPTH}).total(QUEUE_DEPTH)
            if depth is not None:
                queued.append(depth)
            status = await get_text(session, f"{router}/status")
            if status:
                capacities.append([r.get("capacity") or 0 for r in orjson.loads(status).get("replicas", [])])
        await asyncio.sleep(SAMPLE_S)
    return Gauges(_mean(running), _mean(waiting), _mean(queued), capacity_range(capacities))


def capacity_range(samples: Sequence[Sequence[int]]) -> str:
    """Per replica, `N` or `LOW-HIGH` over the samples (0: not learned), joined by `/`."""
    spans = []
    for seen in zip(*samples, strict=False):
        low, high = min(seen), max(seen)
        spans.append(str(low) if low == high else f"{low}-{high}")
    return "/".join(spans)


async def loop_lag(window: Window, clock: Callable[[], float]) -> float:
    """The p99, over the window, of how late the event loop wakes from a 10 ms sleep (ms)."""
    await asyncio.sleep(max(0.0, window.warmup_s - clock()))
    lags = []
    while clock() < window.end:
        before = time.perf_counter()
        await asyncio.sleep(0.01)
        lags.append((time.perf_counter() - before - 0.01) * 1000)
    return round(percentile(sorted(lags), 99), 1)


def _mean(values: Sequence[float]) -> float:
    return round(statistics.fmean(values), 2) if values else math.nan


async def usage_totals(session: aiohttp.ClientSession, router: str) -> dict[str, dict[str, float]]:
    text = await get_text(session, f"{router}/admin/usage")
    if not text:
        return {}
    return {name: tenant["total"] for name, tenant in orjson.loads(text).get("tenants", {}).items()}


def queue_means(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per tenant, the mean seconds its requests that ended between the two readings waited in the queue (ms)."""
    means = {}
    for name, total in after.items():
        start = before.get(name, {})
        requests = total["requests"] - start.get("requests", 0)
        if requests > 0:
            means[name] = round((total["queue_s"] - start.get("queue_s", 0.0)) / requests * 1000, 1)
    return means


# -- one run -----------------------------------------------------------------------------------------


def contender_command(contender: str, replicas: Sequence[str], port: int, args: argparse.Namespace) -> list[str]:
    if contender == "vllm-router":
        return router_command("vllm-router", args.vllm_router_policy, replicas, port)
    extra = ["--flow-control", "off" if contender == "dpserve-off" else "on", *args.dpserve_args.split()]
    return router_command("dpserve", "least_loaded", replicas, port, extra=extra)


async def measure(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    replicas: Sequence[str],
    contender: str,
    loads: Sequence[Load],
    max_tokens: int,
    window: Window,
    extra: Sequence[str] = (),
) -> Measured:
    """`loads` through a fresh router (`contender`, of CONTENDERS; `extra` flags for dpserve's)."""
    dpserve = contender != "vllm-router"
    load_avg = round(os.getloadavg()[0], 2)
    process, url = await streamed.start_router(
        session,
        lambda port: contender_command(contender, replicas, port, args) + list(extra),
        "dpserve-bench-fairness",
        "/ready" if dpserve else "/v1/models",
        60,
    )
    try:
        driver = Driver(url, loads, max_tokens, window, args.retry_pause)
        drive = asyncio.create_task(driver.run(args.drain))
        gauges = asyncio.create_task(sample_gauges(session, replicas, url if dpserve else None, window, driver.began))
        lag = asyncio.create_task(loop_lag(window, driver.clock))
        await asyncio.sleep(window.warmup_s - driver.clock())
        before = await usage_totals(session, url) if dpserve else {}
        await asyncio.sleep(max(0.0, window.end - driver.clock()))
        after = await usage_totals(session, url) if dpserve else {}
        records = await drive
        return Measured(records, window, await gauges, queue_means(before, after), await lag, load_avg)
    finally:
        terminate(process, 30)


def save_records(args: argparse.Namespace, name: str, measured: Measured) -> None:
    """With --records: every request of the run, as `requests-NAME.csv` under --out."""
    if args.records:
        rows = [{**asdict(r), "in_window": measured.window.holds(r.start)} for r in measured.records]
        write_csv(args.out / f"requests-{name}.csv", rows, [*(f.name for f in fields(Record)), "in_window"])


def in_window(measured: Measured, tenant: str) -> list[Record]:
    return [r for r in measured.records if r.tenant == tenant and measured.window.holds(r.start)]


def throughput(measured: Measured) -> tuple[float, float]:
    """Answers/s and tokens/s over the answers that ended in the window."""
    ended = [r for r in measured.records if r.ok and measured.window.holds(r.end)]
    seconds = measured.window.window_s
    return round(len(ended) / seconds, 2), round(sum(r.tokens for r in ended) / seconds, 1)


def error_summary(measured: Measured) -> str:
    codes = Counter(f"{r.tenant}:{r.code}" for r in measured.records if not r.ok and measured.window.holds(r.start))
    return " ".join(f"{code}={count}" for code, count in sorted(codes.items()))


def summary(rows: Sequence[streamed.Row], keys: Sequence[object], *names: str) -> list[streamed.Row]:
    """Per key (the values of the fields `names`): the median of each figure over its runs, with `run` -1;
    counts (`*_answers`, `*_errors`, `batch_*`) are summed, error codes and capacities joined."""
    counts = ("_answers", "_errors", "_shed", "_full", "_timeout")
    return streamed.medians(
        rows,
        keys,
        names,
        lambda name: name.endswith(counts),
        {"errors": streamed.distinct, "capacity": streamed.distinct},
    )


# -- noisy neighbour ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoisySetup:
    backend: str
    a_streams: int
    b_streams: int
    max_tokens: int
    window: Window

    @property
    def label(self) -> str:
        return f"A{self.a_streams}+B{self.b_streams}"


def noisy_row(
    setup: NoisySetup,
    contender: str,
    run: int,
    loads: Sequence[Load],
    measured: Measured,
    baselines: dict[str, NoisyRow],
) -> NoisyRow:
    a, b = in_window(measured, "A"), in_window(measured, "B")
    streams = {load.tenant: load.streams for load in loads}
    a_ttft, b_ttft = ttft_ms(a), ttft_ms(b)
    answers, tokens = throughput(measured)
    done = [r for r in b if r.ok and not math.isnan(r.ttft)]
    a_p50, b_p50 = ms(a_ttft, 50), ms(b_ttft, 50)
    return NoisyRow(
        backend=setup.backend,
        load=setup.label,
        contender=contender,
        run=run,
        a_streams=streams.get("A", 0),
        b_streams=streams.get("B", 0),
        a_answers=sum(r.ok for r in a),
        a_errors=sum(not r.ok for r in a),
        a_ttft_p50_ms=a_p50,
        a_ttft_p99_ms=ms(a_ttft, 99),
        b_answers=sum(r.ok for r in b),
        b_errors=sum(not r.ok for r in b),
        b_ttft_p50_ms=b_p50,
        b_ttft_p99_ms=ms(b_ttft, 99),
        b_over_a=round(b_p50 / a_p50, 3) if a_p50 > 0 else math.nan,
        answers_per_s=answers,
        tokens_per_s=tokens,
        vs_a_alone=relative(tokens, baselines.get("a-alone")),
        vs_a_alone_off=relative(tokens, baselines.get("a-alone-off")),
        vs_off=math.nan,
        b_service_ms=round(statistics.median((r.end - r.start - r.ttft) * 1000 for r in done), 1) if done else math.nan,
        b_answer_ms=round(statistics.median((r.end - r.start) * 1000 for r in done), 1) if done else math.nan,
        a_queue_ms=measured.queue_ms.get("A", math.nan),
        b_queue_ms=measured.queue_ms.get("B", math.nan),
        replica_running=measured.gauges.running,
        replica_waiting=measured.gauges.waiting,
        router_queue=measured.gauges.router_queue,
        capacity=measured.gauges.capacity,
        client_lag_ms=measured.client_lag_ms,
        load_avg=measured.load_avg,
        errors=error_summary(measured),
    )


def relative(tokens_per_s: float, baseline: NoisyRow | None) -> float:
    return round(tokens_per_s / baseline.tokens_per_s, 3) if baseline and baseline.tokens_per_s else math.nan


async def run_noisy(args: argparse.Namespace, setups: Sequence[NoisySetup], work: Path, rows: list[NoisyRow]) -> None:
    """Every setup of one backend on one fleet: its baselines, then its contenders."""
    async with aiohttp.ClientSession() as session:
        fleet, replicas = await start_fleet(session, args, setups[0].backend, work)
        try:
            for setup in setups:
                await run_setup(session, args, setup, replicas, rows)
        finally:
            terminate(fleet, 120)


async def run_setup(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    setup: NoisySetup,
    replicas: Sequence[str],
    rows: list[NoisyRow],
) -> None:
    a, b = Load("A", setup.a_streams), Load("B", setup.b_streams)
    runs = [("a-alone", "dpserve", [a]), ("a-alone-off", "dpserve-off", [a]), ("b-alone", "dpserve", [b])]
    runs += [(c, c, [a, b]) for c in args.contenders]
    if "vllm-router" in args.contenders and bench_tool("vllm-router") is None:
        progress("  vllm-router: skipped, not installed (pip install -e '.[bench]')")
        runs = [r for r in runs if r[1] != "vllm-router"]
    mine: list[NoisyRow] = []
    for run in range(args.repeat):
        baselines: dict[str, NoisyRow] = {}
        round_rows: dict[str, NoisyRow] = {}
        for label, contender, loads in runs:
            tenants = " + ".join(f"{x.tenant} x{x.streams}" for x in loads)
            progress(f"{setup.backend} {setup.label} run {run} {label}: {tenants}")
            measured = await measure(session, args, replicas, contender, loads, setup.max_tokens, setup.window)
            save_records(args, f"{setup.backend}-{setup.label}-{label}-{run}", measured)
            row = noisy_row(setup, label, run, loads, measured, baselines)
            if "alone" in label:
                baselines[label] = row
            mine.append(row)
            round_rows[label] = row
            progress(
                f"  A ttft p50 {row.a_ttft_p50_ms} p99 {row.a_ttft_p99_ms} ms, B p50 {row.b_ttft_p50_ms} "
                f"p99 {row.b_ttft_p99_ms} ms, {row.answers_per_s} answers/s, {row.tokens_per_s} tokens/s, "
                f"running {row.replica_running} waiting {row.replica_waiting} queued {row.router_queue} "
                f"capacity {row.capacity or '-'}, load average {row.load_avg}"
                + (f", errors {row.errors}" if row.errors else "")
            )
        pair_with_off(round_rows)
    rows += mine + summary(mine, [label for label, _, _ in runs], "contender")


def pair_with_off(round_rows: dict[str, NoisyRow]) -> None:
    """Each row's tokens/s over its flow-control-off counterpart's in the same round (`vs_off`)."""
    for label, row in round_rows.items():
        reference = round_rows.get("a-alone-off" if label.startswith("a-alone") else "dpserve-off")
        if label != "b-alone":
            row.vs_off = relative(row.tokens_per_s, reference)


async def start_fleet(
    session: aiohttp.ClientSession, args: argparse.Namespace, backend: str, work: Path
) -> tuple[subprocess.Popen[bytes], list[str]]:
    """`dpserve up` with `--replicas` sims or vLLM CPU replicas at `--max-num-seqs`, on ports below 32768."""
    count = args.replicas
    seqs = ["--max-num-seqs", str(args.max_num_seqs)]
    if backend == "sim":
        flags = ["--sim", str(count), "--", *seqs, *args.sim_args.split()]
    else:
        flags = ["--replicas", str(count), "--cache-dir", str(args.cache_dir), "--", *seqs, *args.vllm_args.split()]
    progress(f"starting {count} {backend} replicas (--max-num-seqs {args.max_num_seqs}) ...")
    return await streamed.start_fleet(session, count, work / backend, flags)


def noisy_goals(rows: Sequence[NoisyRow]) -> list[str]:
    lines = []
    for backend, load in dict.fromkeys((r.backend, r.load) for r in rows):
        mine = {r.contender: r for r in rows if (r.backend, r.load) == (backend, load)}
        on, b_alone = mine.get("dpserve"), mine.get("b-alone")
        if on is None:
            continue
        name = f"{backend} {load}"
        lines.append(
            f"{name}: B TTFT p50 {on.b_ttft_p50_ms} ms = {on.b_over_a}x A's {on.a_ttft_p50_ms} ms "
            f"(goal <= {GOAL_B_OVER_A}): {met(on.b_over_a <= GOAL_B_OVER_A)}"
        )
        if b_alone is not None:
            bound = round(b_alone.b_ttft_p50_ms + b_alone.b_service_ms, 1)
            lines.append(
                f"{name}: B TTFT p50 {on.b_ttft_p50_ms} ms vs B alone {b_alone.b_ttft_p50_ms} ms + one service "
                f"time {b_alone.b_service_ms} ms = {bound} ms (goal <=): {met(on.b_ttft_p50_ms <= bound)}"
            )
        lines.append(
            f"{name}: fleet {on.tokens_per_s} tokens/s = {on.vs_a_alone}x A alone's (goal >= {GOAL_THROUGHPUT}): "
            f"{met(on.vs_a_alone >= GOAL_THROUGHPUT)}; {on.vs_a_alone_off}x A alone's with --flow-control off; "
            f"{on.vs_off}x --flow-control off's under the same load in the same round"
        )
        for other in ("dpserve-off", "vllm-router"):
            row = mine.get(other)
            if row is not None:
                lines.append(
                    f"{name}: for contrast, {other}: B/A TTFT p50 {row.b_over_a}, {row.vs_a_alone}x A alone's "
                    "throughput"
                )
    return lines


# -- priority ----------------------------------------------------------------------------------------


def priority_row(
    contender: str, case: str, run: int, loads: Sequence[Load], measured: Measured, alone: PriorityRow | None
) -> PriorityRow:
    critical, batch = in_window(measured, "critical"), in_window(measured, "bulk")
    ttft = ttft_ms(critical)
    p50, p99 = ms(ttft, 50), ms(ttft, 99)
    streams = {load.tenant: load.streams for load in loads}
    codes = Counter(r.code for r in batch if not r.ok)
    return PriorityRow(
        contender=contender,
        case=case,
        run=run,
        critical_streams=streams.get("critical", 0),
        batch_streams=streams.get("bulk", 0),
        critical_answers=sum(r.ok for r in critical),
        critical_errors=sum(not r.ok for r in critical),
        critical_ttft_p50_ms=p50,
        critical_ttft_p99_ms=p99,
        p50_vs_alone=round(p50 / alone.critical_ttft_p50_ms, 3) if alone and alone.critical_ttft_p50_ms else math.nan,
        p99_vs_alone=round(p99 / alone.critical_ttft_p99_ms, 3) if alone and alone.critical_ttft_p99_ms else math.nan,
        batch_answers=sum(r.ok for r in batch),
        batch_shed=codes.pop("shed", 0),
        batch_queue_full=codes.pop("queue_full", 0),
        batch_queue_timeout=codes.pop("queue_timeout", 0),
        batch_other_errors=sum(codes.values()),
        batch_ttft_p50_ms=ms(ttft_ms(batch), 50),
        answers_per_s=throughput(measured)[0],
        critical_queue_ms=measured.queue_ms.get("critical", math.nan),
        replica_running=measured.gauges.running,
        replica_waiting=measured.gauges.waiting,
        router_queue=measured.gauges.router_queue,
        capacity=measured.gauges.capacity,
        client_lag_ms=measured.client_lag_ms,
        load_avg=measured.load_avg,
    )


async def run_priority(args: argparse.Namespace, work: Path, rows: list[PriorityRow]) -> None:
    bulk = Load("bulk", args.batch_streams, "batch")
    window = Window(args.priority_warmup, args.priority_window)
    extra = ["--queue-size", str(args.queue_size)]
    cases = []
    for streams in args.critical_streams:
        critical = Load("critical", streams, "critical")
        cases += [("alone", [critical]), ("flooded", [critical, bulk])]
    contenders = [c for c in args.contenders if c != "vllm-router"]
    runs: list[PriorityRow] = []
    async with aiohttp.ClientSession() as session:
        fleet, replicas = await start_fleet(session, args, "sim", work)
        try:
            for run in range(args.repeat):
                for contender in contenders:
                    alone: PriorityRow | None = None
                    for case, loads in cases:
                        tenants = " + ".join(f"{x.tenant} x{x.streams}" for x in loads)
                        progress(f"priority run {run} {contender} {case}: {tenants}")
                        measured = await measure(
                            session, args, replicas, contender, loads, args.max_tokens, window, extra
                        )
                        save_records(args, f"priority-{contender}-{case}-{loads[0].streams}-{run}", measured)
                        row = priority_row(contender, case, run, loads, measured, alone if case == "flooded" else None)
                        alone = row if case == "alone" else alone
                        runs.append(row)
                        progress(
                            f"  critical ttft p50 {row.critical_ttft_p50_ms} p99 {row.critical_ttft_p99_ms} ms "
                            f"({row.p50_vs_alone}x alone), batch {row.batch_answers} answered, {row.batch_shed} "
                            f"shed, {row.batch_queue_full} queue_full, {row.batch_queue_timeout} queue_timeout, "
                            f"{row.batch_other_errors} other errors, "
                            f"capacity {row.capacity or '-'}, load average {row.load_avg}"
                        )
        finally:
            terminate(fleet, 60)
    keys = [(c, case, loads[0].streams) for c in contenders for case, loads in cases]
    rows += runs + summary(runs, keys, "contender", "case", "critical_streams")


def priority_goals(rows: Sequence[PriorityRow]) -> list[str]:
    lines = []
    for row in rows:
        if row.case != "flooded":
            continue
        verdict = f": {met(row.p50_vs_alone <= GOAL_CRITICAL)}" if row.contender == "dpserve" else " (contrast)"
        lines.append(
            f"priority {row.contender}, {row.critical_streams} critical streams: critical TTFT p50 flooded/alone "
            f"{row.p50_vs_alone} (p99 {row.p99_vs_alone}), goal <= {GOAL_CRITICAL}{verdict}; batch "
            f"{row.batch_answers} answered, {row.batch_shed} shed, {row.batch_queue_full} refused (queue_full), "
            f"{row.batch_queue_timeout} timed out in the queue; {row.critical_errors} critical errors"
        )
    return lines


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = streamed.bench_parser("fairness", __doc__, EXPERIMENTS, 1)
    contenders = streamed.names_of(CONTENDERS)
    parser.add_argument(
        "--contenders", type=contenders, default=",".join(CONTENDERS), help="of " + ", ".join(CONTENDERS)
    )
    parser.add_argument("--replicas", type=COUNT, default=2)
    parser.add_argument("--max-num-seqs", type=COUNT, default=4, help="every replica's batch limit")
    parser.add_argument("--a-streams", type=COUNT, default=64, help="noisy: tenant A's streams")
    parser.add_argument("--b-streams", type=COUNT, default=2, help="noisy: tenant B's streams")
    parser.add_argument("--max-tokens", type=COUNT, default=32, help="sims: tokens per answer")
    parser.add_argument("--warmup", type=NON_NEGATIVE, default=10.0, help="sims: seconds before the window")
    parser.add_argument("--window", type=POSITIVE, default=30.0, help="sims: seconds measured")
    parser.add_argument(
        "--vllm-a-streams", type=counts, default="16,64", help="vllm: tenant A's streams, one setup per count"
    )
    parser.add_argument("--vllm-b-streams", type=COUNT, default=2)
    parser.add_argument("--vllm-max-tokens", type=COUNT, default=24)
    parser.add_argument("--vllm-warmup", type=NON_NEGATIVE, default=10.0)
    parser.add_argument("--vllm-window", type=POSITIVE, default=30.0)
    parser.add_argument(
        "--critical-streams",
        type=counts,
        default="2,8",
        help="priority: critical streams, alone then flooded for each count (past the batch reserve, they queue)",
    )
    parser.add_argument("--batch-streams", type=COUNT, default=64, help="priority: the batch flood's streams")
    parser.add_argument("--queue-size", type=COUNT, default=16, help="priority: dpserve's --queue-size")
    parser.add_argument("--priority-warmup", type=NON_NEGATIVE, default=10.0)
    parser.add_argument("--priority-window", type=POSITIVE, default=20.0)
    parser.add_argument("--retry-pause", type=NON_NEGATIVE, default=0.5, help="seconds a stream pauses after a refusal")
    parser.add_argument("--drain", type=POSITIVE, default=120.0, help="most seconds to wait for the window's requests")
    parser.add_argument("--vllm-router-policy", default="power_of_two")
    parser.add_argument("--dpserve-args", default="", help="extra flags for every dpserve router")
    parser.add_argument("--sim-args", default="", help="extra flags for every sim")
    parser.add_argument("--vllm-args", default="", help="extra flags for every vLLM replica")
    args = parser.parse_args(list(argv))
    args.critical_streams = [int(n) for n in args.critical_streams.split(",") if n]
    args.vllm_a_streams = [int(n) for n in args.vllm_a_streams.split(",") if n]
    if args.warmup < 0 or args.window <= 0 or args.vllm_window <= 0 or args.priority_window <= 0:
        parser.error("windows must be positive and warm-ups not negative")
    return args


NOISY_COLUMNS = (
    ("backend", "backend"), ("load", "load"), ("contender", "contender"), ("A ttft p50", "a_ttft_p50_ms"),
    ("A p99", "a_ttft_p99_ms"), ("B ttft p50", "b_ttft_p50_ms"), ("B p99", "b_ttft_p99_ms"), ("B/A p50", "b_over_a"),
    ("answers/s", "answers_per_s"), ("tokens/s", "tokens_per_s"), ("vs A alone", "vs_a_alone"), ("vs off", "vs_off"),
    ("B service", "b_service_ms"), ("A queue", "a_queue_ms"), ("B queue", "b_queue_ms"),
    ("running", "replica_running"), ("waiting", "replica_waiting"), ("queued", "router_queue"),
    ("capacity", "capacity"), ("load avg", "load_avg"), ("errors", "errors"),
)  # fmt: skip
PRIORITY_COLUMNS = (
    ("contender", "contender"), ("case", "case"), ("crit streams", "critical_streams"),
    ("crit ttft p50", "critical_ttft_p50_ms"),
    ("crit p99", "critical_ttft_p99_ms"), ("p50 vs alone", "p50_vs_alone"), ("p99 vs alone", "p99_vs_alone"),
    ("crit answers", "critical_answers"), ("crit errors", "critical_errors"), ("batch answers", "batch_answers"),
    ("shed", "batch_shed"), ("queue_full", "batch_queue_full"),
    ("queue_timeout", "batch_queue_timeout"), ("other", "batch_other_errors"),
    ("answers/s", "answers_per_s"), ("crit queue", "critical_queue_ms"), ("running", "replica_running"),
    ("waiting", "replica_waiting"), ("queued", "router_queue"), ("capacity", "capacity"),
    ("client lag", "client_lag_ms"), ("load avg", "load_avg"),
)  # fmt: skip


def write_report(args: argparse.Namespace, noisy: Sequence[NoisyRow], priority: Sequence[PriorityRow]) -> str:
    """The CSVs and fairness.md of what has been measured so far (written after each experiment, so an
    interrupted run keeps what it finished); returns the report's text."""
    tables, lines = [], []
    shown_run = -1 if args.repeat > 1 else 0
    if noisy:
        write_csv(args.out / "noisy.csv", [asdict(r) for r in noisy], [f.name for f in fields(NoisyRow)])
        shown_noisy = [r for r in noisy if r.run == shown_run]
        tables.append(table(NOISY_COLUMNS, shown_noisy))
        lines += noisy_goals(shown_noisy)
    if priority:
        write_csv(args.out / "priority.csv", [asdict(r) for r in priority], [f.name for f in fields(PriorityRow)])
        shown_priority = [r for r in priority if r.run == shown_run]
        tables.append(table(PRIORITY_COLUMNS, shown_priority))
        lines += priority_goals(shown_priority)
    report = "\n\n".join(tables) + "\n\n" + "\n".join(lines) + "\n"
    runs = f"the median of {args.repeat} runs of each" if args.repeat > 1 else "one run each"
    (args.out / "fairness.md").write_text(
        f"# `dpserve bench fairness`\n\n{runs}. TTFT, service and queue times in ms; running, waiting: the "
        "replicas' requests (sum over the fleet), queued: dpserve's queue, means over the window; capacity: "
        "what dpserve had learned per replica.\n\n```\n" + report + "```\n"
    )
    return report


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    noisy: list[NoisyRow] = []
    priority: list[PriorityRow] = []
    backends: list[list[NoisySetup]] = []
    if "noisy" in args.experiments:
        window = Window(args.warmup, args.window)
        backends.append([NoisySetup("sim", args.a_streams, args.b_streams, args.max_tokens, window)])
    if "vllm" in args.experiments:
        window = Window(args.vllm_warmup, args.vllm_window)
        b, tokens = args.vllm_b_streams, args.vllm_max_tokens
        backends.append([NoisySetup("vllm", a, b, tokens, window) for a in args.vllm_a_streams])
    with streamed.framed(args, "fairness", lambda: write_report(args, noisy, priority)) as work:
        for setups in backends:
            uvloop.run(run_noisy(args, setups, work, noisy))
            write_report(args, noisy, priority)
        if "priority" in args.experiments:
            uvloop.run(run_priority(args, work, priority))
    return 0
