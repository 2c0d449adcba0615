"""KV-cache-aware routing on real vLLM CPU replicas: a repeated long prompt lands on the replica that
cached it, learned from the replicas' own KV events."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from tests.integration.conftest import Fleet, RouterFactory, wait_until

pytestmark = pytest.mark.integration

WORDS = "router cache block prefix token replica engine queue batch stream model latency".split()


def long_prompt(seed: int, words: int = 500) -> str:
    """Random words: hundreds of tokens for the tiny model (several 128-token CPU blocks)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def complete(router_url: str, body: dict[str, Any]) -> tuple[str, int]:
    response = httpx.post(f"{router_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return response.headers["x-dpserve-replica"], int(details.get("cached_tokens") or 0)


def metric(router_url: str, name: str, **labels: str) -> float:
    samples = parse_samples(httpx.get(f"{router_url}/metrics", timeout=5).text, {name})
    return sum(v for lbl, v in samples.by_name.get(name, []) if all(lbl.get(k) == x for k, x in labels.items()))


def check_repeats_follow_the_cache(router_url: str, seeds: range) -> None:
    for seed in seeds:
        body = {"prompt": long_prompt(seed), "max_tokens": 2}
        first, cached = complete(router_url, body)
        assert cached == 0, "a fresh prompt cannot be cached yet"
        # The replica publishes the prompt's blocks once it has computed them; wait until the
        # router's index holds them, so the next decision can use them.
        wait_until(lambda r=first: metric(router_url, "dpserve_kv_index_blocks", replica=r) > 0, 10, 0.1, "events")
        for _ in range(4):
            replica, cached = complete(router_url, body)
            assert replica == first, f"seed {seed}: repeat went to {replica}, cache is on {first}"
            assert cached > 0


def test_dpserve_up_routes_repeats_to_the_replica_that_cached_them(fleet: Fleet) -> None:
    status = httpx.get(f"{fleet.router_url}/status", timeout=5).json()
    # The default: slo, choosing as kv_aware when `dpserve up` passes KV events (its cache_hit reasons below).
    assert status["policy"] == "slo"
    before = metric(fleet.router_url, "dpserve_routing_decision_reasons_total", reason="cache_hit")
    check_repeats_follow_the_cache(fleet.router_url, range(100, 104))
    assert metric(fleet.router_url, "dpserve_routing_decision_reasons_total", reason="cache_hit") - before >= 16
    assert metric(fleet.router_url, "dpserve_routing_tokenize_seconds_count", tokenizer="local") > 0
    assert metric(fleet.router_url, "dpserve_routing_tokenize_failures_total") == 0
    replicas = httpx.get(f"{fleet.router_url}/status", timeout=5).json()["replicas"]
    assert all(r["kv_events"]["endpoint"].startswith("tcp://") for r in replicas)
    assert any(r["kv_events"]["batches"] > 0 and r["kv_events"]["indexed_blocks"] > 0 for r in replicas)


def test_router_with_kv_events_flags_and_remote_tokens(fleet: Fleet, router_factory: RouterFactory) -> None:
    sources = [f"{url}={endpoint}" for url, endpoint in zip(fleet.replica_urls, fleet.kv_event_endpoints, strict=True)]
    extra = [arg for source in sources for arg in ("--kv-events", source)]
    router = router_factory("kv_aware", *extra, "--tokenizer", "remote")
    check_repeats_follow_the_cache(router.url, range(200, 203))
    assert metric(router.url, "dpserve_routing_tokenize_seconds_count", tokenizer="remote") > 0
    assert metric(router.url, "dpserve_routing_tokenize_failures_total") == 0
    assert metric(router.url, "dpserve_kv_events_total", type="BlockStored") > 0
    assert metric(router.url, "dpserve_kv_event_decode_errors_total") == 0


def test_a_prompt_another_client_sent_straight_to_a_replica_is_routed_to_it(fleet: Fleet) -> None:
    """Load that never went through the router: a client sends a long prompt straight to each replica in turn.
    The replicas' own KV events tell the router, which sends the same prompt, asked through it, to the replica
    that computed it, and that replica reports it cached."""
    # Two prompts per replica: a policy blind to the cache would place all four right once in 16 runs.
    for index, replica_url in [(i, url) for i, url in enumerate(fleet.replica_urls) for _ in range(2)]:
        name = f"r{index}"
        body = {"model": "dpserve-tiny", "prompt": long_prompt(random.randrange(10**6)), "max_tokens": 2}
        before = metric(fleet.router_url, "dpserve_kv_index_blocks", replica=name)
        direct = httpx.post(f"{replica_url}/v1/completions", json=body, timeout=60)
        assert direct.status_code == 200, direct.text
        wait_until(
            lambda r=name, b=before: metric(fleet.router_url, "dpserve_kv_index_blocks", replica=r) > b,
            10,
            0.1,
            "the replica's events of the outside request",
        )
        replica, cached = complete(fleet.router_url, body)
        assert (replica, cached > 0) == (name, True), (replica, cached)


def test_router_finds_the_models_tokenizer_where_vllm_serves_it_from(
    fleet: Fleet, router_factory: RouterFactory
) -> None:
    """With no --tokenizer, the router loads the tokenizer at the path vLLM serves the model from (its
    /v1/models card's root), holds its ids against the replicas' /tokenize for the first prompts, then
    tokenizes prompts itself; routing still follows the cache."""
    sources = [f"{url}={endpoint}" for url, endpoint in zip(fleet.replica_urls, fleet.kv_event_endpoints, strict=True)]
    router = router_factory("kv_aware", *(arg for source in sources for arg in ("--kv-events", source)))
    for seed in range(2000, 2016):  # distinct prompts, each one tokenized (seeds no other test on this fleet uses)
        complete(router.url, {"prompt": long_prompt(seed, 60), "max_tokens": 1})
    local = metric(router.url, "dpserve_routing_tokenize_seconds_count", tokenizer="local")
    remote = metric(router.url, "dpserve_routing_tokenize_seconds_count", tokenizer="remote")
    assert local > 0 and 8 <= remote < 16, (local, remote)  # 8 checks, and any while the copy loaded
    assert metric(router.url, "dpserve_routing_tokenize_failures_total") == 0
    check_repeats_follow_the_cache(router.url, range(2020, 2022))
