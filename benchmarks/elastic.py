"""`dpserve bench elastic`: do replicas that follow the router's desired-replicas signal serve a day's load as
well as a fleet sized for its peak, on fewer replica-minutes, and start from zero in time?

`sim`: a day compressed into `--day-s` seconds (night at a tenth of the peak, a ramp, the peak, the fall, night
again), replayed open loop (Poisson, streamed chat completions) twice through `dpserve up`'s own router: a
fleet fixed at `--max-replicas` simulator replicas, then an elastic one (`--min-replicas 1 --max-replicas N`)
whose simulators take `--sim-startup-s` to start (as vLLM loading its model, compressed like the day).
`--operator` runs both as an operator would: a client key and an admin key on the router, and clients past the
router sending the first replica streams at a tenth of the day's rate (not measured; the signal sees them in
the replica's own metrics). Per
fleet: requests, failures, TTFT p50/p99, replica-minutes (the replicas registered with the router, sampled
every 0.5 s: a replica counts from its start to its stop, starting and draining included), the most replicas
at once, and the signal's changes. Goals: replica-minutes <= 0.7x the fixed fleet's, TTFT p99 <= 1.2x, 0
failed.

`zero`: `--min-replicas 0`: a first request answered within one replica start-up (the launcher's own
measure, spawn to serving) plus 1 s, twice (the second after the fleet went back to zero); then with a
`--cold-start-wait` shorter than the start-up: the first request 503 with Retry-After at the wait's end, and,
the start-up now measured, the next one 503 with Retry-After at once.

`vllm`: real vLLM CPU replicas of the tiny model, `--min-replicas 1 --max-replicas 2`, under a load step of
long streams: low, high until the second replica serves (and a while more), low again until it is drained
and stopped. Goals: 1 -> 2 -> 1, 0 failed, and the streams that ran on the drained replica while it drained
all complete.

The client shares this machine's cores with the replicas and the router. Writes elastic.md and runs.csv
under --out, and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import random
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks import streamed
from benchmarks.fleet import UpPorts, progress, spawn, wait_ok
from benchmarks.report import shown
from benchmarks.stats import percentile
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE
from dpserve.router.routing.proxied_endpoints import REPLICA_HEADER
from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.up.process import terminate

EXPERIMENTS = ("sim", "zero", "vllm")
MINUTES_GOAL = 0.7
TTFT_GOAL = 1.2
SAMPLE_S = 0.5
DAY = ((0.0, 0.1), (0.2, 0.1), (0.4, 1.0), (0.6, 1.0), (0.8, 0.1), (1.0, 0.1))
"""The day's shape: (share of the day, share of the peak rate), linear in between."""
OPERATOR_KEY = "bench-elastic-key-0001"
OPERATOR_ADMIN_KEY = "bench-elastic-admin-0001"
OUTSIDE_SHARE = 0.1
"""`--operator`: the load sent straight to the first replica, as a share of the day's rate."""
STARTED = re.compile(r"dpserve: (\S+) started in ([0-9.]+) s")


def rate_at(share: float, peak: float) -> float:
    """Requests a second at `share` of the day."""
    for (x0, y0), (x1, y1) in itertools.pairwise(DAY):
        if x0 <= share <= x1:
            return peak * (y0 + (y1 - y0) * (share - x0) / (x1 - x0))
    return peak * DAY[-1][1]


@dataclass
class Run:
    experiment: str
    fleet: str
    seconds: float
    requests: int
    failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    replica_minutes: float
    most_replicas: int
    scale_ups: int
    scale_downs: int
    note: str = ""


@dataclass
class Load:
    """Open-loop streamed chat completions at a rate that `rate(t)` sets, every reply kept."""

    url: str
    max_tokens: int
    words: int
    seed: int
    replies: list[streamed.Reply] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)
    key: str = ""
    """A client key it sends (`--operator`); empty: none."""

    def clock(self) -> float:
        return time.monotonic() - self.began

    async def run(self, session: aiohttp.ClientSession, rate: Any, stop: asyncio.Event) -> None:
        rng = random.Random(self.seed)
        tasks: set[asyncio.Task[None]] = set()
        for number in itertools.count():
            if stop.is_set():
                break
            task = asyncio.create_task(self._one(session, number, rng.random()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            now_rate = max(rate(self.clock()), 1e-3)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rng.expovariate(now_rate))
        if tasks:
            await asyncio.gather(*tasks)

    async def _one(self, session: aiohttp.ClientSession, number: int, salt: float) -> None:
        words = " ".join(f"w{(number * 7919 + i) % 9973}" for i in range(self.words))
        body = {
            "model": TINY_MODEL_NAME,
            "messages": [{"role": "user", "content": f"{number} {salt:.6f} {words}"}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {self.key}"} if self.key else {})
        reply = await streamed.request(
            session, self.url + "/v1/chat/completions", orjson.dumps(body), headers, self.clock, header=REPLICA_HEADER
        )
        self.replies.append(reply)


@dataclass
class Census:
    """The replicas registered with the router, sampled: what a replica-minute is counted from."""

    samples: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    """(seconds since `began`, replica id -> state) at each sample."""
    urls: dict[str, str] = field(default_factory=dict)
    began: float = field(default_factory=time.monotonic)
    admin: dict[str, str] = field(default_factory=dict)
    """The admin API's headers (`--operator`: its key)."""

    async def run(self, session: aiohttp.ClientSession, router: str, stop: asyncio.Event, every_s: float) -> None:
        while not stop.is_set():
            try:
                async with session.get(f"{router}/admin/replicas", headers=self.admin) as resp:
                    entries = (await resp.json())["replicas"]
                self.samples.append((time.monotonic() - self.began, {e["id"]: e["state"] for e in entries}))
                self.urls.update({e["id"]: e["url"] for e in entries})
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    def replica_minutes(self) -> float:
        total = 0.0
        for (t0, seen), (t1, _) in itertools.pairwise(self.samples):
            total += len(seen) * (t1 - t0)
        return total / 60

    def most(self) -> int:
        return max((len(seen) for _, seen in self.samples), default=0)

    def count_now(self) -> int:
        return len(self.samples[-1][1]) if self.samples else 0

    def first(self, replica: str, state: str | None, after: float = 0.0) -> float | None:
        """When `replica` was first seen in `state` (None: first seen gone) after `after`."""
        for at, seen in self.samples:
            if at >= after and seen.get(replica) == state:
                return at
        return None

    def let_go(self, replica: str) -> float | None:
        """When `replica`, once serving, was first seen draining, or gone (drained between two samples)."""
        served = self.first(replica, "healthy")
        if served is None:
            return None
        draining, gone = self.first(replica, "draining", served), self.first(replica, None, served)
        return min((at for at in (draining, gone) if at is not None), default=None)


async def start_fleet(
    session: aiohttp.ClientSession,
    work: Path,
    name: str,
    flags: Sequence[str],
    env: dict[str, str],
    count: int,
    planned: int,
    admin: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`dpserve up` (its router is the one measured) with `flags`, `planned` replicas at most, ready once its
    router is and `count` replicas serve."""
    ports = UpPorts.free(planned)
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    command = [*ports.command(folder, "kv_aware"), *flags]
    log_path = folder / "up.log"
    process = spawn(command, log_path, env)
    streamed.CHILDREN.append(process)
    router = ports.router_url
    try:
        await wait_ok(session, f"{router}/ready", 900, process)
        deadline = time.monotonic() + 900
        while await serving(session, router, admin) < count:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: fewer than {count} replicas served; see {log_path}")
            await asyncio.sleep(0.5)
    except BaseException:
        terminate(process, 60)
        raise
    return process, router, log_path


async def serving(session: aiohttp.ClientSession, router: str, admin: dict[str, str] | None = None) -> int:
    try:
        async with session.get(f"{router}/admin/replicas", headers=admin) as resp:
            entries = (await resp.json())["replicas"]
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
        return 0
    return sum(1 for entry in entries if entry["state"] == "healthy")


async def scale_changes(
    session: aiohttp.ClientSession, router: str, keep: Path | None = None, admin: dict[str, str] | None = None
) -> tuple[int, int]:
    """The signal's changes up and down (`keep`: its last 50, with their reasons, written there)."""
    async with session.get(f"{router}/admin/scale", headers=admin) as resp:
        history = (await resp.json())["history"]
    if keep is not None:
        await asyncio.to_thread(keep.write_bytes, orjson.dumps(history, option=orjson.OPT_INDENT_2))
    ups = sum(1 for change in history if change["to"] > change["from"])
    return ups, len(history) - ups


PHASES = (("night", 0.0, 0.2), ("ramp", 0.2, 0.4), ("peak", 0.4, 0.6), ("fall", 0.6, 0.8), ("night", 0.8, 1.0))


def by_phase(replies: Sequence[streamed.Reply], day_s: float) -> str:
    """TTFT p99 (ms) of the requests each part of the day started: where a fleet's tail comes from."""
    parts = []
    for name, start, end in PHASES:
        mine = [r for r in replies if start * day_s <= r.start < end * day_s]
        parts.append(f"{name} {figures(mine)[3]:g}")
    return "TTFT p99 by part of the day (ms): " + ", ".join(parts)


def figures(replies: Sequence[streamed.Reply]) -> tuple[int, int, float, float]:
    ttfts = sorted(r.ttft * 1000 for r in replies if r.ok and not math.isnan(r.ttft))
    failed = sum(1 for r in replies if not r.ok)
    return len(replies), failed, round(percentile(ttfts, 50), 1), round(percentile(ttfts, 99), 1)


async def day(args: argparse.Namespace, session: aiohttp.ClientSession, work: Path, fleet: str) -> Run:
    """One replay of the day through one fleet (`--operator`: with keys, and load past the router)."""
    top = args.max_replicas
    sims = ["--sim", str(top)]
    scale = ["--scale-down-delay", str(args.scale_down_delay_s), "--scale-target", str(args.scale_target)]
    bounds = ["--min-replicas", "1", "--max-replicas", str(top)] if fleet == "elastic" else []
    keys = ["--api-key", f"bench:{OPERATOR_KEY}", "--admin-key", OPERATOR_ADMIN_KEY] if args.operator else []
    admin = {"authorization": f"Bearer {OPERATOR_ADMIN_KEY}"} if args.operator else {}
    flags = [*sims, *bounds, *scale, *keys, "--", *args.sim_args.split()]
    env = {**os.environ, "DPSERVE_SIM_STARTUP": str(args.sim_startup_s)}
    progress(f"sim/{fleet}: starting ...")
    name = f"sim-{fleet}"
    process, router, _ = await start_fleet(session, work, name, flags, env, 1 if bounds else top, top, admin)
    try:
        load = Load(router, args.max_tokens, args.prompt_words, seed=7, key=OPERATOR_KEY if args.operator else "")
        census = Census(began=load.began, admin=admin)
        stop = asyncio.Event()
        counting = asyncio.create_task(census.run(session, router, stop, SAMPLE_S))
        progress(f"sim/{fleet}: replaying a {args.day_s:.0f} s day, peak {args.peak_rate:g} req/s")
        replay = asyncio.create_task(load.run(session, lambda t: rate_at(t / args.day_s, args.peak_rate), stop))
        beside: asyncio.Task[None] | None = None
        if args.operator:  # clients past the router, on the replica every fleet keeps: not measured
            await until(lambda: "r0" in census.urls, 30)
            outside = Load(census.urls["r0"], args.max_tokens, args.prompt_words, seed=17, began=load.began)
            share = OUTSIDE_SHARE * args.peak_rate
            beside = asyncio.create_task(outside.run(session, lambda t: rate_at(t / args.day_s, share), stop))
        await asyncio.sleep(args.day_s)
        stop.set()
        await asyncio.gather(replay, counting, *([beside] if beside else []))
        ups, downs = await scale_changes(session, router, args.out / f"signal-{fleet}.json", admin)
    finally:
        terminate(process, 60)
    requests, failed, p50, p99 = figures(load.replies)
    minutes = round(census.replica_minutes(), 2)
    note = by_phase(load.replies, args.day_s)
    return Run("sim", fleet, args.day_s, requests, failed, p50, p99, minutes, census.most(), ups, downs, note)


async def one_request(session: aiohttp.ClientSession, router: str, number: int) -> tuple[streamed.Reply, str]:
    """A streamed request, and its answer's Retry-After (empty without)."""
    load = Load(router, 8, 8, seed=number)
    body = {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": f"from zero {number}"}],
        "max_tokens": 8,
        "stream": True,
    }
    headers = {"content-type": "application/json"}
    url = router + "/v1/chat/completions"
    reply = await streamed.request(session, url, orjson.dumps(body), headers, load.clock, header="retry-after")
    return reply, reply.header


async def back_to_zero(session: aiohttp.ClientSession, router: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(f"{router}/admin/replicas") as resp:
            if not (await resp.json())["replicas"]:
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the fleet did not go back to zero replicas")
        await asyncio.sleep(0.2)


def startups(log_path: Path) -> list[float]:
    """The launcher's own measures: spawn to serving, each replica start."""
    return [float(match.group(2)) for match in STARTED.finditer(log_path.read_text())]


async def from_zero(args: argparse.Namespace, session: aiohttp.ClientSession, work: Path) -> list[Run]:
    startup = args.sim_startup_s
    env = {**os.environ, "DPSERVE_SIM_STARTUP": str(startup)}
    rows = []
    base = ["--sim", "2", "--min-replicas", "0", "--max-replicas", "2", "--scale-down-delay", "1"]
    flags = [*base, "--cold-start-wait", str(startup + 10), "--", *args.sim_args.split()]
    progress("zero: a first request to a fleet of none, twice")
    process, router, log_path = await start_fleet(session, work, "zero", flags, env, 0, 2)
    try:
        for number in range(2):
            reply, _ = await one_request(session, router, number)
            took = reply.end - reply.start
            measured = startups(log_path)[-1] if reply.ok else math.nan
            verdict = "met" if reply.ok and took <= measured + 1 else "NOT met"
            note = f"answered in {took:.2f} s; the replica started in {measured:.2f} s (goal <= +1 s): {verdict}"
            progress(f"zero: first request #{number + 1}: {note}")
            rows.append(Run("zero", f"first request #{number + 1}", round(took, 2), 1, 0 if reply.ok else 1,
                            round(reply.ttft * 1000, 1), round(reply.ttft * 1000, 1), 0, 1, 0, 0, note))  # fmt: skip
            await back_to_zero(session, router, 60)
    finally:
        terminate(process, 60)
    progress("zero: --cold-start-wait shorter than a start-up")
    flags = [*base, "--cold-start-wait", str(args.short_wait_s), "--", *args.sim_args.split()]
    process, router, log_path = await start_fleet(session, work, "zero-short", flags, env, 0, 2)
    try:
        for number, when in enumerate(("at the wait's end", "at once (start-up measured)")):
            if number:
                await back_to_zero(session, router, 60)
            reply, retry_after = await one_request(session, router, 10 + number)
            took = reply.end - reply.start
            refused = reply.status == 503 and retry_after.isdigit() and int(retry_after) >= 1
            limit = args.short_wait_s + 1 if number == 0 else 0.5
            verdict = "met" if refused and took <= limit else "NOT met"
            note = f"HTTP {reply.status}, Retry-After {retry_after or '-'}, after {took:.2f} s ({when}): {verdict}"
            progress(f"zero: past the wait #{number + 1}: {note}")
            rows.append(Run("zero", f"past the wait #{number + 1}", round(took, 2), 1, 0, math.nan, math.nan,
                            0, 1, 0, 0, note))  # fmt: skip
            if number == 0:  # the replica it asked for starts all the same: its start-up is measured
                while await serving(session, router) < 1:
                    await asyncio.sleep(0.2)
    finally:
        terminate(process, 60)
    return rows


async def step(args: argparse.Namespace, session: aiohttp.ClientSession, work: Path) -> list[Run]:
    """Real vLLM CPU replicas: 1 -> 2 -> 1 under a load step, with clients that bypass the router sending to
    the second replica while it serves (until its drain begins, as clients told it goes away)."""
    flags = ["--replicas", "2", "--min-replicas", "1", "--max-replicas", "2", "--cache-dir", str(args.cache_dir)]
    flags += ["--scale-down-delay", str(args.scale_down_delay_s), "--", *args.vllm_args.split()]
    progress("vllm: starting 1 replica (of at most 2) ...")
    process, router, log_path = await start_fleet(session, work, "vllm", flags, dict(os.environ), 1, 2)
    load = Load(router, args.vllm_max_tokens, args.prompt_words, seed=11)
    census = Census(began=load.began)
    stop, done, outside_stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
    rate = {"now": args.vllm_low_rate}
    outside: Load | None = None
    try:
        counting = asyncio.create_task(census.run(session, router, done, 0.2))
        replay = asyncio.create_task(load.run(session, lambda _: rate["now"], stop))
        await asyncio.sleep(args.vllm_phase_s)
        progress(f"vllm: load step to {args.vllm_high_rate:g} req/s")
        rate["now"] = args.vllm_high_rate
        await until(lambda: census.first("r1", "healthy") is not None, 600)
        outside = Load(census.urls["r1"], args.vllm_outside_max_tokens, args.prompt_words, seed=13, began=load.began)
        outside_load = asyncio.create_task(outside.run(session, lambda _: args.vllm_outside_rate, outside_stop))
        await asyncio.sleep(args.vllm_phase_s)
        progress(f"vllm: back to {args.vllm_low_rate:g} req/s; waiting for the scale-down")
        rate["now"] = args.vllm_low_rate
        await until(lambda: census.let_go("r1") is not None, 900)
        outside_stop.set()
        await until(lambda: census.count_now() == 1, 900)
        await asyncio.sleep(5)
        stop.set()
        await asyncio.gather(replay, outside_load)
        done.set()
        await counting
        ups, downs = await scale_changes(session, router)
    finally:
        terminate(process, 120)
    assert outside is not None
    requests, failed, p50, p99 = figures(load.replies)
    drain = census.let_go("r1")
    assert drain is not None
    routed = [r for r in load.replies if r.header == "r1" and r.start < drain < r.end]
    direct = [r for r in outside.replies if r.start < drain < r.end]
    complete = sum(1 for r in (*routed, *direct) if r.ok)
    launched = startups(log_path)
    whole = census.most() == 2 and census.count_now() == 1 and failed == 0
    verdict = "met" if whole and routed + direct and complete == len(routed) + len(direct) else "NOT met"
    note = (
        f"1 -> {census.most()} -> {census.count_now()}; r1 started in {launched[-1] if launched else math.nan:.1f} s; "
        f"streams on r1 when its drain began: {len(routed)} through the router, {len(direct)} straight to it, "
        f"{complete} complete; failed through the router {failed}: {verdict}"
    )
    seconds = round(load.clock(), 1)
    minutes = round(census.replica_minutes(), 2)
    return [Run("vllm", "step 1->2->1", seconds, requests, failed, p50, p99, minutes, census.most(), ups, downs, note)]


async def until(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("the fleet did not scale as expected in time")
        await asyncio.sleep(0.2)


async def run_all(args: argparse.Namespace, work: Path) -> list[Run]:
    timeout = aiohttp.ClientTimeout(total=600)
    rows: list[Run] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if "sim" in args.experiments:
            for _ in range(args.repeat):
                rows += [await day(args, session, work, "fixed"), await day(args, session, work, "elastic")]
        if "zero" in args.experiments:
            rows += await from_zero(args, session, work)
        if "vllm" in args.experiments:
            rows += await step(args, session, work)
    return rows


def verdicts(rows: Sequence[Run]) -> list[str]:
    lines = []
    fixed = [r for r in rows if r.experiment == "sim" and r.fleet == "fixed"]
    elastic = [r for r in rows if r.experiment == "sim" and r.fleet == "elastic"]
    met = 0
    for number, (a, b) in enumerate(zip(fixed, elastic, strict=True)):
        minutes, p99 = b.replica_minutes / a.replica_minutes, b.ttft_p99_ms / a.ttft_p99_ms
        met += minutes <= MINUTES_GOAL and p99 <= TTFT_GOAL and a.failed == b.failed == 0
        lines += [
            f"- sim day {number + 1}: replica-minutes {b.replica_minutes:g} vs fixed {a.replica_minutes:g}: "
            f"{minutes:.2f}x (goal <= {MINUTES_GOAL}x): {'met' if minutes <= MINUTES_GOAL else 'NOT met'}",
            f"- sim day {number + 1}: TTFT p99 {b.ttft_p99_ms:g} ms vs fixed {a.ttft_p99_ms:g} ms: {p99:.2f}x "
            f"(goal <= {TTFT_GOAL}x): {'met' if p99 <= TTFT_GOAL else 'NOT met'}",
            f"- sim day {number + 1}: failed {b.failed} of {b.requests} elastic, {a.failed} of {a.requests} fixed "
            f"(goal 0), {b.scale_ups} scale-ups and {b.scale_downs} scale-downs: "
            f"{'met' if a.failed == b.failed == 0 else 'NOT met'}",
        ]
    if len(elastic) > 1:  # a repeated day is judged by every day, not by the best or the mean
        lines.append(f"- sim days meeting every goal: {met} of {len(elastic)}")
    lines += [f"- {r.experiment} {r.fleet}: {r.note}" for r in rows if r.note]
    return lines


def check(rows: Sequence[Run]) -> None:
    """Nonsense stops the run: a day without requests or replica-minutes, an elastic fleet that never moved."""
    for row in rows:
        if row.experiment == "sim" and (row.requests == 0 or row.replica_minutes <= 0 or math.isnan(row.ttft_p99_ms)):
            raise RuntimeError(f"implausible run: {row}")
        if row.experiment == "sim" and row.fleet == "elastic" and row.scale_ups == 0:
            raise RuntimeError(f"the elastic fleet never scaled up: {row}")


def write(args: argparse.Namespace, rows: Sequence[Run]) -> str:
    return streamed.write_rows(args, "elastic", rows, verdicts(rows), "runs.csv", hidden="note")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = streamed.bench_parser("elastic", __doc__, EXPERIMENTS, 1)
    parser.add_argument("--day-s", type=POSITIVE, default=300.0, help="seconds the day is compressed into")
    parser.add_argument("--peak-rate", type=POSITIVE, default=24.0, help="requests a second at the peak")
    parser.add_argument("--max-replicas", type=COUNT, default=4, help="the fixed fleet's size, the elastic's most")
    parser.add_argument(
        "--sim-startup-s",
        type=NON_NEGATIVE,
        default=2.0,
        help="each simulator's start-up: 1/30 of the ramp at the default day (a GPU replica's ~90 s start is "
        "~1/80 of a two-hour morning ramp)",
    )
    parser.add_argument(
        "--scale-down-delay-s",
        type=NON_NEGATIVE,
        default=10.0,
        help="the router's: the day is compressed ~290x, its 30 s default would be 0.1 s",
    )
    parser.add_argument("--scale-target", type=POSITIVE, default=0.8, help="the router's")
    parser.add_argument(
        "--operator",
        action="store_true",
        help="`sim`: as an operator runs it: a client key and an admin key on the router, and clients past it "
        f"sending the first replica {OUTSIDE_SHARE:g} of the day's rate (not measured)",
    )
    parser.add_argument("--short-wait-s", type=POSITIVE, default=1.0, help="`zero`: a --cold-start-wait too short")
    parser.add_argument("--max-tokens", type=COUNT, default=16)
    parser.add_argument("--prompt-words", type=COUNT, default=40)
    parser.add_argument(
        "--sim-args", default="--max-num-seqs 4 --decode-ms-per-token 20", help="extra flags for every sim"
    )
    parser.add_argument("--vllm-args", default="--enforce-eager --max-num-seqs 4", help="for every vLLM replica")
    parser.add_argument("--vllm-low-rate", type=POSITIVE, default=0.4)
    parser.add_argument("--vllm-high-rate", type=POSITIVE, default=5.0)
    parser.add_argument("--vllm-max-tokens", type=COUNT, default=96)
    parser.add_argument("--vllm-phase-s", type=POSITIVE, default=30.0)
    parser.add_argument(
        "--vllm-outside-rate", type=POSITIVE, default=0.3, help="streams a second straight to the second replica"
    )
    parser.add_argument(
        "--vllm-outside-max-tokens", type=COUNT, default=512, help="theirs: long, so one is likely running at the drain"
    )
    args = parser.parse_args(argv)
    args.argv = list(argv)
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    rows: list[Run] = []
    with streamed.framed(args, "elastic", lambda: write(args, rows)) as work:
        found = asyncio.run(run_all(args, work))
        check(found)
        rows += found
    progress(f"results in {shown(args.out)}")
    return 0
