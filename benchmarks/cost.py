"""`dpserve bench cost`: the router's CPU per realistic request, next to vllm-router and sglang-router.

The workload is shaped like real traffic, not like a microbenchmark: G groups of ~1k-token shared system
prompts, each request with a question of its own, streamed answers of --max-tokens tokens, --concurrency in
flight, over 2 `dpserve sim --speed 0` replicas publishing KV events (so every router is the busy part). Each
target is started fresh over prefix caches just emptied, warmed with eight requests per group, then measured:
the CPU seconds its process tree used over the run (probes, scrapes and KV events included) divided by the
requests it served, and the fleet's prefix-cache hit rate from the replicas' own counters.

Targets (`--targets`, `ROUTER:POLICY[+tokenizer]`): dpserve's kv_aware (tokens from the replica's /tokenize, or
with `+tokenizer` from the model's tokenizer loaded in the router) and least_loaded, vllm-router's cache_aware
and round_robin, sglang-router's cache_aware; `--against REV` adds dpserve's router of another commit. `--rounds
R` measures every target R times in ABBA order (the order reversed every other round), so a slow spell on a
shared machine falls on all; ratios are taken within a round and their median reported. Prints the table, the
ratios against the Rust routers and the issue's goals; writes cost.csv. Exit 1 when a figure is nonsense (a
target that failed requests, served none, or used no CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import aiohttp
import psutil

from benchmarks.fleet import (
    CHECKOUT,
    HOST,
    get_text,
    port_block,
    process_cpu_seconds,
    progress,
    router_command,
    sigterm_unwinds,
    spawn,
    stop_all,
    wait_ok,
)
from benchmarks.instructions import callgrind_control
from benchmarks.overhead import checkouts
from benchmarks.policies import Fleet, Outcome, counter_deltas, drive, replica_counters, reset_caches
from benchmarks.policy_workloads import Workload, shared_prefix
from benchmarks.report import format_table, goals_status, shown, write_csv
from benchmarks.report import met as met_text
from dpserve.flag_types import COUNT, NON_NEGATIVE
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.router.observe.prompt_tokens import LocalTokenizer
from dpserve.tiny_model import ensure_tiny_model
from dpserve.up.process import terminate

TARGETS = (
    "dpserve:kv_aware",
    "dpserve:kv_aware+tokenizer",
    "dpserve:least_loaded",
    "vllm-router:cache_aware",
    "vllm-router:round_robin",
    "sglang-router:cache_aware",
)
REPLICAS = 2
WARM_ROUNDS = 8
"""Requests per group before measuring (128 with 16 groups, for every target): the router's start-up work is done
by then. dpserve's start-up work is its tokenizer's: the replicas tokenize prompts until the model's own
tokenizer is loaded in the router (~45 requests here) and agrees with them on 8, then the router's encoder holds
its first 32 prompts against a whole encode; with 3 rounds (48 requests), that last part (~1.2 ms a prompt) fell
in the measured window."""
START_TIMEOUT_S = 120.0
# The goals: dpserve's CPU per request over the Rust router's, (ours, theirs, at most).
GOALS = (
    ("dpserve:kv_aware", "vllm-router:cache_aware", 1.0),
    ("dpserve:kv_aware+tokenizer", "vllm-router:cache_aware", 1.0),
    ("dpserve:least_loaded", "vllm-router:round_robin", 1.0),
)


@dataclass(frozen=True)
class Target:
    router: str
    policy: str
    tokenizer: bool = False
    rev: str = ""

    @classmethod
    def parse(cls, text: str) -> Target:
        router, _, policy = text.partition(":")
        router, _, rev = router.partition("@")
        policy, plus, extra = policy.partition("+")
        if not policy or (plus and extra != "tokenizer") or router not in ("dpserve", "vllm-router", "sglang-router"):
            raise argparse.ArgumentTypeError(f"{text!r}: ROUTER[@REV]:POLICY[+tokenizer], ROUTER one of dpserve, ...")
        if (rev or plus) and router != "dpserve":
            raise argparse.ArgumentTypeError(f"{text!r}: @REV and +tokenizer are for dpserve's router only")
        return cls(router, policy, bool(plus), rev)

    @property
    def label(self) -> str:
        name = f"{self.router}@{self.rev}" if self.rev else self.router
        return f"{name}:{self.policy}{'+tokenizer' if self.tokenizer else ''}"


@dataclass
class Row:
    round: int
    target: str
    requests: int
    errors: int
    seconds: float
    req_s: float
    router_cpu_s: float
    cpu_us_per_request: float
    hit_rate: float
    system_share: float = 0.0
    """Of the router's CPU, the kernel's (system calls: sockets, wake-ups)."""
    tokens_from: str = ""
    """dpserve's kv_aware: how many prompts got their tokens where (`local=N remote=N`), from its metrics."""


# -- one measurement ---------------------------------------------------------------------------------


def target_command(target: Target, fleet: Fleet, port: int, tokenizer: Path) -> list[str]:
    """The target's router over the fleet, told of every replica's KV events (as an operator would)."""
    return router_command(
        target.router,
        target.policy,
        fleet.urls,
        port,
        kv_events=fleet.kv_endpoints,
        tokenizer=str(tokenizer) if target.tokenizer else None,
        block_size=fleet.block_size,
    )


def target_env(target: Target, revs: dict[str, Path]) -> tuple[dict[str, str], Path | None]:
    """The environment and working directory of a target's router: another commit's imports dpserve from its
    worktree (`python -m` looks in its working directory first, before the editable install of this one)."""
    env = dict(os.environ)
    if not target.rev:
        return env, None
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(revs[target.rev]), env.get("PYTHONPATH")]))
    return env, revs[target.rev]


async def measure(
    session: aiohttp.ClientSession,
    target: Target,
    fleet: Fleet,
    workloads: tuple[Workload, Workload],
    args: argparse.Namespace,
    revs: dict[str, Path],
    round_index: int,
) -> Row:
    warm, work = workloads
    await reset_caches(session, fleet)
    port = port_block(2, random.Random())
    command = target_command(target, fleet, port, args.tokenizer_dir)
    counted = args.callgrind is not None and target.router == "dpserve"
    if counted:
        dump = args.callgrind / f"callgrind.{target.label.replace(':', '_').replace('+', '_')}-{round_index}.%p"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={dump}", *command]
    log_path = args.out / f"{target.label.replace(':', '_').replace('@', '_')}-{round_index}.log"
    process = spawn(command, log_path, *target_env(target, revs))
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ok(session, f"{url}/v1/models", START_TIMEOUT_S, process)
        await drive(url, warm, args.concurrency, args.max_tokens)
        await asyncio.sleep(args.settle_s)  # start-up work (first scrapes, subscriptions) out of the window
        tree = psutil.Process(process.pid)
        before, cpu_before = await replica_counters(session, fleet), tree_times(tree)
        if counted:
            callgrind_control("-z", process.pid)
        outcomes, seconds = await drive(url, work, args.concurrency, args.max_tokens)
        if counted:
            callgrind_control("-d", process.pid)
        cpu, user, system = (after - was for after, was in zip(tree_times(tree), cpu_before, strict=True))
        hits, queries, _ = counter_deltas(before, await replica_counters(session, fleet))
        sources = await token_sources(session, url) if target.router == "dpserve" else ""
    finally:
        terminate(process, 10)
    row = row_of(round_index, target, outcomes, seconds, cpu, hits / queries if queries else 0.0)
    row.tokens_from = sources
    row.system_share = round(system / (user + system), 2) if user + system else 0.0
    return row


def tree_times(process: psutil.Process) -> tuple[float, float, float]:
    """CPU seconds so far of a process and its threads and children, to the nanosecond
    (`fleet.process_cpu_seconds`), and of those the user and system seconds in the kernel's 10 ms ticks
    (for the share in the kernel only), in one walk of the tree."""
    total = user = system = 0.0
    for member in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = member.cpu_times()
            total += process_cpu_seconds(member)
            user, system = user + times.user, system + times.system
    return total, user, system


async def token_sources(session: aiohttp.ClientSession, url: str) -> str:
    """Where dpserve's router got prompts' tokens over its life: `local=N remote=N`."""
    name = "dpserve_routing_tokenize_seconds_count"
    samples = parse_samples(await get_text(session, f"{url}/metrics") or "", {name})
    return " ".join(f"{labels.get('tokenizer')}={int(value)}" for labels, value in samples.by_name.get(name, []))


def row_of(
    round_index: int, target: Target, outcomes: Sequence[Outcome], seconds: float, cpu: float, hit: float
) -> Row:
    served = sum(1 for o in outcomes if o.ok)
    return Row(
        round_index,
        target.label,
        len(outcomes),
        len(outcomes) - served,
        round(seconds, 2),
        round(served / seconds, 1) if seconds else 0.0,
        round(cpu, 3),
        round(cpu / served * 1e6) if served else 0.0,
        round(hit, 4),
    )


# -- the run -----------------------------------------------------------------------------------------


async def start_fleet(
    session: aiohttp.ClientSession, args: argparse.Namespace
) -> tuple[Fleet, list[subprocess.Popen[bytes]]]:
    """REPLICAS `dpserve sim --speed 0` processes, each publishing its KV events (and nothing else running:
    `dpserve up` would add a router of its own)."""
    base = port_block(2 * REPLICAS, random.Random())
    urls = [f"http://{HOST}:{base + i}" for i in range(REPLICAS)]
    endpoints = [f"tcp://{HOST}:{base + REPLICAS + i}" for i in range(REPLICAS)]
    run_dir = args.out / "fleet"
    run_dir.mkdir(parents=True, exist_ok=True)
    progress(f"starting {REPLICAS} sims with KV events ...")
    sims = []
    for index, (url, endpoint) in enumerate(zip(urls, endpoints, strict=True)):
        command = [sys.executable, "-m", "dpserve", "sim", "--port", str(base + index), "--kv-events", endpoint]
        command += ["--speed", "0", "--block-size", str(args.block_size), "--log-level", "warning"]
        sims.append(spawn(command, run_dir / f"sim-{index}.log", dict(os.environ)))
        await wait_ok(session, f"{url}/v1/models", START_TIMEOUT_S, sims[-1])
    fleet = Fleet("sim", sims[0], urls, endpoints, args.block_size, 0, run_dir / "sim-0.log")
    return fleet, sims


def order(targets: Sequence[Target], round_index: int) -> list[Target]:
    """ABBA: every other round runs the targets in reverse."""
    return list(targets) if round_index % 2 == 0 else list(reversed(targets))


async def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    # The same requests for every target: each starts over caches just emptied. The first WARM_ROUNDS requests of
    # each group are the warm-up, which also covers the checks of a tokenizer found in the router.
    every = shared_prefix(args.groups, WARM_ROUNDS + args.prompts, args.prefix_words, args.question_words, seed=1)
    cut = WARM_ROUNDS * args.groups
    warm = Workload(every.name, every.requests[:cut], every.groups, every.description)
    work = Workload(every.name, every.requests[cut:], every.groups, every.description)
    tokenizer = LocalTokenizer(args.tokenizer_dir)
    tokens = [len(tokenizer.tokens_now("chat", {"messages": r.messages}) or ()) for r in warm.requests]
    progress(f"prompts of {statistics.mean(tokens):.0f} tokens on average (the tiny model's tokenizer)")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        fleet, sims = await start_fleet(session, args)
        try:
            with checkouts(sorted({t.rev for t in args.targets if t.rev}), args.out) as revs:
                for round_index in range(args.rounds):
                    for target in order(args.targets, round_index):
                        progress(f"round {round_index}: {target.label} ...")
                        row = await measure(session, target, fleet, (warm, work), args, revs, round_index)
                        progress(
                            f"  {row.cpu_us_per_request:,.0f} µs CPU per request, hit rate {row.hit_rate:.3f}, "
                            f"{row.req_s} req/s, {row.errors} errors"
                        )
                        rows.append(row)
        finally:
            stop_all(sims, 10)
    return rows


# -- the report --------------------------------------------------------------------------------------


def medians(rows: Sequence[Row]) -> dict[str, tuple[float, float]]:
    """Per target: the median CPU µs per request and the median hit rate over the rounds."""
    by_target: dict[str, list[Row]] = {}
    for row in rows:
        by_target.setdefault(row.target, []).append(row)
    return {
        name: (statistics.median(r.cpu_us_per_request for r in rs), statistics.median(r.hit_rate for r in rs))
        for name, rs in by_target.items()
    }


def ratios(rows: Sequence[Row], ours: str, theirs: str) -> list[float]:
    """Ours over theirs, CPU per request, within each round that measured both."""
    out = []
    for round_index in sorted({r.round for r in rows}):
        mine = [r for r in rows if r.round == round_index and r.target == ours]
        other = [r for r in rows if r.round == round_index and r.target == theirs]
        if mine and other and other[0].cpu_us_per_request:
            out.append(mine[0].cpu_us_per_request / other[0].cpu_us_per_request)
    return out


def verdicts(rows: Sequence[Row]) -> list[tuple[str, bool]]:
    lines = []
    hits = medians(rows)
    for ours, theirs, goal in GOALS:
        found = ratios(rows, ours, theirs)
        if not found:
            continue
        ratio = statistics.median(found)
        met = ratio <= goal
        if theirs.endswith("cache_aware"):  # precision must not cost hits
            met = met and hits[ours][1] >= hits[theirs][1] - 0.005
        lines.append(
            (
                f"{ours} / {theirs}: CPU per request {ratio:.2f}x (rounds: {', '.join(f'{r:.2f}' for r in found)}), "
                f"hit rate {hits[ours][1]:.3f} vs {hits[theirs][1]:.3f}; goal <= {goal}x",
                met,
            )
        )
    return lines


def nonsense(rows: Sequence[Row]) -> list[str]:
    """Figures no honest run produces: failed requests, nothing served, a router that used no CPU."""
    problems = []
    for row in rows:
        if row.errors:
            problems.append(f"round {row.round} {row.target}: {row.errors} of {row.requests} requests failed")
        if row.requests == 0 or row.router_cpu_s <= 0:
            problems.append(f"round {row.round} {row.target}: served nothing or used no CPU")
    return problems


def targets(text: str) -> list[Target]:
    """--targets: at least one, each as Target.parse reads it (argparse names the flag in the error)."""
    found = [Target.parse(part) for part in text.split(",") if part]
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} names no target")
    return found


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpserve bench cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--targets", type=targets, default=",".join(TARGETS), help="ROUTER[@REV]:POLICY[+tokenizer], comma-separated"
    )
    parser.add_argument("--rounds", type=COUNT, default=2, help="every target this many times, ABBA")
    parser.add_argument("--groups", type=COUNT, default=16, help="shared system prompts")
    parser.add_argument("--prompts", type=COUNT, default=20, help="measured requests per group")
    parser.add_argument("--prefix-words", type=COUNT, default=280, help="words per system prompt (280: ~1k tokens)")
    parser.add_argument("--question-words", type=COUNT, default=16, help="words per request's own question")
    parser.add_argument("--concurrency", type=COUNT, default=8, help="requests in flight")
    parser.add_argument("--max-tokens", type=COUNT, default=16, help="tokens per streamed answer")
    parser.add_argument("--block-size", type=COUNT, default=16, help="the sims' KV block size")
    parser.add_argument("--settle-s", type=NON_NEGATIVE, default=5.0, help="seconds between warm-up and measuring")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--out", type=Path, default=None, help="where cost.csv and the logs go (default: a temp dir)")
    parser.add_argument(
        "--callgrind",
        type=Path,
        default=None,
        help="run dpserve's routers under valgrind's callgrind and dump the measured window's counts into this "
        "folder (for callgrind_annotate: where a realistic request's instructions go); CPU figures are then "
        "valgrind's, not comparable",
    )
    args = parser.parse_args(argv)
    if args.callgrind is not None:
        args.callgrind.mkdir(parents=True, exist_ok=True)
    if args.rounds < 1 or args.prompts < 1 or args.groups < 1:
        parser.error("--rounds, --groups and --prompts must be at least 1")
    return args


@contextlib.contextmanager
def out_dir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="dpserve-cost-") as tmp:
        yield Path(tmp)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.tokenizer_dir = ensure_tiny_model(args.cache_dir)
    with out_dir(args.out) as out, sigterm_unwinds():
        args.out = out
        rows = asyncio.run(run(args))
        columns = [f.name for f in fields(Row)]
        write_csv(out / "cost.csv", [asdict(r) for r in rows], columns)
        print(format_table(columns, [[str(v) for v in asdict(r).values()] for r in rows]))
        for name, (cpu, hit) in medians(rows).items():
            print(f"{name}: median {cpu:,.0f} µs CPU per request, hit rate {hit:.3f}")
        lines = verdicts(rows)
        for line, met in lines:
            print(f"{line}: {met_text(met)}")
        print(f"wrote {shown(out / 'cost.csv')} (checkout {shown(CHECKOUT)})")
        problems = nonsense(rows)
        for problem in problems:
            print(f"nonsense: {problem}")
        return 1 if problems else goals_status("cost", lines)


if __name__ == "__main__":
    raise SystemExit(main())
