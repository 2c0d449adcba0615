"""The processes behind a replica URL on this host: the one listening on its port, and its children
(vLLM's engine core, the process that holds the GPU, is a child of the API server)."""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import psutil


def _is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return False
    if address.is_loopback:
        return True
    return any(a.address == str(address) for addresses in psutil.net_if_addrs().values() for a in addresses)


class ReplicaProcesses:
    """Replica URL -> its pids on this host (empty when it runs elsewhere), for a fixed set of URLs.
    One socket scan serves them all, and its answer is kept `ttl_s`: scanning costs milliseconds,
    and replicas do not move between ports."""

    def __init__(self, urls: Sequence[str], ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ports: dict[str, int] = {}
        for url in urls:
            parts = urlsplit(url)
            if parts.hostname is not None and _is_local(parts.hostname):
                self._ports[url] = parts.port or (443 if parts.scheme == "https" else 80)
        self._ttl_s = ttl_s
        self._clock = clock
        self._scanned_at: float | None = None
        self._found: dict[str, frozenset[int]] = {}

    def pids(self) -> dict[str, frozenset[int]]:
        now = self._clock()
        if self._ports and (self._scanned_at is None or now - self._scanned_at >= self._ttl_s):
            self._found = self._scan()
            self._scanned_at = now
        return self._found

    def _scan(self) -> dict[str, frozenset[int]]:
        try:
            connections = psutil.net_connections(kind="tcp")
        except (psutil.AccessDenied, OSError):
            return {}
        listeners: dict[int, set[int]] = {}
        for c in connections:
            if c.status == psutil.CONN_LISTEN and c.laddr and c.pid is not None:
                listeners.setdefault(c.laddr.port, set()).add(c.pid)
        return {url: _with_children(listeners.get(port, set())) for url, port in self._ports.items()}


def _with_children(pids: set[int]) -> frozenset[int]:
    found: set[int] = set()
    for pid in pids:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        found.add(pid)
        found.update(child.pid for child in children)
    return frozenset(found)
