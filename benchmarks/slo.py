"""`dpserve bench slo`: goodput under a TTFT SLO per routing policy, on replicas of different speeds.

Two replicas of different speeds per backend: `dpserve sim`s (a fast one and one `--sim-slow-speed` times as
fast, each with a small batch so a burst queues), or real vLLM CPU replicas of the tiny model on this box's
cores (`--vllm-fast-cores` and `--vllm-slow-cores`, each replica's VLLM_CPU_OMP_THREADS_BIND). The workload
is bursty (`--bursts` bursts of LEVEL requests sent at once, `--gap-s` apart, without waiting for the last
burst's answers), the prompts in groups sharing a long system prompt (benchmarks/policy_workloads.py), all
streamed; half the requests carry `x-slo-ttft-ms: --slo-ttft-ms`, the other half none (best effort). TTFT is
measured here, at the client, to the first chunk with content. With `--priority` (the default) the replicas
order their queues by vLLM's `priority` field and every router passes it (`--vllm-priority`): only slo gives
a request with an SLO its own, the others give all the same, as first come first served.

First the load sweep: the default policy (kv_aware) one round at each of `--levels` in turn, until its SLO
attainment falls below `--attainment-bound` (or `--level` names the load outright). At that load every
policy of `--policies` runs `--rounds` rounds, the order reversed every other round (A B, B A) so drift hits
them alike; each round a fresh router over replicas whose prefix caches were just emptied, every request
with a routing receipt.

Figures per policy: goodput (SLO requests whose first token came within the SLO, per second of the run: from
the first send to the last answer; a refused one is not met), attainment (met / SLO requests sent), refusals
(429s: on arrival, and how fast they came, p99 from send to the 429; after a wait in the router's queue,
apart), best-effort throughput (best-effort requests
completed per second), TTFT p50/p99 per class, errors; and from the receipts, where the router predicts
TTFT (`predicted_ttft_ms`, `realized_ttft_ms`), each replica's predicted and realized TTFT and the p50 of
|predicted - realized| / realized.

Writes `slo.csv` (one row per backend, phase, load and policy), `predictions.csv` (per replica),
`slo.txt` (the tables and goal lines) and `receipts/BACKEND-POLICY-LOAD-ROUND.jsonl` (each compared round's
receipts) under --out, and prints them; exits 1 when a goal is missed.
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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.fleet import HOST, get_text, port_block, progress, reset_prefix_caches, router_command, spawn, wait_ok
from benchmarks.policy_workloads import BenchRequest, shared_prefix
from benchmarks.report import format_table, goals_status, met, shown, write_csv
from benchmarks.stats import percentile
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE, SHARE, WHOLE, Names, counts
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
from dpserve.up.plan import VLLM_SERVER_MODULE, vllm_engine_flags
from dpserve.up.process import terminate

POLICIES = ("slo", "kv_aware", "least_loaded")
DEFAULT_POLICY = "kv_aware"
"""Today's default with KV events: the load sweep runs it, and the goals are set against it."""
BACKENDS = ("sim", "vllm")
DEFAULT_LEVELS = {"sim": "2,4,6,8,12,16,24", "vllm": "1,2,3,4,6"}
"""The loads swept by default, requests a burst: a CPU vLLM's prefill of a cold prompt alone takes most of the SLO."""
SLO_HEADER = "x-slo-ttft-ms"
WAITED_MARK = b"in the router's queue"
"""In a refusal's message when the request waited in the router's queue first."""
REFUSAL_METRICS = ("dpserve_routing_decision_reasons_total", "dpserve_admission_rejections_total")
REFUSAL_BOUND_MS = 50.0
PREDICTION_BOUND = 0.20
GOODPUT_VS_DEFAULT, GOODPUT_VS_LEAST_LOADED, BEST_EFFORT_VS_DEFAULT = 1.3, 1.5, 0.9


# -- one request and its figures -----------------------------------------------------------------------


@dataclass
class Outcome:
    """One request as the client saw it."""

    slo_ms: float | None
    """Its TTFT SLO; None: best effort."""
    status: int
    """HTTP status; 0 when the connection failed."""
    ttft_s: float = math.nan
    """From the send to the first chunk with content."""
    answered_s: float = math.nan
    """From the send to the answer's end (a refusal's: to its 429)."""
    done: bool = False
    """A whole stream, `[DONE]` at its end."""
    retry_after: bool = False
    """A 429 that carried Retry-After."""
    code: str = ""
    """A refusal's or error's `error.code`."""
    waited: bool = False
    """A refusal that came after a wait in the router's queue (its message says so)."""

    @property
    def met(self) -> bool:
        return self.slo_ms is not None and self.done and self.ttft_s * 1000 <= self.slo_ms

    @property
    def refused(self) -> bool:
        return self.status == 429


@dataclass
class Figures:
    slo_sent: int
    slo_met: int
    best_effort_sent: int
    best_effort_done: int
    refused: int
    """429s to SLO requests."""
    refused_after_wait: int
    """Of those, the ones refused after waiting in the router's queue (predicted, or given a fair chance,
    to meet their SLO on arrival; then no slot freed in time, or the one that did was predicted late):
    the rest were refused on arrival."""
    best_effort_refused: int
    refusal_p50_ms: float
    refusal_p99_ms: float
    """Of the refusals on arrival (those predicted not to meet their SLO)."""
    refusals_without_retry_after: int
    failed: int
    """Neither a whole answer nor a 429 (either class)."""
    failed_late: int
    """SLO requests failed after their deadline."""
    seconds: float
    goodput: float
    attainment: float
    best_effort_per_s: float
    ttft_slo_p50_ms: float
    ttft_slo_p99_ms: float
    ttft_best_effort_p50_ms: float
    ttft_best_effort_p99_ms: float


def summarize(outcomes: Sequence[Outcome], seconds: float) -> Figures:
    """The figures of `outcomes` sent over `seconds` (from the first send to the last answer, rounds summed)."""
    slo = [o for o in outcomes if o.slo_ms is not None]
    best = [o for o in outcomes if o.slo_ms is None]
    met_count = sum(1 for o in slo if o.met)
    best_done = sum(1 for o in best if o.done)
    refusals = sorted(o.answered_s * 1000 for o in outcomes if o.refused and not o.waited)
    failed = [o for o in outcomes if not o.done and not o.refused]
    late = [o for o in failed if o.slo_ms is not None and not o.answered_s * 1000 <= o.slo_ms]
    ttft_slo = sorted(o.ttft_s * 1000 for o in slo if o.done)
    ttft_best = sorted(o.ttft_s * 1000 for o in best if o.done)
    return Figures(
        slo_sent=len(slo),
        slo_met=met_count,
        best_effort_sent=len(best),
        best_effort_done=best_done,
        refused=sum(1 for o in slo if o.refused),
        refused_after_wait=sum(1 for o in slo if o.refused and o.waited),
        best_effort_refused=sum(1 for o in best if o.refused),
        refusal_p50_ms=percentile(refusals, 50),
        refusal_p99_ms=percentile(refusals, 99),
        refusals_without_retry_after=sum(1 for o in outcomes if o.refused and not o.retry_after),
        failed=len(failed),
        failed_late=len(late),
        seconds=seconds,
        goodput=met_count / seconds if seconds > 0 else math.nan,
        attainment=met_count / len(slo) if slo else math.nan,
        best_effort_per_s=best_done / seconds if seconds > 0 else math.nan,
        ttft_slo_p50_ms=percentile(ttft_slo, 50),
        ttft_slo_p99_ms=percentile(ttft_slo, 99),
        ttft_best_effort_p50_ms=percentile(ttft_best, 50),
        ttft_best_effort_p99_ms=percentile(ttft_best, 99),
    )


def comparison_level(attainments: Sequence[tuple[int, float]], bound: float) -> int | None:
    """The first load (in the order swept) at which the default policy's attainment fell below `bound`."""
    return next((level for level, attainment in attainments if attainment < bound), None)


def round_orders(policies: Sequence[str], rounds: int) -> list[list[str]]:
    """Each round's order of the policies: as given, then reversed, and so on (A B, B A, A B ...)."""
    return [list(policies) if index % 2 == 0 else list(reversed(policies)) for index in range(rounds)]


def slo_flags(requests: int, seed: int) -> list[bool]:
    """Which of `requests` carry the SLO: half of them (the odd one out best effort), shuffled by `seed`."""
    flags = [index < requests // 2 for index in range(requests)]
    random.Random(seed).shuffle(flags)
    return flags


LOAD_BANDS = ((0, 1), (2, 5), (6, 1 << 30))
"""The replica's load when its request was routed (the receipt's `load`), in bands for the error by load:
one flat across them is noise the inputs cannot explain (on vLLM CPU on this box, the other replica's
threads on the same cores); one that grows with load is the model's."""


@dataclass
class ReplicaError:
    """Predicted against realized TTFT on one replica, from the receipts that carry both."""

    replica: str
    receipts: int
    predicted_p50_ms: float
    realized_p50_ms: float
    error_p50: float
    """p50 of |predicted - realized| / realized."""
    error_by_load: str = ""
    """That p50 per band of `LOAD_BANDS`, `0-1: 34% (206) 2-5: ...` (the receipts in each)."""


def prediction_errors(receipts: Sequence[dict[str, Any]], names: dict[str, str]) -> list[ReplicaError]:
    """Per replica (named by `names`, receipt replica id -> name; else the id), over the receipts with a
    predicted and a positive realized TTFT."""
    by_replica: dict[str, list[tuple[float, float, int]]] = {}
    for receipt in receipts:
        predicted, realized = receipt.get("predicted_ttft_ms"), receipt.get("realized_ttft_ms")
        if predicted is None or realized is None or realized <= 0:
            continue
        replica = str(receipt.get("replica"))
        load = int(receipt.get("load") or 0)
        by_replica.setdefault(names.get(replica, replica), []).append((float(predicted), float(realized), load))
    out = []
    for replica in sorted(by_replica):
        triples = by_replica[replica]
        out.append(
            ReplicaError(
                replica,
                len(triples),
                percentile(sorted(p for p, _, _ in triples), 50),
                percentile(sorted(r for _, r, _ in triples), 50),
                percentile(sorted(abs(p - r) / r for p, r, _ in triples), 50),
                error_by_load(triples),
            )
        )
    return out


def error_by_load(triples: Sequence[tuple[float, float, int]]) -> str:
    parts = []
    for low, high in LOAD_BANDS:
        errors = sorted(abs(p - r) / r for p, r, load in triples if low <= load <= high)
        band = f"{low}-{high}" if high < 1 << 30 else f"{low}+"
        parts.append(f"{band}: {percentile(errors, 50):.0%} ({len(errors)})" if errors else f"{band}: - (0)")
    return " ".join(parts)


def spread(receipts: Sequence[dict[str, Any]], names: dict[str, str]) -> str:
    """Receipts per replica (every routed request has one here), `fast=N slow=N` in name order."""
    counts: dict[str, int] = {}
    for receipt in receipts:
        if receipt.get("replica") is not None:
            name = names.get(str(receipt["replica"]), str(receipt["replica"]))
            counts[name] = counts.get(name, 0) + 1
    return " ".join(f"{name}={counts[name]}" for name in sorted(counts))


def pooled_error(receipts: Sequence[dict[str, Any]]) -> float:
    """p50 of |predicted - realized| / realized over every replica's receipts."""
    errors = sorted(
        abs(float(r["predicted_ttft_ms"]) - float(r["realized_ttft_ms"])) / float(r["realized_ttft_ms"])
        for r in receipts
        if r.get("predicted_ttft_ms") is not None and (r.get("realized_ttft_ms") or 0) > 0
    )
    return percentile(errors, 50)


# -- the replicas --------------------------------------------------------------------------------------


@dataclass
class Fleet:
    backend: str
    names: list[str]
    """`fast`, `slow`: what each replica is."""
    urls: list[str]
    kv_endpoints: list[str]
    processes: list[subprocess.Popen[bytes]]
    described: str
    """The replicas as the report names them."""

    def stop(self) -> None:
        for process in reversed(self.processes):
            terminate(process, 60)


def sim_command(args: argparse.Namespace, port: int, kv_port: int, speed: float, seed: int) -> list[str]:
    command = [sys.executable, "-m", "dpserve", "sim", "--host", HOST, "--port", str(port), "--log-level", "warning"]
    command += ["--kv-events", f"tcp://127.0.0.1:{kv_port}", "--speed", str(speed), "--seed", str(seed)]
    command += ["--prefill-ms-per-token", str(args.sim_prefill_ms), "--decode-ms-per-token", str(args.sim_decode_ms)]
    command += ["--max-num-seqs", str(args.sim_max_num_seqs), "--jitter", "0.05"]
    return [*command, *scheduling_flags(args)]


def vllm_command(args: argparse.Namespace, model: Path, port: int, kv_port: int) -> list[str]:
    command = [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", str(model), "--host", HOST, "--port", str(port)]
    # Eager: torch.compile costs each start 20-40 s on 2 cores and changes nothing measured here.
    command += [*vllm_engine_flags(TINY_MODEL_NAME, kv_port, 4096), "--enforce-eager"]
    if args.vllm_max_num_seqs:
        command += ["--max-num-seqs", str(args.vllm_max_num_seqs)]
    return [*command, *scheduling_flags(args)]


def scheduling_flags(args: argparse.Namespace) -> list[str]:
    """With --priority the replicas order their queues by each request's `priority` field, as vLLM does."""
    return ["--scheduling-policy", "priority"] if args.priority else []


async def start_fleet(session: aiohttp.ClientSession, args: argparse.Namespace, backend: str, work: Path) -> Fleet:
    base = port_block(4, random.Random())
    urls = [f"http://{HOST}:{base}", f"http://{HOST}:{base + 1}"]
    kv_endpoints = [f"tcp://127.0.0.1:{base + 2}", f"tcp://127.0.0.1:{base + 3}"]
    processes: list[subprocess.Popen[bytes]] = []
    if backend == "sim":
        speeds = (1.0, args.sim_slow_speed)
        for index, speed in enumerate(speeds):
            command = sim_command(args, base + index, base + 2 + index, speed, args.seed + index)
            processes.append(spawn(command, work / f"sim-{index}.log", dict(os.environ)))
        described = (
            f"2 dpserve sims, speed 1 and {args.sim_slow_speed:g}, prefill {args.sim_prefill_ms:g} ms/token, "
            f"decode {args.sim_decode_ms:g} ms/token, at most {args.sim_max_num_seqs} running each"
        )
        timeout = 60.0
    else:
        model = ensure_tiny_model(args.cache_dir)
        for index, cores in enumerate((args.vllm_fast_cores, args.vllm_slow_cores)):
            env = {
                **os.environ,
                "CUDA_VISIBLE_DEVICES": "",
                "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between rounds
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": cores,
            }
            processes.append(
                spawn(vllm_command(args, model, base + index, base + 2 + index), work / f"vllm-{index}.log", env)
            )
        described = (
            "2 vLLM CPU replicas of the tiny model, OMP threads bound to cores "
            f"{args.vllm_fast_cores} (fast) and {args.vllm_slow_cores} (slow)"
            + (f", at most {args.vllm_max_num_seqs} running each" if args.vllm_max_num_seqs else "")
        )
        timeout = 600.0
    described += "; queues ordered by priority" if args.priority else "; queues first come, first served"
    fleet = Fleet(backend, ["fast", "slow"], urls, kv_endpoints, processes, described)
    try:
        for url, process in zip(urls, processes, strict=True):
            await wait_ok(session, f"{url}/v1/models", timeout, process)
    except BaseException:
        fleet.stop()
        raise
    await warm_up(session, fleet, args.max_tokens)
    progress(f"{backend}: {described} (logs in {work})")
    return fleet


async def warm_up(session: aiohttp.ClientSession, fleet: Fleet, max_tokens: int) -> None:
    """A few answers from each replica before anything is measured (a fresh vLLM's first requests are slow)."""
    for url in fleet.urls:
        for index in range(3):
            body = {
                "model": TINY_MODEL_NAME,
                "max_tokens": max_tokens,
                "messages": [
                    {
                        "role": "user",
                        "content": f"Warm-up {index}: " + "a fresh engine answers its first requests slowly " * 8,
                    }
                ],
            }
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered a warm-up request with {resp.status}")


async def reset_caches(session: aiohttp.ClientSession, fleet: Fleet) -> None:
    await reset_prefix_caches(session, fleet.urls)


# -- one round -----------------------------------------------------------------------------------------


def error_code(data: bytes) -> str:
    """An OpenAI-style error body's `error.code` (or its type); empty when there is none."""
    try:
        error = orjson.loads(data).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    return str(error.get("code") or error.get("type") or "") if isinstance(error, dict) else ""


def has_content(payload: bytes) -> bool:
    """Whether an SSE chunk carries generated text (vLLM's first chunk carries the role alone)."""
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    choices = chunk.get("choices") or [] if isinstance(chunk, dict) else []
    return any((choice.get("delta") or {}).get("content") for choice in choices)


async def send(session: aiohttp.ClientSession, url: str, body: bytes, slo_ms: float | None) -> Outcome:
    """One streamed request; TTFT to the first chunk with content."""
    headers = {"content-type": "application/json", "x-dpserve-receipt": "1"}
    if slo_ms is not None:
        headers[SLO_HEADER] = f"{slo_ms:g}"
    started = time.perf_counter()
    first = math.nan
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                data = await resp.read()
                return Outcome(
                    slo_ms,
                    resp.status,
                    answered_s=time.perf_counter() - started,
                    retry_after="retry-after" in resp.headers,
                    code=error_code(data),
                    waited=WAITED_MARK in data,
                )
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    return Outcome(slo_ms, 200, first, time.perf_counter() - started, done=True)
                if payload.startswith(b'{"error"'):
                    return Outcome(slo_ms, 200, first, time.perf_counter() - started, code=error_code(payload))
                if math.isnan(first) and has_content(payload):
                    first = time.perf_counter() - started
            return Outcome(slo_ms, 200, first, time.perf_counter() - started, code="stream_cut")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(slo_ms, 0, first, time.perf_counter() - started, code=type(exc).__name__)


async def drive(
    router_url: str, requests: Sequence[BenchRequest], flags: Sequence[bool], args: argparse.Namespace, level: int
) -> tuple[list[Outcome], float]:
    """`level` requests at once every `--gap-s`, not waiting for the answers; the outcomes and the seconds
    from the first send to the last answer."""
    url = f"{router_url}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks: list[asyncio.Task[Outcome]] = []
        started = time.perf_counter()
        for first in range(0, len(requests), level):
            await asyncio.sleep(max(0.0, started + (first // level) * args.gap_s - time.perf_counter()))
            for request, slo in zip(requests[first : first + level], flags[first : first + level], strict=True):
                body = orjson.dumps(request.body(TINY_MODEL_NAME, args.max_tokens, stream=True))
                tasks.append(asyncio.create_task(send(session, url, body, args.slo_ttft_ms if slo else None)))
        outcomes = list(await asyncio.gather(*tasks))
        return outcomes, time.perf_counter() - started


@dataclass
class RoundResult:
    outcomes: list[Outcome]
    seconds: float
    receipts: list[dict[str, Any]]
    names: dict[str, str]
    """The router's replica ids -> `fast` / `slow`."""
    refusals: dict[str, float] = field(default_factory=dict)
    """Where the router refused SLO requests in the measured bursts (its counters): `decided` (no replica
    predicted to meet it, `slo_unmet`), `queue` (on arrival at its queue, or at the deadline there); and
    `chance` (sent on a fair chance, `slo_chance`)."""
    slo_wait: dict[str, Any] = field(default_factory=dict)
    """The router's learned wait in its queue at the round's end (`/status` `flow.slo_wait`)."""


async def replica_names(session: aiohttp.ClientSession, router_url: str, fleet: Fleet) -> dict[str, str]:
    text = await get_text(session, f"{router_url}/status")
    status: dict[str, Any] = orjson.loads(text) if text else {}
    replicas = status.get("replicas")
    by_url = dict(zip(fleet.urls, fleet.names, strict=True))
    if not isinstance(replicas, list):
        return {}
    return {str(r.get("id")): by_url.get(str(r.get("url")).rstrip("/"), str(r.get("id"))) for r in replicas}


async def run_round(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    fleet: Fleet,
    policy: str,
    level: int,
    tokenizer: Path,
    work: Path,
) -> RoundResult:
    """`policy`'s fresh router, `--warmup-bursts` of other prompts through it first (not counted: its latency
    model learns the replicas as a router that has run a while knows them), then over the emptied caches
    the workload at `level`."""
    requests = level_workload(args, level, args.bursts, args.seed)
    flags = slo_flags(len(requests), args.seed + level)
    warm = level_workload(args, level, args.warmup_bursts, args.seed + 1) if args.warmup_bursts else []
    await reset_caches(session, fleet)
    port = port_block(2, random.Random())
    keep = max(1024, 2 * (len(requests) + len(warm)))
    extra = ["--receipts-sample", "1", "--receipts-keep", str(keep), *args.router_args.split()]
    if args.priority:  # every router the same flag; only slo gives a request with an SLO its own priority
        extra.append("--vllm-priority")
    command = router_command(
        "dpserve",
        policy,
        fleet.urls,
        port,
        kv_events=fleet.kv_endpoints,
        tokenizer=str(tokenizer),
        settings={"probe_interval_s": 0.5},
        extra=extra,
    )
    process = spawn(command, work / f"router-{fleet.backend}-{policy}.log", dict(os.environ))
    router_url = f"http://{HOST}:{port}"
    try:
        await wait_ok(session, f"{router_url}/v1/models", 60, process)
        await asyncio.sleep(1.0)  # KV-event subscribers connected, first probes done
        names = await replica_names(session, router_url, fleet)
        warm_ids: set[str] = set()
        if warm:
            await drive(router_url, warm, slo_flags(len(warm), args.seed + 1), args, level)
            warm_ids = {str(r.get("request_id")) for r in await router_receipts(session, router_url, keep)}
            await reset_caches(session, fleet)
            await asyncio.sleep(1.0)  # the caches' clearing reaches the router's index as KV events
        before = await refusal_counts(session, router_url)
        outcomes, seconds = await drive(router_url, requests, flags, args, level)
        after = await refusal_counts(session, router_url)
        wait = await slo_wait(session, router_url)
        receipts = [
            r for r in await router_receipts(session, router_url, keep) if str(r.get("request_id")) not in warm_ids
        ]
    finally:
        terminate(process, 30)
    refusals = {k: after[k] - before.get(k, 0.0) for k in after}
    return RoundResult(outcomes, seconds, receipts, names, refusals, wait)


def keep_receipts(out: Path, name: str, result: RoundResult) -> None:
    """A compared round's receipts as the router gave them, one JSON object a line, each with its replica's
    name (`fast`/`slow`): what the prediction error is made of, for a look request by request."""
    folder = out / "receipts"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.jsonl", "wb") as handle:
        for receipt in result.receipts:
            named = {**receipt, "replica_name": result.names.get(str(receipt.get("replica")), "")}
            handle.write(orjson.dumps(named) + b"\n")


async def refusal_counts(session: aiohttp.ClientSession, router_url: str) -> dict[str, float]:
    """The router's own counts of SLO refusals by where they happened, and of fair-chance sends."""
    samples = parse_samples(await get_text(session, f"{router_url}/metrics") or "", REFUSAL_METRICS).by_name
    reasons = {labels.get("reason"): value for labels, value in samples.get(REFUSAL_METRICS[0], [])}
    queue = [v for labels, v in samples.get(REFUSAL_METRICS[1], []) if labels.get("reason") == "slo_unattainable"]
    return {"decided": reasons.get("slo_unmet", 0.0), "queue": sum(queue), "chance": reasons.get("slo_chance", 0.0)}


async def slo_wait(session: aiohttp.ClientSession, router_url: str) -> dict[str, Any]:
    """The router's learned wait of a request with an SLO in its queue (`/status` `flow.slo_wait`)."""
    status = orjson.loads(await get_text(session, f"{router_url}/status") or "{}")
    wait: dict[str, Any] = status.get("flow", {}).get("slo_wait", {})
    return wait


async def router_receipts(session: aiohttp.ClientSession, router_url: str, keep: int) -> list[dict[str, Any]]:
    text = await get_text(session, f"{router_url}/admin/receipts?limit={keep}")
    receipts: list[dict[str, Any]] = orjson.loads(text)["receipts"] if text else []
    return receipts


def level_workload(args: argparse.Namespace, level: int, bursts: int, seed: int) -> list[BenchRequest]:
    """`bursts` bursts of `level` prompts, the groups interleaved (each group's long system prompt shared)."""
    count = bursts * level
    prompts = math.ceil(count / args.groups)
    workload = shared_prefix(args.groups, prompts, args.prefix_words, args.question_words, seed)
    return workload.requests[:count]


# -- rows ----------------------------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    phase: str
    """`sweep` (the default policy, one round per load) or `compare` (every policy at the chosen load)."""
    level: int
    """Requests per burst."""
    policy: str
    rounds: int
    figures: Figures
    prediction_error_p50: float = math.nan
    """p50 of |predicted - realized| / realized TTFT over the receipts that carry both (all replicas)."""
    round_goodputs: str = ""
    per_replica: str = ""
    """Requests each replica was sent, from the receipts, `fast=N slow=N`."""
    codes: str = ""
    """Refusals' and errors' codes, `code=N ...`."""

    def flat(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "figures"}
        return {**row, **{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self.figures).items()}}


ROW_COLUMNS = [f.name for f in fields(Row) if f.name != "figures"] + [f.name for f in fields(Figures)]


@dataclass
class Prediction:
    backend: str
    policy: str
    error: ReplicaError


def pool(
    backend: str, phase: str, level: int, policy: str, results: Sequence[RoundResult]
) -> tuple[Row, list[Prediction]]:
    """The rounds of one policy at one load as one row (outcomes pooled, seconds summed), and its receipts'
    prediction errors per replica."""
    outcomes = [o for r in results for o in r.outcomes]
    figures = summarize(outcomes, sum(r.seconds for r in results))
    receipts = [receipt for r in results for receipt in r.receipts]
    names = {k: v for r in results for k, v in r.names.items()}
    codes: dict[str, int] = {}
    for o in outcomes:
        if o.code:
            codes[o.code] = codes.get(o.code, 0) + 1
    row = Row(
        backend,
        phase,
        level,
        policy,
        len(results),
        figures,
        prediction_error_p50=pooled_error(receipts),
        round_goodputs=" ".join(f"{summarize(r.outcomes, r.seconds).goodput:.2f}" for r in results),
        per_replica=spread(receipts, names),
        codes=" ".join(f"{code}={count}" for code, count in sorted(codes.items())),
    )
    return row, [Prediction(backend, policy, e) for e in prediction_errors(receipts, names)]


# -- the runs ------------------------------------------------------------------------------------------


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    predictions: list[Prediction] = field(default_factory=list)
    unfound: list[str] = field(default_factory=list)
    """Backends where the default policy kept its attainment at every load swept."""
    described: list[str] = field(default_factory=list)
    """Each backend's replicas, in words."""


async def sweep(
    session: aiohttp.ClientSession, args: argparse.Namespace, fleet: Fleet, tokenizer: Path, work: Path, out: Results
) -> int:
    """The load to compare at: `--level`, or the first of `--levels` where the default policy attains less
    than `--attainment-bound` (the last one swept when none does, noted)."""
    if args.level:
        return int(args.level)
    levels = [int(item) for item in (args.levels or DEFAULT_LEVELS[fleet.backend]).split(",") if item.strip()]
    seen: list[tuple[int, float]] = []
    for level in levels:
        results = [
            await run_round(session, args, fleet, DEFAULT_POLICY, level, tokenizer, work)
            for _ in range(args.sweep_rounds)
        ]
        row, _ = pool(fleet.backend, "sweep", level, DEFAULT_POLICY, results)
        out.rows.append(row)
        seen.append((level, row.figures.attainment))
        progress(f"  sweep {fleet.backend} load {level}: {DEFAULT_POLICY} attains {row.figures.attainment:.2f}")
        found = comparison_level(seen, args.attainment_bound)
        if found is not None:
            return found
    out.unfound.append(fleet.backend)
    return levels[-1]


async def run_backend(args: argparse.Namespace, backend: str, out: Results) -> None:
    policies = [p for p in args.policies.split(",") if p.strip()]
    tokenizer = ensure_tiny_model(args.cache_dir)
    work = Path(tempfile.mkdtemp(prefix=f"dpserve-bench-slo-{backend}-"))
    async with aiohttp.ClientSession() as session:
        fleet = await start_fleet(session, args, backend, work)
        out.described.append(f"{backend}: {fleet.described}")
        try:
            level = await sweep(session, args, fleet, tokenizer, work, out)
            progress(f"{backend}: comparing at {level} requests a burst; order per round {round_orders(policies, 2)}")
            by_policy: dict[str, list[RoundResult]] = {p: [] for p in policies}
            for order in round_orders(policies, args.rounds):
                for policy in order:
                    result = await run_round(session, args, fleet, policy, level, tokenizer, work)
                    by_policy[policy].append(result)
                    keep_receipts(args.out, f"{backend}-{policy}-{level}-{len(by_policy[policy])}", result)
                    figures = summarize(result.outcomes, result.seconds)
                    where = ", ".join(f"{k} {v:.0f}" for k, v in result.refusals.items())
                    progress(
                        f"  {policy:12} goodput {figures.goodput:.2f}/s, attainment {figures.attainment:.2f}, "
                        f"refused {figures.refused} ({where}), best effort {figures.best_effort_per_s:.2f}/s, "
                        f"queue wait learned {result.slo_wait or '-'}"
                    )
            for policy in policies:
                row, predictions = pool(backend, "compare", level, policy, by_policy[policy])
                out.rows.append(row)
                out.predictions += predictions
        finally:
            fleet.stop()


# -- output --------------------------------------------------------------------------------------------


TABLE_HEADER = (
    "backend",
    "phase",
    "load",
    "policy",
    "SLO sent",
    "met",
    "attain",
    "goodput/s",
    "refused",
    "on arrival p50/p99",
    "after a wait",
    "BE/s",
    "TTFT SLO p50/p99",
    "TTFT BE p50/p99",
    "failed",
    "pred err p50",
    "sent to",
)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def table_cells(row: Row) -> tuple[str, ...]:
    f = row.figures
    return (
        row.backend,
        row.phase,
        str(row.level),
        row.policy,
        str(f.slo_sent),
        str(f.slo_met),
        f"{f.attainment:.2f}",
        f"{f.goodput:.2f}",
        str(f.refused + f.best_effort_refused),
        f"{_ms(f.refusal_p50_ms)}/{_ms(f.refusal_p99_ms)}ms" if f.refused > f.refused_after_wait else "-",
        str(f.refused_after_wait),
        f"{f.best_effort_per_s:.2f}",
        f"{_ms(f.ttft_slo_p50_ms)}/{_ms(f.ttft_slo_p99_ms)}ms",
        f"{_ms(f.ttft_best_effort_p50_ms)}/{_ms(f.ttft_best_effort_p99_ms)}ms",
        str(f.failed),
        "-" if math.isnan(row.prediction_error_p50) else f"{row.prediction_error_p50:.1%}",
        row.per_replica,
    )


def prediction_table(predictions: Sequence[Prediction]) -> str:
    if not predictions:
        return "no receipt carried predicted_ttft_ms and realized_ttft_ms\n"
    header: tuple[str, ...] = ("backend", "policy", "replica", "receipts", "predicted p50", "realized p50")
    header += ("|err|/realized p50", "by load at the decision")
    cells = [
        (
            p.backend,
            p.policy,
            p.error.replica,
            str(p.error.receipts),
            f"{p.error.predicted_p50_ms:.0f}ms",
            f"{p.error.realized_p50_ms:.0f}ms",
            f"{p.error.error_p50:.1%}",
            p.error.error_by_load,
        )
        for p in predictions
    ]
    return format_table(header, cells) + "\n"


def ratio(ours: float, theirs: float) -> float:
    """`ours / theirs`; infinite when only ours is above 0, NaN when both are 0."""
    if theirs > 0:
        return ours / theirs
    return math.inf if ours > 0 else math.nan


def sanity(rows: Sequence[Row]) -> tuple[str, bool]:
    """The run's own figures make sense: every row sent both classes, no request failed (neither an answer
    nor a 429), every 429 carried Retry-After."""
    bad = []
    for r in rows:
        f = r.figures
        if f.slo_sent == 0 or f.best_effort_sent == 0 or not f.seconds > 0:
            bad.append(f"{r.backend} {r.phase} {r.level} {r.policy}: sent {f.slo_sent} SLO, {f.best_effort_sent} BE")
        if f.failed:
            bad.append(f"{r.backend} {r.phase} {r.level} {r.policy}: {f.failed} failed ({r.codes})")
        if f.refusals_without_retry_after:
            bad.append(f"{r.backend} {r.policy}: {f.refusals_without_retry_after} 429s without Retry-After")
    return ("every request answered or refused with Retry-After" if not bad else "; ".join(bad)), not bad


def backend_goals(backend: str, rows: Sequence[Row], unfound: bool) -> list[tuple[str, bool]]:
    compare = {r.policy: r for r in rows if r.backend == backend and r.phase == "compare"}
    out: list[tuple[str, bool]] = []
    level = next(iter(compare.values())).level if compare else 0
    if unfound:
        out.append(
            (f"{backend}: {DEFAULT_POLICY} attained >= the bound at every load swept (compared at {level})", False)
        )
    slo, default, least = compare.get("slo"), compare.get(DEFAULT_POLICY), compare.get("least_loaded")
    if slo is None:
        return out
    checks: list[tuple[str, float, float]] = []
    if default is not None:
        checks.append(
            (f"goodput vs {DEFAULT_POLICY}", ratio(slo.figures.goodput, default.figures.goodput), GOODPUT_VS_DEFAULT)
        )
        checks.append(
            (
                f"best-effort throughput vs {DEFAULT_POLICY}",
                ratio(slo.figures.best_effort_per_s, default.figures.best_effort_per_s),
                BEST_EFFORT_VS_DEFAULT,
            )
        )
    if least is not None:
        checks.append(
            ("goodput vs least_loaded", ratio(slo.figures.goodput, least.figures.goodput), GOODPUT_VS_LEAST_LOADED)
        )
    for what, value, bound in checks:
        out.append(
            (
                f"{backend} load {level}: slo {what} {value:.2f}x, goal >= {bound}x: {met(value >= bound)}",
                value >= bound,
            )
        )
    f = slo.figures
    on_arrival = f.refused - f.refused_after_wait
    fast = not on_arrival or f.refusal_p99_ms <= REFUSAL_BOUND_MS
    refusals = f"{on_arrival} refused, p99 {_ms(f.refusal_p99_ms)} ms" if on_arrival else "none refused"
    waited = f"; {f.refused_after_wait} more after a wait in the router's queue, none past its deadline"
    out.append(
        (
            f"{backend}: slo refusals on arrival within {REFUSAL_BOUND_MS:.0f} ms at p99 ({refusals}{waited}): "
            f"{met(fast)}",
            fast,
        )
    )
    out.append(
        (
            f"{backend}: slo SLO requests failed after their deadline: {f.failed_late}: {met(not f.failed_late)}",
            not f.failed_late,
        )
    )
    if backend == "vllm":
        error = slo.prediction_error_p50
        ok = error <= PREDICTION_BOUND
        shown_error = "no receipt with both" if math.isnan(error) else f"{error:.1%}"
        out.append((f"vllm: slo predicted TTFT p50 |error| {shown_error}, goal <= 20%: {met(ok)}", ok))
    return out


def verdicts(results: Results) -> list[tuple[str, bool]]:
    """The goal lines: the figures sane, then per backend the issue's goals for the slo policy at the load
    where the default policy attains below the bound."""
    goals = [sanity(results.rows)]
    for backend in dict.fromkeys(r.backend for r in results.rows):
        goals += backend_goals(backend, results.rows, backend in results.unfound)
    return goals


def report(args: argparse.Namespace, results: Results) -> str:
    # Paths as the repository knows them: the report is committed.
    argv = [shown(arg) if arg.startswith("/") else arg for arg in args.argv]
    lines = [f"dpserve bench slo {' '.join(argv)}", *results.described]
    lines += [
        f"{args.bursts} bursts {args.gap_s:g} s apart, half the requests with {SLO_HEADER}: {args.slo_ttft_ms:g}, "
        f"{args.groups} prefix groups of ~{args.prefix_words} words, {args.max_tokens} tokens out, streamed",
        "",
        format_table(TABLE_HEADER, [table_cells(r) for r in results.rows]),
        "",
        prediction_table(results.predictions),
    ]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------


def cores(text: str) -> str:
    """A VLLM_CPU_OMP_THREADS_BIND core list: `0-1`, `1`, `0,1`."""
    parts = text.replace("-", ",").split(",")
    if not text or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a core list such as 0-1, 1 or 0,1")
    return text


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpserve bench slo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=(*BACKENDS, "both"), default="both")
    parser.add_argument("--policies", type=Names(POLICIES), default=",".join(POLICIES), help="policies compared")
    parser.add_argument(
        "--levels",
        type=counts,
        help="loads swept, requests a burst (default: "
        + "; ".join(f"{b} {v}" for b, v in DEFAULT_LEVELS.items())
        + ")",
    )
    parser.add_argument("--level", type=WHOLE, default=0, help="compare at this load, no sweep (0: sweep)")
    parser.add_argument("--attainment-bound", type=SHARE, default=0.8, help="the sweep stops below this attainment")
    parser.add_argument("--rounds", type=COUNT, default=2, help="rounds per policy at the compared load, A B / B A")
    parser.add_argument("--sweep-rounds", type=COUNT, default=2, help="rounds pooled at each load swept")
    parser.add_argument("--bursts", type=COUNT, default=16, help="bursts per round")
    parser.add_argument(
        "--warmup-bursts",
        type=WHOLE,
        default=0,
        help="bursts of other prompts through each fresh router before a round, not counted (then the caches "
        "are emptied again): its latency model starts from what it learned, not from its prior",
    )
    parser.add_argument(
        "--priority",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replicas run --scheduling-policy priority and every router --vllm-priority: the policy slo has "
        "requests with an SLO served before best effort in the replicas' queues; the others pass every request "
        "the same priority, as first come first served",
    )
    parser.add_argument("--gap-s", type=POSITIVE, default=1.0, help="seconds from one burst to the next")
    parser.add_argument("--slo-ttft-ms", type=POSITIVE, default=300.0, help="the SLO half the requests carry")
    parser.add_argument("--groups", type=COUNT, default=4, help="prompt groups, each its own long system prompt")
    parser.add_argument("--prefix-words", type=COUNT, default=300, help="words in each group's system prompt")
    parser.add_argument("--question-words", type=COUNT, default=20)
    parser.add_argument("--max-tokens", type=COUNT, default=16)
    parser.add_argument("--sim-slow-speed", type=POSITIVE, default=0.35, help="the slow sim's --speed (fast: 1)")
    parser.add_argument("--sim-prefill-ms", type=NON_NEGATIVE, default=0.3, help="sims' --prefill-ms-per-token")
    parser.add_argument("--sim-decode-ms", type=NON_NEGATIVE, default=8.0, help="sims' --decode-ms-per-token")
    parser.add_argument("--sim-max-num-seqs", type=COUNT, default=4, help="sims' --max-num-seqs")
    parser.add_argument("--vllm-fast-cores", type=cores, default="0-1", help="the fast vLLM's OMP thread cores")
    parser.add_argument("--vllm-slow-cores", type=cores, default="1", help="the slow vLLM's OMP thread cores")
    parser.add_argument(
        "--vllm-max-num-seqs",
        type=WHOLE,
        default=0,
        help="the vLLM replicas' --max-num-seqs, a bounded batch as the sims have (0: vLLM's own, which takes a "
        "whole burst of this tiny model at once)",
    )
    parser.add_argument("--router-args", default="", help="extra flags for every router")
    parser.add_argument("--seed", type=WHOLE, default=0)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--out", type=Path, default=Path("bench-results/slo"))
    args = parser.parse_args(list(argv))
    args.argv = list(argv)
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results()
    for backend in backends:
        asyncio.run(run_backend(args, backend, results))
    write_csv(args.out / "slo.csv", [r.flat() for r in results.rows], ROW_COLUMNS)
    write_csv(
        args.out / "predictions.csv",
        [{"backend": p.backend, "policy": p.policy, **asdict(p.error)} for p in results.predictions],
        ["backend", "policy", *(f.name for f in fields(ReplicaError))],
    )
    goals = verdicts(results)
    text = report(args, results) + "\n" + "\n".join(line for line, _ in goals) + "\n"
    (args.out / "slo.txt").write_text(text)
    print()
    print(text)
    print(f"wrote {shown(args.out)}/slo.csv, predictions.csv, slo.txt")
    return goals_status("slo", goals)
