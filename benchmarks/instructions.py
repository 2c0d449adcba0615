"""Instructions per request: dpserve's router under callgrind, counted over a fixed number of requests.

Timings on a shared 2-core machine differ by ±10% between identical runs; an instruction count does not,
so a change of a few percent on the hot path shows here first (then in `dpserve bench overhead`).

For each checkout (this one, and each `--against REV` in a temporary worktree): the router runs under
`valgrind --tool=callgrind` over 2 fast scripted backends (`benchmarks/fast_backend.py`, not under
valgrind), with probes slowed so that the counted window holds only requests. After `--warmup` requests,
the counters are zeroed (`callgrind_control -z`), `--requests` are sent one after another on one
keep-alive connection, and the counters dumped (`callgrind_control -d`). The router's whole process is
counted: the event loop, uvicorn, the upstream client, the app. Each checkout is measured `--repeat`
times (each a fresh router) and the spread is printed, to show what varies.

    python -m benchmarks.instructions [--mode json|sse] [--requests 400] [--against REV] [--pure] [--out DIR]
                                      [--keep-dumps DIR]

This checkout runs as built: compiled where `make compiled` built it (the first line says), and `--pure`
counts it interpreted as well (DPSERVE_PURE_PYTHON=1); other commits run interpreted.

Prints instructions per request per checkout and mode, and the ratio against the first checkout; writes
instructions.csv under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import http.client
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from benchmarks.fleet import CHECKOUT, port_block, stop_all, wait_ok
from benchmarks.overhead import checkouts, request_body, start_backends
from dpserve.version import compiled_check

READY_TIMEOUT_S = 300.0  # a router's start under valgrind: about 40 s here
SLOW_PROBES = ("--probe-interval", "--quiet-probe-interval", "--linked-quiet-probe-interval")


@dataclass(frozen=True)
class Count:
    checkout: str
    mode: str
    requests: int
    instructions: int

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests


def wait_ready(url: str, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    async def ready() -> None:
        async with aiohttp.ClientSession() as session:
            await wait_ok(session, url, timeout_s, process)

    asyncio.run(ready())


def send(port: int, body: bytes, count: int) -> None:
    """`count` requests, one after another, on one keep-alive connection; each must be a 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(count):
        connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise SystemExit(f"the router answered {response.status}: {data[:200]!r}")
    connection.close()


@contextlib.contextmanager
def backends(work: Path) -> Iterator[list[str]]:
    """The overhead benchmark's 2 fast backends, stopped at the end."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        yield start_backends("fast", 2, work, processes)
    finally:
        stop_all(processes, 10)


def count_router(
    checkout: Path,
    label: str,
    urls: Sequence[str],
    body: bytes,
    args: argparse.Namespace,
    work: Path,
    build_env: Mapping[str, str],
) -> int:
    """The router's instructions over `args.requests` requests, after a warm-up."""
    port = port_block(1, random.Random())
    out = work / f"callgrind-{re.sub(r'[^A-Za-z0-9]', '_', label)}.%p"
    replicas = [part for url in urls for part in ("--replica", url)]
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
        sys.executable, "-m", "dpserve", "router", *replicas, "--port", str(port), "--policy", args.policy,
        "--gpu-interval", "0", *slow_probes(checkout), *args.router_arg,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout), **build_env}
    # In the checkout's own folder: `python -m` puts the working directory first on the path.
    with (work / f"router-{label}.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=checkout)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", READY_TIMEOUT_S, process)
        send(port, body, args.warmup)
        # valgrind execs its tool in the process it was started as: that pid is the counted one.
        callgrind_control("-z", process.pid)
        send(port, body, args.requests)
        callgrind_control("-d", process.pid)
    finally:
        stop_all([process], 60)
    prefix = out.name.replace(".%p", ".")
    dumps = sorted(path for path in work.glob(prefix + "*") if path.stat().st_size)
    if not dumps:
        raise SystemExit(f"{label}: callgrind wrote no dump (see {work})")
    match = re.search(rb"^summary: (\d+)$", dumps[-1].read_bytes(), re.MULTILINE)
    if match is None:
        raise SystemExit(f"{label}: no summary line in {dumps[-1]}")
    if args.keep_dumps is not None:  # for callgrind_annotate: where the instructions went
        args.keep_dumps.mkdir(parents=True, exist_ok=True)
        shutil.copy(dumps[-1], args.keep_dumps / f"callgrind.{label}.out")
    for dump in work.glob(prefix + "*"):
        dump.unlink()
    return int(match.group(1))


def slow_probes(checkout: Path) -> list[str]:
    """Probes an hour apart, with the flags this checkout's router has (older ones lack some)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, "-m", "dpserve", "router", "--help"]
    usage = subprocess.run(command, capture_output=True, text=True, env=env, cwd=checkout, timeout=60).stdout
    return [part for flag in SLOW_PROBES if flag in usage.split() for part in (flag, "3600")]


def callgrind_control(flag: str, pid: int) -> None:
    """Zero (-z) or dump (-d) the counts of a process run under callgrind."""
    done = subprocess.run(["callgrind_control", flag, str(pid)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or "OK" not in done.stdout:
        raise SystemExit(f"callgrind_control {flag} {pid} failed: {done.stdout}{done.stderr}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("json", "sse"), action="append", help="json (default) and/or sse")
    parser.add_argument("--requests", type=int, default=400, help="requests counted per run (400)")
    parser.add_argument("--warmup", type=int, default=50, help="requests before counting (50)")
    parser.add_argument("--repeat", type=int, default=2, help="fresh routers per checkout and mode (2)")
    parser.add_argument("--stream-chunks", type=int, default=16, help="SSE events per streamed answer (16)")
    parser.add_argument("--policy", default="least_loaded")
    parser.add_argument("--against", default="", help="comma list of other commits to count as well")
    parser.add_argument(
        "--pure", action="store_true", help="count this checkout's interpreted build too (here-pure), beside here"
    )
    parser.add_argument("--router-arg", action="append", default=[], help="one more router flag (--x=y)")
    parser.add_argument("--out", type=Path, default=None, help="where instructions.csv goes")
    parser.add_argument(
        "--keep-dumps", type=Path, default=None, help="copy each run's callgrind dump here (for callgrind_annotate)"
    )
    args = parser.parse_args(argv)
    if args.requests < 50 or args.warmup < 1 or args.repeat < 1:
        parser.error("--requests ≥ 50, --warmup ≥ 1, --repeat ≥ 1")
    args.mode = args.mode or ["json"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"needs {tool} (apt-get install valgrind)", file=sys.stderr)
            return 2
    revs = [rev for rev in args.against.split(",") if rev]
    counts: list[Count] = []
    with tempfile.TemporaryDirectory(prefix="dpserve-instructions-") as tmp:
        work = Path(tmp)
        with checkouts(revs, work) as others, backends(work) as urls:
            pure = {"DPSERVE_PURE_PYTHON": "1"}
            # Other commits' worktrees hold no compiled files: they run interpreted.
            trees = {"here": (CHECKOUT, {}), **({"here-pure": (CHECKOUT, pure)} if args.pure else {})}
            trees |= {label: (tree, pure) for label, tree in others.items()}
            print(f"here: {compiled_check() or 'compiled'}", flush=True)
            for mode in args.mode:
                body = request_body(mode, args.stream_chunks)
                for repeat in range(args.repeat):
                    order = list(trees.items()) if repeat % 2 == 0 else list(trees.items())[::-1]
                    for label, (tree, build_env) in order:
                        total = count_router(tree, f"{label}-{mode}", urls, body, args, work, build_env)
                        count = Count(label, mode, args.requests, total)
                        counts.append(count)
                        print(f"{label:>12} {mode:4} {count.per_request / 1e3:8.1f}k instructions/request", flush=True)
    report(counts, args.out)
    return 0


def report(counts: Sequence[Count], out: Path | None) -> None:
    base = counts[0].checkout
    for mode in dict.fromkeys(count.mode for count in counts):
        rows = [count for count in counts if count.mode == mode]
        for label in dict.fromkeys(count.checkout for count in rows):
            mine = [count.per_request for count in rows if count.checkout == label]
            ref = [count.per_request for count in rows if count.checkout == base]
            mean, ref_mean = sum(mine) / len(mine), sum(ref) / len(ref)
            spread = (max(mine) - min(mine)) / mean
            print(f"{mode} {label}: {mean / 1e3:.1f}k per request (spread {spread:.1%}), {mean / ref_mean:.3f}x {base}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with (out / "instructions.csv").open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["checkout", "mode", "requests", "instructions", "per_request"])
            for count in counts:
                per_request = round(count.per_request)
                writer.writerow([count.checkout, count.mode, count.requests, count.instructions, per_request])


if __name__ == "__main__":
    sys.exit(main())
