"""16 simulator replicas behind the router (`dpserve up --sim 16`): every request served, none lost, load
spread over all of them, and each sim's metrics and KV events reaching the outside."""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import pytest
import zmq

from dpserve.replicas.prometheus_text import parse_samples
from tests.conftest import free_port_range
from tests.integration.conftest import (
    Fleet,
    healthy_count,
    router_status,
    running_fleet,
    running_sim,
    start_router,
    stop_process,
    stop_router,
    wait_until,
)

pytestmark = pytest.mark.integration

SIMS = 16
REQUESTS = 480
CONCURRENCY = 64


@pytest.fixture(scope="module")
def sim_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work: Path = tmp_path_factory.mktemp("sim-fleet")
    # least_loaded, not the default kv_aware: this fleet test checks that every replica takes a share
    # (kv_aware would rightly keep each of the 8 shared prompts on one sim; see test_kv_routing.py).
    args = ["--sim", str(SIMS), "--policy", "least_loaded", "--", "--decode-ms-per-token", "2", "--max-num-seqs", "8"]
    with running_fleet(work, SIMS, args, timeout_s=120) as fleet:
        yield fleet


def body_for(index: int) -> tuple[str, dict[str, Any]]:
    # Eight shared system prompts, so prefixes repeat; alternating endpoints and streaming.
    system = f"System prompt number {index % 8}. " * 20
    if index % 2:
        return "/v1/completions", {"prompt": system + f"question {index}", "max_tokens": 6, "stream": index % 4 == 1}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {index}"}]
    return "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "stream": index % 4 == 0}


async def send_all(router_url: str) -> tuple[collections.Counter[str], list[str]]:
    served: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)

    async with httpx.AsyncClient(base_url=router_url, timeout=60, limits=limits) as client:

        async def one(index: int) -> None:
            path, body = body_for(index)
            async with gate:
                try:
                    response = await client.post(path, json={"model": "dpserve-tiny", **body})
                except httpx.TransportError as exc:
                    failures.append(f"{index} {path} stream={body['stream']}: {exc!r}")
                    return
            if response.status_code != 200:
                failures.append(f"{index}: {response.status_code} {response.text[:200]}")
                return
            if body["stream"]:
                frames = [f for f in response.text.split("\n\n") if f]
                tokens = [orjson.loads(f[6:]) for f in frames[:-1] if orjson.loads(f[6:])["choices"]]
                finished = tokens[-1]["choices"][0]["finish_reason"] if tokens else None
                if frames[-1] != "data: [DONE]" or finished != "length":
                    failures.append(f"{index}: broken stream {response.text[-200:]!r}")
                    return
            elif response.json()["usage"]["completion_tokens"] != 6:
                failures.append(f"{index}: wrong usage {response.text[:200]}")
                return
            served[response.headers["x-dpserve-replica"]] += 1

        await asyncio.gather(*(one(index) for index in range(REQUESTS)))
    return served, failures


def replica_counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return parse_samples(text, {name}).total(name) or 0.0


def test_sixteen_sims_behind_the_router_serve_everything(sim_fleet: Fleet) -> None:
    status = router_status(sim_fleet.router_url)
    assert len(status["replicas"]) == SIMS
    assert all(r["healthy"] and r["block_size"] == 16 for r in status["replicas"])
    before = sum(replica_counter(url, "vllm:request_success_total") for url in sim_fleet.replica_urls)

    started = time.monotonic()
    served, failures = asyncio.run(send_all(sim_fleet.router_url))
    elapsed = time.monotonic() - started
    print(f"{REQUESTS} requests over {SIMS} sims in {elapsed:.1f}s; per replica: {dict(sorted(served.items()))}")

    assert failures == []
    assert sum(served.values()) == REQUESTS
    assert set(served) == {f"r{i}" for i in range(SIMS)}, "least_loaded left a replica idle"
    after = sum(replica_counter(url, "vllm:request_success_total") for url in sim_fleet.replica_urls)
    assert after - before == REQUESTS, "the sims finished a different number of requests than the router sent"
    hits = sum(replica_counter(url, "vllm:prefix_cache_hits_total") for url in sim_fleet.replica_urls)
    assert hits > 0, "repeated system prompts never hit a sim's prefix cache"


def test_every_sim_publishes_kv_events_where_dpserve_up_says(sim_fleet: Fleet) -> None:
    context = zmq.Context.instance()
    sockets = []
    for endpoint in sim_fleet.kv_event_endpoints:
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        sockets.append(socket)
    try:
        stored: collections.Counter[int] = collections.Counter()
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=30) as client:
            # Direct to each sim, a prompt of its own: each must store new blocks and say so. ZMQ's slow joiner
            # drops what a publisher sends before the subscription reaches it: a sim not heard from yet gets
            # another new prompt, until each is heard or the deadline passes.
            attempt = 0
            while len(stored) < SIMS and time.monotonic() < deadline:
                attempt += 1
                for index, url in enumerate(sim_fleet.replica_urls):
                    if index in stored:
                        continue
                    prompt = f"A prompt only replica {index} ever sees ({attempt}), long enough to fill blocks. " * 6
                    response = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                    assert response.status_code == 200
                for index, socket in enumerate(sockets):
                    while socket.poll(0 if index in stored else 200):
                        _, _, payload = socket.recv_multipart()
                        events = msgspec.msgpack.decode(payload)[1]
                        if blocks := sum(1 for event in events if event["type"] == "BlockStored"):
                            stored[index] += blocks  # other events (removals) do not count as heard
    finally:
        for socket in sockets:
            socket.close(linger=0)
    assert set(stored) == set(range(SIMS))


def test_a_client_that_leaves_aborts_its_request_on_the_sim() -> None:
    with running_sim("--decode-ms-per-token", "20") as sim:
        body = {"prompt": "Write a long answer", "max_tokens": 500}  # 10 s of decoding
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{sim.url}/v1/completions", json=body, timeout=0.5)
        wait_until(lambda: replica_counter(sim.url, "vllm:num_requests_running") == 0, 3, 0.1, "the abort")
        text = httpx.get(f"{sim.url}/metrics", timeout=5).text
        success = parse_samples(text, {"vllm:request_success_total"}).by_name["vllm:request_success_total"]
        assert {labels["finished_reason"]: value for labels, value in success if value} == {"abort": 1.0}


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_the_router_aborts_its_request_on_the_sim(stream: bool) -> None:
    """Through the router's own HTTP protocol, which tells a request its client left (no watcher task): the
    replica's request is aborted, the router counts one client gone, and its in-flight count returns to 0."""
    with running_sim("--decode-ms-per-token", "20") as sim:
        router = start_router([sim.url], "round_robin")
        try:
            body = {"prompt": "Write a long answer", "max_tokens": 500, "stream": stream}  # 10 s of decoding
            with httpx.Client(timeout=0.5) as client:
                if stream:  # two chunks read, then the connection closed with the answer half sent
                    with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
                        chunks = response.iter_bytes()
                        assert next(chunks) and next(chunks)
                else:  # gone while waiting for the whole answer
                    with pytest.raises(httpx.ReadTimeout):
                        client.post(f"{router.url}/v1/completions", json=body)
            wait_until(lambda: replica_counter(sim.url, "vllm:num_requests_running") == 0, 3, 0.1, "the abort")
            wait_until(lambda: router_status(router.url)["replicas"][0]["in_flight"] == 0, 3, 0.1, "in-flight 0")
            text = httpx.get(f"{router.url}/metrics", timeout=5).text
            gone = parse_samples(text, {"dpserve_client_disconnects_total"}).total("dpserve_client_disconnects_total")
            assert gone == 1
        finally:
            stop_router(router)


def peer_links(url: str) -> list[dict[str, Any]]:
    links: list[dict[str, Any]] = router_status(url)["peers"]["links"]
    return links


def test_up_with_two_routers_serves_on_both_ports(tmp_path: Path) -> None:
    """`dpserve up --sim 2 --routers 2`: routers on --port and --port+1, each in front of both sims, both
    in the banner, both stopped with the rest."""
    router_port = free_port_range(2)
    base_port = free_port_range(2, start=router_port + 100)
    kv_base_port = free_port_range(2, start=base_port + 100)
    command = [sys.executable, "-m", "dpserve", "up", "--sim", "2", "--routers", "2", "--port", str(router_port)]
    command += ["--base-port", str(base_port), "--kv-events-base-port", str(kv_base_port)]
    command += ["--run-dir", str(tmp_path / "run"), "--probe-interval", "0.5", "--warm-start-timeout", "2"]
    log_path = tmp_path / "dpserve-up.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    urls = [f"http://127.0.0.1:{router_port + index}" for index in range(2)]
    try:
        wait_until(
            lambda: "2 routers ready at" in log_path.read_text() or process.poll() is not None, 45, 0.2, "routers"
        )
        output = log_path.read_text()
        assert process.poll() is None, output
        assert f"ready at {urls[0]}/v1, {urls[1]}/v1" in output
        for url in urls:
            models = httpx.get(f"{url}/v1/models", timeout=5)
            assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["dpserve-tiny"]
            wait_until(lambda url=url: healthy_count(url) == 2, 10, 0.2, f"both sims healthy at {url}")
        # Each is the other's peer (`--peer`), and their link is up.
        for url, other in zip(urls, reversed(urls), strict=True):
            wait_until(
                lambda url=url, other=other: (
                    [(link["url"], link["state"]) for link in peer_links(url)] == [(other, "up")]
                ),
                10,
                0.2,
                f"{url}'s link to {other}",
            )
    finally:
        stop_process(process, 60)
    assert process.returncode == 0, log_path.read_text()
    assert "stopped every replica and every router" in log_path.read_text()
