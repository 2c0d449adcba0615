"""`dpserve bench overhead`: what the router adds on the hot path, next to vllm-router and sglang-router.

Starts K backends, then measures one target at a time, each stopped before the next starts so that no two
share the CPU. The backends (`--backend`): `fast`, scripted servers that answer in microseconds
(`benchmarks/fast_backend.py`), so that the router is the bottleneck; or `sim`, `dpserve sim --speed 0`
(no simulated GPU time, but a scheduler and uvicorn per request: slower than the routers can push). Targets:
  * direct: the backends themselves, the ceiling;
  * dpserve: `dpserve router` over the K backends, once per policy in --dpserve-policies;
  * dpserve@REV (`--against REV`): the same router from another commit, checked out in a temporary worktree;
  * vllm-router and sglang-router (round_robin), when installed.
`--rounds R` measures every target R times, in ABBA order (the order reversed every other round), so a slow
spell on a shared machine falls on all; ratios are taken within a round and their median reported.
Every target must first answer correctly. Then, for each mode (json: 16 tokens in one JSON answer; sse:
--stream-chunks SSE events), after an unrecorded warm-up: C connections over all K backends (throughput),
then 1 connection over the first backend alone (added latency; each router is started again over it),
closed loop, with wrk or a Python generator. The generator's own CPU use is reported next
to the router's, so a generator that was itself the bottleneck shows. Prints a table, req/s ratios against
the Rust routers and the issue's verdicts; writes overhead.csv and overhead.png, then the policies'
decision times (decision_time.csv).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from benchmarks.fleet import (
    CHECKOUT,
    HOST,
    bench_tool,
    cpu_seconds,
    port_block,
    progress,
    relative_source_paths,
    router_command,
    sigterm_unwinds,
    spawn,
    stop_all,
    wait_ok,
)
from benchmarks.loadgen import python_command, run_all, write_wrk_script, wrk_command
from benchmarks.report import figure, format_table, goals_status, shown, write_csv
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE
from dpserve.up.process import log_tail, terminate

PATH = "/v1/completions"
MODEL = "dpserve-tiny"
PROMPT = "Hello, my name is"
JSON_MAX_TOKENS = 16
MODES = ("json", "sse")
MODE_NAMES = {"json": "non-streaming", "sse": "streaming"}
TARGETS = ("direct", "dpserve", "vllm-router", "sglang-router")
RUST_ROUTERS = ("vllm-router", "sglang-router")
RUST_POLICY = "round_robin"
NO_GPU = {"gpu_interval_s": 0.0}  # dpserve's router: no GPU telemetry (the backends are sims)
START_TIMEOUT_S = 60.0
LOADGEN_BUSY_CORES = 0.9  # above this, the generator may be what limits req/s
# dpserve req/s against vllm-router's, per mode (the hot-path issue's goals), and against --against's commits.
GOAL_RPS_RATIO = {"json": 0.8, "sse": 1.5}
GOAL_AGAINST_RATIO = 1.0
GOAL_ADDED_P50_MS = 1.0  # added p50 at 1 connection

COLUMNS = [
    "round",
    "target",
    "policy",
    "mode",
    "connections",
    "req_s",
    "chunks_s",
    "p50_ms",
    "p99_ms",
    "errors",
    "added_p50_ms",
    "loadgen_cpu",
    "router_cpu",
    "backends_cpu",
    "loadgen",
    "load1",
]


@dataclass(frozen=True)
class Target:
    name: str  # one of TARGETS
    policy: str = ""
    rev: str = ""  # dpserve only: another commit's router (`--against`)

    @property
    def label(self) -> str:
        name = f"{self.name}@{self.rev}" if self.rev else self.name
        return f"{name}({self.policy})" if self.policy else name


@dataclass
class Run:
    target: Target
    mode: str
    connections: int
    chunks: int  # SSE events per answer; 0 for JSON
    requests: int
    req_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    loadgen: str
    loadgen_cpu: float  # cores, every generator of the run together
    loadgen_peak: float  # cores, the busiest generator: near 1, it was the bottleneck
    router_cpu: float | None  # cores, the router and its children; None for direct
    backends_cpu: float  # cores, all the backends together
    load1: float  # 1-minute load average when the run started: other work on the box skews figures
    round: int = 0


@dataclass
class Context:
    """What every measurement needs."""

    args: argparse.Namespace
    loadgen: str
    work: Path  # logs and wrk scripts, removed at the end
    bodies: dict[str, bytes]
    scripts: dict[str, Path]
    backend_urls: list[str]
    backends: list[psutil.Process]
    checkouts: dict[str, Path]  # --against: each commit's worktree
    router_cpus: str = ""  # --router-cpus: the routers' CPUs, and everything else's
    other_cpus: str = ""
    round: int = 0


# -- requests and answers -------------------------------------------------------------------------------


def request_body(mode: str, chunks: int) -> bytes:
    stream = mode == "sse"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": chunks if stream else JSON_MAX_TOKENS, "stream": stream}
    return json.dumps(body, separators=(",", ":")).encode()


def answer_problem(mode: str, data: bytes, chunks: int) -> str | None:
    """What is wrong with an answer, None when it is right: JSON with choices, or `chunks` SSE events then [DONE]."""
    if mode == "json":
        try:
            answer = json.loads(data)
        except ValueError:
            return f"the non-streaming answer is not JSON: {data[:200]!r}"
        return None if isinstance(answer, dict) and answer.get("choices") else f"no choices in {data[:200]!r}"
    events = [line[len(b"data: ") :] for line in data.split(b"\n") if line.startswith(b"data: ")]
    if len(events) != chunks + 1 or events[-1] != b"[DONE]":
        return f"the stream has {len(events)} data events, not {chunks} and [DONE]: {data[-200:]!r}"
    try:
        if all(json.loads(event).get("choices") for event in events[:-1]):
            return None
    except ValueError:
        pass
    return "a stream event is not a JSON chunk with choices"


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    """Status and body; status 0 when nothing answered."""
    try:
        async with session.post(url + PATH, data=body, headers={"content-type": "application/json"}) as resp:
            return resp.status, await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        return 0, repr(exc).encode()


async def check_target(
    ctx: Context, label: str, url: str, process: subprocess.Popen[bytes] | None, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Wait until `url` serves completions (a router answers 503 until it has probed its backends), then check
    that both modes' answers are whole; raises RuntimeError if not."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for mode in MODES:
            status, data = await _post(session, url, ctx.bodies[mode])
            while status != 200:
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"{label} exited with {process.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label} did not serve in {timeout_s:.0f}s: {status} {data[:200]!r}")
                await asyncio.sleep(0.2)
                status, data = await _post(session, url, ctx.bodies[mode])
            problem = answer_problem(mode, data, ctx.args.stream_chunks)
            if problem is not None:
                raise RuntimeError(f"{label} answered wrongly ({MODE_NAMES[mode]}): {problem}")


# -- processes ------------------------------------------------------------------------------------------


def backend_command(backend: str, port: int) -> list[str]:
    if backend == "fast":
        return [sys.executable, "-m", "benchmarks.fast_backend", "--port", str(port), "--model", MODEL]
    return [sys.executable, "-m", "dpserve", "sim", "--speed", "0", "--port", str(port), "--log-level", "warning"]


def why_missing(target: Target) -> str | None:
    if target.name == "vllm-router" and bench_tool("vllm-router") is None:
        return "no vllm-router binary next to python or on PATH (pip install -e '.[bench]')"
    if target.name == "sglang-router" and importlib.util.find_spec("sglang_router") is None:
        return "the sglang_router package is not installed (pip install -e '.[bench]')"
    return None


async def _wait_healthy(urls: list[str], processes: list[subprocess.Popen[bytes]]) -> None:
    async with aiohttp.ClientSession() as session:
        for url, process in zip(urls, processes, strict=True):
            await wait_ok(session, f"{url}/health", START_TIMEOUT_S, process)


def pinned(command: list[str], cpus: str) -> list[str]:
    """`command` bound to `cpus` (taskset's list syntax), or as it is when `cpus` is empty."""
    return ["taskset", "-c", cpus, *command] if cpus else command


def cpu_split(router_cpus: str) -> tuple[str, str]:
    """(the routers' CPUs, everything else's: backends and load generators), or ("", "") unpinned."""
    if not router_cpus:
        return "", ""
    ours = set(os.sched_getaffinity(0))
    routers: set[int] = set()
    for part in router_cpus.split(","):
        first, _, last = part.partition("-")
        routers.update(range(int(first), int(last or first) + 1))
    others = sorted(ours - routers)
    if not routers <= ours or not others:
        raise SystemExit(f"--router-cpus {router_cpus}: must be some, not all, of the CPUs {sorted(ours)}")
    return router_cpus, ",".join(map(str, others))


def start_backends(
    backend: str, count: int, work: Path, processes: list[subprocess.Popen[bytes]], cpus: str = ""
) -> list[str]:
    """Start `count` backends (appended to `processes`, which the caller stops) on `cpus` (all when empty) and
    wait until all answer."""
    base = port_block(count, random.Random())
    urls = [f"http://{HOST}:{base + index}" for index in range(count)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))}
    for index in range(count):
        command = pinned(backend_command(backend, base + index), cpus)
        processes.append(spawn(command, work / f"{backend}{index}.log", env))
    asyncio.run(_wait_healthy(urls, processes))
    return urls


# -- measuring ------------------------------------------------------------------------------------------


def split(connections: int, parts: int) -> list[int]:
    """`connections` spread over `parts` generators as evenly as they go; parts left without any are dropped."""
    shares = [connections // parts + (1 if index < connections % parts else 0) for index in range(parts)]
    return [share for share in shares if share > 0]


def load_commands(ctx: Context, urls: list[str], mode: str, connections: int, duration_s: float) -> list[list[str]]:
    """--loadgens generators per URL, the connections shared between them; the URLs repeated in turn (a, b, a, b),
    so that few connections still reach every URL before any gets a second generator."""
    urls = list(urls) * ctx.args.loadgens
    commands = []
    for url, share in zip(urls, split(connections, len(urls)), strict=False):
        if ctx.loadgen == "wrk":
            command = wrk_command(ctx.scripts[mode], url + PATH, share, duration_s)
        else:
            expect = ctx.args.stream_chunks if mode == "sse" else 0
            command = python_command(url + PATH, ctx.bodies[mode], share, duration_s, expect)
        commands.append(pinned(command, ctx.other_cpus))
    return commands


def measure(
    ctx: Context, target: Target, urls: list[str], router: psutil.Process | None, mode: str, connections: int
) -> Run:
    commands = load_commands(ctx, urls, mode, connections, ctx.args.duration)
    load1 = os.getloadavg()[0]
    router_before = cpu_seconds([router]) if router is not None else 0.0
    backends_before = cpu_seconds(ctx.backends)
    results = run_all(commands, ctx.args.duration)
    # The servers idle while a generator starts and exits: divide by the load window, not the wall time.
    window = max(r.seconds for r in results) or 1.0
    router_cpu = (cpu_seconds([router]) - router_before) / window if router is not None else None
    return Run(
        target=target,
        mode=mode,
        connections=connections,
        chunks=ctx.args.stream_chunks if mode == "sse" else 0,
        requests=sum(r.requests for r in results),
        req_s=sum(r.rps for r in results),
        # Several generators (direct at C connections): their histograms cannot be merged, so the worst.
        p50_ms=max(r.p50_ms for r in results),
        p99_ms=max(r.p99_ms for r in results),
        errors=sum(r.errors for r in results),
        loadgen=ctx.loadgen,
        loadgen_cpu=sum(r.cpu_cores for r in results),
        loadgen_peak=max(r.cpu_cores for r in results),
        router_cpu=router_cpu,
        backends_cpu=(cpu_seconds(ctx.backends) - backends_before) / window,
        load1=load1,
        round=ctx.round,
    )


def report_run(run: Run) -> None:
    router = "" if run.router_cpu is None else f" router {run.router_cpu:.2f}"
    progress(
        f"  {run.target.label:>26} {run.mode:>4} c={run.connections:<3} {run.req_s:8.0f} req/s  "
        f"p50 {run.p50_ms:7.2f} ms  p99 {run.p99_ms:7.2f} ms  errors {run.errors}  "
        f"cores: loadgen {run.loadgen_cpu:.2f}{router} backends {run.backends_cpu:.2f}"
    )
    if run.loadgen_peak > LOADGEN_BUSY_CORES:
        progress(
            f"  warning: a load generator used {run.loadgen_peak:.2f} cores (> {LOADGEN_BUSY_CORES}): "
            "it may be what limited this run"
        )


def measure_target(
    ctx: Context, target: Target, urls: list[str], router: psutil.Process | None, connections: int
) -> list[Run]:
    """Both modes at `connections` over `urls`, each after a warm-up."""
    runs = []
    for mode in MODES:
        if ctx.args.warmup > 0:
            run_all(load_commands(ctx, urls, mode, connections, ctx.args.warmup), ctx.args.warmup)
        run = measure(ctx, target, urls, router, mode, connections)
        report_run(run)
        runs.append(run)
        if ctx.args.profile and target.name == "dpserve" and router is not None and connections > 1 and mode == "json":
            profile_router(ctx, target, urls, router.pid, mode)
    return runs


def run_target(ctx: Context, target: Target) -> list[Run]:
    """Throughput at C connections over every backend, then latency at 1 connection over the first backend
    alone, as direct measures it: a router spreading one connection's requests over K backends would also
    be timed waking backends that idle between its requests (about 0.25 ms a request here), which is not
    its own cost."""
    connections = ctx.args.connections
    if target.name == "direct":
        for index, url in enumerate(ctx.backend_urls):
            asyncio.run(check_target(ctx, f"backend {index}", url, None))
        runs = measure_target(ctx, target, ctx.backend_urls, None, connections)
        return runs + measure_target(ctx, target, ctx.backend_urls[:1], None, 1)
    runs = router_runs(ctx, target, ctx.backend_urls, connections)
    return runs + router_runs(ctx, target, ctx.backend_urls[:1], 1)


def router_runs(ctx: Context, target: Target, backend_urls: list[str], connections: int) -> list[Run]:
    """The target's router over `backend_urls`, checked, then measured at `connections`."""
    port = port_block(2, random.Random())
    log_path = ctx.work / f"{target.label}-{len(backend_urls)}-{ctx.round}.log"
    extra = ctx.args.router_arg if target.name == "dpserve" else ()
    command = pinned(
        router_command(target.name, target.policy, backend_urls, port, settings=NO_GPU, extra=extra), ctx.router_cpus
    )
    if target.rev:
        # `python -m` puts its working directory first on the path: the other commit's package is imported.
        checkout = ctx.checkouts[target.rev]
        with open(log_path, "wb") as log:
            env = {**os.environ, "PYTHONPATH": str(checkout)}
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=checkout)
    else:
        process = spawn(command, log_path, dict(os.environ))
    try:
        url = f"http://{HOST}:{port}"
        try:
            asyncio.run(check_target(ctx, target.label, url, process))
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{log_tail(log_path, 10)}") from None
        return measure_target(ctx, target, [url], psutil.Process(process.pid), connections)
    finally:
        terminate(process, 10)


def profile_router(ctx: Context, target: Target, urls: list[str], pid: int, mode: str) -> None:
    """py-spy on the router during one more run like the C-connection one, not recorded: the sampler
    takes CPU too, so the measured figures are kept free of it."""
    py_spy = bench_tool("py-spy")
    if py_spy is None:
        progress("  profile: py-spy not found; skipped")
        return
    output = ctx.args.out / f"profile-{target.policy}-{mode}.json"
    seconds = max(1, math.ceil(ctx.args.duration))
    command = [py_spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200"]
    command += ["--format", "speedscope", "--output", str(output), "--nonblocking", "--subprocesses"]
    log_path = ctx.work / "py-spy.log"
    spy = spawn(command, log_path, dict(os.environ))
    try:
        # The load outlasts the sampler, which starts first: no idle time in the profile.
        run_all(load_commands(ctx, urls, mode, ctx.args.connections, seconds + 1), seconds + 1)
        spy.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    finally:
        terminate(spy, 5)
    if spy.returncode == 0 and output.exists():
        # Committed with the results: the sources' paths relative to the checkout, site-packages, stdlib.
        output.write_text(relative_source_paths(output.read_text()))
        progress(f"  profile: wrote {shown(output)}")
    else:
        progress(f"  profile: py-spy failed (rc={spy.returncode}): {log_tail(log_path, 5)}")


# -- the whole benchmark ----------------------------------------------------------------------------------


def targets(args: argparse.Namespace) -> list[Target]:
    out = []
    for name in args.targets:
        if name == "dpserve":
            out += [Target("dpserve", policy) for policy in args.dpserve_policies]
            out += [Target("dpserve", policy, rev) for rev in args.against for policy in args.dpserve_policies]
        elif name in RUST_ROUTERS:
            out.append(Target(name, RUST_POLICY))
        else:
            out.append(Target(name))
    return out


def run_benchmark(args: argparse.Namespace, loadgen: str) -> tuple[list[Run], list[str]]:
    """Every target's runs, round after round, and what failed; overhead.csv is rewritten after each target,
    so an interrupted run keeps what it had."""
    runs: list[Run] = []
    failures: list[str] = []
    backends: list[subprocess.Popen[bytes]] = []
    with (
        tempfile.TemporaryDirectory(prefix="dpserve-bench-overhead-") as tmp,
        checkouts(args.against, Path(tmp)) as revs,
    ):
        work = Path(tmp)
        try:
            router_cpus, other_cpus = cpu_split(args.router_cpus)
            progress(f"starting {args.backends} {args.backend} backends ...")
            urls = start_backends(args.backend, args.backends, work, backends, other_cpus)
            bodies = {mode: request_body(mode, args.stream_chunks) for mode in MODES}
            scripts = {mode: write_wrk_script(work, mode, body) for mode, body in bodies.items()}
            processes = [psutil.Process(p.pid) for p in backends]
            ctx = Context(args, loadgen, work, bodies, scripts, urls, processes, revs, router_cpus, other_cpus)
            for ctx.round in range(args.rounds):
                order = targets(args) if ctx.round % 2 == 0 else targets(args)[::-1]  # ABBA
                for target in order:
                    if target.label in failures:
                        continue
                    missing = why_missing(target)
                    if missing is not None:
                        progress(f"{target.label}: skipped, {missing}")
                        continue
                    progress(f"round {ctx.round + 1}/{args.rounds}: {target.label} ...")
                    try:
                        runs += run_target(ctx, target)
                    except RuntimeError as exc:
                        failures.append(target.label)
                        progress(f"{target.label} failed, skipped: {exc}")
                    save_runs(runs, args.out / "overhead.csv")
        finally:
            stop_all(backends, 10)
    return runs, failures


@contextlib.contextmanager
def checkouts(revs: Sequence[str], work: Path) -> Iterator[dict[str, Path]]:
    """Each commit of `--against` checked out (detached) in a worktree of this checkout, removed at the end."""
    paths: dict[str, Path] = {}
    try:
        for rev in revs:
            path = work / f"rev-{rev}"
            git = ["git", "-C", str(CHECKOUT), "worktree", "add", "--detach", "--force", str(path), rev]
            done = subprocess.run(git, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"--against {rev}: git worktree add failed: {done.stderr.strip()}")
            paths[rev] = path
        yield paths
    finally:
        for path in paths.values():
            subprocess.run(
                ["git", "-C", str(CHECKOUT), "worktree", "remove", "--force", str(path)], capture_output=True
            )


# -- reporting --------------------------------------------------------------------------------------------


def find(runs: Sequence[Run], target: Target, mode: str, connections: int, round_: int | None = None) -> Run | None:
    """The run of `target` in `mode` at `connections`, in round `round_` (None: the first one)."""
    for run in runs:
        if (run.target, run.mode, run.connections) == (target, mode, connections):
            if round_ is None or run.round == round_:
                return run
    return None


def added_p50(runs: Sequence[Run], run: Run) -> float | None:
    """A 1-connection row's p50 minus direct's 1-connection p50 in the same mode and round."""
    if run.connections != 1 or run.target.name == "direct":
        return None
    direct = find(runs, Target("direct"), run.mode, 1, run.round)
    return None if direct is None else run.p50_ms - direct.p50_ms


def _blank(value: float | None, digits: int) -> Any:
    return "" if value is None else round(value, digits)


def table_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    return [
        {
            "round": run.round + 1,
            "target": f"{run.target.name}@{run.target.rev}" if run.target.rev else run.target.name,
            "policy": run.target.policy,
            "mode": run.mode,
            "connections": run.connections,
            "req_s": round(run.req_s),
            "chunks_s": round(run.req_s * run.chunks) if run.chunks else "",
            "p50_ms": round(run.p50_ms, 2),
            "p99_ms": round(run.p99_ms, 2),
            "errors": run.errors,
            "added_p50_ms": _blank(added_p50(runs, run), 2),
            "loadgen_cpu": round(run.loadgen_cpu, 2),
            "router_cpu": _blank(run.router_cpu, 2),
            "backends_cpu": round(run.backends_cpu, 2),
            "loadgen": run.loadgen,
            "load1": round(run.load1, 2),
        }
        for run in runs
    ]


def save_runs(runs: Sequence[Run], path: Path) -> None:
    write_csv(path, table_rows(runs), COLUMNS)


Figure = Callable[[Run], float | None]
"""A figure of one run, None where it has none."""


def round_ratios(
    runs: Sequence[Run], ours: Target, theirs: Target, mode: str, connections: int, figure: Figure
) -> list[float]:
    """Ours over theirs in `figure`, one ratio per round that measured both (same round: same conditions)."""
    ratios = []
    for round_ in sorted({run.round for run in runs}):
        a, b = find(runs, ours, mode, connections, round_), find(runs, theirs, mode, connections, round_)
        if a is None or b is None:
            continue
        mine, other = figure(a), figure(b)
        if mine is not None and other:
            ratios.append(mine / other)
    return ratios


def rps_ratios(runs: Sequence[Run], ours: Target, theirs: Target, mode: str, connections: int) -> list[float]:
    return round_ratios(runs, ours, theirs, mode, connections, lambda run: run.req_s)


def cpu_per_request(run: Run) -> float | None:
    """The router's cores over its req/s; None without both."""
    return run.router_cpu / run.req_s if run.router_cpu and run.req_s > 0 else None


def cpu_ratios(runs: Sequence[Run], ours: Target, theirs: Target, mode: str, connections: int) -> list[float]:
    """Router CPU per request, ours over theirs: what the rates cannot show when the backends and load
    generators, not the routers, fill the machine."""
    return round_ratios(runs, ours, theirs, mode, connections, cpu_per_request)


def _ratio_text(ratios: Sequence[float]) -> str:
    return f"{statistics.median(ratios):.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"


def comparisons(args: argparse.Namespace) -> list[tuple[Target, Target, dict[str, float]]]:
    """(ours, theirs, goal per mode) for each dpserve policy: against vllm-router, then each --against commit."""
    pairs = []
    for policy in args.dpserve_policies:
        ours = Target("dpserve", policy)
        pairs += [
            (ours, Target(other, RUST_POLICY), GOAL_RPS_RATIO if other == "vllm-router" else {})
            for other in RUST_ROUTERS
        ]
        goal = dict.fromkeys(MODES, GOAL_AGAINST_RATIO)
        pairs += [(ours, Target("dpserve", policy, rev), goal) for rev in args.against]
    return pairs


def ratio_lines(runs: Sequence[Run], args: argparse.Namespace) -> list[tuple[str, bool | None]]:
    """Each comparison's median req/s ratio per mode, with its verdict when it has a goal: (line, whether the
    goal was met, None without one)."""
    lines: list[tuple[str, bool | None]] = []
    for ours, theirs, goals in comparisons(args):
        for mode in MODES:
            ratios = rps_ratios(runs, ours, theirs, mode, args.connections)
            if not ratios:
                continue
            where = f"{MODE_NAMES[mode]}, {args.connections} connections"
            line = f"{ours.label}/{theirs.label} req/s = {_ratio_text(ratios)}  ({where})"
            met = None
            if mode in goals:
                met = statistics.median(ratios) >= goals[mode]
                line += f": goal >= {goals[mode]:g}x {'PASS' if met else 'FAIL'}"
            lines.append((line, met))
            cpu = cpu_ratios(runs, ours, theirs, mode, args.connections)
            if cpu:
                text = f"{ours.label}/{theirs.label} router CPU per request = {_ratio_text(cpu)}  ({where})"
                lines.append((text, None))
    return lines


def added_lines(runs: Sequence[Run], policies: Sequence[str]) -> list[tuple[str, bool | None]]:
    """The added p50 at 1 connection, per dpserve policy, its median over rounds against the goal: (line, met)."""
    lines: list[tuple[str, bool | None]] = []
    for policy in policies:
        for mode in MODES:
            added = [
                a
                for run in runs
                if run.target == Target("dpserve", policy)
                and run.mode == mode
                and (a := added_p50(runs, run)) is not None
            ]
            if added:
                met = statistics.median(added) <= GOAL_ADDED_P50_MS
                line = (
                    f"dpserve({policy}) added p50 at 1 connection ({MODE_NAMES[mode]}) = "
                    f"{statistics.median(added):.2f} ms: goal <= {GOAL_ADDED_P50_MS:g} ms {'PASS' if met else 'FAIL'}"
                )
                lines.append((line, met))
    return lines


def plot(runs: Sequence[Run], path: Path, connections: int) -> None:
    shown_targets = list(dict.fromkeys(run.target for run in runs))
    titles = (f"requests/s at {connections} connections", "added p50 at 1 connection (ms, over direct)")
    # Every target is in the req/s panel; the goal line only in the other: one legend for both, below them.
    with figure(path, titles, (13, 5.4), legend="figure", legend_columns=6, legend_space=0.08) as axes:
        rps_axis, added_axis = axes
        width = 0.8 / max(1, len(shown_targets))
        for index, target in enumerate(shown_targets):
            xs, rps, added_xs, added = [], [], [], []
            for m_index, mode in enumerate(MODES):
                x = m_index - 0.4 + width * (index + 0.5)
                many = find(runs, target, mode, connections)
                one = find(runs, target, mode, 1)
                if many is not None:
                    xs.append(x)
                    rps.append(many.req_s)
                extra = None if one is None else added_p50(runs, one)
                if extra is not None:
                    added_xs.append(x)
                    added.append(extra)
            bars = rps_axis.bar(xs, rps, width, label=target.label, color=f"C{index}")
            rps_axis.bar_label(bars, fmt="%.0f", fontsize=7)
            bars = added_axis.bar(added_xs, added, width, label=target.label, color=f"C{index}")
            added_axis.bar_label(bars, fmt="%.2f", fontsize=7)
        goal = f"goal: {GOAL_ADDED_P50_MS:g} ms"
        added_axis.axhline(GOAL_ADDED_P50_MS, color="black", linestyle="dashed", linewidth=1, label=goal)
        for axis in axes:
            axis.set_xticks(range(len(MODES)), [MODE_NAMES[mode] for mode in MODES])


def decision_times(out: Path) -> None:
    """The policies' own decision time, from the module that measures it (written separately)."""
    try:
        from benchmarks.decision_time import decision_report
    except ImportError as exc:
        print(f"decision time: benchmarks.decision_time is not available ({exc}); skipped")
        return
    progress("policy decision time ...")
    report = decision_report()
    if report.rows:
        path = out / "decision_time.csv"
        write_csv(path, report.rows)
        print(f"wrote {shown(path)}")
    print(report.text)


def report(runs: Sequence[Run], args: argparse.Namespace) -> list[tuple[str, bool]]:
    """Prints the table and the goal lines; returns each goal line with whether it was met."""
    print()
    print(format_table(COLUMNS, [[row[c] for c in COLUMNS] for row in table_rows(runs)], align="right"))
    print()
    lines = [*ratio_lines(runs, args), *added_lines(runs, args.dpserve_policies)]
    for line, _ in lines:
        print(line)
    busy = [run for run in runs if run.loadgen_peak > LOADGEN_BUSY_CORES]
    if busy:
        print(
            f"warning: in {len(busy)} run(s) a load generator used more than {LOADGEN_BUSY_CORES} cores: "
            "those req/s may be the generator's limit"
        )
    plot(runs, args.out / "overhead.png", args.connections)
    print(f"\nwrote {shown(args.out / 'overhead.csv')}, {shown(args.out / 'overhead.png')}")
    return [(line, met) for line, met in lines if met is not None]


# -- main ---------------------------------------------------------------------------------------------------


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpserve bench overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", type=COUNT, default=2, help="backends behind every router (2)")
    parser.add_argument(
        "--backend",
        choices=("fast", "sim"),
        default="fast",
        help="fast: scripted backends the router cannot keep busy (default); sim: dpserve sim --speed 0",
    )
    parser.add_argument(
        "--router-cpus",
        default="",
        metavar="LIST",
        help="bind every router to these CPUs (taskset -c LIST), the backends and load generators to the others",
    )
    parser.add_argument("--rounds", type=COUNT, default=1, help="times every target is measured, in ABBA order (1)")
    parser.add_argument(
        "--against",
        default="",
        metavar="REV[,REV]",
        help="also measure dpserve's router as of these commits (git worktrees of this checkout)",
    )
    parser.add_argument("--connections", type=COUNT, default=32, help="connections of the throughput runs (32)")
    parser.add_argument(
        "--loadgens",
        type=COUNT,
        default=1,
        help="load generators (one thread each) per URL under load, the connections shared between them (1): "
        "more when one generator is near a core (the warning) and the router has cores to spare",
    )
    parser.add_argument("--duration", type=POSITIVE, default=10.0, help="seconds per measured run (10)")
    parser.add_argument(
        "--warmup", type=NON_NEGATIVE, default=1.0, help="seconds of unrecorded load per target and mode (1)"
    )
    parser.add_argument("--stream-chunks", type=COUNT, default=64, help="SSE events per streamed answer (64)")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)} (default: all)"
    )
    parser.add_argument(
        "--dpserve-policies", default="least_loaded,round_robin", help="dpserve policies to run (%(default)s)"
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more flag for dpserve's router, repeatable; write it with '=': --router-arg=--retries=0",
    )
    parser.add_argument(
        "--loadgen",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="auto: wrk when on PATH, else the Python generator",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy dpserve's router (profile-POLICY-json.json)")
    parser.add_argument("--skip-decision", action="store_true", help="do not measure the policies' decision time")
    parser.add_argument("--decision-only", action="store_true", help="only the policies' decision time")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/overhead"))
    args = parser.parse_args(list(argv))
    args.targets = _comma_list(args.targets)
    args.dpserve_policies = _comma_list(args.dpserve_policies)
    args.against = _comma_list(args.against)
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets: {sorted(unknown)}")
    if "dpserve" in args.targets and not args.dpserve_policies:
        parser.error("--dpserve-policies names no policy")
    if min(args.backends, args.connections, args.stream_chunks, args.rounds, args.loadgens) < 1:
        parser.error("--backends, --connections, --stream-chunks, --rounds and --loadgens must be at least 1")
    if args.duration <= 0 or args.warmup < 0:
        parser.error("--duration must be positive and --warmup not negative")
    return args


def pick_loadgen(choice: str) -> str | None:
    if choice == "auto":
        return "wrk" if shutil.which("wrk") else "python"
    if choice == "wrk" and not shutil.which("wrk"):
        return None
    return choice


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.decision_only:
        decision_times(args.out)
        return 0
    loadgen = pick_loadgen(args.loadgen)
    if loadgen is None:
        print("wrk is not on PATH", file=sys.stderr)
        return 2
    print(
        f"# {os.cpu_count()} CPUs shared by {args.backends} {args.backend} backends, the router and the load generators"
        f" ({loadgen}, {args.loadgens} per URL); {args.rounds} round(s) of {args.duration:g} s per run "
        f"at {args.connections} and 1 connections; "
        f"load average before: {os.getloadavg()[0]:.2f} (anything else running skews the figures)",
        flush=True,
    )
    with sigterm_unwinds():
        try:
            runs, failures = run_benchmark(args, loadgen)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    goals = report(runs, args) if runs else []
    if failures:
        print(f"failed: {', '.join(failures)}")
    if not args.skip_decision:
        decision_times(args.out)
    if failures or not runs or any(run.errors for run in runs):
        return 1
    return goals_status("overhead", goals)  # 1 when a stated goal was missed


if __name__ == "__main__":
    raise SystemExit(main())
