"""Replicas found by DNS: what `--discover` names, and the replica URLs a name resolves to right now.

`dns:NAME:PORT`: every A and AAAA address of NAME is a replica at PORT (a scaled compose service, a
Kubernetes headless Service). `srv:_service._proto.NAME`: every SRV record's target and port (Consul,
Kubernetes named ports), targets resolved to their addresses. The resolver is dnspython's: it reads the
system's resolv.conf (Docker's embedded DNS inside a container) unless given a nameserver, and does SRV.
Measured against dnsmasq here (benchmarks/resolver.py): 0.65 ms of CPU per A+AAAA lookup, aiodns 0.15 ms;
at one lookup per interval (refusals debounced to two a second at most) either is under 0.2% of a core, so
the pure-Python, typed one won over a C extension in the router's image."""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

LOOKUP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class DiscoverySource:
    kind: str  # "dns" or "srv"
    name: str
    port: int | None = None  # dns: the replicas' port; srv: from each record

    def __str__(self) -> str:
        return f"dns:{self.name}:{self.port}" if self.kind == "dns" else f"srv:{self.name}"


def parse_discovery_source(text: str, flag: str = "--discover") -> DiscoverySource:
    """`dns:NAME:PORT` or `srv:_service._proto.NAME`; ValueError saying what is wrong otherwise."""
    kind, _, rest = text.strip().partition(":")
    if kind == "dns":
        name, _, port = rest.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{flag} {text!r}: expected dns:NAME:PORT, e.g. dns:vllm:8000")
        _check_name(text, name, flag)
        return DiscoverySource("dns", name.rstrip("."), int(port))
    if kind == "srv":
        labels = rest.split(".")
        if len(labels) < 3 or not labels[0].startswith("_") or not labels[1].startswith("_"):
            raise ValueError(f"{flag} {text!r}: expected srv:_service._proto.NAME, e.g. srv:_vllm._tcp.example")
        _check_name(text, rest, flag)
        return DiscoverySource("srv", rest.rstrip("."))
    raise ValueError(f"{flag} {text!r}: expected dns:NAME:PORT or srv:_service._proto.NAME")


def _check_name(text: str, name: str, flag: str) -> None:
    if any(char.isspace() or char in "/@?#[]" for char in name) or ".." in name or len(name) > 253:
        raise ValueError(f"{flag} {text!r}: {name!r} is not a DNS name")


def replica_url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


class DiscoveryError(Exception):
    """A lookup that gave no usable answer (timeout, SERVFAIL, NXDOMAIN, no records)."""


class DnsResolver:
    """Async lookups through dnspython. `nameserver` (`HOST` or `HOST:PORT`) overrides resolv.conf."""

    def __init__(self, nameserver: str | None = None, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        if nameserver:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            host, port = split_nameserver(nameserver)
            self._resolver.nameservers = [host]
            self._resolver.port = port
        else:
            self._resolver = dns.asyncresolver.Resolver()
        self._resolver.lifetime = timeout_s
        self._resolver.timeout = timeout_s

    async def replica_urls(self, source: DiscoverySource) -> frozenset[str]:
        """The replicas `source` names now; DiscoveryError when it names none or cannot be read."""
        if source.kind == "dns":
            assert source.port is not None
            return frozenset(replica_url(address, source.port) for address in await self.addresses(source.name))
        try:
            answer = await self._resolver.resolve(source.name, "SRV")
        except (dns.exception.DNSException, OSError) as exc:
            raise DiscoveryError(_describe(exc)) from None
        targets = {(record.target.to_text().rstrip("."), int(record.port)) for record in answer}
        found = await asyncio.gather(*(self.addresses(host) for host, _ in targets), return_exceptions=True)
        urls = {
            replica_url(address, port)
            for (_, port), addresses in zip(targets, found, strict=True)
            if not isinstance(addresses, BaseException)
            for address in addresses
        }
        if not urls:
            raise DiscoveryError(f"no SRV target of {source.name} resolves to an address")
        return frozenset(urls)

    async def addresses(self, name: str) -> set[str]:
        """A and AAAA, asked together: either may be empty, both empty is an error."""
        answers = await asyncio.gather(
            self._resolver.resolve(name, "A"), self._resolver.resolve(name, "AAAA"), return_exceptions=True
        )
        found: set[str] = set()
        errors: list[str] = []
        for answer in answers:
            if isinstance(answer, dns.resolver.NoAnswer):
                continue  # the name exists, without records of this type
            if isinstance(answer, dns.exception.DNSException | OSError):
                errors.append(_describe(answer))
            elif isinstance(answer, BaseException):
                raise answer
            else:
                found.update(record.address for record in answer)
        if not found:
            raise DiscoveryError(errors[0] if errors else f"{name} has no A or AAAA records")
        return found


def split_nameserver(text: str) -> tuple[str, int]:
    """`HOST`, `HOST:PORT` or `[V6]:PORT` (an address: the server is what resolves names); ValueError else."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
        host, port = host.rstrip("]"), port or "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"--discover-nameserver {text!r}: expected an IP address, optionally with :PORT") from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--discover-nameserver {text!r}: {port!r} is not a port")
    return host, int(port)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, dns.resolver.NXDOMAIN):
        return "NXDOMAIN: no such name"
    if isinstance(exc, dns.resolver.LifetimeTimeout | dns.exception.Timeout):
        return "timed out: no answer from the DNS server"
    if isinstance(exc, dns.resolver.NoNameservers):
        return "no nameserver answered (SERVFAIL or refused)"
    return f"{type(exc).__name__}: {exc}"
