"""Routing into a real vLLM data-parallel server (vLLM's CPU build, `--data-parallel-size 2`, one core per
engine), started as users start one: `dpserve up --engine-dp --replicas 2`, keyed. Its own router, and
routers started here over the same server (as other routers share it), find its two engines from the
`engine` label of its metrics, route each as a replica of its own (pinned with `X-data-parallel-rank`), read
each engine's KV events at the endpoint's port plus its rank, and keep a repeated prefix on the engine that
caches it, as the engines' own metrics show. One server for the module (it takes most of a minute here)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.up.engine_dp import ENGINE_PROCESS
from tests.integration.conftest import (
    FLEET_START_TIMEOUT_S,
    Fleet,
    RouterProcess,
    bearer,
    router_status,
    running_fleet,
    running_sim,
    start_router,
    stop_router,
    wait_until,
)
from tests.integration.traffic import per_engine, spread_distinct

pytestmark = pytest.mark.integration

SUCCESS = "vllm:request_success_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
ENGINES = ("r0:dp0", "r0:dp1")
REPLICA_KEY = "dp-engines-replica-key"
"""The server's key, given so that this module's own routers and direct clients can use it too (a key
`dpserve up` generates itself is tested in test_tensor_parallel.py)."""


@pytest.fixture(scope="module")
def dp_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("engine-dp")
    up_args = ["--engine-dp", "--replicas", "2", "--cache-dir", str(work / "cache"), "--replica-api-key", REPLICA_KEY]
    # Healthy count 2: the router found both engines of the one server.
    with running_fleet(work, 2, up_args, FLEET_START_TIMEOUT_S, open_replicas=False) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def router(dp_fleet: Fleet) -> Iterator[RouterProcess]:
    """A router of this module's own over the server: one --replica and one --kv-events for it; its engines
    are found, each with its own events."""
    started = _start_router(dp_fleet, [], expect_healthy=2)
    try:
        yield started
    finally:
        stop_router(started)


def _start_router(dp_fleet: Fleet, others: list[str], expect_healthy: int) -> RouterProcess:
    """A kv_aware router over the server (its first replica, with the server's key and KV events) and `others`."""
    server = dp_fleet.replica_urls[0]
    extra = ("--kv-events", f"{server}={dp_fleet.kv_event_endpoints[0]}", "--replica-api-key", REPLICA_KEY)
    return start_router([server, *others], "kv_aware", *extra, expect_healthy=expect_healthy)


def _status(router_url: str) -> dict[str, dict[str, Any]]:
    """The router's replicas by id."""
    return {str(replica["id"]): replica for replica in router_status(router_url)["replicas"]}


def _engines_indexed(router_url: str) -> bool:
    """Whether the router has indexed blocks from each engine's KV events."""
    status = _status(router_url)
    return all(status[engine]["kv_events"]["indexed_blocks"] for engine in ENGINES)


def _engine_processes(dp_fleet: Fleet) -> dict[int, psutil.Process]:
    """The server's engine processes by rank (vLLM titles them `VLLM::EngineCore_DP<rank>`)."""
    engines = {}
    for process in psutil.Process(dp_fleet.process.pid).children(recursive=True):
        match = ENGINE_PROCESS.match(" ".join(process.cmdline()).strip())
        if match:
            engines[int(match.group(1))] = process
    return engines


def _served_since(server: str, name: str, before: dict[str, float]) -> dict[str, float]:
    """How much the server's counter `name` grew on each engine since `before` (`per_engine`'s)."""
    return {engine: count - before.get(engine, 0.0) for engine, count in per_engine(server, name).items()}


def _chat(router: RouterProcess, text: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)


def test_engine_dp_serves_a_chat_through_its_router_with_both_engines_routable(dp_fleet: Fleet) -> None:
    server = dp_fleet.replica_urls[0]
    # Its table (printed once the router is ready): one server, engine r on core r.
    wait_until(lambda: "ready at" in dp_fleet.log_tail(20_000), 30, what="dpserve up's table")
    log = dp_fleet.log_tail(20_000)
    assert "2 data-parallel engines" in log and "cpu:0|1" in log, log
    # Each engine process runs on its own engine's core, as its model worker does (vLLM binds only the worker).
    engines = {
        rank: {os.sched_getaffinity(t.id).pop() for t in process.threads()}
        for rank, process in _engine_processes(dp_fleet).items()
    }
    assert engines == {0: {0}, 1: {1}}, engines
    replicas = _status(dp_fleet.router_url)
    assert sorted(replicas) == list(ENGINES) and all(r["url"] == server and r["healthy"] for r in replicas.values())

    body = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    answer = httpx.post(f"{dp_fleet.router_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] is not None
    # The server is keyed (dpserve up's default): only a client with its key gets through.
    assert httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).status_code == 401

    before = per_engine(server, SUCCESS)
    chosen = spread_distinct(dp_fleet.router_url, body, "its own router")
    assert set(chosen) == set(ENGINES), chosen
    # Each pinned request ran on the engine the router chose, as the engines' own counters show.
    served = _served_since(server, SUCCESS, before)
    assert served == {"0": chosen.count("r0:dp0"), "1": chosen.count("r0:dp1")}, (served, chosen)
    # Each engine's KV events (on the endpoint's port + its rank) reach the router.
    wait_until(lambda: _engines_indexed(dp_fleet.router_url), 20, what="both engines' KV events indexed")


def test_the_servers_engines_are_routed_as_replicas_each_with_its_own_events(
    router: RouterProcess, dp_fleet: Fleet
) -> None:
    server = dp_fleet.replica_urls[0]
    status = _status(router.url)
    assert sorted(status) == list(ENGINES), status
    assert all(replica["url"] == server and replica["healthy"] for replica in status.values())

    before = per_engine(server, SUCCESS)
    spread_distinct(router.url, {"model": TINY_MODEL_NAME, "max_tokens": 8}, "another router")
    served = _served_since(server, SUCCESS, before)
    assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served
    # Each engine's events came on its own port (5557 + rank) and filled the index for that engine.
    wait_until(lambda: _engines_indexed(router.url), 20, what="both engines' KV events indexed")


def test_a_repeated_prefix_goes_to_the_engine_that_caches_it(router: RouterProcess, dp_fleet: Fleet) -> None:
    """The prefix is cached on engine 1 by a client straight at the server; through the router every turn
    then goes to engine 1 too. vLLM alone would send these one-at-a-time requests to engine 0 (its balancer
    breaks ties towards the first engine), so only the router's pinning puts them there."""
    shared = "The shared system prompt of this conversation, which every turn repeats in full. " * 6
    body = {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": f"{shared} Question 0?"}],
        "max_tokens": 2,
    }
    server = dp_fleet.replica_urls[0]
    headers = {"X-data-parallel-rank": "1", **bearer(REPLICA_KEY)}
    direct = httpx.post(f"{server}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert direct.status_code == 200
    wait_until(lambda: _status(router.url)["r0:dp1"]["kv_events"]["indexed_blocks"], 20, what="the blocks indexed")
    before_success, before_hits = per_engine(server, SUCCESS), per_engine(server, PREFIX_HITS)
    for turn in range(1, 6):
        assert _chat(router, f"{shared} Question {turn}?").status_code == 200
    served, hits = _served_since(server, SUCCESS, before_success), _served_since(server, PREFIX_HITS, before_hits)
    assert served.get("1") == 5 and served.get("0", 0) == 0, served
    assert hits.get("1", 0) > 0, hits  # engine 1 served the prefix from its cache


def test_an_engine_that_dies_takes_its_server_out_and_the_share_moves_to_another_replica(dp_fleet: Fleet) -> None:
    """vLLM ends the whole data-parallel server when one engine dies (measured here: the API server stops
    answering within a second). Both engines leave routing at once; the other replica takes every request.
    Runs last: it kills the module's server (`dpserve up` then starts it again, and stops it at the end)."""
    with running_sim("--model", TINY_MODEL_NAME) as sim:
        router = _start_router(dp_fleet, [f"r1={sim.url}"], expect_healthy=3)
        try:
            # This server's engine 1 only: other vLLM servers may run on the machine.
            _engine_processes(dp_fleet)[1].kill()
            wait_until(
                lambda: not any(_status(router.url)[e]["healthy"] for e in ENGINES), 10, 0.1, "both engines ejected"
            )
            before = int(_status(router.url)["r1"]["served_total"])
            for turn in range(10):
                assert _chat(router, f"after the engine died {turn}").status_code == 200
            assert int(_status(router.url)["r1"]["served_total"]) - before == 10
        finally:
            stop_router(router)
