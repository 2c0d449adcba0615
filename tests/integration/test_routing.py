"""Policies and relaying over the real replicas, each test with its own `dpserve router` process."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from tests.integration.conftest import (
    Fleet,
    RouterFactory,
    router_status,
    start_router,
    stop_router,
    wait_until,
)

pytestmark = pytest.mark.integration

SHORT = {"prompt": "Hello there", "max_tokens": 2}
# Thousands of tokens take the tiny model many seconds on one core: "long" for as long as a test needs.
LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}


def served_by(router_url: str, body: dict[str, Any], count: int) -> list[str]:
    replicas = []
    with httpx.Client(timeout=60) as client:
        for _ in range(count):
            response = client.post(f"{router_url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            replicas.append(response.headers["x-dpserve-replica"])
    return replicas


def replica_running(replica_url: str) -> float:
    text = httpx.get(f"{replica_url}/metrics", timeout=5).text
    return parse_samples(text, {"vllm:num_requests_running"}).total("vllm:num_requests_running") or 0.0


@contextlib.contextmanager
def open_stream(url: str, body: dict[str, Any]) -> Iterator[tuple[httpx.Response, Iterator[bytes]]]:
    """A streaming request held open (its first chunk read) until the block ends, then dropped."""
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        # Keep the iterator referenced: a dropped one is closed, and that closes the stream.
        chunks = response.iter_raw()
        next(chunks)
        yield response, chunks


def test_round_robin_spreads_over_both_replicas(router_factory: RouterFactory) -> None:
    router = router_factory("round_robin")
    counts = collections.Counter(served_by(router.url, SHORT, 10))
    assert counts == {"r0": 5, "r1": 5}


def test_least_loaded_steers_away_from_a_replica_holding_long_requests(
    fleet: Fleet, router_factory: RouterFactory
) -> None:
    router = router_factory("least_loaded")
    with open_stream(f"{router.url}/v1/completions", LONG) as (first, _):
        busy = first.headers["x-dpserve-replica"]
        busy_url = fleet.replica_urls[int(busy[1:])]
        # A second long request straight to the same replica: the router only sees it in scraped metrics.
        with open_stream(f"{busy_url}/v1/completions", LONG):
            wait_until(
                lambda: next(r for r in router_status(router.url)["replicas"] if r["id"] == busy)["running"] >= 2,
                timeout_s=10,
                what="the router to scrape 2 running requests",
            )
            status = {r["id"]: r for r in router_status(router.url)["replicas"]}
            assert status[busy]["in_flight"] == 1
            chosen = served_by(router.url, SHORT, 8)
    assert busy not in chosen, f"{busy} held 2 long requests yet got {chosen.count(busy)} of 8 new ones"


def test_client_disconnect_aborts_the_replica_request(fleet: Fleet, router_factory: RouterFactory) -> None:
    router = router_factory("round_robin")
    with open_stream(f"{router.url}/v1/completions", LONG) as (response, chunks):
        replica_url = fleet.replica_urls[int(response.headers["x-dpserve-replica"][1:])]
        # Read for a second to learn how fast this replica generates.
        events, started = 0, time.monotonic()
        while time.monotonic() - started < 1.0:
            events += next(chunks).count(b"data: ")
        rate = events / (time.monotonic() - started)
        assert replica_running(replica_url) >= 1
    closed = time.monotonic()
    wait_until(lambda: replica_running(replica_url) == 0, timeout_s=10, interval_s=0.1, what="the replica to abort")
    freed_after = time.monotonic() - closed
    left_to_generate = (int(LONG["max_tokens"]) - events) / rate
    # Only an abort frees the replica long before the stream could have finished on its own.
    assert freed_after < left_to_generate / 2, f"freed after {freed_after:.1f}s; {left_to_generate:.1f}s were left"
    wait_until(
        lambda: all(r["in_flight"] == 0 for r in router_status(router.url)["replicas"]),
        timeout_s=5,
        what="the router's in-flight count to drop",
    )
    text = httpx.get(f"{router.url}/metrics").text
    assert parse_samples(text, {"dpserve_client_disconnects_total"}).total("dpserve_client_disconnects_total") == 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b"", 400, None),
        (b'{"messages": "hello"}', 400, "messages"),
        (b'{"messages": [{"content": "no role"}]}', 400, "messages[0]"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "stream"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', 400, "model"),
        (b'{"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ],
)
def test_bad_input_gets_an_openai_style_4xx(fleet: Fleet, body: bytes, status: int, param: str | None) -> None:
    response = httpx.post(
        f"{fleet.router_url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_oversized_body_is_413_and_the_router_keeps_serving(fleet: Fleet, router_factory: RouterFactory) -> None:
    router = router_factory("round_robin", "--max-body-bytes", "4096")
    big = {"prompt": "x" * 10_000, "max_tokens": 1}
    response = httpx.post(f"{router.url}/v1/completions", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"
    assert served_by(router.url, SHORT, 1)


def test_models_and_requests_still_answer_with_a_replica_down(fleet: Fleet) -> None:
    nothing_listens = "http://127.0.0.1:9"  # the discard port: connections are refused
    router = start_router([fleet.replica_urls[0], nothing_listens], "round_robin", expect_healthy=1)
    try:
        models = httpx.get(f"{router.url}/v1/models").json()
        assert [card["id"] for card in models["data"]] == ["dpserve-tiny"]
        assert served_by(router.url, SHORT, 3) == ["r0", "r0", "r0"]
        assert httpx.get(f"{router.url}/ready").json()["healthy_replicas"] == 1
    finally:
        stop_router(router)
