"""What a `--discover` lookup costs with each async resolver, against a real DNS server.

Starts Debian's dnsmasq on 127.0.0.53 with one name holding `--addresses` A records, then looks the name up
`--lookups` times (A and AAAA together, as the router does) with dnspython's asyncresolver (what
dpserve/replicas/discovery.py uses) and with aiodns (c-ares), one lookup at a time, in one event loop.
Prints per-lookup wall time (p50, p99) and the process's CPU time per lookup, and writes a CSV. The loop's own
`getaddrinfo` is not in the race: it can neither ask a given server nor read SRV records.

    python -m benchmarks.resolver [--lookups 2000] [--addresses 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from benchmarks.report import format_table, shown, write_csv
from dpserve.replicas.discovery import DnsResolver

ADDRESS = "127.0.0.53"
NAME = "vllm.bench.test"
RESULTS = Path(__file__).parent / "results" / "resolver"
COLUMNS = ["resolver", "lookups", "p50_us", "p99_us", "cpu_us_per_lookup", "addresses"]


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((ADDRESS, 0))
        return int(sock.getsockname()[1])


def start_dnsmasq(folder: Path, addresses: int) -> tuple[subprocess.Popen[bytes], int]:
    dnsmasq = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
    hosts = folder / "hosts"
    hosts.write_text("".join(f"127.0.1.{index + 1} {NAME}\n" for index in range(addresses)))
    port = _free_udp_port()
    command = [dnsmasq, "--keep-in-foreground", "--no-resolv", "--no-hosts", "--bind-interfaces", "--pid-file="]
    command += [f"--listen-address={ADDRESS}", f"--port={port}", f"--addn-hosts={hosts}", "--local=/test/"]
    command += ["--user=root"] if os.geteuid() == 0 else []
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    if process.poll() is not None:
        raise SystemExit("dnsmasq did not start (Debian's package: apt-get install dnsmasq)")
    return process, port


async def _time(lookup: Callable[[], Awaitable[set[str]]], lookups: int) -> tuple[list[float], float, int]:
    found = await lookup()  # warm: sockets, imports
    wall: list[float] = []
    cpu_start = time.process_time()
    for _ in range(lookups):
        start = time.perf_counter()
        await lookup()
        wall.append(time.perf_counter() - start)
    return wall, time.process_time() - cpu_start, len(found)


async def measure(port: int, lookups: int) -> list[dict[str, object]]:
    import aiodns
    import pycares  # aiodns's own dependency: the record types it answers with

    dnspython = DnsResolver(f"{ADDRESS}:{port}")
    cares = aiodns.DNSResolver(nameservers=[f"{ADDRESS}:{port}"])

    async def with_dnspython() -> set[str]:
        return await dnspython.addresses(NAME)

    async def with_aiodns() -> set[str]:
        answers = await asyncio.gather(
            cares.query_dns(NAME, "A"), cares.query_dns(NAME, "AAAA"), return_exceptions=True
        )
        found: set[str] = set()
        for answer in answers:
            if not isinstance(answer, BaseException):
                found.update(
                    str(record.data.addr)
                    for record in answer.answer
                    if isinstance(record.data, pycares.ARecordData | pycares.AAAARecordData)
                )
        return found

    rows: list[dict[str, object]] = []
    for name, lookup in (("dnspython", with_dnspython), ("aiodns", with_aiodns)):
        wall, cpu, found = await _time(lookup, lookups)
        quantiles = statistics.quantiles(wall, n=100)
        rows.append(
            {
                "resolver": name,
                "lookups": lookups,
                "p50_us": round(statistics.median(wall) * 1e6),
                "p99_us": round(quantiles[98] * 1e6),
                "cpu_us_per_lookup": round(cpu / lookups * 1e6),
                "addresses": found,
            }
        )
    await cares.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resolver", description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--addresses", type=int, default=8, help="A records of the name")
    parser.add_argument("--out", type=Path, default=RESULTS / "resolver.csv")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        process, port = start_dnsmasq(Path(folder), args.addresses)
        try:
            rows = asyncio.run(measure(port, args.lookups))
        finally:
            process.terminate()
            process.wait(5)
    print(format_table(COLUMNS, [[row[column] for column in COLUMNS] for row in rows], align="right"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows, COLUMNS)
    print(f"wrote {shown(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
