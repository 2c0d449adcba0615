"""Killing a replica under traffic, its restart, and stopping the whole fleet. These run last. The kill and restart
are tested in test_lora.py, on the replica that holds an adapter (one vLLM restart for both), with the traffic
here."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.integration.conftest import Fleet

pytestmark = [pytest.mark.integration, pytest.mark.disruptive]

REQUEST = {"prompt": "Hello", "max_tokens": 8}


def replica_process(fleet: Fleet, replica_url: str) -> psutil.Process:
    port = replica_url.rsplit(":", 1)[1]
    for child in psutil.Process(fleet.process.pid).children():
        cmdline = child.cmdline()
        if "vllm.entrypoints.openai.api_server" in cmdline and port in cmdline:
            return child
    raise AssertionError(f"no replica process on port {port}")


class Traffic:
    """Sequential non-streaming requests in a thread, recording who served each and every failure."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.served: list[tuple[float, str]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(f"{self.url}/v1/completions", json=REQUEST)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                if response.status_code == 200:
                    self.served.append((time.monotonic(), response.headers["x-dpserve-replica"]))
                else:
                    self.failures.append(f"{response.status_code} {response.text[:200]}")


class StreamTraffic(Traffic):
    """Sequential streams beside the non-streaming traffic: each must end with [DONE], a cut one with
    an SSE error event just before it."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.broken = 0

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    events = self._one(client)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                if not events or events[-1] != "[DONE]":
                    self.failures.append(f"stream ended without [DONE]: {events[-3:]}")
                elif len(events) > 1 and events[-2].startswith('{"error"'):
                    self.broken += 1

    def _one(self, client: httpx.Client) -> list[str]:
        events: list[str] = []
        body = {**REQUEST, "max_tokens": 32, "stream": True}
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                self.failures.append(f"stream answered {response.status_code}")
                return ["[DONE]"]
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            self.served.append((time.monotonic(), response.headers["x-dpserve-replica"]))
        return events


@pytest.mark.stops_fleet
def test_sigterm_stops_the_router_and_every_replica(fleet: Fleet) -> None:
    launcher = psutil.Process(fleet.process.pid)
    family = launcher.children(recursive=True)
    assert len(family) >= 3  # 2 replicas (and their engine processes) and the router
    fleet.process.send_signal(signal.SIGTERM)
    assert fleet.process.wait(timeout=90) == 0
    _gone, alive = psutil.wait_procs(family, timeout=10)
    assert alive == [], f"still running after shutdown: {[p.pid for p in alive]}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{fleet.router_url}/health")
    for url in fleet.replica_urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
