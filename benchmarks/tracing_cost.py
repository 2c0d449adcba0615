"""What tracing costs the router: its own CPU per request with `--otlp-traces-endpoint` off, and on at sampling
ratios (`OTEL_TRACES_SAMPLER=parentbased_traceidratio`, `OTEL_TRACES_SAMPLER_ARG`).

    python -m benchmarks.tracing_cost [--requests 2000] [--ratios 0.1,1.0] [--rounds 2] [--out DIR]

The router runs over 2 fast scripted backends (`benchmarks/fast_backend.py`) and exports over gRPC to a real
OTLP receiver (`benchmarks/otlp_receiver.py`) in this process. For each case, a fresh router takes `--warmup`
requests, then `--requests` are sent one after another on one keep-alive connection, JSON answers and then
streams of `--stream-chunks` events; the router's CPU (user + system, from /proc) over each is divided by the
requests. Rounds alternate the order of the cases (ABBA). Prints the table, writes tracing_cost.csv under
--out; exits 1 when the receiver did not get the spans a ratio asks for (2 per sampled request: the
request's and its attempt's), or a figure is nonsense."""

from __future__ import annotations

import argparse
import csv
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


@dataclass(frozen=True)
class Row:
    round: int
    case: str
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
                already = len(receiver.wait_for(0, 0))
                send(port, body, args.warmup)
                # The warm-up's spans in before counting starts, so none of them lands in the counted window.
                before_spans = already + _spans_after(receiver, already, ratio, args.warmup)
                start = cpu_seconds([watched])
                send(port, body, args.requests)
                used = cpu_seconds([watched]) - start
                spans = _spans_after(receiver, before_spans, ratio, args.requests)
                rows.append(Row(rnd, case, mode, args.requests, used / args.requests * 1e6, spans))
        finally:
            stop_all([process], 30)
    return rows


def _spans_after(receiver: OtlpReceiver, before: int, ratio: float | None, requests: int) -> int:
    """The spans received for the counted requests, once the exporter has sent what the ratio asks for (or
    EXPORT_WAIT_S has passed): the batch processor exports on its own schedule, after the requests."""
    expected = 0 if ratio is None else int(2 * requests * ratio * 0.8)
    return len(receiver.wait_for(before + expected, EXPORT_WAIT_S)) - before


def problems(rows: Sequence[Row]) -> list[str]:
    found = []
    for row in rows:
        if not row.cpu_us_per_request > 0:
            found.append(f"{row.case} {row.mode}: CPU per request {row.cpu_us_per_request}")
        ratio = None if row.case == "off" else float(row.case.split()[1])
        low, high = (0, 0) if ratio is None else (2 * row.requests * ratio * 0.7, 2 * row.requests * ratio * 1.3)
        if not low <= row.spans <= high:
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
