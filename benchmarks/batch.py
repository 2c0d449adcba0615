"""`dpserve bench batch`: does an OpenAI batch fill the fleet's idle time without touching interactive latency?

Two replicas (`dpserve up`: sims, or real vLLM CPU replicas of the tiny model) behind one dpserve router with
a batch store of its own (defaults otherwise: the policy, flow control, `--batch-slots`). An interactive load
arrives open loop (Poisson, `--rate` a second: streamed chat completions, unique prompts, `ignore_eos`), and
phases take turns in ABBA order each round: `alone` (the interactive load for `--phase-s`), `batch` (the same
load while a batch of `--lines` chat lines, sharing a few system prompts, runs from upload to `completed`).

Per phase: the interactive requests started in it (count, errors, TTFT p50/p99 to the first token); the
replicas' idle share (each replica's own `vllm:num_requests_running`, sampled every 0.1 s: the share of
samples at 0, averaged over the replicas); the tokens they processed a second (their own
`vllm:prompt_tokens_total` + `vllm:generation_tokens_total`); and the batch's lines a second. The verdicts pool
each kind's phases: TTFT p50 and p99 with the batch <= 1.1x alone, the idle share lower with the batch, every
batch completed with each custom_id once in its output, no interactive request failed.

`--operator` runs the router as an operator would: every replica's KV events, `--tokenizer remote`, a client
key (the batch and the interactive load use it), and load that does not come through the router: half as
much again, straight to the first replica (not measured, but seen by the replicas and the room rule).

The client shares this machine's cores with the replicas and the router. Writes batch.md and phases.csv
under --out, and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks import streamed
from benchmarks.fleet import UpPorts, progress, router_command
from benchmarks.report import shown
from benchmarks.stats import percentile
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.up.process import terminate

EXPERIMENTS = ("sim", "vllm")
GOAL_RATIO = 1.1
SAMPLE_S = 0.1
OPERATOR_KEY = "bench-batch-key-0001"
OUTSIDE_SHARE = 0.5
"""`--operator`: a second interactive load sent straight to the first replica, at this share of --rate."""
SYSTEM_PROMPTS = 8
"""Batch lines share this many system prompts (cache-aware placement groups them)."""
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


@dataclass
class PhaseRow:
    experiment: str
    round: int
    phase: str
    seconds: float
    interactive: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    idle_share: float
    replica_tokens_per_s: float
    batch_lines: int
    batch_lines_per_s: float


@dataclass
class Interactive:
    start: float
    ttft: float
    code: str

    @property
    def ok(self) -> bool:
        return not self.code


def chat(number: int, words: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    prompt = f"request {number}: " + " ".join(f"word{(number * 7 + i) % 997}" for i in range(words))
    return {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def batch_file(lines: int, words: int, max_tokens: int) -> bytes:
    out = io.StringIO()
    for number in range(lines):
        body = chat(number, words, max_tokens, False)
        system = f"You are assistant {number % SYSTEM_PROMPTS}. " * 12
        body["messages"].insert(0, {"role": "system", "content": system})
        line = {"custom_id": f"line-{number}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        out.write(orjson.dumps(line).decode() + "\n")
    return out.getvalue().encode()


class Load:
    """Open-loop interactive arrivals until stopped; every request recorded."""

    def __init__(self, url: str, rate: float, words: int, max_tokens: int, seed: int) -> None:
        self.url = f"{url}/v1/chat/completions"
        self.rate = rate
        self.words = words
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.records: list[Interactive] = []
        self.numbers = itertools.count(seed * 1_000_000)
        self.began = time.monotonic()

    def clock(self) -> float:
        return time.monotonic() - self.began

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            body = orjson.dumps(chat(next(self.numbers), self.words, self.max_tokens, True))
            task = asyncio.create_task(self._one(session, body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            try:
                await asyncio.wait_for(stop.wait(), self.rng.expovariate(self.rate))
            except TimeoutError:
                pass
        if tasks:
            await asyncio.gather(*tasks)

    async def _one(self, session: aiohttp.ClientSession, body: bytes) -> None:
        headers = {"content-type": "application/json"}
        reply = await streamed.request(session, self.url, body, headers, self.clock, streamed_token)
        self.records.append(Interactive(reply.start, reply.ttft, reply.code))


def streamed_token(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if (choice.get("delta") or {}).get("content") is not None:
            return True
    return False


async def replica_sample(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(requests running, tokens processed so far) as the replica's own metrics say."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    samples = parse_samples(text, {"vllm:num_requests_running", *COUNTERS})
    running = sum(value for _, value in samples.by_name.get("vllm:num_requests_running", []))
    tokens = sum(value for name in COUNTERS for _, value in samples.by_name.get(name, []))
    return running, tokens


async def watch_replicas(session: aiohttp.ClientSession, replicas: Sequence[str], stop: asyncio.Event) -> list[float]:
    """Each replica's share of samples with nothing running, until stopped."""
    idle = [0] * len(replicas)
    samples = 0
    while not stop.is_set():
        readings = await asyncio.gather(*(replica_sample(session, url) for url in replicas))
        samples += 1
        for index, (running, _) in enumerate(readings):
            idle[index] += running == 0
        with_stop = asyncio.ensure_future(stop.wait())
        await asyncio.wait([with_stop], timeout=SAMPLE_S)
        with_stop.cancel()
    return [count / samples for count in idle] if samples else []


async def replica_tokens(session: aiohttp.ClientSession, replicas: Sequence[str]) -> float:
    return sum(tokens for _, tokens in await asyncio.gather(*(replica_sample(session, url) for url in replicas)))


async def run_batch(
    session: aiohttp.ClientSession, router: str, data: bytes, timeout_s: float
) -> tuple[int, dict[str, Any]]:
    """Uploads `data`, creates a batch and polls it to its end: (lines in its output, the batch object)."""
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="batch.jsonl", content_type="application/jsonl")
    async with session.post(f"{router}/v1/files", data=form) as response:
        uploaded = await response.json()
        assert response.status == 200, uploaded
    create = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    async with session.post(f"{router}/v1/batches", json=create) as response:
        batch = await response.json()
        assert response.status == 200, batch
    deadline = time.monotonic() + timeout_s
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the batch did not end within {timeout_s:.0f} s: {batch['request_counts']}")
        await asyncio.sleep(0.25)
        async with session.get(f"{router}/v1/batches/{batch['id']}") as response:
            batch = await response.json()
    output_id = batch.get("output_file_id")
    if not output_id:
        return 0, batch
    async with session.get(f"{router}/v1/files/{output_id}/content") as response:
        lines = (await response.read()).splitlines()
    ids = [orjson.loads(line)["custom_id"] for line in lines]
    if len(set(ids)) != len(ids):
        raise RuntimeError(f"a custom_id repeats in the batch's output ({len(ids) - len(set(ids))} repeats)")
    return len(ids), batch


async def phase(
    session: aiohttp.ClientSession, args: argparse.Namespace, experiment: str, number: int, kind: str,
    router: str, replicas: Sequence[str],
) -> tuple[PhaseRow, list[Interactive]]:  # fmt: skip
    load = Load(router, args.rate, args.prompt_words, args.max_tokens, seed=number * 2 + (kind == "batch"))
    stop = asyncio.Event()
    tokens_before = await replica_tokens(session, replicas)
    started = time.monotonic()
    driving = asyncio.create_task(load.run(session, stop))
    # `--operator`: load that does not come through the router, straight to the first replica (not measured).
    outside = Load(replicas[0], args.rate * OUTSIDE_SHARE, args.prompt_words, args.max_tokens, seed=number + 7)
    beside = asyncio.create_task(outside.run(session, stop)) if args.operator else None
    watching = asyncio.create_task(watch_replicas(session, replicas, stop))
    lines = 0
    try:
        if kind == "batch":
            data = batch_file(args.lines, args.prompt_words, args.max_tokens)
            lines, batch = await run_batch(session, router, data, args.batch_timeout_s)
            if batch["status"] != "completed" or lines != args.lines:
                raise RuntimeError(f"batch ended {batch['status']} with {lines} of {args.lines} lines in its output")
        else:
            await asyncio.sleep(args.phase_s)
    finally:
        stop.set()
        seconds = time.monotonic() - started
        idle = await watching
        await driving
        if beside is not None:
            await beside
    tokens = await replica_tokens(session, replicas) - tokens_before
    records = [record for record in load.records if record.start <= seconds]
    ttfts = sorted(record.ttft * 1000 for record in records if record.ok and not math.isnan(record.ttft))
    row = PhaseRow(
        experiment, number, kind, round(seconds, 1), len(records), sum(not r.ok for r in records),
        round(percentile(ttfts, 50), 1) if ttfts else math.nan, round(percentile(ttfts, 99), 1) if ttfts else math.nan,
        round(sum(idle) / len(idle), 3) if idle else math.nan, round(tokens / seconds, 1), lines,
        round(lines / seconds, 1),
    )  # fmt: skip
    progress(f"  {kind}: {row}")
    return row, records


async def run_experiment(args: argparse.Namespace, experiment: str, work: Path) -> list[PhaseRow]:
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    key = {"authorization": f"Bearer {OPERATOR_KEY}"} if args.operator else {}  # the replicas take no key
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=key) as session:
        seqs = ["--max-num-seqs", str(args.max_num_seqs)]
        if experiment == "sim":
            flags = ["--sim", "2", "--", *seqs, *args.sim_args.split()]
        else:
            flags = ["--replicas", "2", "--cache-dir", str(args.cache_dir), "--", *seqs, *args.vllm_args.split()]
        progress(f"{experiment}: starting 2 replicas ...")
        fleet, replicas = await streamed.start_fleet(session, 2, work / experiment, flags)
        store = work / experiment / "batches.sqlite3"
        settings = {"batch_store": str(store), "batch_slots": args.batch_slots}
        # `--operator`: as an operator runs it: every replica's KV events (dpserve up's ports: the replicas',
        # then their KV ports), the replicas' tokenizer, a client key.
        events = UpPorts(2, int(replicas[0].rsplit(":", 1)[1])).kv_endpoints if args.operator else []
        extra = ["--api-key", OPERATOR_KEY] if args.operator else []

        def command(port: int) -> list[str]:
            tokenizer = "remote" if args.operator else None
            return router_command(
                "dpserve", "slo", replicas, port, kv_events=events, tokenizer=tokenizer, settings=settings, extra=extra
            )

        router_process, router = await streamed.start_router(session, command, "bench-batch", "/ready", 60)
        rows: list[PhaseRow] = []
        records: dict[str, list[Interactive]] = {"alone": [], "batch": []}
        try:
            progress(f"{experiment}: warming up for {args.warmup_s:.0f} s")
            warm = Load(router, args.rate, args.prompt_words, args.max_tokens, seed=999)
            stop = asyncio.Event()
            warming = asyncio.create_task(warm.run(session, stop))
            await asyncio.sleep(args.warmup_s)
            stop.set()
            await warming
            for number in range(args.repeat):
                for kind in ("alone", "batch", "batch", "alone"):
                    row, kept = await phase(session, args, experiment, number, kind, router, replicas)
                    rows.append(row)
                    records[kind] += kept
        finally:
            terminate(router_process, 30)
            terminate(fleet, 60)
        rows += pooled(experiment, rows, records)
        return rows


def pooled(experiment: str, rows: Sequence[PhaseRow], records: dict[str, list[Interactive]]) -> list[PhaseRow]:
    """One row per kind of phase over all of its phases (round -1)."""
    out = []
    for kind in ("alone", "batch"):
        mine = [row for row in rows if row.phase == kind]
        seconds = sum(row.seconds for row in mine)
        ttfts = sorted(r.ttft * 1000 for r in records[kind] if r.ok and not math.isnan(r.ttft))
        if not ttfts or not seconds:
            raise RuntimeError(f"{experiment}: no interactive answer in the {kind} phases")
        out.append(
            PhaseRow(
                experiment, -1, kind, round(seconds, 1), sum(r.interactive for r in mine), sum(r.errors for r in mine),
                round(percentile(ttfts, 50), 1), round(percentile(ttfts, 99), 1),
                round(sum(r.idle_share * r.seconds for r in mine) / seconds, 3),
                round(sum(r.replica_tokens_per_s * r.seconds for r in mine) / seconds, 1),
                sum(r.batch_lines for r in mine), round(sum(r.batch_lines for r in mine) / seconds, 1),
            )
        )  # fmt: skip
    return out


def verdicts(rows: Sequence[PhaseRow]) -> list[str]:
    lines = []
    for experiment in dict.fromkeys(row.experiment for row in rows):
        alone, batch = (next(r for r in rows if r.experiment == experiment and r.round == -1 and r.phase == kind)
                        for kind in ("alone", "batch"))  # fmt: skip
        for name in ("ttft_p50_ms", "ttft_p99_ms"):
            ratio = getattr(batch, name) / getattr(alone, name)
            met = "met" if ratio <= GOAL_RATIO else "NOT met"
            lines.append(
                f"- {experiment}: interactive {name[:-3]} with the batch {getattr(batch, name)} ms vs alone "
                f"{getattr(alone, name)} ms: {ratio:.2f}x (goal <= {GOAL_RATIO}x): {met}"
            )
        fell = "met" if batch.idle_share < alone.idle_share else "NOT met"
        lines.append(
            f"- {experiment}: replicas idle {alone.idle_share:.0%} alone, {batch.idle_share:.0%} with the batch "
            f"(tokens/s {alone.replica_tokens_per_s:g} -> {batch.replica_tokens_per_s:g}): idle share falls: {fell}"
        )
        failed = alone.errors + batch.errors
        lines.append(
            f"- {experiment}: {batch.batch_lines} batch lines completed, each once, at {batch.batch_lines_per_s:g}/s; "
            f"interactive requests failed: {failed}: {'met' if failed == 0 else 'NOT met'}"
        )
    return lines


def check(rows: Sequence[PhaseRow]) -> None:
    """Nonsense stops the run: a phase with no interactive request, a share outside 0-1, no replica work."""
    for row in rows:
        if row.interactive == 0 or not 0 <= row.idle_share <= 1 or row.replica_tokens_per_s <= 0:
            raise RuntimeError(f"implausible phase: {row}")
        if row.phase == "batch" and row.batch_lines <= 0:
            raise RuntimeError(f"a batch phase without batch lines: {row}")


def write(args: argparse.Namespace, rows: Sequence[PhaseRow]) -> str:
    return streamed.write_rows(args, "batch", rows, verdicts(rows), "phases.csv")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = streamed.bench_parser("batch", __doc__, EXPERIMENTS, 1)
    parser.add_argument("--lines", type=COUNT, default=2000, help="lines in each batch")
    parser.add_argument("--rate", type=POSITIVE, default=4.0, help="interactive requests a second (Poisson)")
    parser.add_argument("--phase-s", type=POSITIVE, default=60.0, help="seconds of each phase without a batch")
    parser.add_argument("--warmup-s", type=NON_NEGATIVE, default=10.0)
    parser.add_argument("--max-tokens", type=COUNT, default=16)
    parser.add_argument("--prompt-words", type=COUNT, default=60)
    parser.add_argument("--max-num-seqs", type=COUNT, default=8)
    parser.add_argument("--batch-slots", type=COUNT, default=1, help="the router's --batch-slots")
    parser.add_argument("--batch-timeout-s", type=POSITIVE, default=900.0)
    parser.add_argument(
        "--operator",
        action="store_true",
        help="as an operator runs it: KV events of every replica, the replicas' tokenizer, a client key, and "
        "half as much load again sent straight to the first replica",
    )
    parser.add_argument("--sim-args", default="--decode-ms-per-token 5", help="extra flags for every sim")
    parser.add_argument("--vllm-args", default="--enforce-eager", help="extra flags for every vLLM replica")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    rows: list[PhaseRow] = []
    with streamed.framed(args, "batch", lambda: write(args, rows)) as work:
        for experiment in args.experiments:
            found = asyncio.run(run_experiment(args, experiment, work))
            check(found)
            rows += found
    progress(f"results in {shown(args.out)}")
    return 0
