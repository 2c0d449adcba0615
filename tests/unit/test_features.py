"""Request features: tokens are computed once per request, matches at decision time, so requests
tokenized side by side still see where the others went."""

from __future__ import annotations

from typing import Any

from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import TextPrefixIndex
from dpserve.policies import make_policy
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.http.endpoints import CHAT, COMPLETIONS, EMBEDDINGS
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.observe.prompt_tokens import TokenCache, TokenIds
from dpserve.router.routing.features import FeatureBuilder
from dpserve.router.routing.selection import PrefixLookup


class WordIds:
    """One token per word, so the test can reason in blocks."""

    name = "words"
    failures = 0

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        return tuple(len(word) for word in payload["prompt"].split())

    def source(self, model: str) -> str:
        return self.name


def fleet() -> tuple[ReplicaRegistry, ModelCatalog]:
    registry = ReplicaRegistry(["r0=http://a", "r1=http://b"])
    catalog = ModelCatalog(registry)
    for replica in registry:
        registry.probe_succeeded(replica.id)
        replica.block_size = 2
        catalog.set_model_cards(replica.id, ({"id": "m"},))
    return registry, catalog


async def test_kv_matches_are_read_at_decision_time() -> None:
    registry, catalog = fleet()
    now = [0.0]
    policy = make_policy("kv_aware")
    metrics = RouterMetrics(registry, policy.name)
    kv_index = KvIndex()
    builder = FeatureBuilder(policy.needs, registry, catalog, metrics, kv_index=kv_index, tokens=TokenCache(WordIds()))
    lookup = PrefixLookup(metrics, kv_index, recent=RecentRoutes(lambda: now[0]))
    body = {"prompt": "a bb ccc dddd eeeee ffffff"}
    first = await builder.build(COMPLETIONS, "m", False, body, {})
    second = await builder.build(COMPLETIONS, "m", False, body, {})
    assert first.prefix is not None and first.prefix.total_blocks == 3 and not first.prefix.matched
    # The first is routed to r1 before the second decides: the second sees it as pending there.
    candidates = catalog.candidates("m")
    decided = lookup.match(first, candidates)
    assert decided.prefix is not None and decided.prefix.best == 0
    lookup.record(decided, "r1")
    later = lookup.match(second, candidates)
    assert later.prefix is not None
    assert dict(later.prefix.matched) == {"r0": 0, "r1": 3}
    assert dict(later.prefix.held) == {"r0": 0, "r1": 3}
    assert later.prefix.peers == 0  # no peers: the router alone places new prefixes
    assert policy.choose(later, candidates).id == "r1"
    # With peers heard, the match says how many share the routes (kv_aware then ties near-equal held counts).
    routes = RecentRoutes(lambda: now[0])
    routes.peers = 3  # as the peer board sets it
    shared = PrefixLookup(metrics, kv_index, recent=routes).match(second, candidates).prefix
    assert shared is not None and shared.peers == 3


class AskedWhere(WordIds):
    """Records which replica each prompt's tokens were asked of (`source`: remote, or local)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.asked: list[str] = []

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        self.asked.append(replica_url)
        return await super().tokens(endpoint, payload, model, replica_url)


async def test_remote_tokens_come_from_the_least_busy_replica_that_is_not_backing_off() -> None:
    registry, catalog = fleet()
    policy = make_policy("kv_aware")
    body = {"prompt": "a bb ccc"}
    remote = AskedWhere("remote")
    builder = FeatureBuilder(
        policy.needs, registry, catalog, RouterMetrics(registry, policy.name), KvIndex(), tokens=TokenCache(remote)
    )
    registry.get("r0").in_flight = 3
    await builder.build(COMPLETIONS, "m", False, body, {})
    registry.get("r0").in_flight, registry.get("r1").in_flight = 0, 1
    registry.get("r0").health.backoff_until = float("inf")  # a 429/503 from it: asked only if none other is left
    await builder.build(COMPLETIONS, "m", False, {"prompt": "dd ee"}, {})
    assert remote.asked == ["http://b", "http://b"]
    local = AskedWhere("local")  # the router's own tokenizer: the URL is not read, whichever it is
    builder = FeatureBuilder(
        policy.needs, registry, catalog, RouterMetrics(registry, policy.name), KvIndex(), tokens=TokenCache(local)
    )
    features = await builder.build(COMPLETIONS, "m", False, body, {})
    assert features.prefix is not None and features.prefix.total_blocks == 1 and len(local.asked) == 1


async def test_text_prefix_and_session_features() -> None:
    registry, catalog = fleet()
    policy = make_policy("prefix")
    metrics = RouterMetrics(registry, policy.name)
    text_index = TextPrefixIndex()
    builder = FeatureBuilder(policy.needs, registry, catalog, metrics, text_index=text_index)
    lookup = PrefixLookup(metrics, text_index=text_index)
    body = {"prompt": "x" * 300}
    features = await builder.build(COMPLETIONS, "m", False, body, {})
    lookup.record(lookup.match(features, catalog.candidates("m")), "r0")
    again = lookup.match(await builder.build(COMPLETIONS, "m", False, body, {}), catalog.candidates("m"))
    assert again.prefix is not None and again.prefix.blocks("r0") == again.prefix.total_blocks > 0
    session = make_policy("session")
    keyed = FeatureBuilder(session.needs, registry, catalog, RouterMetrics(registry, session.name))
    assert (await keyed.build(CHAT, "m", False, {"user": "u1"}, {})).session_key == "u1"
    assert (await keyed.build(CHAT, "m", False, {"user": "u1"}, {"x-session-id": "s9"})).session_key == "s9"
    assert (await keyed.build(EMBEDDINGS, "m", False, {"user": "u1"}, {})).session_key is None
