"""Every GPU of the fleet in one view: this host's (NVML, gpu/sampler.py) and other hosts' (their GPU
agents, fleet/agents.py), each tied to the replica it serves, with its health verdict (gpu/health.py).

After each reading the view is rebuilt, and each replica's GPU trouble is written to the registry:
a replica on a degraded GPU is soft-drained by selection (no new requests while another has room). A
replica on several GPUs (`--replica URL@gpu=0,1`, tensor parallel) is drained when any of them is
degraded (its ranks all wait on the sick one), and its GPUs are also read as one (`replica_gpus`).

Tying a GPU to its replica: a hint (`--replica URL@gpu=N|UUID`) first; on this host, the replica's
processes (the sampler does it); on other hosts, the `ADDRESS:PORT`s the agent saw the GPU's process
(or its parent) listen on, matched against the replica's URL (host names resolved to addresses)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dpserve.gpu.combined import ReplicaGpus, combine_gpus
from dpserve.gpu.health import GpuHealthTracker, GpuVerdict
from dpserve.gpu.sample import GpuSample
from dpserve.gpu.sampler import GpuSampler
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.fleet.agents import GpuAgents

TELEMETRY_OFF = "GPU telemetry is off (--gpu-interval 0)"
RESOLVE_TTL_S = 30.0


@dataclass(frozen=True)
class FleetGpu:
    host: str
    """"" for this host; else the host name its agent reports."""
    agent: str | None
    """The agent's URL; None for this host's own GPUs."""
    gpu: GpuSample
    replica: str | None
    verdict: GpuVerdict

    @property
    def key(self) -> str:
        return gpu_key(self.gpu, self.agent)

    @property
    def where(self) -> str:
        return f"GPU {self.gpu.index}" + (f" on {self.host or self.agent}" if self.agent else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.gpu.to_dict(),
            "host": self.host or None,
            "agent": self.agent,
            "replica": self.replica,
            "health": self.verdict.to_dict(),
        }


def gpu_key(gpu: GpuSample, agent: str | None) -> str:
    """Unique across hosts: the GPU's UUID (an agent or NVML that gives none: where it was read)."""
    return gpu.uuid or f"{agent or 'local'}#{gpu.index}"


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GpuFleet:
    def __init__(
        self,
        registry: ReplicaRegistry,
        local: GpuSampler | None,
        agents: GpuAgents | None,
        tracker: GpuHealthTracker,
        act: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`act`: write GPU trouble to the registry (soft-drain); off, it is only shown."""
        self._registry = registry
        self.local = local
        self.agents = agents
        self._tracker = tracker
        self._act = act
        self._clock = clock
        self.devices: tuple[FleetGpu, ...] = ()
        self.degradations: dict[str, int] = {}
        """Replica id -> times it became degraded (a counter for /metrics)."""
        self._addresses: dict[str, tuple[float, tuple[str, ...]]] = {}
        """Replica host name -> (when resolved, its addresses), for matching agents' endpoints."""

    @property
    def enabled(self) -> bool:
        return self.local is not None or self.agents is not None

    async def refresh_remote(self) -> None:
        """After a round of agent polls: learn replica hosts' addresses (off the loop), then rebuild."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        for replica in self._registry:
            host = urlsplit(replica.url).hostname or ""
            if not host or _is_address(host):
                continue
            known = self._addresses.get(host)
            if known is not None and now - known[0] < RESOLVE_TTL_S:
                continue
            try:
                infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
                found = tuple(sorted({str(info[4][0]) for info in infos}))
            except OSError:
                found = known[1] if known else ()
            self._addresses[host] = (now, found)
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the view from the latest readings and apply the verdicts to the registry."""
        now = self._clock()
        placed: list[tuple[str, str | None, GpuSample, str | None]] = []  # host, agent URL, GPU, replica
        if self.local is not None:
            snapshot = self.local.snapshot
            placed += [("", None, gpu, snapshot.replica_of(gpu.index)) for gpu in snapshot.gpus]
        if self.agents is not None:
            by_endpoint, by_hint = self._remote_clues()
            readings = self.agents.readings()
            # An index hint (`@gpu=0`) names a GPU only where there is one host to read (compose).
            hints = by_hint if len(readings) == 1 else {k: v for k, v in by_hint.items() if not k.isdigit()}
            for state, reading in readings:
                for gpu in reading.gpus:
                    placed.append((reading.host, state.url, gpu, _place(gpu, by_endpoint, hints)))
        placed.sort(key=lambda item: (item[0], item[1] or "", item[2].index))  # this host first, then by host
        devices = [
            FleetGpu(host, agent_url, gpu, replica, self._tracker.update(gpu_key(gpu, agent_url), gpu, now))
            for host, agent_url, gpu, replica in placed
        ]
        self._tracker.forget({device.key for device in devices})
        self.devices = tuple(devices)
        self._apply()

    def _remote_clues(self) -> tuple[dict[str, str], dict[str, str]]:
        """`ADDRESS:PORT` -> replica id, and GPU UUID or index (from hints) -> replica id."""
        by_endpoint: dict[str, str] = {}
        by_hint: dict[str, str] = {}
        for replica in self._registry:
            parts = urlsplit(replica.url)
            host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
            addresses = (host,) if _is_address(host) else self._addresses.get(host, (0.0, ()))[1]
            for address in addresses:
                by_endpoint[endpoint(address, port)] = replica.id
            for hint in replica.gpu_hint:
                by_hint[hint] = replica.id
        return by_endpoint, by_hint

    def replica_gpus(self) -> dict[str, ReplicaGpus]:
        """Each replica with GPUs tied to it: their readings combined (gpu/combined.py says how)."""
        samples: dict[str, list[GpuSample]] = {}
        for device in self.devices:
            if device.replica is not None:
                samples.setdefault(device.replica, []).append(device.gpu)
        return {replica: combine_gpus(gpus) for replica, gpus in samples.items()}

    def _apply(self) -> None:
        reasons: dict[str, list[str]] = {}
        for device in self.devices:
            if device.replica is not None and device.verdict.degraded:
                reasons.setdefault(device.replica, []).extend(f"{device.where}: {r}" for r in device.verdict.reasons)
        for replica in self._registry:
            wanted = tuple(reasons.get(replica.id, ())) if self._act else ()
            if self._registry.set_degraded(replica.id, wanted) and wanted:
                self.degradations[replica.id] = self.degradations.get(replica.id, 0) + 1

    def status(self) -> dict[str, Any]:
        if not self.enabled:
            return {"available": False, "reason": TELEMETRY_OFF, "devices": [], "agents": []}
        reason = None
        sampled_at = None
        if self.local is not None:
            reason, sampled_at = self.local.snapshot.unavailable, self.local.snapshot.taken_at
        agents = [agent.to_dict() for agent in self.agents.agents.values()] if self.agents is not None else []
        if not self.devices and self.agents is not None and self.local is None:
            reason = "no GPU agent has answered with a GPU yet"
        return {
            "available": bool(self.devices),
            "reason": None if self.devices else reason,
            "sampled_at": sampled_at,
            "devices": [device.to_dict() for device in self.devices],
            "agents": agents,
        }


def _place(gpu: GpuSample, by_endpoint: dict[str, str], by_hint: dict[str, str]) -> str | None:
    """A hint first (UUID, then index), then the process listening on a replica's address."""
    for hint in (gpu.uuid, str(gpu.index)):
        if hint in by_hint:
            return by_hint[hint]
    for process in gpu.processes:
        for listen in process.listens:
            if listen in by_endpoint:
                return by_endpoint[listen]
    return None


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
