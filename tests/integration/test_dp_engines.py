"""Routing into a real vLLM data-parallel server (vLLM's CPU build, `--data-parallel-size 2`, one core per
engine): the router finds its two engines from the `engine` label of its metrics, routes each as a replica
of its own (pinned with `X-data-parallel-rank`), reads each engine's KV events at the endpoint's port plus
its rank, and keeps a repeated prefix on the engine that caches it, as the engines' own metrics show."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dpserve.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
from dpserve.up.plan import VLLM_SERVER_MODULE, vllm_engine_flags
from tests.conftest import free_port
from tests.integration.conftest import (
    FLEET_START_TIMEOUT_S,
    VLLM_TEST_FLAGS,
    RouterProcess,
    running_sim,
    start_router,
    stop_process,
    stop_router,
    wait_until,
)
from tests.integration.traffic import per_engine, spread_distinct

pytestmark = pytest.mark.integration

SUCCESS = "vllm:request_success_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
ENGINES = ("r0:dp0", "r0:dp1")


@dataclass(frozen=True)
class DpServer:
    url: str
    kv_endpoint: str
    log: Path
    pid: int


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DpServer]:
    work = tmp_path_factory.mktemp("dp")
    model = ensure_tiny_model(work / "cache")
    port, kv_port, rpc_port = free_port(), free_port(), free_port()
    command = [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", str(model), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--data-parallel-size", "2", "--data-parallel-rpc-port", str(rpc_port)]
    # The engine flags every replica dpserve starts gets: prefix caching, KV events (each engine on kv_port
    # plus its rank), cached-token counts.
    command += vllm_engine_flags(TINY_MODEL_NAME, kv_port, 512, VLLM_TEST_FLAGS)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    log_path = work / "vllm.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + FLEET_START_TIMEOUT_S
        while not _answers(f"{url}/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the vLLM data-parallel server did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield DpServer(url, f"tcp://127.0.0.1:{kv_port}", log_path, process.pid)
    finally:
        stop_process(process, 60)


@pytest.fixture(scope="module")
def router(dp_server: DpServer) -> Iterator[RouterProcess]:
    # One --replica and one --kv-events for the server: its engines are found, each with its own events.
    kv = f"{dp_server.url}={dp_server.kv_endpoint}"
    started = start_router([dp_server.url], "kv_aware", "--kv-events", kv, expect_healthy=2)
    try:
        yield started
    finally:
        stop_router(started)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _status(router: RouterProcess) -> dict[str, dict[str, object]]:
    replicas = httpx.get(f"{router.url}/status", timeout=10).json()["replicas"]
    return {str(replica["id"]): replica for replica in replicas}


def _chat(router: RouterProcess, text: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)


def test_the_servers_engines_are_routed_as_replicas_each_with_its_own_events(
    router: RouterProcess, dp_server: DpServer
) -> None:
    status = _status(router)
    assert sorted(status) == list(ENGINES), status
    assert all(replica["url"] == dp_server.url and replica["healthy"] for replica in status.values())

    before = per_engine(dp_server.url, SUCCESS)
    spread_distinct(router.url, {"model": TINY_MODEL_NAME, "max_tokens": 8})
    served = {engine: count - before.get(engine, 0.0) for engine, count in per_engine(dp_server.url, SUCCESS).items()}
    assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served
    # Each engine's events came on its own port (5557 + rank) and filled the index for that engine.
    wait_until(
        lambda: all(_status(router)[e]["kv_events"]["indexed_blocks"] for e in ENGINES),  # type: ignore[index]
        20,
        what="both engines' KV events indexed",
    )


def test_a_repeated_prefix_goes_to_the_engine_that_caches_it(router: RouterProcess, dp_server: DpServer) -> None:
    """The prefix is cached on engine 1 by a client straight at the server; through the router every turn
    then goes to engine 1 too. vLLM alone would send these one-at-a-time requests to engine 0 (its balancer
    breaks ties towards the first engine), so only the router's pinning puts them there."""
    shared = "The shared system prompt of this conversation, which every turn repeats in full. " * 6
    body = {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": f"{shared} Question 0?"}],
        "max_tokens": 2,
    }
    direct = httpx.post(
        f"{dp_server.url}/v1/chat/completions", json=body, headers={"X-data-parallel-rank": "1"}, timeout=60
    )
    assert direct.status_code == 200
    wait_until(lambda: _status(router)["r0:dp1"]["kv_events"]["indexed_blocks"], 20, what="the blocks indexed")  # type: ignore[index]
    before_success, before_hits = per_engine(dp_server.url, SUCCESS), per_engine(dp_server.url, PREFIX_HITS)
    for turn in range(1, 6):
        assert _chat(router, f"{shared} Question {turn}?").status_code == 200
    served = {e: n - before_success.get(e, 0.0) for e, n in per_engine(dp_server.url, SUCCESS).items()}
    hits = {e: n - before_hits.get(e, 0.0) for e, n in per_engine(dp_server.url, PREFIX_HITS).items()}
    assert served.get("1") == 5 and served.get("0", 0) == 0, served
    assert hits.get("1", 0) > 0, hits  # engine 1 served the prefix from its cache


def test_an_engine_that_dies_takes_its_server_out_and_the_share_moves_to_another_replica(dp_server: DpServer) -> None:
    """vLLM ends the whole data-parallel server when one engine dies (measured here: the API server stops
    answering within a second). Both engines leave routing at once; the other replica takes every request.
    Runs last: it kills the module's server."""
    import psutil

    with running_sim("--model", TINY_MODEL_NAME) as sim:
        kv = f"{dp_server.url}={dp_server.kv_endpoint}"
        router = start_router([dp_server.url, f"r1={sim.url}"], "kv_aware", "--kv-events", kv, expect_healthy=3)
        try:
            # This server's engine 1 only: other vLLM servers may run on the machine.
            children = psutil.Process(dp_server.pid).children(recursive=True)
            next(child for child in children if child.name() == "VLLM::EngineCore_DP1").kill()
            wait_until(lambda: not any(_status(router)[e]["healthy"] for e in ENGINES), 10, 0.1, "both engines ejected")
            before = int(_status(router)["r1"]["served_total"])  # type: ignore[call-overload]
            for turn in range(10):
                assert _chat(router, f"after the engine died {turn}").status_code == 200
            assert int(_status(router)["r1"]["served_total"]) - before == 10  # type: ignore[call-overload]
        finally:
            stop_router(router)
