"""`dpserve bench lora`: does adapter-aware placement serve many LoRA adapters on replicas that hold only a few
at once with fewer adapter loads and a lower TTFT tail than routing that ignores adapters, and does a hot
adapter spread over the fleet?

2 real vLLM CPU replicas of the tiny model with `--enable-lora --max-loras 2 --max-lora-rank 8` (started once
with `dpserve up`, whose own router stays idle; or `--replica URL` for each of running LoRA-enabled replicas),
and `--adapters` adapters built by `dpserve model tiny-lora` (tiny-lora-0, ...). The clients are asyncio +
aiohttp closed loops in this process: `--concurrency` of them take the next request of one seeded sequence
as their last one ends, each a streamed completion (a short prompt, `max_tokens` tokens with `ignore_eos`)
for one adapter. Every request is recorded: adapter, start, TTFT (to the first streamed event carrying a
choice), end, status, error code and the replica that answered (`x-dpserve-replica`).

Before each setup every adapter is unloaded from every replica (POST /v1/unload_lora_adapter for each one
/v1/models lists with a parent) and each replica answers one base-model request (a warm-up that also makes
vLLM report its adapter slots, which dpserve reads from `vllm:lora_requests_info`); after the last, the
adapters are unloaded again.

1. compare. The same Zipf-popular sequence (`--zipf` 1.1 over the adapters, tiny-lora-0 the most popular)
   through three setups over the same replicas, each on a fresh router:
   - dpserve: `--lora-dir DIR` (adapter affinity on): placement prefers replicas holding the adapter, else
     a free slot, else unloads the least recently used idle adapter;
   - dpserve-blind: `--lora-dir DIR --lora-affinity off`: any replica (least loaded), the adapter loaded
     there on demand;
   - vllm-router (`--vllm-router-policy`, round_robin): every adapter registered on both replicas before it
     starts (POST /v1/load_lora_adapter for each, what `--lora-modules` does at start), so vLLM swaps them
     in and out of its `--max-loras` slots itself.
   Per setup: requests, failed (any non-200, or a stream that ended without [DONE]), 404s, adapter loads
   per 100 requests (dpserve: the change of `dpserve_lora_loads_total{outcome="ok"}`; vllm-router: n/a, vLLM
   swaps internally and does not count them), unloads, placements by reason, TTFT p50/p99 of the answers,
   the run's duration, answers/s and tokens/s, and how many adapters each replica had registered at the
   end. Goals: dpserve fails no request, makes fewer loads per 100 requests than dpserve-blind, and has a
   lower TTFT p99 than dpserve-blind; vllm-router's 404s are reported.
2. hot. dpserve (affinity on) alone: one adapter (tiny-lora-0) takes `--hot-share` (0.5) of the requests,
   the others share the rest uniformly. Reported: each replica's share of the hot adapter's answers, and
   which replicas hold it at the end (the router's /status, `lora.loaded`). Goals: it is loaded on every
   replica, and each replica's share is within 1.5x of an even share (between 1/3 and 2/3 with 2 replicas).

With `--repeat N` (3) every run is done N times, the setups of compare taking turns round after round (so
a slow spell on a shared machine hits them all) and then the hot run N times: the tables and goals use each
figure's median over the rounds (loads, TTFT, throughput, each replica's hot share, placements by reason),
requests, failures and 404s the rounds' totals. The CSVs keep every round's row (`run` 0, 1, ...) beside
the medians (`run` -1).

The client shares this machine's cores with the replicas and the router; the 1-minute load average as each
run starts is reported with it.

Writes compare.csv, hot.csv and lora.md under --out (after each experiment), and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import uvloop

from benchmarks import streamed
from benchmarks.fleet import bench_tool, child_env, get_text, progress, router_command
from benchmarks.report import goals_status, met, write_csv
from benchmarks.streamed import ms, table, ttft_ms
from dpserve.flag_types import COUNT, NON_NEGATIVE, SHARE, WHOLE
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.router.parts import check_base_url
from dpserve.up.process import terminate

EXPERIMENTS = ("compare", "hot")
SETUPS = ("dpserve", "dpserve-blind", "vllm-router")
REPLICA_HEADER = "x-dpserve-replica"
JSON_HEADERS = {"content-type": "application/json"}
REQUEST_TIMEOUT_S = 300.0
LORA_LOADS = "dpserve_lora_loads_total"
LORA_UNLOADS = "dpserve_lora_unloads_total"
LORA_PLACEMENTS = "dpserve_lora_placements_total"
HOT_SPREAD = 1.5
"""The hot adapter's share on each replica must be within this factor of an even share."""


@dataclass
class Record(streamed.Outcome):
    """One request of the sequence and what became of it (a `streamed.Reply`'s figures, in seconds since the
    run began; TTFT to the first streamed event carrying a choice)."""

    number: int
    """The request's place in the sequence."""
    adapter: str
    start: float
    end: float
    ttft: float
    status: int
    code: str
    replica: str
    """`x-dpserve-replica` (r0, r1, ...); empty when the router does not say (vllm-router)."""
    tokens: int


@dataclass
class Run:
    records: list[Record]
    duration_s: float
    load_avg: float
    """This machine's 1-minute load average as the run started."""


@dataclass
class CompareRow:
    setup: str
    run: int
    """0, 1, ...: the setups take turns, round after round; -1: the median over the rounds (`summary`)."""
    router: str
    requests: int
    """Requests of the run (summed in the median)."""
    answered: int
    failed: int
    not_found: int
    """Requests answered 404 (counted in `failed` too; summed in the median, like `answered` and `failed`)."""
    loads: float | str
    """Adapter loads the router made (`n/a` for vllm-router: vLLM swaps adapters itself)."""
    loads_per_100: float | str
    unloads: float | str
    ttft_p50_ms: float
    ttft_p99_ms: float
    duration_s: float
    answers_per_s: float
    tokens_per_s: float
    placements: str
    """dpserve's placements by reason over the run (`dpserve_lora_placements_total`; `full` counts every look
    at which no replica could take the request, flow control's learned capacity included)."""
    held_at_end: str
    """How many adapters each replica had registered when the run ended (its /v1/models), `2/2`."""
    errors: str
    load_avg: float


@dataclass
class HotRow:
    hot_adapter: str
    run: int
    hot_share: float
    requests: int
    hot_requests: int
    failed: int
    replica_shares: str
    """Each replica's share of the hot adapter's answers, `r0=0.52 r1=0.48`."""
    min_share: float
    max_share: float
    hot_loaded_on: str
    """The replicas holding the hot adapter at the end (router /status)."""
    loaded_everywhere: bool
    """In the median: in most rounds."""
    loads: float
    loads_per_100: float
    unloads: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    hot_ttft_p99_ms: float
    duration_s: float
    answers_per_s: float
    placements: str
    held_at_end: str
    errors: str
    load_avg: float


# -- the request sequences ---------------------------------------------------------------------------


def adapter_names(count: int) -> list[str]:
    return [f"tiny-lora-{index}" for index in range(count)]


def zipf_sequence(adapters: Sequence[str], count: int, s: float, seed: int) -> list[str]:
    """`count` adapters drawn with Zipf weights 1/rank^s (the first the most popular), seeded."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** s for rank in range(len(adapters))]
    return rng.choices(list(adapters), weights, k=count)


def hot_sequence(adapters: Sequence[str], count: int, share: float, seed: int) -> list[str]:
    """The first adapter at `share` of `count` requests, the others uniform over the rest, seeded."""
    rng = random.Random(seed + 1)
    return [adapters[0] if rng.random() < share else rng.choice(adapters[1:]) for _ in range(count)]


def mix(sequence: Sequence[str]) -> str:
    counts = Counter(sequence)
    return ", ".join(f"{name} {counts[name]}" for name in sorted(counts, key=lambda n: (-counts[n], n)))


# -- the clients -------------------------------------------------------------------------------------


def completion_body(model: str, number: int, max_tokens: int) -> bytes:
    """A short prompt; `ignore_eos` makes vLLM answer exactly `max_tokens` tokens."""
    return orjson.dumps(
        {
            "model": model,
            "prompt": f"Request {number}: once upon a time, a lighthouse keeper",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
    )


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    number: int,
    adapter: str,
    max_tokens: int,
    clock: Callable[[], float],
) -> Record:
    body = completion_body(adapter, number, max_tokens)
    s = await streamed.request(session, url, body, JSON_HEADERS, clock, header=REPLICA_HEADER)
    return Record(number, adapter, s.start, s.end, s.ttft, s.status, s.code, s.header, s.tokens)


async def drive(url: str, sequence: Sequence[str], concurrency: int, max_tokens: int) -> Run:
    """`concurrency` closed loops, each sending the sequence's next request as its last one ends."""
    load_avg = round(os.getloadavg()[0], 2)
    began = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - began

    todo: Iterator[tuple[int, str]] = iter(enumerate(sequence))
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> None:
            for number, adapter in todo:  # shared: each takes the next one
                records.append(await one_request(session, f"{url}/v1/completions", number, adapter, max_tokens, clock))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return Run(sorted(records, key=lambda r: r.number), round(clock(), 2), load_avg)


# -- the replicas ------------------------------------------------------------------------------------


async def models(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    text = await get_text(session, f"{url}/v1/models")
    if text is None:
        raise RuntimeError(f"{url}/v1/models did not answer")
    cards: list[dict[str, Any]] = orjson.loads(text)["data"]
    return cards


async def base_model(session: aiohttp.ClientSession, url: str) -> str:
    """The model a replica serves (its card without a parent)."""
    return next(str(card["id"]) for card in await models(session, url) if not card.get("parent"))


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
        return resp.status, await resp.text()


async def unload_all(session: aiohttp.ClientSession, replicas: Sequence[str]) -> int:
    """Every adapter off every replica; how many were there."""
    count = 0
    for url in replicas:
        for card in await models(session, url):
            if card.get("parent"):
                await post(session, f"{url}/v1/unload_lora_adapter", {"lora_name": card["id"]})
                count += 1
    return count


async def held(session: aiohttp.ClientSession, replicas: Sequence[str]) -> str:
    """How many adapters each replica has registered, `2/2`."""
    counts = [sum(bool(card.get("parent")) for card in await models(session, url)) for url in replicas]
    return "/".join(str(count) for count in counts)


async def load_all(session: aiohttp.ClientSession, replicas: Sequence[str], adapters: dict[str, Path]) -> None:
    """Every adapter registered on every replica (400: it already was)."""
    for url in replicas:
        for name, path in adapters.items():
            status, text = await post(
                session, f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
            )
            if status not in (200, 400):
                raise RuntimeError(f"loading {name} on {url}: {status} {text[:200]}")


async def reset(session: aiohttp.ClientSession, replicas: Sequence[str]) -> None:
    """No adapter anywhere, and each replica has answered one base-model request."""
    unloaded = await unload_all(session, replicas)
    for url in replicas:
        body = {"model": await base_model(session, url), "prompt": "warm up", "max_tokens": 4}
        status, text = await post(session, f"{url}/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"warm-up on {url}: {status} {text[:200]}")
    progress(f"  replicas reset: {unloaded} adapters unloaded, each warmed up with one base-model request")


# -- the routers -------------------------------------------------------------------------------------


def counter_by(text: str, name: str, label: str, **match: str) -> dict[str, float]:
    """A counter's samples whose labels include `match`, summed by the value of `label`."""
    totals: dict[str, float] = {}
    for labels, value in parse_samples(text, {name}).by_name.get(name, []):
        if all(labels.get(key) == wanted for key, wanted in match.items()):
            key = labels.get(label, "")
            totals[key] = totals.get(key, 0.0) + value
    return totals


@dataclass
class Counters:
    loads: float = 0.0
    unloads: float = 0.0
    placements: Counter[str] | None = None

    @classmethod
    def read(cls, text: str) -> Counters:
        placements = Counter({k: int(v) for k, v in counter_by(text, LORA_PLACEMENTS, "reason").items() if v})
        return cls(
            loads=sum(counter_by(text, LORA_LOADS, "replica", outcome="ok").values()),
            unloads=sum(counter_by(text, LORA_UNLOADS, "replica", outcome="ok").values()),
            placements=placements,
        )

    def since(self, before: Counters) -> Counters:
        after, earlier = self.placements or Counter(), before.placements or Counter()
        return Counters(self.loads - before.loads, self.unloads - before.unloads, after - earlier)

    def placement_text(self) -> str:
        counts = self.placements or Counter()
        return " ".join(f"{reason}={count}" for reason, count in sorted(counts.items()))


async def router_counters(session: aiohttp.ClientSession, url: str) -> Counters:
    return Counters.read(await get_text(session, f"{url}/metrics") or "")


async def router_status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    status: dict[str, Any] = orjson.loads(await get_text(session, f"{url}/status") or "{}")
    return status


def setup_command(
    setup: str, replicas: Sequence[str], port: int, lora_dir: Path, args: argparse.Namespace
) -> list[str]:
    if setup == "vllm-router":
        return router_command("vllm-router", args.vllm_router_policy, replicas, port)
    settings = {"lora_dir": str(lora_dir), "lora_affinity": setup != "dpserve-blind", "probe_interval_s": 0.5}
    return router_command("dpserve", "least_loaded", replicas, port, settings=settings)


def router_label(setup: str, args: argparse.Namespace) -> str:
    if setup == "vllm-router":
        return f"vllm-router {args.vllm_router_policy}, all adapters registered"
    return "dpserve --lora-dir" + (" --lora-affinity off" if setup == "dpserve-blind" else "")


async def start_router(
    session: aiohttp.ClientSession, setup: str, replicas: Sequence[str], lora_dir: Path, args: argparse.Namespace
) -> tuple[subprocess.Popen[bytes], str]:
    """A fresh router for `setup`, ready; dpserve's once it knows every replica's adapter slots."""
    peer = setup == "vllm-router"
    process, url = await streamed.start_router(
        session,
        lambda port: setup_command(setup, replicas, port, lora_dir, args),
        "dpserve-bench-lora",
        "/v1/models" if peer else "/ready",
        120 if peer else 60,
    )
    if peer:
        return process, url
    try:
        deadline = time.monotonic() + 60
        while True:
            reported = [(r.get("lora") or {}).get("max_loras") for r in (await router_status(session, url))["replicas"]]
            if len(reported) == len(replicas) and all(reported):
                args.slots = reported
                return process, url
            if time.monotonic() > deadline:
                raise RuntimeError(f"dpserve never learned the replicas' adapter slots: {reported}")
            await asyncio.sleep(0.2)
    except BaseException:
        terminate(process, 30)
        raise


# -- the figures -------------------------------------------------------------------------------------


def error_summary(records: Sequence[Record]) -> str:
    codes = Counter(
        r.code if r.code.startswith("http_") or r.status in (0, 200) else f"{r.code}({r.status})"
        for r in records
        if not r.ok
    )
    return " ".join(f"{code}={count}" for code, count in sorted(codes.items()))


def per_100(count: float, requests: int) -> float:
    return round(count * 100 / requests, 2) if requests else math.nan


def compare_row(
    setup: str, turn: int, args: argparse.Namespace, run: Run, counters: Counters | None, held_at_end: str
) -> CompareRow:
    records = run.records
    answered = [r for r in records if r.ok]
    ttft = ttft_ms(records)
    seconds = run.duration_s or math.nan
    return CompareRow(
        setup=setup,
        run=turn,
        router=router_label(setup, args),
        requests=len(records),
        answered=len(answered),
        failed=len(records) - len(answered),
        not_found=sum(r.status == 404 for r in records),
        loads=round(counters.loads) if counters else "n/a",
        loads_per_100=per_100(counters.loads, len(records)) if counters else "n/a",
        unloads=round(counters.unloads) if counters else "n/a",
        ttft_p50_ms=ms(ttft, 50),
        ttft_p99_ms=ms(ttft, 99),
        duration_s=run.duration_s,
        answers_per_s=round(len(answered) / seconds, 2),
        tokens_per_s=round(sum(r.tokens for r in answered) / seconds, 1),
        placements=counters.placement_text() if counters else "",
        held_at_end=held_at_end,
        errors=error_summary(records),
        load_avg=run.load_avg,
    )


def hot_row(
    args: argparse.Namespace,
    hot: str,
    turn: int,
    run: Run,
    counters: Counters,
    holders: Sequence[str],
    replica_ids: Sequence[str],
    held_at_end: str,
) -> HotRow:
    records = run.records
    answered = [r for r in records if r.ok]
    hot_answers = [r for r in answered if r.adapter == hot]
    by_replica = Counter(r.replica for r in hot_answers)
    shares = {rid: by_replica.get(rid, 0) / len(hot_answers) if hot_answers else math.nan for rid in replica_ids}
    seconds = run.duration_s or math.nan
    return HotRow(
        hot_adapter=hot,
        run=turn,
        hot_share=args.hot_share,
        requests=len(records),
        hot_requests=sum(r.adapter == hot for r in records),
        failed=len(records) - len(answered),
        replica_shares=" ".join(f"{rid}={share:.3f}" for rid, share in shares.items()),
        min_share=round(min(shares.values()), 3),
        max_share=round(max(shares.values()), 3),
        hot_loaded_on=" ".join(holders),
        loaded_everywhere=set(holders) == set(replica_ids),
        loads=round(counters.loads),
        loads_per_100=per_100(counters.loads, len(records)),
        unloads=round(counters.unloads),
        ttft_p50_ms=ms(ttft_ms(records), 50),
        ttft_p99_ms=ms(ttft_ms(records), 99),
        hot_ttft_p99_ms=ms(ttft_ms(hot_answers), 99),
        duration_s=run.duration_s,
        answers_per_s=round(len(answered) / seconds, 2),
        placements=counters.placement_text(),
        held_at_end=held_at_end,
        errors=error_summary(records),
        load_avg=run.load_avg,
    )


SUMMED = ("requests", "answered", "failed", "not_found", "hot_requests")
"""Counts the median row adds up over the rounds."""


def median_pairs(texts: Sequence[str], digits: int | None = None) -> str:
    """`key=value ...` texts, one a round, as one: each key's median over the rounds (0 in a round without it),
    to `digits` decimals (None: as short as it goes)."""
    rounds = [dict(pair.split("=", 1) for pair in text.split()) for text in texts]
    keys = dict.fromkeys(key for counts in rounds for key in counts)
    values = {key: statistics.median(float(counts.get(key, 0)) for counts in rounds) for key in keys}
    return " ".join(f"{k}={v:g}" if digits is None else f"{k}={v:.{digits}f}" for k, v in values.items())


def each_round(texts: Sequence[str]) -> str:
    """The text where every round's is the same, else each round's in turn."""
    return texts[0] if len(set(texts)) == 1 else " | ".join(t or "-" for t in texts)


def summary(rows: Sequence[streamed.Row], keys: Sequence[str], name: str) -> list[streamed.Row]:
    """Per key (the value of the field `name`): the median of each figure over its rounds, with `run` -1;
    requests, answers, failures and 404s summed; placements and the hot adapter's shares each reason's and
    replica's median (the lowest and highest share: of those medians); held at end and where the hot
    adapter was loaded, each round's where they differ; error codes joined."""
    merged = streamed.medians(
        rows,
        keys,
        (name,),
        lambda field: field in SUMMED,
        {
            "placements": median_pairs,
            "replica_shares": lambda texts: median_pairs(texts, 3),
            "held_at_end": each_round,
            "hot_loaded_on": each_round,
            "errors": streamed.distinct,
        },
    )
    for row in merged:
        if isinstance(row, HotRow):
            shares = [float(pair.split("=", 1)[1]) for pair in row.replica_shares.split()]
            row.min_share, row.max_share = min(shares), max(shares)
    return merged


def save_records(args: argparse.Namespace, name: str, run: Run) -> None:
    """With --records: every request of the run, as `requests-NAME.csv` under --out."""
    if args.records:
        write_csv(args.out / f"requests-{name}.csv", [asdict(r) for r in run.records], [f.name for f in fields(Record)])


# -- the experiments ---------------------------------------------------------------------------------


async def run_compare(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    replicas: Sequence[str],
    adapters: dict[str, Path],
    lora_dir: Path,
    rows: list[CompareRow],
) -> None:
    """`--repeat` rounds of the setups in turn, then their medians."""
    sequence = zipf_sequence(list(adapters), args.requests, args.zipf, args.seed)
    setups = list(SETUPS)
    if bench_tool("vllm-router") is None:
        progress("vllm-router: skipped, not installed (pip install -e '.[bench]')")
        setups.remove("vllm-router")
    mine: list[CompareRow] = []
    for turn in range(args.repeat):
        for setup in setups:
            progress(f"compare round {turn} {setup}: {len(sequence)} requests, {args.concurrency} clients")
            await reset(session, replicas)
            if setup == "vllm-router":
                await load_all(session, replicas, adapters)
            process, url = await start_router(session, setup, replicas, lora_dir, args)
            try:
                before = await router_counters(session, url) if setup != "vllm-router" else None
                run = await drive(url, sequence, args.concurrency, args.max_tokens)
                counters = (await router_counters(session, url)).since(before) if before is not None else None
                held_at_end = await held(session, replicas)
            finally:
                terminate(process, 30)
            save_records(args, f"compare-{setup}-{turn}", run)
            row = compare_row(setup, turn, args, run, counters, held_at_end)
            mine.append(row)
            progress(
                f"  {row.answered}/{row.requests} answered, {row.failed} failed ({row.not_found} 404), loads/100 "
                f"{row.loads_per_100}, TTFT p50 {row.ttft_p50_ms} p99 {row.ttft_p99_ms} ms, {row.duration_s} s, "
                f"{row.answers_per_s} answers/s, load average {row.load_avg}"
                + (f", placements {row.placements}" if row.placements else "")
                + (f", errors {row.errors}" if row.errors else "")
            )
    rows += mine + summary(mine, setups, "setup")


async def run_hot(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    replicas: Sequence[str],
    adapters: dict[str, Path],
    lora_dir: Path,
    rows: list[HotRow],
) -> None:
    """`--repeat` rounds, then their medians."""
    names = list(adapters)
    hot = names[0]
    sequence = hot_sequence(names, args.requests, args.hot_share, args.seed)
    mine: list[HotRow] = []
    for turn in range(args.repeat):
        progress(
            f"hot round {turn}: {hot} at {args.hot_share:.0%} of {len(sequence)} requests, {args.concurrency} clients"
        )
        await reset(session, replicas)
        process, url = await start_router(session, "dpserve", replicas, lora_dir, args)
        try:
            before = await router_counters(session, url)
            run = await drive(url, sequence, args.concurrency, args.max_tokens)
            counters = (await router_counters(session, url)).since(before)
            status = await router_status(session, url)
            held_at_end = await held(session, replicas)
        finally:
            terminate(process, 30)
        save_records(args, f"hot-{turn}", run)
        replica_ids = [str(r["id"]) for r in status["replicas"]]
        holders = [str(r["id"]) for r in status["replicas"] if hot in ((r.get("lora") or {}).get("loaded") or [])]
        row = hot_row(args, hot, turn, run, counters, holders, replica_ids, held_at_end)
        mine.append(row)
        progress(
            f"  {row.requests - row.failed}/{row.requests} answered, hot shares {row.replica_shares}, loaded on "
            f"{row.hot_loaded_on or 'none'}, loads/100 {row.loads_per_100}, TTFT p99 {row.ttft_p99_ms} ms"
            + (f", errors {row.errors}" if row.errors else "")
        )
    rows += mine + summary(mine, [hot], "hot_adapter")


# -- the goals ---------------------------------------------------------------------------------------


def by_round(rounds: Sequence[CompareRow], setup: str, name: str) -> str:
    """A figure of `setup`'s rounds in turn, `a/b/c`; empty with one round."""
    values = [str(getattr(r, name)) for r in rounds if r.setup == setup]
    return "/".join(values) if len(values) > 1 else ""


def compare_goals(rows: Sequence[CompareRow], rounds: Sequence[CompareRow] = ()) -> list[tuple[str, bool]]:
    """The goal lines on `rows` (one a setup: the medians, or a single round's), each with whether it was met
    (vllm-router's line states figures, no goal); with `rounds`, each round's figures beside them."""
    by = {row.setup: row for row in rows}
    lines: list[tuple[str, bool]] = []
    ours, blind, peer = by.get("dpserve"), by.get("dpserve-blind"), by.get("vllm-router")

    def each(name: str) -> str:
        mine, theirs = by_round(rounds, "dpserve", name), by_round(rounds, "dpserve-blind", name)
        return f"; by round {mine} vs {theirs}" if mine and theirs else ""

    def goal(text: str, ok: bool) -> None:
        lines.append((f"{text}: {met(ok)}", ok))

    if ours is not None:
        goal(f"compare dpserve: {ours.failed} failed requests of {ours.requests} (goal 0)", ours.failed == 0)
    if ours is not None and blind is not None:
        assert not isinstance(ours.loads_per_100, str) and not isinstance(blind.loads_per_100, str)  # dpserve's
        goal(
            f"compare dpserve: {ours.loads_per_100} adapter loads per 100 requests vs {blind.loads_per_100} with "
            f"--lora-affinity off (goal fewer{each('loads_per_100')})",
            ours.loads_per_100 < blind.loads_per_100,
        )
        goal(
            f"compare dpserve: TTFT p99 {ours.ttft_p99_ms} ms vs {blind.ttft_p99_ms} ms with --lora-affinity off "
            f"(goal lower{each('ttft_p99_ms')})",
            ours.ttft_p99_ms < blind.ttft_p99_ms,
        )
    if peer is not None:
        what = (
            "none: every adapter was registered on both replicas and vLLM swapped them in and out of its slots itself"
            if peer.not_found == 0
            else "requests for adapters a replica did not hold"
        )
        text = (
            f"compare vllm-router: {peer.not_found} 404s of {peer.requests} requests ({what}); {peer.failed} failed "
            f"in all; TTFT p99 {peer.ttft_p99_ms} ms (dpserve {ours.ttft_p99_ms if ours else '-'} ms)"
        )
        lines.append((text, True))  # figures beside dpserve's, no goal of its own
    return lines


def hot_goals(rows: Sequence[HotRow], replicas: int, rounds: Sequence[HotRow] = ()) -> list[tuple[str, bool]]:
    """The goal lines on `rows` (the medians, or a single round's), each with whether it was met; with `rounds`,
    each round's lowest share."""
    lines: list[tuple[str, bool]] = []
    even = 1 / replicas
    low, high = even / HOT_SPREAD, min(1.0, even * HOT_SPREAD, 1 - (replicas - 1) * even / HOT_SPREAD)
    for row in rows:
        within = low <= row.min_share and row.max_share <= high
        lowest = [str(r.min_share) for r in rounds if r.hot_adapter == row.hot_adapter]
        each = f"; the lowest share by round {'/'.join(lowest)}" if len(lowest) > 1 else ""
        text = (
            f"hot {row.hot_adapter} ({row.hot_requests} of {row.requests} requests): shares {row.replica_shares}, "
            f"goal each within {HOT_SPREAD}x of even ({low:.3f}..{high:.3f}{each}): {met(within)}"
        )
        lines.append((text, within))
        most = ", in most rounds" if row.run == -1 else ""
        text = (
            f"hot {row.hot_adapter}: loaded at the end on {row.hot_loaded_on or 'none'} "
            f"(goal every replica{most}): {met(row.loaded_everywhere)}; {row.failed} failed requests"
        )
        lines.append((text, row.loaded_everywhere))
    return lines


# -- main --------------------------------------------------------------------------------------------


def replica_url(text: str) -> str:
    """--replica: a base URL, as the router's own --replica takes it."""
    try:
        check_base_url(text, "URL", "a replica's base URL, e.g. http://127.0.0.1:8100")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = streamed.bench_parser("lora", __doc__, EXPERIMENTS, 3)
    parser.add_argument(
        "--replica",
        action="append",
        type=replica_url,
        default=[],
        metavar="URL",
        help="a running LoRA-enabled vLLM replica to use (repeat; none: start 2 with dpserve up)",
    )
    parser.add_argument("--replicas", type=COUNT, default=2, help="how many to start without --replica")
    parser.add_argument("--max-loras", type=COUNT, default=2, help="the started replicas' --max-loras")
    parser.add_argument("--requests", type=COUNT, default=600, help="requests per setup (and in the hot run), a round")
    parser.add_argument("--concurrency", type=COUNT, default=8, help="closed-loop clients")
    parser.add_argument("--adapters", type=COUNT, default=8, help="how many adapters (tiny-lora-0, ...)")
    parser.add_argument("--zipf", type=NON_NEGATIVE, default=1.1, help="compare: the adapters' popularity exponent")
    parser.add_argument("--hot-share", type=SHARE, default=0.5, help="hot: the hot adapter's share of requests")
    parser.add_argument("--max-tokens", type=COUNT, default=16, help="tokens per answer")
    parser.add_argument("--seed", type=WHOLE, default=0, help="seeds the request sequences")
    parser.add_argument("--vllm-router-policy", default="round_robin")
    args = parser.parse_args(list(argv))
    if args.adapters < 2 or args.requests < 1 or args.concurrency < 1 or args.repeat < 1:
        parser.error("--adapters must be at least 2, --requests, --concurrency and --repeat at least 1")
    if not 0 < args.hot_share < 1:
        parser.error("--hot-share must be between 0 and 1")
    return args


def build_adapters(args: argparse.Namespace, folder: Path) -> dict[str, Path]:
    """`--adapters` adapters of the tiny model in `folder` (`dpserve model tiny-lora`), by name."""
    command = [sys.executable, "-m", "dpserve", "model", "tiny-lora", str(folder), "--count", str(args.adapters)]
    command += ["--cache-dir", str(args.cache_dir)]
    subprocess.run(command, check=True, capture_output=True, timeout=600, env=child_env())
    return {name: folder / name for name in adapter_names(args.adapters)}


async def start_fleet(session: aiohttp.ClientSession, args: argparse.Namespace, work: Path) -> list[str]:
    """`dpserve up` with `--replicas` LoRA-enabled vLLM CPU replicas, on ports below 32768."""
    count = args.replicas
    flags = ["--replicas", str(count), "--cache-dir", str(args.cache_dir)]
    flags += ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", "8"]
    progress(f"starting {count} vLLM CPU replicas (--enable-lora --max-loras {args.max_loras}) ...")
    _, urls = await streamed.start_fleet(session, count, work / "vllm", flags)
    return urls


async def run_all(
    args: argparse.Namespace, work: Path, compare: list[CompareRow], hot: list[HotRow], replicas: list[str]
) -> None:
    progress(f"building {args.adapters} adapters ...")
    lora_dir = work / "adapters"
    adapters = build_adapters(args, lora_dir)
    async with aiohttp.ClientSession() as session:
        if not replicas:
            replicas += await start_fleet(session, args, work)
        try:
            if "compare" in args.experiments:
                await run_compare(session, args, replicas, adapters, lora_dir, compare)
                write_report(args, compare, hot, len(replicas))
            if "hot" in args.experiments:
                await run_hot(session, args, replicas, adapters, lora_dir, hot)
        finally:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, RuntimeError):
                await unload_all(session, replicas)


COMPARE_COLUMNS = (
    ("setup", "setup"), ("router", "router"), ("requests", "requests"), ("failed", "failed"), ("404s", "not_found"),
    ("loads", "loads"), ("loads/100", "loads_per_100"), ("unloads", "unloads"), ("ttft p50", "ttft_p50_ms"),
    ("ttft p99", "ttft_p99_ms"), ("duration s", "duration_s"), ("answers/s", "answers_per_s"),
    ("tokens/s", "tokens_per_s"), ("placements", "placements"), ("held at end", "held_at_end"),
    ("load avg", "load_avg"),
)  # fmt: skip
HOT_COLUMNS = (
    ("hot adapter", "hot_adapter"), ("requests", "requests"), ("hot requests", "hot_requests"), ("failed", "failed"),
    ("hot shares", "replica_shares"), ("loaded on", "hot_loaded_on"), ("loads/100", "loads_per_100"),
    ("unloads", "unloads"), ("ttft p50", "ttft_p50_ms"), ("ttft p99", "ttft_p99_ms"),
    ("hot ttft p99", "hot_ttft_p99_ms"), ("duration s", "duration_s"), ("answers/s", "answers_per_s"),
    ("placements", "placements"), ("held at end", "held_at_end"), ("load avg", "load_avg"),
)  # fmt: skip


RowT = TypeVar("RowT", "CompareRow", "HotRow")


def shown_rows(rows: Sequence[RowT]) -> list[RowT]:
    """The rows a report shows: the medians' (run -1), or the one round's."""
    return [r for r in rows if r.run == -1] or list(rows)


def goal_lines(compare: Sequence[CompareRow], hot: Sequence[HotRow], replicas: int) -> list[tuple[str, bool]]:
    """The goal lines of what has been measured so far, on the shown rows, with each round's figures, each with
    whether it was met."""
    lines = compare_goals(shown_rows(compare), [r for r in compare if r.run >= 0]) if compare else []
    if hot:
        lines += hot_goals(shown_rows(hot), replicas, [r for r in hot if r.run >= 0])
    return lines


def write_report(args: argparse.Namespace, compare: Sequence[CompareRow], hot: Sequence[HotRow], replicas: int) -> str:
    """The CSVs (every round's rows and the medians) and lora.md (the medians, or the one round's) of what has
    been measured so far; returns the report's text."""
    tables = []
    if compare:
        write_csv(args.out / "compare.csv", [asdict(r) for r in compare], [f.name for f in fields(CompareRow)])
        tables.append(table(COMPARE_COLUMNS, shown_rows(compare)))
    if hot:
        write_csv(args.out / "hot.csv", [asdict(r) for r in hot], [f.name for f in fields(HotRow)])
        tables.append(table(HOT_COLUMNS, shown_rows(hot)))
    report = "\n\n".join(tables) + "\n\n" + "\n".join(line for line, _ in goal_lines(compare, hot, replicas)) + "\n"
    names = adapter_names(args.adapters)
    slots = "/".join(str(n) for n in getattr(args, "slots", None) or [args.max_loras])
    zipf = zipf_sequence(names, args.requests, args.zipf, args.seed)
    rounds = (
        f"{args.repeat} rounds of {args.requests} requests per setup (compare's setups taking turns, round after "
        "round) and of the hot run; each figure is the median over the rounds, but requests, failed, 404s and hot "
        "requests are the rounds' totals"
        if args.repeat > 1
        else f"one round of {args.requests} requests per setup, and of the hot run"
    )
    (args.out / "lora.md").write_text(
        f"# `dpserve bench lora`\n\n{replicas} vLLM CPU replicas of the tiny model, `--max-loras {slots}`, "
        f"{args.adapters} adapters, {args.concurrency} closed-loop clients, streamed completions of "
        f"{args.max_tokens} tokens, seed {args.seed}; {rounds}. compare: Zipf s={args.zipf} ({mix(zipf)}, the "
        f"same sequence every round); hot: {names[0]} at {args.hot_share:.0%}, the rest uniform. TTFT in ms "
        "(answers only); loads, unloads, placements: dpserve's own counters over the run (n/a for vllm-router, "
        "where vLLM swaps adapters itself; `full`: a look at which no replica could take the request, flow "
        "control's capacity included); held at end: adapters registered on each replica when the run ended "
        "(each round's where they differ).\n\n```\n" + report + "```\n"
    )
    return report


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    compare: list[CompareRow] = []
    hot: list[HotRow] = []
    replicas: list[str] = list(args.replica)
    with streamed.framed(args, "lora", lambda: write_report(args, compare, hot, len(replicas))) as work:
        uvloop.run(run_all(args, work, compare, hot, replicas))
    return goals_status("lora", goal_lines(compare, hot, len(replicas)))  # 1: a goal missed


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
