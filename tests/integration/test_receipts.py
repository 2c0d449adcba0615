"""Routing receipts on the real vLLM CPU replicas: what the KV-aware policy predicted per request against
the cached tokens vLLM reports in the answer's usage (streams too), and the class of each."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import zmq

from tests.conftest import free_port
from tests.integration.conftest import (
    Fleet,
    RouterFactory,
    kv_router_over_sims,
    running_sim,
    start_router,
    stop_router,
    wait_until,
)
from tests.integration.test_kv_routing import long_prompt, metric

pytestmark = pytest.mark.integration


def receipts(router_url: str, limit: int = 100) -> dict[str, Any]:
    response = httpx.get(f"{router_url}/admin/receipts", params={"limit": limit}, timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def send(router_url: str, prompt: str, stream: bool, **headers: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "stream": stream}
    response = httpx.post(f"{router_url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    if stream:
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        # The router asked for the usage chunk to read the realized cached tokens, and took it out again.
        assert all(json.loads(e[6:]).get("usage") is None for e in events[:-1])
    return response


def test_receipts_predict_what_vllm_reports_cached(fleet: Fleet, router_factory: RouterFactory) -> None:
    sources = [f"{url}={endpoint}" for url, endpoint in zip(fleet.replica_urls, fleet.kv_event_endpoints, strict=True)]
    extra = [arg for source in sources for arg in ("--kv-events", source)]
    router = router_factory("kv_aware", *extra, "--receipts-sample", "1")
    for seed in range(300, 303):
        prompt = long_prompt(seed)
        stored = metric(router.url, "dpserve_kv_events_total", type="BlockStored")
        send(router.url, prompt, stream=False)
        # The next decision can only predict what the replica's events have told the index.
        wait_until(
            lambda s=stored: metric(router.url, "dpserve_kv_events_total", type="BlockStored") > s, 10, 0.1, "events"
        )
        for stream in (False, True, False):
            send(router.url, prompt, stream=stream)
    book = receipts(router.url)
    rows = book["receipts"]
    assert len(rows) == 12 == book["summary"]["receipts"] == sum(book["summary"]["classes"].values())
    firsts, repeats = rows[3::4], [r for i, r in enumerate(rows) if i % 4 != 3]  # newest first
    for row in firsts:  # a new prompt: nothing held anywhere, nothing found
        assert (row["class"], row["predicted_cached_tokens"], row["realized_cached_tokens"]) == ("cold", 0, 0), row
    for row in repeats:
        assert row["class"] == "hit", row
        assert row["predicted_cached_tokens"] > 0 and row["realized_cached_tokens"] > 0
        # Predicted against realized: within one block (vLLM computes a fully cached prompt's last block again).
        assert abs(row["realized_cached_tokens"] - row["predicted_cached_tokens"]) <= row["block_tokens"], row
        assert row["policy"] == "kv_aware" and row["replica"] == row["best_replica"]
    quality = httpx.get(f"{router.url}/status", timeout=5).json()["routing_quality"]
    assert quality["receipts"] == 12 and quality["classes"]["hit"] == 9 and quality["hit_mean_error_blocks"] <= 1
    assert metric(router.url, "dpserve_receipts_total", **{"class": "hit"}) == 9
    assert metric(router.url, "dpserve_receipt_tokens_total", kind="realized_cached") > 0


def test_a_request_asks_for_its_receipt_and_gets_the_prediction(fleet: Fleet, router_factory: RouterFactory) -> None:
    sources = [f"{url}={endpoint}" for url, endpoint in zip(fleet.replica_urls, fleet.kv_event_endpoints, strict=True)]
    extra = [arg for source in sources for arg in ("--kv-events", source)]
    router = router_factory("kv_aware", *extra, "--receipts-sample", "0")
    prompt = long_prompt(310)
    plain = send(router.url, prompt, stream=False)
    assert "x-dpserve-cached-tokens" not in plain.headers
    assert receipts(router.url)["receipts"] == []  # sample 0: none unless asked
    wait_until(lambda: metric(router.url, "dpserve_kv_events_total", type="BlockStored") > 0, 10, 0.1, "events")
    asked = send(router.url, prompt, stream=True, **{"x-dpserve-receipt": "1"})
    predicted = int(asked.headers["x-dpserve-cached-tokens"])
    (row,) = receipts(router.url)["receipts"]
    assert row["predicted_cached_tokens"] == predicted > 0 and row["request_id"] == asked.headers["x-request-id"]
    bad = httpx.get(f"{router.url}/admin/receipts", params={"limit": "many"}, timeout=5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_text_prefix_receipts_learn_the_models_tokens_per_chunk(router_factory: RouterFactory) -> None:
    """The prefix policy predicts in text chunks. The tiny model's tokenizer is far from 4 characters a
    token and vLLM caches whole blocks of its own, so the predictions hold, in tokens, only once the answers
    have taught the router what a chunk is and rounded to the engine's block."""
    router = router_factory("prefix", "--receipts-sample", "1")
    status = httpx.get(f"{router.url}/status", timeout=5).json()
    block = max(replica["block_size"] or 0 for replica in status["replicas"])
    assert block > 0  # the replicas' KV block, read from their metrics
    for seed in range(320, 324):
        prompt = long_prompt(seed)
        for _ in range(3):
            send(router.url, prompt, stream=False)
    rows = receipts(router.url)["receipts"][::-1]  # oldest first
    assert [row["source"] for row in rows] == ["routed_text"] * 12
    assert all(row["class"] == "cold" for row in rows[::3])  # each new prompt
    for row in [r for i, r in enumerate(rows) if i % 3]:  # its repeats, each taught by the answers before
        assert row["class"] == "hit", row
        # More than 4 characters a token would have said, and within a block of what vLLM reported.
        assert row["predicted_cached_tokens"] > row["prompt_blocks"] * 16, row
        assert row["block_tokens"] >= block
        assert abs(row["realized_cached_tokens"] - row["predicted_cached_tokens"]) <= row["block_tokens"], row


class EventRelay:
    """Between a sim's KV-event publisher and the router: passes every message on, or drops them while
    `paused` (events lost on the way: a fault the replica cannot make on demand)."""

    def __init__(self, source: str) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.paused = threading.Event()
        self.dropped = 0
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.bind(self.endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            frames = self._sub.recv_multipart()
            if self.paused.is_set():
                self.dropped += 1
            else:
                self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._pub.close(0)
        self._context.term()


@contextmanager
def relayed_sim(*args: str) -> Iterator[tuple[str, EventRelay]]:
    with running_sim(*args) as sim:
        relay = EventRelay(sim.kv_events)
        try:
            yield sim.url, relay
        finally:
            relay.close()


def test_lost_events_show_as_evicted_and_routing_recovers() -> None:
    """A sim with room for about three prompts; its events reach the router through a relay that the test
    pauses. While paused, the sim evicts a prompt the index still holds: asked again, its receipt says
    `evicted`. Once events flow again, the sequence gap clears that replica from the index, and new
    prompts are `cold`, then `hit`, as before."""
    with relayed_sim("--num-blocks", "48", "--decode-ms-per-token", "1") as (url, relay):
        router = start_router([url], "kv_aware", f"--kv-events={url}={relay.endpoint}", "--tokenizer", "remote")
        try:
            stored = lambda: metric(router.url, "dpserve_kv_events_total", type="BlockStored")  # noqa: E731

            def fresh(seed: int) -> str:
                """A new prompt, sent until its events are in (a relay's subscriber may join late)."""
                before = stored()
                prompt = long_prompt(seed, words=100)
                send(router.url, prompt, stream=False)
                wait_until(lambda: stored() > before, 10, 0.1, "the prompt's events")
                return prompt

            def classes() -> dict[str, int]:
                return dict(receipts(router.url)["summary"]["classes"])

            warm_up = iter(range(350, 400))

            def heard() -> bool:
                send(router.url, long_prompt(next(warm_up), words=100), stream=False)
                time.sleep(0.2)
                return stored() > 0

            wait_until(heard, 20, 0.1, "events through the relay")
            kept = fresh(401)
            send(router.url, kept, stream=True, **{"x-dpserve-receipt": "1"})
            assert receipts(router.url, 1)["receipts"][0]["class"] == "hit"

            relay.paused.set()
            for seed in range(402, 406):  # more than the cache holds beside `kept`: it is evicted
                send(router.url, long_prompt(seed, words=100), stream=False)
            before = classes()
            send(router.url, kept, stream=False, **{"x-dpserve-receipt": "1"})
            stale = receipts(router.url, 1)["receipts"][0]
            assert stale["class"] == "evicted", stale
            assert stale["predicted_cached_tokens"] > stale["realized_cached_tokens"] + stale["block_tokens"]
            assert classes()["evicted"] == before["evicted"] + 1
            assert relay.dropped > 0

            relay.paused.clear()
            again = fresh(406)  # its events carry a sequence number past the lost ones: a gap
            status = httpx.get(f"{router.url}/status", timeout=5).json()
            assert status["replicas"][0]["kv_events"]["gaps"] >= 1
            send(router.url, again, stream=True, **{"x-dpserve-receipt": "1"})
            assert receipts(router.url, 1)["receipts"][0]["class"] == "hit"
            summary = receipts(router.url)["summary"]
            assert summary["receipts"] == sum(summary["classes"].values())
        finally:
            stop_router(router)


def every_batch_heard(router_url: str) -> bool:
    """Whether the router has received every KV-event batch each of its sims has published so far."""
    for replica in httpx.get(f"{router_url}/status", timeout=5).json()["replicas"]:
        published = metric(replica["url"], "dpserve_sim_kv_event_batches_total")
        if replica["kv_events"]["batches"] != published:
            return False
    return True


def test_shadow_policies_are_scored_beside_the_live_one() -> None:
    """kv_aware live over 4 sims, round robin in its shadow: 3 groups of a shared prompt, 4 prompts each.
    The live choices through the cache model estimate what the sims report; round robin's estimate is
    what spreading each group over the replicas in turn would have hit, lower."""
    shadows = ("--shadow-policy", "round_robin", "--shadow-policy", "least_loaded")
    with kv_router_over_sims(4, ("--decode-ms-per-token", "1"), "--receipts-sample", "1", *shadows) as router:
        for turn in range(4):
            for group in range(3):  # 3 groups, 4 replicas: round robin's turn does not follow the groups
                shared = long_prompt(500 + group, words=120)
                send(router.url, f"{shared} {long_prompt(600 + 4 * turn + group, words=12)}", stream=turn % 2 == 1)
            # The turn's events reach the index before the next turn is routed.
            wait_until(lambda: every_batch_heard(router.url), 10, 0.05, "the turn's KV events at the router")
        status = httpx.get(f"{router.url}/status", timeout=5).json()
    shadows, quality = status["shadows"], status["routing_quality"]
    live, rr = shadows["live_modelled"], shadows["shadows"]["round_robin"]
    assert live["decisions"] == rr["decisions"] == 12 and set(shadows["shadows"]) == {"round_robin", "least_loaded"}
    # The model, fed kv_aware's own choices, says what the sims reported cached (within a point).
    assert abs(live["estimated_hit_rate"] - quality["realized_hit_rate"]) < 0.01, (live, quality)
    assert live["estimated_hit_rate"] > 0.5
    # Round robin spreads each group over the replicas (its turn, in the cache model, a uniform draw): each
    # group's first visit to each replica misses. Its decisions are the counter's, even.
    assert rr["estimated_hit_rate"] < live["estimated_hit_rate"] - 0.2 and rr["by_replica"] == {
        f"r{i}": 3 for i in range(4)
    }
    assert sum(rr["by_replica"].values()) == 12
