"""Hosts on one machine: a real DNS server (Debian's dnsmasq on 127.0.0.53, a port of the test's own)
answering for `*.test`, and `dpserve sim` replicas on 127.0.0.x addresses, each address standing for a host."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dns.exception
import dns.resolver
import pytest

from tests.conftest import free_port
from tests.integration.conftest import SimProcess, answers, sim_command, stop_process, wait_until

DNS_ADDRESS = "127.0.0.53"
DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"


def free_port_on(*addresses: str) -> int:
    """A port free for TCP on every one of these loopback addresses (and for UDP on the first)."""
    for _ in range(50):
        port = free_port()
        try:
            for address in addresses:
                with socket.socket() as sock:
                    sock.bind((address, port))
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                udp.bind((addresses[0], port))
        except OSError:
            continue
        return port
    raise RuntimeError("no common free port")


@dataclass
class Dns:
    """dnsmasq answering for `*.test` from a hosts file (re-read on SIGHUP) and fixed SRV records."""

    hosts_file: Path
    port: int
    extra: tuple[str, ...]
    process: subprocess.Popen[bytes] | None = None
    generation: int = 0
    """Each version of the hosts file also names `records-N.test` (N this): once it answers, dnsmasq serves
    that version."""

    @property
    def nameserver(self) -> str:
        return f"{DNS_ADDRESS}:{self.port}"

    def set_records(self, records: dict[str, list[str]]) -> None:
        self.generation += 1
        lines = [f"{address} {name}" for name, addresses in records.items() for address in addresses]
        lines.append(f"127.0.0.1 records-{self.generation}.test")
        self.hosts_file.write_text("\n".join(lines) + "\n")
        if self.process is not None:
            self.process.send_signal(signal.SIGHUP)  # dnsmasq re-reads the file asynchronously
            self.wait_serving()

    def serves_current_records(self) -> bool:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port = [DNS_ADDRESS], self.port
        try:
            resolver.resolve(f"records-{self.generation}.test", "A", lifetime=0.5)
        except dns.exception.DNSException:
            return False
        return True

    def wait_serving(self) -> None:
        process = self.process
        assert process is not None
        wait_until(lambda: process.poll() is not None or self.serves_current_records(), 10, 0.02, "dnsmasq's records")
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""

    def start(self) -> None:
        command = [DNSMASQ, "--keep-in-foreground", "--no-resolv", "--no-hosts", "--bind-interfaces"]
        command += [f"--listen-address={DNS_ADDRESS}", f"--port={self.port}", f"--addn-hosts={self.hosts_file}"]
        command += ["--local=/test/", "--local-ttl=0", "--pid-file=", *self.extra]
        if os.geteuid() == 0:
            command.append("--user=root")  # the hosts file lies in root's private tmp
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.wait_serving()

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 5)
            self.process = None


@contextlib.contextmanager
def dns_server(tmp_path: Path, *extra: str) -> Iterator[Dns]:
    if not os.access(DNSMASQ, os.X_OK):
        pytest.skip("dnsmasq is not installed (Debian's package: apt-get install dnsmasq)")
    dns = Dns(tmp_path / "hosts", free_port_on(DNS_ADDRESS), extra)
    dns.set_records({})
    dns.start()
    try:
        yield dns
    finally:
        dns.stop()


@contextlib.contextmanager
def sims_at(port: int, *addresses: str, kv_port: int | None = None) -> Iterator[dict[str, SimProcess]]:
    """One `dpserve sim` per address, all on `port` (and KV events on `kv_port`), as hosts of a service."""
    sims: dict[str, SimProcess] = {}
    try:
        for address in addresses:
            sims[address] = start_sim(address, port, kv_port)
        yield sims
    finally:
        for sim in sims.values():
            stop_process(sim.process, 10)


def start_sim(address: str, port: int, kv_port: int | None) -> SimProcess:
    kv_events = f"tcp://{address}:{kv_port or free_port_on(address)}"
    command = [*sim_command(port, kv_events, "--decode-ms-per-token", "2"), "--host", address]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sim = SimProcess(f"http://{address}:{port}", kv_events, process)
    wait_until(lambda: answers(f"{sim.url}/health") or process.poll() is not None, 30, 0.1, f"sim at {address}")
    assert process.poll() is None, f"sim at {address} exited"
    return sim
