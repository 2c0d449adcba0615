"""`dpserve sim --count N`: N independent replicas in one process, one ASGI app handing each connection to the
replica that owns its local port; each replica with its own cache, metrics, seeds and KV-event endpoints."""

from __future__ import annotations

import resource
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from dpserve.config import SimSettings
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.sim.fleet import Fleet, FleetError, bind_ports, build_fleet, ensure_fds, port_span
from dpserve.sim.kv_publisher import KvEventBindError
from dpserve.sim.replica import build_simulator
from tests.conftest import free_port_range

PROMPT = " ".join(f"word{i}" for i in range(80))


def count_settings(count: int, port: int, **overrides: Any) -> SimSettings:
    base: dict[str, Any] = {"sim_speed": 0, "sim_num_blocks": 64, "port": port, "sim_count": count}
    return SimSettings(**{**base, **overrides})


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    built = build_fleet(count_settings(3, free_port_range(3)))
    try:
        yield built
    finally:
        built.close()


@pytest.fixture
async def clients(fleet: Fleet) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One client per replica: the ASGI scope's server port is the URL's, as uvicorn sets it from the socket."""
    opened = [
        httpx.AsyncClient(transport=httpx.ASGITransport(app=fleet), base_url=f"http://127.0.0.1:{port}")
        for port in fleet.ports
    ]
    try:
        yield opened
    finally:
        for client in opened:
            await client.aclose()


async def cached_tokens(client: httpx.AsyncClient) -> int:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    tokens: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


async def hits(client: httpx.AsyncClient) -> float:
    samples = parse_samples((await client.get("/metrics")).text, {"vllm:prefix_cache_hits_total"})
    return sum(value for _, value in samples.by_name["vllm:prefix_cache_hits_total"])


def test_the_replicas_listen_on_consecutive_ports(fleet: Fleet) -> None:
    first = fleet.ports[0]
    assert fleet.ports == [first, first + 1, first + 2]
    assert port_span(fleet.ports) == f"{first}..{first + 2}"
    assert port_span([5, 9]) == "5,9"


async def test_each_replica_answers_on_its_own_port_with_its_own_cache_and_metrics(
    clients: list[httpx.AsyncClient],
) -> None:
    for client in clients:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "dpserve-tiny"
    assert await cached_tokens(clients[1]) == 0
    assert await cached_tokens(clients[1]) > 0  # replica 1 cached the prompt
    assert await cached_tokens(clients[2]) == 0  # replica 2 has a cache of its own
    assert [await hits(client) for client in clients][0::2] == [0, 0]
    assert await hits(clients[1]) > 0


async def test_each_replica_draws_from_its_own_seed(clients: list[httpx.AsyncClient], fleet: Fleet) -> None:
    """Replica 0 is seeded as a lone sim is; the others from the seed plus their index."""
    body = {"prompt": "same", "max_tokens": 12}
    texts = [(await client.post("/v1/completions", json=body)).json()["choices"][0]["text"] for client in clients]
    lone = build_simulator(count_settings(1, 0))
    transport = httpx.ASGITransport(app=lone.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as http:
        alone = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    assert texts[0] == alone
    assert len(set(texts)) == 3


def test_replica_i_publishes_engine_r_on_the_kv_port_plus_i_times_engines_plus_r() -> None:
    port, kv_port = free_port_range(3), free_port_range(6, start=40000)
    settings = count_settings(3, port, sim_kv_events=f"tcp://127.0.0.1:{kv_port}", sim_data_parallel_size=2)
    built = build_fleet(settings)
    try:
        endpoints = [[p.endpoint for p in simulator.publishers] for simulator in built.simulators]
        assert endpoints == [[f"tcp://127.0.0.1:{kv_port + 2 * index + rank}" for rank in (0, 1)] for index in range(3)]
        assert [engine._rng.random() for s in built.simulators for engine in s.api.engines.engines] == [
            build_simulator(count_settings(1, 0, sim_seed=seed)).api.engine._rng.random() for seed in range(6)
        ]
    finally:
        built.close()


def test_a_port_in_use_is_named_and_nothing_stays_bound() -> None:
    port = free_port_range(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))
        with pytest.raises(FleetError, match=f"port {port + 2} \\(replica 2 of 3\\) on 127.0.0.1 is already in use"):
            build_fleet(count_settings(3, port))
    bind_ports("127.0.0.1", port, 3)[0].close()  # the two it had bound are free again


def test_a_kv_events_port_in_use_is_named_and_the_http_ports_are_released() -> None:
    port, kv_port = free_port_range(2), free_port_range(2, start=40000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", kv_port + 1))
        taken.listen()
        settings = count_settings(2, port, sim_kv_events=f"tcp://127.0.0.1:{kv_port}")
        with pytest.raises(KvEventBindError, match=f"cannot bind tcp://127.0.0.1:{kv_port + 1}"):
            build_fleet(settings)
    for sock in bind_ports("127.0.0.1", port, 2):
        sock.close()


def test_count_must_be_positive_and_fit_below_port_65536() -> None:
    with pytest.raises(ValueError, match="--count 0"):
        SimSettings(sim_count=0)
    with pytest.raises(ValueError, match="ports past 65535"):
        SimSettings(port=65000, sim_count=1000)
    assert SimSettings(port=0, sim_count=1000).sim_count == 1000  # port 0: the OS picks each


def test_the_open_files_limit_is_raised_to_what_the_fleet_needs_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    ensure_fds(1000)
    assert calls == []
    ensure_fds(3000)
    assert calls == [(3000, 4096)]
    with pytest.raises(FleetError, match="5000 file descriptors needed, the hard limit is 4096"):
        ensure_fds(5000)
