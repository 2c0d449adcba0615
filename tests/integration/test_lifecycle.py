"""Killing a replica under traffic, its restart, and stopping the whole fleet. These run last."""

from __future__ import annotations

import collections
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.integration.conftest import Fleet, router_status, wait_until

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


def test_killed_replica_fails_no_request_and_is_restarted_and_readmitted(fleet: Fleet) -> None:
    victim_url = fleet.replica_urls[0]
    victim = replica_process(fleet, victim_url)
    with Traffic(fleet.router_url) as traffic, StreamTraffic(fleet.router_url) as streams:
        wait_until(lambda: len(traffic.served) >= 10, timeout_s=60, what="traffic to flow")
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        wait_until(
            lambda: sum(1 for t, _ in traffic.served if t > killed_at + 1) >= 20,
            timeout_s=60,
            what="requests after the kill",
        )
    after = [replica for t, replica in traffic.served if t > killed_at + 1]
    print(
        f"\nfailover: {len(traffic.served)} requests, {len(traffic.failures)} failed; after the kill all went to "
        f"{collections.Counter(after)}; {len(streams.served)} streams alongside, {streams.broken} cut by the kill "
        f"(ended with an error event and [DONE]), {len(streams.failures)} failed"
    )
    assert traffic.failures == [] and streams.failures == []
    assert set(after) == {"r1"}

    # The launcher restarts it and the router takes it back once it answers its probes.
    wait_until(
        lambda: router_status(fleet.router_url)["replicas"][0]["healthy"],
        timeout_s=300,
        interval_s=2,
        what="the killed replica to be restarted and re-admitted",
    )
    assert replica_process(fleet, victim_url).pid != victim.pid
    with httpx.Client(timeout=60) as client:
        served = {
            client.post(f"{fleet.router_url}/v1/completions", json=REQUEST).headers["x-dpserve-replica"]
            for _ in range(20)
        }
    assert "r0" in served
    assert "r0 exited" in fleet.log_tail(20000) and "r0 is back" in fleet.log_tail(20000)


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
