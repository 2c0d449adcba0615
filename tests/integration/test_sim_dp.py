"""`dpserve sim --data-parallel-size 2` as a process, as the router and `dpserve bench vllm-dp` meet it: one
HTTP port, two engines, engine R's KV events on the --kv-events port + R (a real ZMQ subscription)."""

from __future__ import annotations

import subprocess
import time

import httpx
import msgspec
import pytest
import zmq

from dpserve.replicas.prometheus_text import parse_samples
from tests.conftest import free_port, free_port_range
from tests.integration.conftest import answers, sim_command, stop_process, wait_until

pytestmark = pytest.mark.integration


def test_two_engines_behind_one_port_each_with_its_kv_event_port_and_metrics() -> None:
    port, kv_port = free_port(), free_port_range(2)
    command = sim_command(port, f"tcp://127.0.0.1:{kv_port}", "--data-parallel-size", "2", "--speed", "0")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    sockets: list[zmq.Socket[bytes]] = []
    try:
        wait_until(lambda: answers(f"{url}/health") or process.poll() is not None, 30, 0.1, "sim")
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else "sim exited"
        for rank in (0, 1):
            sockets.append(zmq.Context.instance().socket(zmq.SUB))
            sockets[rank].setsockopt(zmq.SUBSCRIBE, b"")
            sockets[rank].connect(f"tcp://127.0.0.1:{kv_port + rank}")
        time.sleep(0.5)  # ZMQ's slow joiner
        prompt = " ".join(f"token{i}" for i in range(64))
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(2):
                body = {"prompt": prompt, "max_tokens": 2}
                reply = http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "1"})
                assert reply.status_code == 200, reply.text
            metrics = parse_samples(http.get("/metrics").text, {"vllm:prefix_cache_hits_total"})
        hits = {labels["engine"]: value for labels, value in metrics.by_name["vllm:prefix_cache_hits_total"]}
        assert hits["0"] == 0 < hits["1"]  # both ran on engine 1: the second hit its cache
        ranks: dict[int, set[int]] = {0: set(), 1: set()}
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            for rank, socket in enumerate(sockets):
                if socket.poll(20):
                    ranks[rank].add(msgspec.msgpack.decode(socket.recv_multipart()[2])[2])
        assert ranks == {0: set(), 1: {1}}
    finally:
        for socket in sockets:
            socket.close(linger=0)
        stop_process(process, 10)
