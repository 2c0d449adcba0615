"""The processes behind a replica URL on this host: the one listening on its port, and its children
(vLLM's engine core, the process that holds the GPU, is a child of the API server)."""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import psutil

WILDCARDS = {"0.0.0.0", "::"}


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
    """Replica URL -> its pids on this host (empty when it runs elsewhere). Cached: scanning sockets
    costs milliseconds, and replicas do not move between ports."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._cache: dict[str, tuple[float, frozenset[int]]] = {}

    def pids(self, url: str) -> frozenset[int]:
        now = self._clock()
        cached = self._cache.get(url)
        if cached is not None and now - cached[0] < self._ttl_s:
            return cached[1]
        found = self._scan(url)
        self._cache[url] = (now, found)
        return found

    def _scan(self, url: str) -> frozenset[int]:
        parts = urlsplit(url)
        if parts.hostname is None or not _is_local(parts.hostname):
            return frozenset()
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            connections = psutil.net_connections(kind="tcp")
        except (psutil.AccessDenied, OSError):
            return frozenset()
        listeners = {
            c.pid
            for c in connections
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid is not None
        }
        pids: set[int] = set()
        for pid in listeners:
            try:
                process = psutil.Process(pid)
                pids.add(pid)
                pids.update(child.pid for child in process.children(recursive=True))
            except psutil.Error:
                continue
        return frozenset(pids)
