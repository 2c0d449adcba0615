"""What tracing costs the router: its own CPU per request with `--otlp-traces-endpoint` off, and on at sampling
ratios (`OTEL_TRACES_SAMPLER=parentbased_traceidratio`, `OTEL_TRACES_SAMPLER_ARG`).

    python -m benchmarks.tracing_cost [--requests 2000] [--ratios 0.1,1.0] [--rounds 2] [--out DIR]

The router runs over 2 fast scripted backends (`benchmarks/fast_backend.py`) and exports over gRPC to a real
OTLP receiver (`benchmarks/otlp_receiver.py`) in this process. For each case, a fresh router takes `--warmup`
requests, then `--requests` are sent one after another on one keep-alive connection, JSON answers and then
streams of `--stream-chunks` events; the router's CPU (user + system, from /proc) over each is divided by the
requests. Rounds alternate the order of the cases (ABBA). Prints the table, writes tracing_cost.csv under
--out; exits 1 when the receiver did not get the spans a ratio asks for (2 per sampled request: the
request's and its attempt's; the sampled requests within 5 standard deviations of ratio x requests, all of
them at 1.0), or a figure is nonsense. Spans are counted once the exporter has gone quiet, before and after
each counted window, so a window holds its own requests' spans and no others."""

from __future__ import annotations

import argparse
import csv
import math
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from benchmarks.fleet import HOST, cpu_seconds, port_block, spawn, stop_all
from benchmarks.instructions import send, wait_ready
from benchmarks.otlp_receiver import OtlpReceiver
from benchmarks.overhead import request_body, start_backends

READY_TIMEOUT_S = 60.0
EXPORT_WAIT_S = 30.0
QUIET_S = 6.0
"""No span for this long and the exporter has sent them all: its batch processor waits up to 5 s to export
(OTEL_BSP_SCHEDULE_DELAY's default), or less when 512 spans are queued."""
SIGMAS = 5.0
"""How far a sampled count may stray from ratio x requests, in standard deviations of the binomial."""


@dataclass(frozen=True)
class Row:
    round: int
    case: str
    ratio: float | None
    """The sampling ratio; None: tracing off."""
    mode: str
    requests: int
    cpu_us_per_request: float
    spans: int


def measure_case(ratio: float | None, urls: Sequence[str], args: argparse.Namespace, work: Path, rnd: int) -> list[Row]:
    """One fresh router with tracing off (`ratio` None) or sampling `ratio`; a row per mode."""
    case = "off" if ratio is None else f"sampled {ratio:g}"
    port = port_block(1, random.Random())
    replicas = [part for url in urls for part in ("--replica", url)]
    command = [sys.executable, "-m", "dpserve", "router", *replicas, "--port", str(port), "--policy", "least_loaded"]
    command += ["--gpu-interval", "0", "--log-level", "warning"]
    env = dict(os.environ)
    rows: list[Row] = []
    with OtlpReceiver() as receiver:
        if ratio is not None:
            command += ["--otlp-traces-endpoint", receiver.endpoint]
            env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(ratio)}
        process = spawn(command, work / f"router-{rnd}-{case.replace(' ', '-')}.log", env)
        try:
            wait_ready(f"http://{HOST}:{port}/health", READY_TIMEOUT_S, process)
            watched = psutil.Process(process.pid)
            for mode in ("json", "sse"):
                body = request_body(mode, args.stream_chunks)
                send(port, body, args.warmup)
                # Every span of the warm-up in before counting starts, and every span of the counted requests
                # before they are counted, so each window holds exactly its own requests' spans.
                before = _settled(receiver, ratio)
                start = cpu_seconds([watched])
                send(port, body, args.requests)
                used = cpu_seconds([watched]) - start
                spans = _settled(receiver, ratio) - before
                rows.append(Row(rnd, case, ratio, mode, args.requests, used / args.requests * 1e6, spans))
        finally:
            stop_all([process], 30)
    return rows


def _settled(receiver: OtlpReceiver, ratio: float | None) -> int:
    """The spans received so far, once the exporter has sent all it holds (at once with tracing off: there is
    nothing to wait for, and a span that still came would show in the next count)."""
    return len(receiver.spans) if ratio is None else receiver.settled(QUIET_S, EXPORT_WAIT_S)


def problems(rows: Sequence[Row]) -> list[str]:
    """What no sane run gives: no CPU; spans with tracing off; an odd count (each sampled request has 2); or a
    sampled share further than SIGMAS standard deviations from the ratio (with ratio 1: every request)."""
    found = []
    for row in rows:
        if not row.cpu_us_per_request > 0:
            found.append(f"{row.case} {row.mode}: CPU per request {row.cpu_us_per_request}")
        ratio = row.ratio or 0.0
        sampled, mean = row.spans / 2, row.requests * ratio
        spread = SIGMAS * math.sqrt(row.requests * ratio * (1 - ratio))
        if row.spans % 2 or not mean - spread <= sampled <= mean + spread:
            found.append(f"{row.case} {row.mode}: {row.spans} spans for {row.requests} requests")
    return found


def report(rows: Sequence[Row], out: Path | None) -> None:
    cases = list(dict.fromkeys(row.case for row in rows))
    print("router CPU per request, µs (each round's figure):")
    print("| | " + " | ".join(cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for mode, label in (("json", "JSON answer"), ("sse", "stream")):
        cells = []
        for case in cases:
            values = [row.cpu_us_per_request for row in rows if row.case == case and row.mode == mode]
            cells.append("-".join(f"{value:.0f}" for value in sorted(values)))
        print(f"| {label} | " + " | ".join(cells) + " |")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "tracing_cost.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0])))
            writer.writeheader()
            writer.writerows(asdict(row) for row in rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tracing_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests counted per case and mode (2000)")
    parser.add_argument("--warmup", type=int, default=200, help="requests before counting (200)")
    parser.add_argument("--ratios", default="0.1,1.0", help="sampling ratios besides off (0.1,1.0)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the cases' order (2)")
    parser.add_argument("--stream-chunks", type=int, default=16, help="SSE events per streamed answer (16)")
    parser.add_argument("--out", type=Path, default=None, help="where tracing_cost.csv goes")
    args = parser.parse_args(argv)
    if args.requests < 10 or args.warmup < 1 or args.rounds < 1:
        parser.error("--requests ≥ 10, --warmup ≥ 1, --rounds ≥ 1")
    ratios: list[float | None] = [None, *(float(r) for r in args.ratios.split(",") if r)]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="dpserve-tracing-") as tmp:
        work = Path(tmp)
        processes: list[subprocess.Popen[bytes]] = []
        try:
            urls = start_backends("fast", 2, work, processes)
            for rnd in range(1, args.rounds + 1):
                for ratio in ratios if rnd % 2 else ratios[::-1]:
                    rows += measure_case(ratio, urls, args, work, rnd)
        finally:
            stop_all(processes, 10)
    report(rows, args.out)
    found = problems(rows)
    for problem in found:
        print(f"NONSENSE: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
