"""Elastic replicas through `dpserve up --min-replicas A --max-replicas B` over simulators that take a while to
start (`DPSERVE_SIM_STARTUP`): from zero, the first request waits (visible in /status) and is answered
within one start-up plus a second; a wait past its limit is refused with 503 and Retry-After, and the replica
its retry needs starts all the same; a scale-down drains the replica and stops it only once the stream on it
(sent straight to it, past the router) has ended, whole."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dpserve.tiny_model import TINY_MODEL_NAME
from tests.integration.conftest import Fleet, healthy_count, router_status, running_fleet, wait_until

pytestmark = pytest.mark.integration

STARTED = re.compile(r"dpserve: (\S+) started in ([0-9.]+) s")


@pytest.fixture
def slow_sims(monkeypatch: pytest.MonkeyPatch) -> Iterator[float]:
    """Simulators that take 2 s to listen, as vLLM loading a model."""
    monkeypatch.setenv("DPSERVE_SIM_STARTUP", "2")
    yield 2.0


def registered(fleet: Fleet) -> dict[str, str]:
    """The router's replicas, id -> state."""
    answer = httpx.get(f"{fleet.router_url}/admin/replicas", timeout=5).json()
    return {entry["id"]: entry["state"] for entry in answer["replicas"]}


def startups(fleet: Fleet) -> list[float]:
    return [float(found.group(2)) for found in STARTED.finditer(fleet.log_path.read_text())]


def chat(max_tokens: int, text: str = "hello") -> dict[str, Any]:
    return {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


def stream_whole(url: str, max_tokens: int, text: str) -> int:
    """Streams a chat completion from `url`; the content events, once [DONE] came (else an AssertionError)."""
    events = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat(max_tokens, text), timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                return events
            if line.startswith("data: "):
                choices = json.loads(line[6:]).get("choices") or [{}]
                events += 1 if (choices[0].get("delta") or {}).get("content") else 0  # not the role's empty one
    raise AssertionError(f"the stream from {url} ended without [DONE] after {events} events")


def test_from_zero_the_first_request_waits_for_a_replica(tmp_path: Path, slow_sims: float) -> None:
    bounds = ["--min-replicas", "0", "--max-replicas", "2", "--cold-start-wait", "20", "--scale-down-delay", "1"]
    with running_fleet(tmp_path, 2, ["--sim", "2", *bounds], 60, serving=0) as fleet:
        assert registered(fleet) == {}
        client = openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key="none", max_retries=0)
        seen: list[dict[str, Any]] = []

        def watch() -> None:  # what /status shows while the request waits
            while not done.is_set():
                scale = router_status(fleet.router_url)["scale"]
                if scale["waiting_for_replica"]:
                    seen.append(scale)
                time.sleep(0.1)

        done = threading.Event()
        watcher = threading.Thread(target=watch)
        watcher.start()
        began = time.monotonic()
        try:
            stream = client.chat.completions.create(
                model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "first"}], max_tokens=8, stream=True
            )
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            took = time.monotonic() - began
        finally:
            done.set()
            watcher.join()
        assert text
        assert took <= startups(fleet)[0] + 1.0, (took, fleet.log_tail())
        assert seen and seen[0]["desired"] == 1 and seen[0]["cold_start_wait_s"] == 20
        assert "waiting and no replica" in seen[-1]["models"][0]["reason"]
        # Idle again, it goes back to none.
        wait_until(lambda: registered(fleet) == {}, 30, 0.2, "the fleet back at zero")
        wait_until(lambda: "r0 drained and stopped" in fleet.log_tail(), 60, 0.2, "the launcher to stop r0")


def test_a_wait_past_its_limit_gets_503_with_retry_after(tmp_path: Path, slow_sims: float) -> None:
    bounds = ["--min-replicas", "0", "--max-replicas", "1", "--cold-start-wait", "0.5", "--scale-down-delay", "1"]
    with running_fleet(tmp_path, 1, ["--sim", "1", *bounds], 60, serving=0) as fleet:
        url = f"{fleet.router_url}/v1/chat/completions"
        began = time.monotonic()
        first = httpx.post(url, json=chat(4), timeout=30)
        assert first.status_code == 503 and time.monotonic() - began < 2.0
        assert first.json()["error"]["code"] == "replica_starting" and int(first.headers["retry-after"]) >= 1
        # The replica it asked for starts all the same (its start-up is measured), then goes back to none.
        wait_until(lambda: healthy_count(fleet.router_url) == 1, 30, 0.1, "the replica it asked for")
        wait_until(lambda: registered(fleet) == {}, 30, 0.2, "the fleet back at zero")
        began = time.monotonic()
        second = httpx.post(url, json=chat(4), timeout=30)
        assert second.status_code == 503 and time.monotonic() - began < 0.5  # at once: 2 s would not do
        retry_after = int(second.headers["retry-after"])
        assert retry_after >= 2
        # Its retry, after the Retry-After, finds the replica that the refusal asked for.
        time.sleep(retry_after + 0.5)
        assert httpx.post(url, json=chat(4), timeout=30).status_code == 200


def test_a_scale_down_drains_and_waits_for_the_stream_on_the_replica(tmp_path: Path, slow_sims: float) -> None:
    # The target alone: with its spread (1 + sqrt(1)), the one outside stream would hold both 2-slot replicas.
    bounds = ["--min-replicas", "1", "--max-replicas", "2", "--scale-down-delay", "1", "--scale-spread", "0"]
    engine = ["--", "--max-num-seqs", "2", "--decode-ms-per-token", "20"]
    with running_fleet(tmp_path, 2, ["--sim", "2", *bounds, *engine], 60, serving=1) as fleet:
        # A burst past one replica's 2 slots: its capacity is learned, the signal asks for a second.
        with ThreadPoolExecutor(8) as pool:
            burst = [pool.submit(stream_whole, fleet.router_url, 60, f"burst {n}") for n in range(8)]
            wait_until(lambda: registered(fleet).get("r1") == "healthy", 30, 0.1, "a second replica serving")
            assert all(future.result() == 60 for future in burst)
        # A long stream straight to the new replica (a client past the router): the load falls to what one
        # replica holds, the signal lets r1 go, and r1 must not stop before that stream has ended.
        states: list[str] = []
        with ThreadPoolExecutor(1) as pool:
            direct = pool.submit(stream_whole, fleet.replica_urls[1], 1200, "outside the router")
            while not direct.done():
                states.append(registered(fleet).get("r1", "gone"))
                time.sleep(0.1)
            assert direct.result() == 1200  # whole (24 s: longer than the smoothed load takes to fall)
        assert "draining" in states, states  # drained while the stream ran...
        assert "gone" not in states, states  # ... and not stopped until it ended
        wait_until(lambda: "r1" not in registered(fleet), 30, 0.2, "r1 stopped after its stream")
        wait_until(lambda: "r1 drained and stopped" in fleet.log_tail(), 60, 0.2, "the launcher to stop r1")
        scale = router_status(fleet.router_url)["scale"]
        history = scale["history"]  # up from 1 for the burst (as far as it needed), down to 1 again
        assert history[0]["from"] == 1 and history[0]["to"] >= 2 and history[-1]["to"] == 1, history


def test_with_workers_one_signal_starts_a_replica_that_every_worker_routes_to(tmp_path: Path, slow_sims: float) -> None:
    """`--workers 2`: the supervisor follows the signal through one worker and tells one worker of each replica it
    starts. A request that reached the other worker still asks for a replica (workers share what they hold),
    and every worker routes to it (a change through the admin API is made on every worker)."""
    bounds = ["--min-replicas", "0", "--max-replicas", "1", "--cold-start-wait", "20", "--scale-down-delay", "60"]
    with running_fleet(tmp_path, 1, ["--sim", "1", "--workers", "2", *bounds], 60, serving=0) as fleet:
        url = f"{fleet.router_url}/v1/chat/completions"
        body = {**chat(4), "stream": False}
        took = []
        for _ in range(12):  # each on a new connection: the kernel hands them to either worker
            began = time.monotonic()
            answer = httpx.post(url, json=body, timeout=30)
            took.append(round(time.monotonic() - began, 2))
            assert answer.status_code == 200, (answer.text, took, fleet.log_tail())
        assert took[0] <= startups(fleet)[0] + 1.0 and max(took[1:]) < 1.0, (took, fleet.log_tail())
        assert len(startups(fleet)) == 1  # one replica, whichever worker a request reached
        scale = httpx.get(f"{fleet.router_url}/admin/scale", timeout=5).json()
        assert scale["desired"] == 1, scale
