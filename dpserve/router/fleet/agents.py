"""The GPUs of other hosts: each host's `dpserve agent` polled for its NVML reading (GET /gpus).

Agents are given by URL (`--gpu-agent`) or found by DNS (`--discover-agents dns:NAME:PORT`, e.g. a
Kubernetes headless Service in front of the agent DaemonSet). A reading older than `STALE_POLLS`
intervals is dropped: its GPUs leave the fleet view rather than stand for a host that went quiet."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from dpserve.background import cancel_and_wait
from dpserve.gpu.sample import GpuSample
from dpserve.replicas.discovery import DiscoveryError, DiscoverySource, DnsResolver

log = logging.getLogger("dpserve.gpu_agents")

AGENT_PATH = "/gpus"
STALE_POLLS = 3
MAX_POLL_TIMEOUT_S = 5.0


class AgentReadingError(ValueError):
    """An agent answered, but not with a GPU reading."""


@dataclass(frozen=True)
class AgentReading:
    host: str
    """The agent's host name, as it reports it."""
    gpus: tuple[GpuSample, ...]
    unavailable: str | None
    """The agent's own `no NVIDIA GPU found: ...` line, when it has nothing to read."""
    taken_at: float | None


def parse_reading(data: Any) -> AgentReading:
    """An agent's /gpus JSON; AgentReadingError saying what is wrong otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise AgentReadingError("expected an object with a `gpus` list")
    try:
        gpus = tuple(GpuSample.from_dict(item) for item in data["gpus"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AgentReadingError(f"a malformed GPU reading: {exc}") from exc
    unavailable = data.get("unavailable")
    taken_at = data.get("taken_at")
    return AgentReading(
        host=str(data.get("host") or ""),
        gpus=gpus,
        unavailable=None if unavailable is None else str(unavailable),
        taken_at=float(taken_at) if isinstance(taken_at, (int, float)) else None,
    )


@dataclass
class AgentState:
    url: str
    found_by: str | None = None
    """The discovery source that found it; None for a `--gpu-agent` URL."""
    reading: AgentReading | None = None
    error: str | None = None
    """Why the last poll failed; None after a good one."""
    read_at: float | None = None
    """time.time() of the last good poll."""
    failures: int = 0

    def to_dict(self) -> dict[str, Any]:
        reading = self.reading
        return {
            "url": self.url,
            "found_by": self.found_by,
            "host": reading.host if reading else None,
            "gpus": len(reading.gpus) if reading else 0,
            "unavailable": reading.unavailable if reading else None,
            "error": self.error,
            "read_at": self.read_at,
            "failures": self.failures,
        }


@dataclass
class GpuAgents:
    urls: Sequence[str]
    sources: Sequence[DiscoverySource]
    resolver: DnsResolver | None
    interval_s: float
    discover_interval_s: float
    on_update: Callable[[], Awaitable[None]] | None = None
    """Awaited after each round of polls (the router rebuilds its GPU view)."""
    clock: Callable[[], float] = time.time
    agents: dict[str, AgentState] = field(default_factory=dict)
    _resolved_at: float | None = None
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        for url in self.urls:
            self.agents[url.rstrip("/")] = AgentState(url.rstrip("/"))

    def readings(self) -> list[tuple[AgentState, AgentReading]]:
        """Fresh readings only: an agent silent for `STALE_POLLS` intervals counts as gone."""
        now, limit = self.clock(), self.interval_s * STALE_POLLS
        return [
            (agent, agent.reading)
            for agent in self.agents.values()
            if agent.reading is not None and agent.read_at is not None and now - agent.read_at <= limit
        ]

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        await self._discover()
        agents = list(self.agents.values())
        await asyncio.gather(*(self._poll(session, agent) for agent in agents))
        if self.on_update is not None:
            await self.on_update()

    async def _discover(self) -> None:
        if not self.sources or self.resolver is None:
            return
        now = self.clock()
        if self._resolved_at is not None and now - self._resolved_at < self.discover_interval_s:
            return
        self._resolved_at = now
        for source in self.sources:
            try:
                urls = await self.resolver.replica_urls(source)
            except DiscoveryError as exc:  # keep what was found: DNS hiccups must not blind the router
                log.warning("GPU agents: %s: %s", source, exc)
                continue
            for url in urls:
                if url not in self.agents:
                    log.info("GPU agent %s found by %s", url, source)
                    self.agents[url] = AgentState(url, found_by=str(source))
            for url in [u for u, a in self.agents.items() if a.found_by == str(source) and u not in urls]:
                log.info("GPU agent %s is gone from %s", url, source)
                del self.agents[url]

    async def _poll(self, session: aiohttp.ClientSession, agent: AgentState) -> None:
        timeout = aiohttp.ClientTimeout(total=min(MAX_POLL_TIMEOUT_S, max(self.interval_s * 2, 1.0)))
        try:
            async with session.get(agent.url + AGENT_PATH, timeout=timeout) as response:
                if response.status != 200:
                    raise AgentReadingError(f"HTTP {response.status}")
                reading = parse_reading(await response.json(content_type=None))
        except (TimeoutError, aiohttp.ClientError, AgentReadingError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if agent.error != error:
                log.warning("GPU agent %s: %s", agent.url, error)
            agent.error = error
            agent.failures += 1
            return
        if agent.error is not None or agent.reading is None:
            log.info("GPU agent %s (%s): %d GPU(s)", agent.url, reading.host or "?", len(reading.gpus))
        agent.reading, agent.error, agent.read_at = reading, None, self.clock()

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._run(session), name="gpu-agents")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.poll_once(session)
            except Exception:  # one bad round must not end polling
                log.exception("polling GPU agents failed")
            await asyncio.sleep(self.interval_s)
