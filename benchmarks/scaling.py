"""`dpserve bench scaling`: how throughput grows as replicas are added, measured with Locust.

For each replica count N it starts N replicas and the router with `dpserve up` (`--sim N` or real vLLM
CPU replicas), runs `loadtests/locustfile.py` headless against the router (closed-loop users, N x
--users-per-replica of them, or open-loop Poisson arrivals at N x --arrival-rate-per-replica), and reads
Locust's CSV: requests/s and output tokens/s over the measured window (requests that end during the
warm-up are reported apart and not counted), TTFT and inter-token latency p50/p99, failures. It also
samples the CPU the router, the replicas, the load generator and the whole machine used over the
window, so a run that falls short of linear says what ran out.

Writes, under --out/<backend>/: `scaling.csv`, `scaling.md`, `scaling.png` (throughput vs replicas with
the ideal line N x thr(1)) and Locust's own CSV and HTML per N under `locust/`. Prints the table, with
scaling efficiency = thr(N) / (N x thr(1)).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from benchmarks.fleet import CHECKOUT, UpPorts, cpu_seconds, progress, spawn, start_up
from benchmarks.report import figure, format_table, read_rows, shown, write_csv
from dpserve.flag_types import COUNT, NON_NEGATIVE, POSITIVE, SHARE, WHOLE, counts, existing_file
from dpserve.up.process import terminate

LOCUSTFILE = CHECKOUT / "loadtests" / "locustfile.py"
"""The repository's Locust file, beside benchmarks/ in the checkout (pass --locustfile for another)."""
POST = "POST"
WARMUP_PREFIX = "(warmup)"
USERS_PER_LOAD_PROCESS = 100


@dataclass
class ScalingRow:
    backend: str
    policy: str
    replicas: int
    users: int
    arrival_rate: float
    """Open-loop arrivals per second in total (0: closed loop)."""
    load_processes: int
    window_s: float
    requests: int
    errors: int
    req_per_s: float
    output_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    latency_p50_ms: float
    efficiency: float
    """req/s over (N / N0) x req/s at the smallest count N0 (1 when the run starts at one replica)."""
    router_cpu: float
    """Cores the router used over the window (1.0 = one core busy)."""
    replicas_cpu: float
    locust_cpu: float
    machine_cpu: float
    """Cores busy on the whole machine; `cores` is how many it has."""
    cores: int


# -- processes ---------------------------------------------------------------------------------------


@dataclass
class Stack:
    """`dpserve up` (replicas and router) for one replica count."""

    process: subprocess.Popen[bytes]
    router_url: str
    replica_urls: list[str]
    log_path: Path


def up_command(args: argparse.Namespace, ports: UpPorts, run_dir: Path) -> list[str]:
    command = ports.command(run_dir, args.policy)
    if args.backend == "sim":
        command += ["--sim", str(ports.count), "--", "--max-num-seqs", str(args.sim_max_num_seqs)]
        return [*command, "--decode-ms-per-token", str(args.sim_decode_ms), "--seed", str(args.seed)]
    return [*command, "--replicas", str(ports.count), "--cache-dir", str(args.cache_dir)]


async def start_stack(args: argparse.Namespace, count: int, work: Path) -> Stack:
    ports = UpPorts.free(count)
    run_dir = work / f"n{count}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "up.log"
    async with aiohttp.ClientSession() as session:
        command = up_command(args, ports, run_dir)
        process = await start_up(session, ports, command, log_path, dict(os.environ), args.start_timeout)
        try:
            await wait_ready_in_router(session, ports.router_url, count, args.start_timeout)
        except BaseException:
            terminate(process, 60)
            raise
    return Stack(process, ports.router_url, ports.replica_urls, log_path)


async def wait_ready_in_router(session: aiohttp.ClientSession, router_url: str, count: int, timeout_s: float) -> None:
    """Until the router itself counts every replica healthy (its probes may lag the replicas)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{router_url}/status") as resp:
                status = await resp.json()
            if sum(1 for replica in status.get("replicas", []) if replica.get("healthy")) >= count:
                return
        except (aiohttp.ClientError, ValueError):
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the router did not see {count} healthy replicas within {timeout_s:.0f}s")


def locust_command(
    args: argparse.Namespace, stack: Stack, count: int, prefix: Path, users: int, processes: int
) -> list[str]:
    run_time = round(args.warmup + args.duration)
    command = [sys.executable, "-m", "locust", "-f", str(args.locustfile), "--headless", "--host", stack.router_url]
    command += ["-u", str(users), "-r", str(users), "-t", f"{run_time}s", "--warmup", str(args.warmup)]
    command += ["--csv", str(prefix), "--csv-full-history", "--html", f"{prefix}.html", "--only-summary"]
    command += ["--json-file", str(prefix), "--loglevel", "WARNING"]
    command += ["--workload", args.workload, "--api", args.api, "--stream-ratio", str(args.stream_ratio)]
    command += ["--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens)]
    command += ["--model", args.model, "--seed", str(args.seed)]
    if args.arrival_rate_per_replica:
        command += ["--arrival-rate", str(args.arrival_rate_per_replica * count)]
    if processes > 1:
        command += ["--processes", str(processes)]
    return command


def users_for(args: argparse.Namespace, count: int, processes: int) -> int:
    if args.arrival_rate_per_replica:
        return 2 * processes  # arrival generators: two per load process
    return int(args.users_per_replica) * count


def load_processes_for(args: argparse.Namespace, count: int) -> int:
    if args.processes != "auto":
        return max(1, int(args.processes))
    # Measured on 2 cores: one Locust process drives 80 streaming users (8 sims, ~5,200 tokens/s) with
    # 0.42 of a core, and a master with 2 workers costs more than it saves there. So one process per
    # USERS_PER_LOAD_PROCESS users, at most one per core.
    users = users_for(args, count, 1)
    return max(1, min(os.cpu_count() or 1, math.ceil(users / USERS_PER_LOAD_PROCESS)))


# -- CPU accounting ----------------------------------------------------------------------------------


def cpu_snapshot(stack: Stack, locust: subprocess.Popen[bytes]) -> dict[str, float]:
    """CPU seconds so far: router, replicas (with their children), Locust (with its workers), machine."""
    snapshot = {"router": 0.0, "replicas": 0.0, "locust": 0.0}
    try:
        for child in psutil.Process(stack.process.pid).children():
            role = "router" if " router " in " ".join(child.cmdline()) + " " else "replicas"
            snapshot[role] += cpu_seconds([child])
    except psutil.Error:
        pass
    with contextlib.suppress(psutil.Error):
        snapshot["locust"] = cpu_seconds([psutil.Process(locust.pid)])
    machine = psutil.cpu_times()
    snapshot["machine"] = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
    snapshot["clock"] = time.monotonic()
    return snapshot


def cores_used(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    elapsed = max(1e-9, end["clock"] - start["clock"])
    return {key: (end[key] - start[key]) / elapsed for key in ("router", "replicas", "locust", "machine")}


# -- Locust's results --------------------------------------------------------------------------------


def read_stats(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def read_entries(path: Path) -> list[dict[str, Any]]:
    """Locust's final statistics (`--json-file`): written at shutdown, so nothing is missing (its CSV is
    rewritten once a second and may lag the end)."""
    entries: list[dict[str, Any]] = orjson.loads(path.read_bytes())
    return entries


def histogram_percentile(response_times: dict[str, int], q: float) -> float:
    """The q-quantile of Locust's histogram ({rounded value: count}), as Locust reads it."""
    counts = sorted((float(value), count) for value, count in response_times.items())
    total = sum(count for _, count in counts)
    if not total:
        return 0.0
    seen = 0
    for value, count in counts:
        seen += count
        if seen >= q * total:
            return value
    return counts[-1][0]


def summarize(entries: list[dict[str, Any]], window_s: float) -> dict[str, float]:
    """Throughput and latency over the measured window: requests that ended in the warm-up are reported
    under their own names and left out; Locust kills requests still running at the end (stop timeout 0)."""
    requests = [e for e in entries if e["method"] == POST and not e["name"].startswith(WARMUP_PREFIX)]
    every_post = [e for e in entries if e["method"] == POST]
    llm = {e["name"]: e for e in entries if e["method"] == "LLM"}
    empty: dict[str, Any] = {"num_requests": 0, "num_failures": 0, "response_times": {}, "total_content_length": 0}
    count = sum(e["num_requests"] for e in requests)
    dropped = llm.get("arrival dropped", empty)["num_requests"]
    errors = sum(e["num_failures"] for e in every_post) + dropped
    merged: dict[str, int] = {}
    for entry in requests:
        for value, times in entry["response_times"].items():
            merged[value] = merged.get(value, 0) + times
    ttft = llm.get("TTFT", empty)["response_times"]
    itl = llm.get("ITL", empty)["response_times"]
    return {
        "requests": count,
        "errors": errors,
        "req_per_s": count / window_s,
        "output_tok_per_s": llm.get("output_tokens", empty)["total_content_length"] / window_s,
        "ttft_p50_ms": histogram_percentile(ttft, 0.5),
        "ttft_p99_ms": histogram_percentile(ttft, 0.99),
        "itl_p50_ms": histogram_percentile(itl, 0.5),
        "itl_p99_ms": histogram_percentile(itl, 0.99),
        "latency_p50_ms": histogram_percentile(merged, 0.5),
    }


def _number(row: dict[str, str], column: str) -> float:
    try:
        return float(row.get(column, ""))
    except ValueError:
        return 0.0  # "N/A" when an entry has no samples yet


def current_rate(history_path: Path) -> tuple[float, float, int] | None:
    """(requests/s now, failures/s now, users) from the last rows of Locust's history CSV."""
    try:
        rows = read_stats(history_path)
    except (OSError, csv.Error):
        return None
    if not rows:
        return None
    last = rows[-1]["Timestamp"]
    latest = [r for r in rows if r["Timestamp"] == last and r["Type"] == POST]
    users = int(_number(rows[-1], "User Count"))
    return sum(_number(r, "Requests/s") for r in latest), sum(_number(r, "Failures/s") for r in latest), users


# -- one replica count -------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, count: int, work: Path, out: Path) -> ScalingRow:
    progress(f"N={count}: starting {count} {args.backend} replica(s) and the router (policy {args.policy}) ...")
    started = time.monotonic()
    stack = await start_stack(args, count, work)
    progress(f"N={count}: ready in {time.monotonic() - started:.0f}s")
    try:
        processes = load_processes_for(args, count)
        prefix = out / "locust" / f"n{count}"
        prefix.parent.mkdir(parents=True, exist_ok=True)
        users = users_for(args, count, processes)
        command = locust_command(args, stack, count, prefix, users, processes)
        load = f"{args.arrival_rate_per_replica * count:g} req/s open loop" if args.arrival_rate_per_replica else ""
        progress(
            f"N={count}: Locust, {load or f'{users} users'}, {processes} load process(es), "
            f"{args.warmup:g}s warm-up + {args.duration:g}s measured"
        )
        locust = spawn(command, out / "locust" / f"n{count}.log", dict(os.environ))
        try:
            cpu = await watch(args, count, stack, locust, prefix)
        finally:
            terminate(locust, 30)
        summary = summarize(read_entries(Path(f"{prefix}.json")), args.duration)
    finally:
        terminate(stack.process, 90)
    row = ScalingRow(
        backend=args.backend,
        policy=args.policy,
        replicas=count,
        users=users,
        arrival_rate=args.arrival_rate_per_replica * count,
        load_processes=processes,
        window_s=args.duration,
        requests=int(summary["requests"]),
        errors=int(summary["errors"]),
        req_per_s=summary["req_per_s"],
        output_tok_per_s=summary["output_tok_per_s"],
        ttft_p50_ms=summary["ttft_p50_ms"],
        ttft_p99_ms=summary["ttft_p99_ms"],
        itl_p50_ms=summary["itl_p50_ms"],
        itl_p99_ms=summary["itl_p99_ms"],
        latency_p50_ms=summary["latency_p50_ms"],
        efficiency=0.0,
        router_cpu=cpu.get("router", 0.0),
        replicas_cpu=cpu.get("replicas", 0.0),
        locust_cpu=cpu.get("locust", 0.0),
        machine_cpu=cpu.get("machine", 0.0),
        cores=os.cpu_count() or 1,
    )
    progress(
        f"N={count}: {row.req_per_s:.1f} req/s, {row.output_tok_per_s:.0f} tok/s, TTFT p50 {row.ttft_p50_ms:.0f} ms, "
        f"{row.errors} errors; CPU cores: router {row.router_cpu:.2f}, replicas {row.replicas_cpu:.2f}, "
        f"Locust {row.locust_cpu:.2f}, machine {row.machine_cpu:.2f}/{row.cores}"
    )
    return row


async def watch(
    args: argparse.Namespace, count: int, stack: Stack, locust: subprocess.Popen[bytes], prefix: Path
) -> dict[str, float]:
    """Wait for Locust, printing its rate every few seconds; CPU used over the measured window."""
    launched = time.monotonic()
    window_start = launched + args.warmup + 1.0  # Locust's own start-up takes about a second
    window_end = window_start + args.duration - 1.0
    start: dict[str, float] | None = None
    end: dict[str, float] | None = None
    next_report = launched + 5
    deadline = launched + args.warmup + args.duration + 120
    while locust.poll() is None:
        now = time.monotonic()
        if start is None and now >= window_start:
            start = cpu_snapshot(stack, locust)
        if end is None and now >= window_end:
            end = cpu_snapshot(stack, locust)
        if now >= next_report:
            rate = current_rate(Path(f"{prefix}_stats_history.csv"))
            if rate:
                requests_now, failures_now, users_now = rate
                elapsed = now - launched
                rates = f"{requests_now:.1f} req/s, {failures_now:.1f} fail/s"
                progress(f"N={count}: t={elapsed:.0f}s, {users_now} users, {rates}")
            next_report = now + 5
        if now > deadline:
            raise RuntimeError(f"Locust did not finish in time; see {prefix.parent}")
        await asyncio.sleep(0.25)
    if stack.process.poll() is not None:
        raise RuntimeError(f"dpserve up exited during the run; see {stack.log_path}")
    return cores_used(start, end) if start and end else {}


# -- output ------------------------------------------------------------------------------------------


def with_efficiency(rows: list[ScalingRow]) -> list[ScalingRow]:
    if not rows:
        return rows
    base = min(rows, key=lambda r: r.replicas)
    for row in rows:
        ideal = base.req_per_s * row.replicas / base.replicas
        row.efficiency = row.req_per_s / ideal if ideal else 0.0
    return rows


EFFICIENCY_CEILING = 1.1
"""Above this, N replicas did more than N times one replica's work: the single-replica run was cut short
(errors, a slow start) or the machine was busier then; the figures are not a scaling result."""


def nonsense(rows: Sequence[ScalingRow]) -> list[str]:
    """What makes the run's figures meaningless: a count with no request served or no rate, or an efficiency
    past EFFICIENCY_CEILING."""
    found = [
        f"{row.replicas} replicas: {row.requests} requests, {row.req_per_s} req/s"
        for row in rows
        if row.requests <= 0 or row.req_per_s <= 0
    ]
    found += [
        f"{row.replicas} replicas: efficiency {row.efficiency:.3f} > {EFFICIENCY_CEILING}"
        for row in rows
        if row.efficiency > EFFICIENCY_CEILING
    ]
    return found


def save_rows(rows: Sequence[ScalingRow], path: Path) -> None:
    records = [{key: round(v, 4) if isinstance(v, float) else v for key, v in asdict(row).items()} for row in rows]
    write_csv(path, records, [f.name for f in fields(ScalingRow)])


def load_rows(path: Path) -> list[ScalingRow]:
    return read_rows(ScalingRow, path)


TABLE_COLUMNS = (
    ("replicas", "N", "{}"),
    ("users", "users", "{}"),
    ("load_processes", "load procs", "{}"),
    ("requests", "requests", "{}"),
    ("errors", "errors", "{}"),
    ("req_per_s", "req/s", "{:.1f}"),
    ("output_tok_per_s", "out tok/s", "{:.0f}"),
    ("efficiency", "efficiency", "{:.3f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.0f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.0f}"),
    ("router_cpu", "router CPU", "{:.2f}"),
    ("replicas_cpu", "replicas CPU", "{:.2f}"),
    ("locust_cpu", "Locust CPU", "{:.2f}"),
    ("machine_cpu", "machine CPU", "{:.2f}"),
)


def _cells(row: ScalingRow) -> list[str]:
    return [fmt.format(getattr(row, name)) for name, _, fmt in TABLE_COLUMNS]


def markdown_table(rows: Sequence[ScalingRow]) -> str:
    header = [title for _, title, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def plot(rows: Sequence[ScalingRow], path: Path) -> None:
    rows = sorted(rows, key=lambda r: r.replicas)
    counts = [r.replicas for r in rows]
    base = rows[0]
    processes = sorted({r.load_processes for r in rows})
    suptitle = (
        f"dpserve throughput vs replicas: {base.backend}, policy {base.policy}, "
        f"Locust processes {'/'.join(map(str, processes))} (labels: scaling efficiency)"
    )
    titles = ("requests/s", "output tokens/s")
    with figure(
        path, titles, (11, 4.2), xlabel="replicas", grid=True, legend_loc="upper left", suptitle=suptitle
    ) as axes:
        for axis, attribute in zip(axes, ("req_per_s", "output_tok_per_s"), strict=True):
            measured = [getattr(r, attribute) for r in rows]
            ideal = [getattr(base, attribute) * n / base.replicas for n in counts]
            axis.plot(counts, ideal, linestyle="dashed", color="grey", label=f"ideal: N x thr({base.replicas})")
            axis.plot(counts, measured, marker="o", label="measured")
            for row, value in zip(rows, measured, strict=True):
                axis.annotate(
                    f"{row.efficiency:.2f}", (row.replicas, value), textcoords="offset points", xytext=(4, -12)
                )
            axis.set_xticks(counts)
            axis.set_ylim(bottom=0)


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpserve bench scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=counts, default="1,2,4,8", help="replica counts, comma-separated")
    parser.add_argument("--backend", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--policy", default="least_loaded", help="the router's policy")
    parser.add_argument("--duration", type=POSITIVE, help="measured seconds per N (default 30 sim, 60 vLLM)")
    parser.add_argument("--warmup", type=NON_NEGATIVE, help="unmeasured seconds first (default 5 sim, 20 vLLM)")
    parser.add_argument(
        "--users-per-replica", type=COUNT, help="closed-loop users per replica (default 10 sim, 8 vLLM)"
    )
    parser.add_argument(
        "--arrival-rate-per-replica", type=NON_NEGATIVE, default=0.0, help="open loop instead: req/s each"
    )
    parser.add_argument("--processes", default="auto", help="Locust processes (auto: 1 per 100 users, <= cores)")
    parser.add_argument(
        "--workload",
        choices=("random", "shared_prefix", "multi_turn"),
        default="random",
        help="random, shared_prefix or multi_turn",
    )
    parser.add_argument(
        "--api", choices=("chat", "completions", "mixed"), default="chat", help="chat, completions or mixed"
    )
    parser.add_argument("--stream-ratio", type=SHARE, default=1.0)
    parser.add_argument("--prompt-tokens", type=COUNT, default=128)
    parser.add_argument("--output-tokens", type=COUNT, default=64)
    parser.add_argument("--model", default="dpserve-tiny")
    parser.add_argument("--seed", type=WHOLE, default=0)
    parser.add_argument("--sim-max-num-seqs", type=COUNT, default=8, help="each sim's batch limit (its capacity)")
    parser.add_argument("--sim-decode-ms", type=NON_NEGATIVE, default=10.0, help="each sim's time per output token")
    parser.add_argument("--start-timeout", type=POSITIVE, default=900.0)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--locustfile", type=existing_file, default=LOCUSTFILE)
    parser.add_argument("--out", type=Path, default=Path("bench-results/scaling"))
    args = parser.parse_args(list(argv))
    if args.duration is None:
        args.duration = 30.0 if args.backend == "sim" else 60.0
    if args.warmup is None:
        args.warmup = 5.0 if args.backend == "sim" else 20.0
    if args.users_per_replica is None:
        args.users_per_replica = 10 if args.backend == "sim" else 8
    args.counts = sorted({int(n) for n in args.replicas.split(",") if n.strip()})
    if not args.counts or min(args.counts) < 1:
        parser.error("--replicas needs counts of at least 1, e.g. 1,2,4,8")
    if not args.locustfile.exists():
        parser.error(f"no locustfile at {args.locustfile} (pass --locustfile)")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every `finally` stops the replicas and Locust it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out / args.backend
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dpserve-bench-scaling-"))  # replica logs
    rows: list[ScalingRow] = []
    for count in args.counts:
        rows.append(asyncio.run(measure(args, count, work, out)))
        with_efficiency(rows)
        save_rows(rows, out / "scaling.csv")  # after every N: a cut-short run keeps what it measured
    plot(rows, out / "scaling.png")
    table = markdown_table(rows)
    (out / "scaling.md").write_text(table + "\n")
    print()
    print(format_table([title for _, title, _ in TABLE_COLUMNS], [_cells(row) for row in rows], align="right"))
    largest = max(rows, key=lambda r: r.replicas)
    ideal = largest.req_per_s / largest.efficiency if largest.efficiency else 0.0
    print(
        f"\nscaling efficiency at {largest.replicas} replicas: {largest.efficiency:.3f} "
        f"(req/s {largest.req_per_s:.1f} vs ideal {ideal:.1f})"
    )
    print(
        f"wrote scaling.csv, scaling.md, scaling.png in {shown(out)}; Locust's CSV and HTML in {shown(out / 'locust')}"
    )
    problems = nonsense(rows)
    for problem in problems:
        print(f"NONSENSE: {problem}", file=sys.stderr)
    return 1 if problems else 0
