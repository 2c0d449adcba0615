"""`dpserve sim --count 4` as a process: four replicas on four consecutive ports, each answering as a sim of its
own (health, models, chat), with its own prefix cache and metrics, and its KV events on its own ZMQ port, with
its own sequence numbers (real ZMQ subscriptions)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from dpserve.replicas.prometheus_text import parse_samples
from tests.conftest import free_port_range
from tests.integration.conftest import router_status, running_sims, start_router, stop_router

pytestmark = pytest.mark.integration

COUNT = 4


def chat(http: httpx.Client, url: str, text: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 3}
    reply = http.post(f"{url}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def hits(http: httpx.Client, url: str) -> float:
    samples = parse_samples(http.get(f"{url}/metrics").text, {"vllm:prefix_cache_hits_total"})
    return sum(value for _, value in samples.by_name["vllm:prefix_cache_hits_total"])


def subscribe(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def drain(sockets: list[zmq.Socket[bytes]], wait_s: float) -> list[list[tuple[int, list[Any]]]]:
    """Every batch each socket receives within `wait_s`: (sequence number, [ts, events, dp_rank])."""
    received: list[list[tuple[int, list[Any]]]] = [[] for _ in sockets]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for index, sock in enumerate(sockets):
            while sock.poll(5):
                _, seq, payload = sock.recv_multipart()
                received[index].append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return received


def stored(batch: tuple[int, list[Any]]) -> list[int]:
    return [t for event in batch[1][1] if event["type"] == "BlockStored" for t in event["token_ids"]]


def test_four_replicas_in_one_process_each_with_its_own_cache_metrics_and_kv_events() -> None:
    with running_sims(COUNT, "--speed", "0") as sims:
        assert len({sim.process.pid for sim in sims}) == 1
        sockets = [subscribe(sim.kv_events) for sim in sims]
        try:
            time.sleep(0.5)  # ZMQ's slow joiner
            texts = [" ".join(f"replica{index} word{i}" for i in range(60)) for index in range(COUNT)]
            with httpx.Client(timeout=30) as http:
                for sim in sims:
                    assert http.get(f"{sim.url}/health").status_code == 200
                    assert http.get(f"{sim.url}/v1/models").json()["data"][0]["id"] == "dpserve-tiny"
                messages = [{"messages": [{"role": "user", "content": text}]} for text in texts]
                ids = [http.post(f"{sims[0].url}/tokenize", json=m).json()["tokens"] for m in messages]
                for index, sim in enumerate(sims):
                    for _ in range(index):  # replica I chats I times, with its own prompt
                        chat(http, sim.url, texts[index])
                assert [hits(http, sim.url) > 0 for sim in sims] == [False, False, True, True]
                # Replica 3's prompt is cached there, not on replica 1:
                usage = chat(http, sims[1].url, texts[3])["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] == 0
            batches = drain(sockets, 1.5)
        finally:
            for sock in sockets:
                sock.close(linger=0)
    assert batches[0] == []  # replica 0 ran nothing
    for index, received in enumerate(batches[1:], start=1):
        assert [seq for seq, _ in received] == list(range(len(received))), f"replica {index}: its own sequence"
        assert {payload[2] for _, payload in received} == {0}  # dp_rank: each is a one-engine server
    # Each stored only the blocks of the prompts it ran: 2 and 3 their own (once: then hits), 1 its own and 3's.
    for index in (2, 3):
        tokens = [t for batch in batches[index] for t in stored(batch)]
        assert tokens and tokens == ids[index][: len(tokens)]
    first, last = stored(batches[1][0]), stored(batches[1][-1])
    assert first == ids[1][: len(first)] and first
    assert last == ids[3][: len(last)] and last


def test_a_port_in_use_stops_the_sim_with_an_error_naming_it() -> None:
    port = free_port_range(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        command = [sys.executable, "-m", "dpserve", "sim", "--port", str(port), "--count", "3"]
        done = subprocess.run(command, capture_output=True, timeout=60, check=False)
    assert done.returncode == 1
    assert f"port {port + 1} (replica 1 of 3) on 127.0.0.1 is already in use" in done.stderr.decode()


def success(http: httpx.Client, url: str) -> float:
    samples = parse_samples(http.get(f"{url}/metrics").text, {"vllm:request_success_total"})
    return sum(value for _, value in samples.by_name["vllm:request_success_total"])


def test_a_kv_aware_router_sees_a_counted_sim_as_four_replicas_each_with_its_own_events() -> None:
    with running_sims(COUNT, "--speed", "0") as sims:
        events = [f"--kv-events={sim.url}={sim.kv_events}" for sim in sims]
        router = start_router([s.url for s in sims], "kv_aware", *events, "--tokenizer", "remote", expect_healthy=COUNT)
        try:
            prompts = [" ".join(f"prompt{k} word{i}" for i in range(80)) for k in range(8)]
            with httpx.Client(timeout=30) as http:
                for _ in range(3):
                    for prompt in prompts:
                        reply = http.post(f"{router.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                        assert reply.status_code == 200, reply.text
                time.sleep(0.5)  # the last events reach the router
                replicas = {replica["url"]: replica for replica in router_status(router.url)["replicas"]}
                served = {sim.url: success(http, sim.url) for sim in sims}
        finally:
            stop_router(router)
    assert sum(served.values()) == 3 * len(prompts)
    for url, replica in replicas.items():
        assert replica["healthy"] and replica["served_total"] == served[url]  # what the router sent, it alone ran
        assert replica["kv_events"]["gaps"] == 0
        assert (replica["kv_events"]["batches"] > 0) == (served[url] > 0), url  # its events, from its port
