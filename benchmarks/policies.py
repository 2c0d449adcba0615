"""`dpserve bench policies`: prefix-cache hit rate, TTFT, throughput and load spread per routing policy,
dpserve's and vllm-router's, on the same replicas in the same run.

For each backend (real vLLM CPU replicas, or `dpserve sim` replicas) it starts the replicas once with
`dpserve up` (KV events on, prefix-cache reset allowed), tokenizes every workload request on a replica
(the ids vLLM sees) to compute the oracle hit rates, then for each workload and contender: resets every
replica's prefix cache, starts the contender's router, runs the workload through it, and reads the hit
rate from the replicas' own `vllm:prefix_cache_hits_total / queries_total` and the request spread from
their `vllm:request_success_total`. The cache-pressure workloads (the groups, and the conversations) run on
replicas restarted with a small KV cache (sized from the groups unless `--pressure-blocks` says: their
prefixes exceed one replica's cache but fit the fleet's), against the partitioned oracle.

Writes `policies.csv`, `tokenize.csv` and one PNG per backend under --out, and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

from benchmarks.fleet import (
    UpPorts,
    get_text,
    port_block,
    progress,
    reset_prefix_caches,
    router_command,
    spawn,
    start_up,
    wait_ok,
)
from benchmarks.policy_workloads import (
    BenchRequest,
    Workload,
    multi_turn,
    oracle_partitioned,
    oracle_unbounded,
    shared_prefix,
)
from benchmarks.report import figure, format_table, goals_status, read_rows, shown, write_csv
from benchmarks.stats import percentile
from dpserve.flag_types import COUNT, NON_NEGATIVE, WHOLE, Names
from dpserve.kvindex.index import block_keys
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.router.observe.prompt_tokens import LocalTokenizer, RemoteTokenizer
from dpserve.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
from dpserve.up.process import terminate

DPSERVE_POLICIES = ("kv_aware", "slo", "prefix", "session", "least_loaded", "round_robin")
SHADOWED = ("round_robin", "least_loaded")
"""Run as shadows of dpserve:kv_aware (`--shadow-policy`), each estimate held against that policy's own run."""
VLLM_ROUTER_POLICIES = ("round_robin", "cache_aware", "kv_aware")
WORKLOADS = ("shared_prefix", "cache_pressure", "multi_turn", "multi_turn_pressure")
PRESSURE_WORKLOADS = ("cache_pressure", "multi_turn_pressure")
"""Run on the small-cache replicas, against the partitioned oracle."""
HITS, QUERIES, SUCCESS = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"
CACHE_CONFIG = "vllm:cache_config_info"
T = TypeVar("T")


@dataclass(frozen=True)
class Contender:
    router: str
    policy: str

    @property
    def label(self) -> str:
        return f"{self.router}:{self.policy}"


@dataclass
class Fleet:
    backend: str
    process: subprocess.Popen[bytes]
    urls: list[str]
    kv_endpoints: list[str]
    block_size: int
    capacity_blocks: int
    log_path: Path


@dataclass
class Row:
    backend: str
    workload: str
    contender: str
    requests: int
    errors: int
    hit_rate: float
    oracle: float
    vs_oracle: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    req_per_s: float
    max_share: float
    """Requests on the busiest replica over the fair share (1.0 = perfectly even)."""
    per_replica: str
    reasons: str = ""
    """dpserve's decision reasons (dpserve_routing_decision_reasons_total) over the run."""
    receipt_classes: str = ""
    """dpserve's routing receipts (every request gets one here) by class, `hit=N cold=N ...`."""
    receipt_predicted_hit_rate: float = math.nan
    """Cached tokens the policy predicted on its choices over the prompts' tokens, from the receipts."""
    receipt_realized_hit_rate: float = math.nan
    """Cached tokens the replicas reported for the same requests over the prompts' tokens."""
    receipt_hit_error_blocks: float = math.nan
    """Mean |realized - predicted| of a `hit`, in blocks."""
    shadows: str = ""
    """dpserve:kv_aware's shadow policies' estimated hit rates, `NAME=rate ...` (`live` = kv_aware's own
    choices through the same cache model)."""
    round_hit_rates: str = ""
    """Each round's hit rate (the row's is their mean)."""
    round_vs_oracle: str = ""
    """Each round's hit rate over the oracle."""
    round_max_shares: str = ""
    """Each round's requests on its busiest replica over the fair share."""


# -- processes ---------------------------------------------------------------------------------------


async def start_fleet(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    backend: str,
    work: Path,
    num_blocks: int | None,
    max_model_len: int | None,
) -> Fleet:
    count = args.replicas or (2 if backend == "vllm" else 8)
    ports = UpPorts.free(count)
    name = f"{backend}-{'small' if num_blocks else 'large'}"
    run_dir = work / name
    command = ports.command(run_dir, "round_robin")
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if backend == "sim":
        command += ["--sim", str(count), "--", "--block-size", str(args.sim_block_size), "--speed", str(args.sim_speed)]
        command += ["--num-blocks", str(num_blocks or 1_000_000)]
    else:
        command += ["--replicas", str(count), "--cache-dir", str(args.cache_dir)]
        # Scale-out endpoints: vllm-router's kv_aware reads token ids from /render (403 without them).
        command += ["--", "--enable-scale-out"]
        if args.vllm_block_size:
            command += ["--block-size", str(args.vllm_block_size)]
        if num_blocks:
            command += ["--num-gpu-blocks-override", str(num_blocks)]
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "up.log"
    progress(f"starting {count} {backend} replicas ({name}) ...")
    # Dev mode: vLLM serves POST /reset_prefix_cache only with it (the sim always does).
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    process = await start_up(session, ports, command, log_path, env, 900)
    urls = ports.replica_urls
    text = await get_text(session, f"{urls[0]}/metrics") or ""
    labels = parse_samples(text, {CACHE_CONFIG}).first_labels(CACHE_CONFIG) or {}
    fleet = Fleet(
        backend,
        process,
        urls,
        ports.kv_endpoints,
        int(labels.get("block_size", 16)),
        int(float(labels.get("num_gpu_blocks", 0) or 0)),
        log_path,
    )
    progress(f"{count} {backend} replicas ready: block size {fleet.block_size}, {fleet.capacity_blocks} blocks each")
    return fleet


def contender_command(
    contender: Contender, fleet: Fleet, port: int, tokenizer: Path | None, extra: Sequence[str] = ()
) -> list[str]:
    """The contender's router over the fleet, with every replica's KV events; `extra` goes to dpserve's only."""
    if contender.router == "dpserve":
        return router_command(
            "dpserve",
            contender.policy,
            fleet.urls,
            port,
            kv_events=fleet.kv_endpoints,
            tokenizer=None if tokenizer is None else str(tokenizer),
            settings={"probe_interval_s": 0.5},
            extra=extra,
        )
    return router_command(
        contender.router, contender.policy, fleet.urls, port, kv_events=fleet.kv_endpoints, block_size=fleet.block_size
    )


# -- one run -----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    ttft_s: float


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> Outcome:
    started = time.perf_counter()
    first: float | None = None
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                await resp.read()
                return Outcome(False, math.nan)
            done = False
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if first is None:
                    first = time.perf_counter() - started
                if b'"error"' in line[:40]:
                    return Outcome(False, math.nan)
                if line.strip() == b"data: [DONE]":
                    done = True
            return Outcome(done, first if first is not None else math.nan)
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(False, math.nan)


async def drive(router_url: str, workload: Workload, concurrency: int, max_tokens: int) -> tuple[list[Outcome], float]:
    """Each thread's requests in order; at most `concurrency` in flight; returns outcomes and seconds."""
    return await drive_threads(router_url, workload, concurrency, max_tokens, _one)


async def drive_threads(
    base_url: str,
    workload: Workload,
    concurrency: int,
    max_tokens: int,
    one: Callable[[aiohttp.ClientSession, str, bytes], Awaitable[T]],
) -> tuple[list[T], float]:
    """Each thread's requests in order (a conversation's turns), streamed, at most `concurrency` in flight;
    `one` sends a request and reads its answer. Returns what `one` returned for each, and the seconds."""
    threads: dict[int, list[BenchRequest]] = {}
    for request in workload.requests:
        threads.setdefault(request.thread, []).append(request)
    gate = asyncio.Semaphore(concurrency)
    results: list[T] = []
    url = f"{base_url}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def thread(requests: list[BenchRequest]) -> None:
            for request in requests:
                body = orjson.dumps(request.body(TINY_MODEL_NAME, max_tokens, stream=True))
                async with gate:
                    results.append(await one(session, url, body))

        started = time.perf_counter()
        await asyncio.gather(*(thread(requests) for requests in threads.values()))
        return results, time.perf_counter() - started


async def replica_counters(session: aiohttp.ClientSession, fleet: Fleet) -> list[tuple[float, float, float]]:
    counters = []
    for url in fleet.urls:
        text = await get_text(session, f"{url}/metrics") or ""
        samples = parse_samples(text, {HITS, QUERIES, SUCCESS})
        hits, queries, success = (samples.total(name) or 0.0 for name in (HITS, QUERIES, SUCCESS))
        counters.append((hits, queries, success))
    return counters


def counter_deltas(
    before: Sequence[tuple[float, float, float]], after: Sequence[tuple[float, float, float]]
) -> tuple[float, float, list[float]]:
    """Over a run, from `replica_counters` read before and after: the fleet's prefix-cache hits and queries
    (tokens), and the requests each replica served."""
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits, queries, [a[2] - b[2] for a, b in zip(after, before, strict=True)]


async def decision_reasons(session: aiohttp.ClientSession, router_url: str) -> dict[str, int]:
    name = "dpserve_routing_decision_reasons_total"
    samples = parse_samples(await get_text(session, f"{router_url}/metrics") or "", {name})
    return {str(labels.get("reason")): int(value) for labels, value in samples.by_name.get(name, [])}


async def receipt_summary(session: aiohttp.ClientSession, router_url: str) -> dict[str, Any]:
    """dpserve's routing receipts over the run (`/admin/receipts`, the summary alone)."""
    text = await get_text(session, f"{router_url}/admin/receipts?limit=0")
    summary: dict[str, Any] = orjson.loads(text)["summary"] if text else {}
    return summary


async def shadow_rates(session: aiohttp.ClientSession, router_url: str) -> dict[str, float]:
    """The shadows' estimated hit rates from /status (`live`: the live policy's choices, modelled)."""
    text = await get_text(session, f"{router_url}/status")
    status: dict[str, Any] = orjson.loads(text) if text else {}
    block = status.get("shadows") or {}
    rates = {"live": (block.get("live_modelled") or {}).get("estimated_hit_rate")}
    rates |= {name: tally.get("estimated_hit_rate") for name, tally in (block.get("shadows") or {}).items()}
    return {name: float(rate) for name, rate in rates.items() if rate is not None}


async def reset_caches(session: aiohttp.ClientSession, fleet: Fleet) -> None:
    await reset_prefix_caches(session, fleet.urls)


@dataclass
class RoundResult:
    """One contender's run of a workload: a fresh router over caches just emptied."""

    outcomes: list[Outcome]
    seconds: float
    hits: float
    queries: float
    served: list[float]
    reasons: dict[str, int]
    receipts: dict[str, Any]
    shadows: dict[str, float]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def max_share(self) -> float:
        return max_share(self.served)


def max_share(served: Sequence[float]) -> float:
    """Requests on the busiest replica over the fair share (nan when none were served)."""
    fair = sum(served) / len(served) if served else 0.0
    return max(served) / fair if fair else math.nan


async def run_round(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    fleet: Fleet,
    workload: Workload,
    contender: Contender,
    tokenizer: Path | None,
) -> RoundResult:
    await reset_caches(session, fleet)
    port = port_block(2, random.Random())
    extra = args.dpserve_args.split()
    if contender.router == "dpserve":
        extra += ["--receipts-sample", "1"]  # every request's prediction against what the replica reported
    if contender == Contender("dpserve", "kv_aware"):
        # What round robin and least loaded would have hit, estimated in the shadow of kv_aware's run, to
        # hold against their own runs on the same workload.
        extra += [f"--shadow-policy={name}" for name in SHADOWED]
    process = spawn(contender_command(contender, fleet, port, tokenizer, extra), None, dict(os.environ))
    router_url = f"http://127.0.0.1:{port}"
    try:
        await wait_ok(session, f"{router_url}/v1/models", 60, process)
        await asyncio.sleep(1.0)  # subscribers connected, first probes done
        before = await replica_counters(session, fleet)
        outcomes, seconds = await drive(
            router_url, workload, args.concurrency or (4 if fleet.backend == "vllm" else 16), args.max_tokens
        )
        after = await replica_counters(session, fleet)
        reasons = await decision_reasons(session, router_url) if contender.router == "dpserve" else {}
        receipts = await receipt_summary(session, router_url) if contender.router == "dpserve" else {}
        shadows = await shadow_rates(session, router_url) if contender == Contender("dpserve", "kv_aware") else {}
    finally:
        terminate(process, 30)
    hits, queries, served = counter_deltas(before, after)
    return RoundResult(outcomes, seconds, hits, queries, served, reasons, receipts, shadows)


async def run_contender(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    fleet: Fleet,
    workloads: list[Workload],
    name: str,
    contender: Contender,
    oracles: list[float],
    tokenizer: Path | None,
) -> Row:
    """One round per draw of the workload, pooled (the draws are alike in size, so the pooled hit rate is about
    the mean of the rounds', and the oracle the mean of theirs); each round's rate against its own oracle is
    kept beside it."""
    rounds = [await run_round(session, args, fleet, workload, contender, tokenizer) for workload in workloads]
    oracle = sum(oracles) / len(oracles)
    outcomes = [o for r in rounds for o in r.outcomes]
    hits, queries = sum(r.hits for r in rounds), sum(r.queries for r in rounds)
    served = [sum(column) for column in zip(*(r.served for r in rounds), strict=True)]
    ttfts = sorted(o.ttft_s * 1000 for o in outcomes if o.ok)
    hit_rate = hits / queries if queries else 0.0
    receipts = pool_receipts([r.receipts for r in rounds])
    return Row(
        backend=fleet.backend,
        workload=name,
        contender=contender.label,
        requests=len(outcomes),
        errors=sum(1 for o in outcomes if not o.ok),
        hit_rate=round(hit_rate, 4),
        oracle=round(oracle, 4),
        vs_oracle=round(hit_rate / oracle, 3) if oracle else math.nan,
        ttft_p50_ms=round(percentile(ttfts, 50), 1),
        ttft_p99_ms=round(percentile(ttfts, 99), 1),
        req_per_s=round(len(outcomes) / sum(r.seconds for r in rounds), 2),
        max_share=round(max_share(served), 3),
        per_replica="/".join(str(int(s)) for s in served),
        reasons=" ".join(f"{reason}={count}" for reason, count in sum_counts([r.reasons for r in rounds]).items()),
        receipt_classes=" ".join(f"{name}={count}" for name, count in receipts.get("classes", {}).items() if count),
        receipt_predicted_hit_rate=_rounded(receipts.get("predicted_hit_rate")),
        receipt_realized_hit_rate=_rounded(receipts.get("realized_hit_rate")),
        receipt_hit_error_blocks=_rounded(receipts.get("hit_mean_error_blocks")),
        shadows=" ".join(f"{name}={rate:.4f}" for name, rate in mean_rates([r.shadows for r in rounds]).items()),
        round_hit_rates=" ".join(f"{r.hit_rate:.3f}" for r in rounds),
        round_vs_oracle=" ".join(f"{r.hit_rate / o:.3f}" if o else "nan" for r, o in zip(rounds, oracles, strict=True)),
        round_max_shares=" ".join(f"{r.max_share:.2f}" for r in rounds),
    )


def sum_counts(parts: Sequence[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for key, count in part.items():
            total[key] = total.get(key, 0) + count
    return total


def mean_rates(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each name's mean over the rounds that report it (every round sends the same prompt tokens)."""
    seen: dict[str, list[float]] = {}
    for part in parts:
        for name, rate in part.items():
            seen.setdefault(name, []).append(rate)
    return {name: sum(rates) / len(rates) for name, rates in seen.items()}


def pool_receipts(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' receipt summaries as one: classes summed, rates averaged, a hit's error weighted by hits."""
    parts = [part for part in parts if part]
    if not parts:
        return {}
    pooled: dict[str, Any] = {"classes": sum_counts([part.get("classes", {}) for part in parts])}
    for key in ("predicted_hit_rate", "realized_hit_rate"):
        rates = [part[key] for part in parts if part.get(key) is not None]
        pooled[key] = sum(rates) / len(rates) if rates else None
    weighted = [
        (part["hit_mean_error_blocks"], part.get("classes", {}).get("hit", 0))
        for part in parts
        if part.get("hit_mean_error_blocks") is not None
    ]
    hits = sum(count for _, count in weighted)
    pooled["hit_mean_error_blocks"] = sum(error * count for error, count in weighted) / hits if hits else None
    return pooled


def _rounded(value: float | None) -> float:
    return math.nan if value is None else round(value, 4)


def receipts_table(rows: Sequence[Row]) -> str:
    """dpserve's routing receipts: what each policy predicted cached against what the replicas reported."""
    lines = [
        "| backend | workload | contender | predicted hit rate | realized hit rate | a hit's error (blocks) "
        "| classes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.receipt_classes:
            lines.append(
                f"| {r.backend} | {r.workload} | {r.contender} | {_cell(r.receipt_predicted_hit_rate)} | "
                f"{_cell(r.receipt_realized_hit_rate)} | {_cell(r.receipt_hit_error_blocks, 2)} | {r.receipt_classes} |"
            )
    return "\n".join(lines) + "\n"


def shadow_table(rows: Sequence[Row]) -> str:
    """Each shadow's estimate (made during dpserve:kv_aware's run) beside that policy's own run, and
    kv_aware's own estimate through the same model beside what the replicas reported."""
    by_key = {(r.backend, r.workload, r.contender): r for r in rows}
    lines = [
        "| backend | workload | policy | estimated in kv_aware's shadow | its own run | difference | its own rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.contender != "dpserve:kv_aware" or not r.shadows:
            continue
        estimates = {name: float(rate) for name, rate in (part.split("=") for part in r.shadows.split())}
        for name, estimate in estimates.items():
            policy = "kv_aware" if name == "live" else name
            own = by_key.get((r.backend, r.workload, f"dpserve:{policy}"))
            if own is None:
                continue
            label = "kv_aware (its own choices, modelled)" if name == "live" else policy
            lines.append(
                f"| {r.backend} | {r.workload} | {label} | {estimate:.3f} | {own.hit_rate:.3f} | "
                f"{estimate - own.hit_rate:+.3f} | {own.round_hit_rates} |"
            )
    return "\n".join(lines) + "\n"


def _cell(value: float, digits: int = 3) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}f}"


# -- workloads, oracles, sizes -----------------------------------------------------------------------


def build_workloads(args: argparse.Namespace, backend: str, replicas: int, round_: int = 0) -> dict[str, Workload]:
    """The workloads of one round: round k draws its prompts with `--seed` + 2k (and + 1 for the conversations),
    so the rounds are different groups and conversations, in a different order, not one draw repeated."""
    groups = args.groups or (4 * replicas)
    seed = args.seed + 2 * round_
    prefix = shared_prefix(groups, args.prompts, args.prefix_words, args.question_words, seed)
    conversations = args.conversations or (4 * replicas)
    turns = multi_turn(conversations, args.turns, args.prefix_words, args.question_words, seed + 1)
    return {"shared_prefix": prefix, "cache_pressure": prefix, "multi_turn": turns, "multi_turn_pressure": turns}


def tokenize_locally(workloads: Sequence[Workload], model_dir: Path) -> None:
    local = LocalTokenizer(model_dir)
    for workload in workloads:
        for request in workload.requests:
            if not request.token_ids:
                ids = local.tokens_now("chat", {"messages": request.messages})
                if ids is None:
                    raise RuntimeError("the tiny model's tokenizer could not tokenize a benchmark request")
                request.token_ids = tuple(ids)


async def tokenize_all(session: aiohttp.ClientSession, fleet: Fleet, workloads: Sequence[Workload]) -> None:
    remote = RemoteTokenizer(session, timeout_s=60)
    for workload in workloads:
        for request in workload.requests:
            if request.token_ids:
                continue
            ids = await remote.tokens("chat", {"messages": request.messages}, TINY_MODEL_NAME, fleet.urls[0])
            if ids is None:
                raise RuntimeError("could not tokenize a benchmark request on the replica")
            request.token_ids = tuple(ids)


def pressure_capacity(workload: Workload, block_size: int, replicas: int, concurrency: int, max_tokens: int) -> int:
    """Blocks per replica: its share of the groups' prefixes plus room for the requests in flight. A perfect
    partition fits; all the groups' prefixes together do not fit in one replica."""
    by_group: dict[int, list[BenchRequest]] = {}
    for request in workload.requests:
        by_group.setdefault(request.group, []).append(request)
    prefix_blocks = []
    for requests in by_group.values():
        keys = [block_keys(r.token_ids, block_size) for r in requests]
        shared = 0
        while all(len(k) > shared and k[shared] == keys[0][shared] for k in keys):
            shared += 1
        prefix_blocks.append(shared)
    per_group = max(prefix_blocks)
    request_blocks = max(math.ceil((len(r.token_ids) + max_tokens) / block_size) for r in workload.requests)
    groups_per_replica = math.ceil(len(by_group) / replicas)
    in_flight = math.ceil(concurrency / replicas) + 1
    # Each request in flight holds its own blocks beyond the shared prefix (already counted).
    return groups_per_replica * per_group + in_flight * (request_blocks - per_group + 1) + 1


def oracle_for(name: str, workload: Workload, fleet: Fleet, max_tokens: int) -> float:
    if name in PRESSURE_WORKLOADS:
        return oracle_partitioned(
            workload.requests, fleet.block_size, len(fleet.urls), fleet.capacity_blocks, max_tokens
        )
    return oracle_unbounded(workload.requests, fleet.block_size)


# -- tokenizer cost ----------------------------------------------------------------------------------


# One tokenize.csv row: the backend, the prompts' mean length, the local and remote tokenizers' p50 and p99.
TokenizerCost = dict[str, str | int | float]


async def tokenizer_cost(
    session: aiohttp.ClientSession, fleet: Fleet, workload: Workload, model_dir: Path
) -> TokenizerCost:
    local = LocalTokenizer(model_dir)
    remote = RemoteTokenizer(session)
    local_us, remote_us = [], []
    for request in workload.requests:
        payload = {"messages": request.messages}
        t0 = time.perf_counter()
        ids = local.tokens_now("chat", payload)
        local_us.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        remote_ids = await remote.tokens("chat", payload, TINY_MODEL_NAME, fleet.urls[0])
        remote_us.append((time.perf_counter() - t0) * 1e6)
        if ids != remote_ids:
            raise RuntimeError("the router's local tokenizer disagrees with the replica's /tokenize")
    local_us.sort()
    remote_us.sort()
    tokens = sum(len(r.token_ids) for r in workload.requests) / len(workload.requests)
    return {
        "backend": fleet.backend,
        "requests": len(workload.requests),
        "mean_prompt_tokens": round(tokens),
        "local_p50_us": round(percentile(local_us, 50), 1),
        "local_p99_us": round(percentile(local_us, 99), 1),
        "remote_p50_us": round(percentile(remote_us, 50), 1),
        "remote_p99_us": round(percentile(remote_us, 99), 1),
    }


# -- output ------------------------------------------------------------------------------------------


TABLE_HEADER = (
    "backend",
    "workload",
    "contender",
    "hit",
    "oracle",
    "vs_oracle",
    "ttft_p50",
    "ttft_p99",
    "req/s",
    "max_share",
    "per_replica",
    "err",
)


def table_cells(r: Row) -> tuple[str, ...]:
    return (
        r.backend,
        r.workload,
        r.contender,
        f"{r.hit_rate:.3f}",
        f"{r.oracle:.3f}",
        f"{r.vs_oracle:.2f}",
        f"{r.ttft_p50_ms:.0f}ms",
        f"{r.ttft_p99_ms:.0f}ms",
        f"{r.req_per_s:.1f}",
        f"{r.max_share:.2f}",
        r.per_replica,
        str(r.errors),
    )


def markdown_table(rows: Sequence[Row]) -> str:
    lines = [
        "| backend | workload | contender | hit rate | oracle | of oracle | TTFT p50 | TTFT p99 | req/s | max share |"
        " requests per replica |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = f"**{r.contender}**" if r.contender == "dpserve:kv_aware" else r.contender
        lines.append(
            f"| {r.backend} | {r.workload} | {name} | {r.hit_rate:.3f} | {r.oracle:.3f} | {r.vs_oracle:.2f} | "
            f"{r.ttft_p50_ms:.0f} ms | {r.ttft_p99_ms:.0f} ms | {r.req_per_s:.1f} | {r.max_share:.2f} | "
            f"{r.per_replica} |"
        )
    return "\n".join(lines) + "\n"


def summary_table(rows: Sequence[Row]) -> str:
    """Hit rate as a share of the oracle: one row per contender, one column per backend and workload."""
    columns = list(dict.fromkeys((r.backend, r.workload) for r in rows))
    contenders = list(dict.fromkeys(r.contender for r in rows))
    by_key = {(r.backend, r.workload, r.contender): r for r in rows}
    lines = [
        "| contender | " + " | ".join(f"{b} {w}" for b, w in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for contender in contenders:
        cells = []
        for backend, workload in columns:
            row = by_key.get((backend, workload, contender))
            cells.append(f"{row.vs_oracle:.2f}" if row is not None else "")
        name = f"**{contender}**" if contender == "dpserve:kv_aware" else contender
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load_rows(path: Path) -> list[Row]:
    """Rows back from a policies.csv (to redraw the plot or the tables without rerunning)."""
    return read_rows(Row, path)


def verdicts(rows: Sequence[Row]) -> list[tuple[str, bool]]:
    """The stated goals, checked on this run's figures: per backend and workload that dpserve:kv_aware ran,
    a line and whether it met them all (kv_aware at 0.95 of the oracle or more, above dpserve:round_robin
    and at least as high as the best vllm-router policy where they ran; on shared_prefix, no replica over
    1.5x its fair share)."""
    out = []
    for backend in sorted({r.backend for r in rows}):
        for workload in WORKLOADS:
            subset = [r for r in rows if r.backend == backend and r.workload == workload]
            ours = next((r for r in subset if r.contender == "dpserve:kv_aware"), None)
            if ours is None:
                continue
            checks = [(f"kv_aware/oracle {ours.vs_oracle:.2f}", ">=", "0.95", ours.vs_oracle >= 0.95)]
            rr = next((r for r in subset if r.contender == "dpserve:round_robin"), None)
            if rr is not None:
                checks.append(
                    (f"vs round_robin {ours.hit_rate:.3f}", ">", f"{rr.hit_rate:.3f}", ours.hit_rate > rr.hit_rate)
                )
            peers = [r for r in subset if r.contender.startswith("vllm-router:")]
            if peers:
                best_peer = max(r.hit_rate for r in peers)
                checks.append(
                    (f"vs best vllm-router {ours.hit_rate:.3f}", ">=", f"{best_peer:.3f}", ours.hit_rate >= best_peer)
                )
            if workload == "shared_prefix":
                checks.append((f"max share {ours.max_share:.2f}", "<=", "1.5", ours.max_share <= 1.5))
            text = "; ".join(f"{what} {goal if ok else 'NOT ' + goal} {bound}" for what, goal, bound, ok in checks)
            out.append((f"{backend:5} {workload:19} {text}", all(ok for *_, ok in checks)))
            if workload in PRESSURE_WORKLOADS:
                out += [pressure_verdict(r) for r in subset if r.contender in PRESSURE_GOAL_CONTENDERS]
    return out


PRESSURE_GOAL_CONTENDERS = ("dpserve:kv_aware", "dpserve:slo")
PRESSURE_FLOOR = 0.95
"""Each round under cache pressure at this share of the partitioned oracle or more..."""
PRESSURE_MAX_SHARE = 1.1
"""...with its busiest replica at most this over the fair share: a group or conversation more on one replica
than a partition gives it is what the cache cannot keep."""


def pressure_verdict(row: Row) -> tuple[str, bool]:
    """Under cache pressure the goal holds round by round, not on the mean: one bad placement costs a whole
    round's hits."""
    ratios = [float(x) for x in row.round_vs_oracle.split()]
    shares = [float(x) for x in row.round_max_shares.split()]
    ok = bool(ratios) and min(ratios) >= PRESSURE_FLOOR and max(shares) <= PRESSURE_MAX_SHARE and row.errors == 0
    text = (
        f"{row.backend:5} {row.workload:19} {row.contender} round by round: of oracle {row.round_vs_oracle} "
        f"(goal >= {PRESSURE_FLOOR}), max share {row.round_max_shares} (goal <= {PRESSURE_MAX_SHARE}), "
        f"{row.errors} errors"
    )
    return text, ok


def rounds_table(rows: Sequence[Row]) -> str:
    """Each row's rounds: hit rate over the oracle and the busiest replica's share, run by run."""
    lines = ["| backend | workload | contender | of oracle, round by round | max share, round by round |"]
    lines.append("|---|---|---|---|---|")
    for r in rows:
        lines.append(f"| {r.backend} | {r.workload} | {r.contender} | {r.round_vs_oracle} | {r.round_max_shares} |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: Path, backend: str) -> None:
    subset = [r for r in rows if r.backend == backend]
    workloads = [w for w in WORKLOADS if any(r.workload == w for r in subset)]
    contenders = list(dict.fromkeys(r.contender for r in subset))
    titles = (f"prefix-cache hit rate (replica metrics), {backend}", f"TTFT p50 (ms), {backend}")
    with figure(path, titles, (13, 5.4), legend="figure", legend_columns=5, legend_space=0.1) as axes:
        width = 0.8 / max(1, len(contenders))
        for index, contender in enumerate(contenders):
            xs, hits, ttfts = [], [], []
            for w_index, workload in enumerate(workloads):
                row = next((r for r in subset if r.workload == workload and r.contender == contender), None)
                if row is not None:
                    xs.append(w_index + index * width - 0.4 + width / 2)
                    hits.append(row.hit_rate)
                    ttfts.append(row.ttft_p50_ms)
            hatch = "//" if contender.startswith("vllm-router") else None
            axes[0].bar(xs, hits, width, label=contender, hatch=hatch)
            axes[1].bar(xs, ttfts, width, label=contender, hatch=hatch)
        for w_index, workload in enumerate(workloads):
            oracle = next(r.oracle for r in subset if r.workload == workload)
            axes[0].hlines(
                oracle,
                w_index - 0.42,
                w_index + 0.42,
                colors="black",
                linestyles="dashed",
                label="oracle" if w_index == 0 else "_nolegend_",  # one legend entry for all the oracle lines
            )
        for axis in axes:
            axis.set_xticks(range(len(workloads)), workloads)
        axes[0].set_ylim(0, 1.05)


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpserve bench policies", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("vllm", "sim", "both"), default="both")
    parser.add_argument("--replicas", type=COUNT, help="replicas per backend (default: 2 vLLM, 8 sims)")
    parser.add_argument(
        "--workloads",
        type=Names(WORKLOADS),
        default=",".join(WORKLOADS),
        help="comma-separated, of " + ", ".join(WORKLOADS),
    )
    parser.add_argument(
        "--policies", type=Names(DPSERVE_POLICIES), default=",".join(DPSERVE_POLICIES), help="dpserve policies to run"
    )
    parser.add_argument(
        "--vllm-router-policies",
        type=Names(VLLM_ROUTER_POLICIES, empty=True),
        default=",".join(VLLM_ROUTER_POLICIES),
        help="vllm-router policies to run (empty: none)",
    )
    parser.add_argument("--groups", type=COUNT, help="shared-prefix groups (default 4 per replica)")
    parser.add_argument("--prompts", type=COUNT, default=6, help="prompts per group")
    parser.add_argument("--conversations", type=COUNT, help="multi-turn conversations (default 4 per replica)")
    parser.add_argument("--turns", type=COUNT, default=5)
    parser.add_argument("--prefix-words", type=COUNT, default=350, help="words in each group's system prompt")
    parser.add_argument("--question-words", type=COUNT, default=30)
    parser.add_argument("--max-tokens", type=COUNT, default=8)
    parser.add_argument("--concurrency", type=COUNT, help="requests in flight (default: 4 vLLM, 16 sims)")
    parser.add_argument("--sim-block-size", type=COUNT, default=16)
    parser.add_argument("--vllm-block-size", type=COUNT, help="vLLM's --block-size (default: vLLM's, 128 on CPU)")
    parser.add_argument(
        "--pressure-blocks",
        type=COUNT,
        help="KV blocks per replica for the cache-pressure workloads (default: sized from the groups)",
    )
    parser.add_argument("--sim-speed", type=NON_NEGATIVE, default=1.0)
    parser.add_argument("--seed", type=WHOLE, default=0)
    parser.add_argument(
        "--rounds", type=COUNT, default=1, help="runs of each contender on each workload, pooled (a fresh router each)"
    )
    parser.add_argument("--dpserve-args", default="", help="extra flags for every dpserve router, e.g. tuning")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--out", type=Path, default=Path("bench-results/policies"))
    return parser.parse_args(list(argv))


async def run_backend(
    args: argparse.Namespace, backend: str, contenders: list[Contender], rows: list[Row], costs: list[TokenizerCost]
) -> None:
    replicas = args.replicas or (2 if backend == "vllm" else 8)
    concurrency = args.concurrency or (4 if backend == "vllm" else 16)
    by_round = [build_workloads(args, backend, replicas, k) for k in range(args.rounds)]
    workloads = by_round[0]
    wanted = [w for w in args.workloads.split(",") if w]
    model_dir = ensure_tiny_model(args.cache_dir)
    work = Path(tempfile.mkdtemp(prefix="dpserve-bench-policies-"))  # replica logs
    every = list({id(w): w for round_ in by_round for w in round_.values()}.values())
    async with aiohttp.ClientSession() as session:
        large = [w for w in wanted if w not in PRESSURE_WORKLOADS]
        block_size = args.sim_block_size if backend == "sim" else args.vllm_block_size
        if large:
            fleet = await start_fleet(session, args, backend, work, None, None)
            block_size = fleet.block_size
            try:
                await tokenize_all(session, fleet, every)
                costs.append(await tokenizer_cost(session, fleet, workloads["shared_prefix"], model_dir))
                progress(f"tokenizer cost: {costs[-1]}")
                for name in large:
                    rounds = [r[name] for r in by_round]
                    await _run_workload(session, args, fleet, name, rounds, contenders, rows, model_dir)
            finally:
                terminate(fleet.process, 60)
        else:
            tokenize_locally(every, model_dir)  # the replica's own ids (tokenizer_cost checks they agree)
        pressured = [w for w in wanted if w in PRESSURE_WORKLOADS]
        if pressured:
            if not block_size:
                raise SystemExit("--vllm-block-size is needed when only cache-pressure workloads run on vLLM")
            sized = workloads["cache_pressure"]  # the groups: a partition of them fits, one replica does not
            blocks = args.pressure_blocks or pressure_capacity(
                sized, block_size, replicas, concurrency, args.max_tokens
            )
            drawn = [round_[name] for round_ in by_round for name in pressured]
            longest = max(len(r.token_ids) for workload in drawn for r in workload.requests) + args.max_tokens
            max_len = min(blocks * block_size, 4096, math.ceil(longest / block_size + 1) * block_size)
            small = await start_fleet(session, args, backend, work, blocks, max_len)
            try:
                for name in pressured:
                    rounds = [r[name] for r in by_round]
                    await _run_workload(session, args, small, name, rounds, contenders, rows, model_dir)
            finally:
                terminate(small.process, 60)


async def _run_workload(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    fleet: Fleet,
    name: str,
    rounds: list[Workload],
    contenders: list[Contender],
    rows: list[Row],
    model_dir: Path,
) -> None:
    """`rounds`: each round's draw of the workload (every contender runs the same draws)."""
    oracles = [oracle_for(name, workload, fleet, args.max_tokens) for workload in rounds]
    first = rounds[0]
    progress(
        f"{fleet.backend} {name}: {first.description}; {len(first.requests)} requests a round, oracle "
        + " ".join(f"{oracle:.3f}" for oracle in oracles)
    )
    for contender in contenders:
        row = await run_contender(session, args, fleet, rounds, name, contender, oracles, model_dir)
        rows.append(row)
        progress(
            f"  {contender.label:26} hit {row.hit_rate:.3f} ({row.vs_oracle:.2f} of oracle), "
            f"ttft p50 {row.ttft_p50_ms:.0f} ms, {row.req_per_s:.1f} req/s, spread {row.per_replica}, "
            f"errors {row.errors}"
        )


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    contenders = [Contender("dpserve", p) for p in args.policies.split(",") if p]
    contenders += [Contender("vllm-router", p) for p in args.vllm_router_policies.split(",") if p]
    backends = ("vllm", "sim") if args.backend == "both" else (args.backend,)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    costs: list[TokenizerCost] = []
    for backend in backends:
        asyncio.run(run_backend(args, backend, contenders, rows, costs))
    write_csv(args.out / "policies.csv", [asdict(r) for r in rows], [f.name for f in fields(Row)])
    write_csv(args.out / "tokenize.csv", costs)
    (args.out / "policies.md").write_text(
        summary_table(rows)
        + "\n"
        + markdown_table(rows)
        + "\n"
        + rounds_table(rows)
        + "\n"
        + receipts_table(rows)
        + "\n"
        + shadow_table(rows)
    )
    for backend in backends:
        plot(rows, args.out / f"policies-{backend}.png", backend)
    print()
    print(format_table(TABLE_HEADER, [table_cells(r) for r in rows]))
    print()
    print(rounds_table(rows))
    for cost in costs:
        print(
            f"tokens for kv_aware ({cost['backend']}, {cost['mean_prompt_tokens']} tokens/prompt): "
            f"router-side tokenizer p50 {cost['local_p50_us']} us, replica /tokenize p50 {cost['remote_p50_us']} us"
        )
    print()
    print(receipts_table(rows))
    print(shadow_table(rows))
    goals = verdicts(rows)
    print("\n".join(line for line, _ in goals))
    print(
        f"\nwrote {shown(args.out)}/policies.csv, policies.md, tokenize.csv, "
        + ", ".join(f"policies-{b}.png" for b in backends)
    )
    return goals_status("policies", goals)
