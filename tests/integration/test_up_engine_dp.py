"""`dpserve up --engine-dp --replicas 2` on vLLM's CPU build: one `vllm serve --data-parallel-size 2` (one core
per engine), keyed as by default, and its router routing each engine as a replica of its own. One start for
the module (about 2 minutes here)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import psutil
import pytest

from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.up.engine_dp import ENGINE_PROCESS
from tests.integration.conftest import FLEET_START_TIMEOUT_S, Fleet, router_status, running_fleet, wait_until
from tests.integration.traffic import per_engine, spread_distinct

pytestmark = pytest.mark.integration

ENGINES = ["r0:dp0", "r0:dp1"]
SUCCESS = "vllm:request_success_total"


@pytest.fixture(scope="module")
def dp_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("engine-dp")
    up_args = ["--engine-dp", "--replicas", "2", "--cache-dir", str(work / "cache")]
    # Healthy count 2: the router found both engines of the one server.
    with running_fleet(work, 2, up_args, FLEET_START_TIMEOUT_S, open_replicas=False) as fleet:
        yield fleet


def test_engine_dp_serves_a_chat_through_its_router_with_both_engines_routable(dp_fleet: Fleet) -> None:
    server = dp_fleet.replica_urls[0]
    # Its table (printed once the router is ready): one server, engine r on core r.
    wait_until(lambda: "ready at" in dp_fleet.log_tail(20_000), 30, what="dpserve up's table")
    log = dp_fleet.log_tail(20_000)
    assert "2 data-parallel engines" in log and "cpu:0|1" in log, log
    # Each engine process runs on its own engine's core, as its model worker does (vLLM binds only the worker).
    engines = {}
    for process in psutil.Process(dp_fleet.process.pid).children(recursive=True):
        match = ENGINE_PROCESS.match(" ".join(process.cmdline()).strip())
        if match:
            engines[int(match.group(1))] = {os.sched_getaffinity(t.id).pop() for t in process.threads()}
    assert engines == {0: {0}, 1: {1}}, engines
    replicas = {str(r["id"]): r for r in router_status(dp_fleet.router_url)["replicas"]}
    assert sorted(replicas) == ENGINES and all(r["url"] == server and r["healthy"] for r in replicas.values())

    body = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    answer = httpx.post(f"{dp_fleet.router_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] is not None
    # The server is keyed (dpserve up's default): only its router gets through.
    assert httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).status_code == 401

    before = per_engine(server, SUCCESS)
    chosen = spread_distinct(dp_fleet.router_url, body)
    assert set(chosen) == set(ENGINES), chosen
    # Each pinned request ran on the engine the router chose, as the engines' own counters show.
    after = per_engine(server, SUCCESS)
    served = {engine: after[engine] - before.get(engine, 0.0) for engine in after}
    assert served == {"0": chosen.count("r0:dp0"), "1": chosen.count("r0:dp1")}, (served, chosen)
    # Each engine's KV events (on the endpoint's port + its rank) reach the router.
    wait_until(
        lambda: all(
            r["kv_events"]["indexed_blocks"]
            for r in router_status(dp_fleet.router_url)["replicas"]
            if r["id"] in ENGINES
        ),
        20,
        what="both engines' KV events indexed",
    )
