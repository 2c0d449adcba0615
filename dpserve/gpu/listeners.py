"""What a GPU process is reachable at, read from /proc: the TCP ports it or its parents listen on, in
its own network namespace (a container's or pod's), with wildcard binds spelled out as that
namespace's addresses; and the container or pod it runs in. A GPU agent on each host tells the router
this, so the router can tie a GPU to the replica URL it routes to.

Linux only; a process that is gone or cannot be read (another user's, without root) yields nothing.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

LISTEN = "0A"  # the TCP state code in /proc/net/tcp
WILDCARDS = ("0.0.0.0", "::")
MAX_PARENTS = 8
"""How far up to look for the listening process (vLLM: API server -> engine core; a container's init)."""
_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True)
class Reachable:
    listens: tuple[str, ...] = ()
    container: str | None = None
    pod: str | None = None


def reachable(pid: int, proc: Path = Path("/proc")) -> Reachable:
    """Where the process `pid` (or the nearest parent that listens) takes connections."""
    chain = [pid]
    try:
        chain += [parent.pid for parent in psutil.Process(pid).parents()[:MAX_PARENTS] if parent.pid > 1]
    except psutil.Error:
        pass
    # The kernel writes a namespace's whole socket table on each read of /proc/PID/net/tcp (ms on a busy
    # host), and the chain mostly shares one namespace: one read per namespace, for all members' sockets.
    by_namespace: dict[str, tuple[int, set[str]]] = {}
    for member in chain:
        inodes = socket_inodes(member, proc)
        if inodes:
            by_namespace.setdefault(_net_namespace(member, proc), (member, set()))[1].update(inodes)
    listens: list[str] = []
    for member, inodes in by_namespace.values():
        for endpoint in listening(member, inodes, proc):
            if endpoint not in listens:
                listens.append(endpoint)
    container, pod = cgroup_identity(pid, proc)
    return Reachable(tuple(listens), container, pod)


def _net_namespace(pid: int, proc: Path) -> str:
    try:
        return os.readlink(proc / str(pid) / "ns" / "net")
    except OSError:  # unreadable: the process stands for its own
        return f"pid:{pid}"


def listening(pid: int, inodes: set[str], proc: Path = Path("/proc")) -> list[str]:
    """`ADDRESS:PORT` for each TCP socket among `inodes` that listens, as seen in `pid`'s network
    namespace (IPv6 as `[ADDR]:PORT`), wildcards expanded to the namespace's addresses."""
    found: list[str] = []
    local: list[str] | None = None
    for table, v6 in (("tcp", False), ("tcp6", True)):
        for address, port in _listen_sockets(proc / str(pid) / "net" / table, v6, inodes):
            if address in WILDCARDS:
                if local is None:
                    local = namespace_addresses(pid, proc)
                addresses = [a for a in local if (":" in a) == v6 or address == "::"]
            else:
                addresses = [address]
            for a in addresses:
                endpoint = f"[{a}]:{port}" if ":" in a else f"{a}:{port}"
                if endpoint not in found:
                    found.append(endpoint)
    return found


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[str]:
    inodes: set[str] = set()
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:  # gone, or another user's (the agent runs as root where it must see them all)
        return inodes
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listen_sockets(path: Path, v6: bool, inodes: set[str]) -> Iterator[tuple[str, int]]:
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return
    for line in lines:
        parts = line.split()
        if len(parts) < 10 or parts[3] != LISTEN or parts[9] not in inodes:
            continue
        hex_address, hex_port = parts[1].split(":")
        yield _decode(hex_address, v6), int(hex_port, 16)


def _decode(hex_address: str, v6: bool) -> str:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words))


def namespace_addresses(pid: int, proc: Path = Path("/proc")) -> list[str]:
    """The addresses of the network namespace `pid` runs in: a wildcard bind listens on each."""
    found: list[str] = []
    try:
        trie = (proc / str(pid) / "net" / "fib_trie").read_text().splitlines()
    except OSError:
        trie = []
    last = ""
    for line in trie:
        text = line.strip()
        if text.startswith("|--"):
            last = text.split()[-1]
        elif text == "/32 host LOCAL" and last and last not in found:
            found.append(last)
    try:
        for line in (proc / str(pid) / "net" / "if_inet6").read_text().splitlines():
            hex_address = line.split()[0]
            address = str(ipaddress.IPv6Address(bytes.fromhex(hex_address)))
            if address not in found:
                found.append(address)
    except (OSError, ValueError, IndexError):
        pass
    return found


def cgroup_identity(pid: int, proc: Path = Path("/proc")) -> tuple[str | None, str | None]:
    """(container id, pod UID) from the process's cgroup path, each None where it is not in one."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None, None
    container = _CONTAINER_ID.search(text)
    pod = _POD_UID.search(text)
    return (
        container.group(1) if container else None,
        pod.group(1).replace("_", "-") if pod else None,
    )
