"""Turning a request into the features its policy reads: prefix matches and session keys.

Only what the policy declares it needs is computed (`Policy.needs`), so round robin and least loaded
pay nothing for tokenization. Everything here may read router state (indexes, registry); the policy
that consumes the result stays a pure function.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from dpserve.kvindex.index import KvIndex, block_keys
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import CHARS_PER_TOKEN, CHUNK_CHARS, TextPrefixIndex, text_keys
from dpserve.policies.base import Need, Policy, PrefixMatch, PrefixSource, ReplicaView, RequestFeatures
from dpserve.policies.session import SessionAffinity
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.endpoints import Endpoint, Prompt
from dpserve.router.metrics import RouterMetrics
from dpserve.router.prompt_tokens import TokenCache, prompt_text

SESSION_HEADER = "x-session-id"
SESSION_OWNERS = 4
"""A session key's replicas, in ring order, that a sampled decision considers before the least loaded."""


class FeatureBuilder:
    def __init__(
        self,
        policy: Policy,
        registry: ReplicaRegistry,
        metrics: RouterMetrics,
        kv_index: KvIndex | None = None,
        text_index: TextPrefixIndex | None = None,
        tokens: TokenCache | None = None,
        recent: RecentRoutes | None = None,
    ) -> None:
        self._needs = policy.needs
        self._policy = policy
        self._last_owners: tuple[str, tuple[str, ...], tuple[str, ...]] = ("", (), ())
        self._registry = registry
        self._metrics = metrics
        self._kv_index = kv_index
        self._text_index = text_index
        self._tokens = tokens
        self._recent = recent

    async def build(
        self,
        endpoint: Endpoint,
        model: str,
        stream: bool,
        payload: dict[str, Any],
        headers: Mapping[str, str],
    ) -> RequestFeatures:
        """Load-only endpoints (embeddings, tokenize, ...) get no prompt features."""
        prompt = endpoint.prompt
        if not self._needs or prompt is None:
            return RequestFeatures(endpoint.name, model, stream)
        if prompt is Prompt.RESPONSE:
            payload = response_as_chat(payload)
        # The tokenizers and the text index know two shapes: chat messages and completion prompts.
        shape = "completions" if prompt is Prompt.COMPLETION else "chat"
        prefix: PrefixMatch | None = None
        session_key: str | None = None
        if Need.SESSION in self._needs:
            session_key = headers.get(SESSION_HEADER) or _user(payload)
        if Need.KV_PREFIX in self._needs:
            prefix = await self._kv_prefix(shape, model, payload)
        elif Need.TEXT_PREFIX in self._needs:
            prefix = self._text_prefix(shape, model, payload)
        return RequestFeatures(endpoint.name, model, stream, prefix, session_key)

    def routed(self, features: RequestFeatures, replica_id: str) -> None:
        """Called once the policy chose: the approximate index learns where the text went."""
        prefix = features.prefix
        if prefix is None:
            return
        if prefix.source is PrefixSource.ROUTED_TEXT and self._text_index is not None:
            self._text_index.record(prefix.keys, replica_id)
        elif prefix.source is PrefixSource.KV_EVENTS and self._recent is not None:
            self._recent.record(prefix.keys, replica_id)
        predicted = prefix.blocks(replica_id) * prefix.tokens_per_block
        self._metrics.labeled(self._metrics.predicted_cached_tokens, prefix.source.value).observe(predicted)

    async def _kv_prefix(self, endpoint: str, model: str, payload: dict[str, Any]) -> PrefixMatch | None:
        if self._kv_index is None or self._tokens is None:
            return None
        candidates = self._registry.candidates(model)
        if not candidates:
            return None
        block_size = self._block_size(candidates)
        if block_size is None:
            return None  # no replica has reported its block size yet: route on load
        started = time.perf_counter()
        # Tokenize on the least busy replica when the tokens come from a replica.
        url = self._registry.get(min(candidates, key=lambda c: c.in_flight).id).url
        tokens = await self._tokens.tokens(endpoint, payload, model, url)
        metrics = self._metrics
        metrics.labeled(metrics.tokenize_seconds, self._tokens.tokenizer.name).observe(time.perf_counter() - started)
        if tokens is None:
            return None
        keys = block_keys(tokens, block_size)
        self._metrics.prompt_tokens.inc(len(tokens))
        # Matches are read at decision time (`at_decision`): requests tokenized side by side must see
        # each other's routing, so the index is not read here.
        return PrefixMatch(PrefixSource.KV_EVENTS, len(keys), block_size, keys=tuple(keys))

    def likely_best(self, features: RequestFeatures, limit: int) -> list[str]:
        """Replicas likely to hold the longest run of the prompt: when the router routes among a sample
        of a large fleet, these join the sample so a cache hit is not missed."""
        if features.session_key and isinstance(self._policy, SessionAffinity):
            return list(self._session_owners(features.session_key, self._registry.routable_ids(features.model)))
        prefix = features.prefix
        if prefix is None or not prefix.keys:
            return []
        if prefix.source is PrefixSource.ROUTED_TEXT:
            return self._text_index.likely_best(prefix.keys, limit) if self._text_index is not None else []
        found = self._kv_index.likely_best(prefix.keys, limit) if self._kv_index is not None else []
        if self._recent is not None:
            found += [rid for rid in self._recent.likely_best(prefix.keys, limit) if rid not in found]
        return found

    def at_decision(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> RequestFeatures:
        """The prefix matches and cache ownership as they are now, for these candidates (cheap, sync); for
        a session key routed among a sample of the fleet, its owners on the whole fleet's ring."""
        if features.session_key and isinstance(self._policy, SessionAffinity):
            fleet = self._registry.routable_ids(features.model)
            if len(candidates) < len(fleet):
                return replace(features, session_owners=self._session_owners(features.session_key, fleet))
            return features
        prefix = features.prefix
        if prefix is None:
            return features
        ids = [c.id for c in candidates]
        if prefix.source is PrefixSource.ROUTED_TEXT:
            if self._text_index is None:
                return features
            matched = self._text_index.match(prefix.keys, ids)
            return replace(features, prefix=replace(prefix, matched=matched))
        if self._kv_index is None:
            return features
        matched = self._kv_index.match(prefix.keys, ids)
        held = {rid: self._kv_index.blocks(rid) for rid in ids}
        if self._recent is not None:
            # What was just sent somewhere counts as cached there: its events are a prefill away.
            pending = self._recent.match(prefix.keys, ids)
            matched = {rid: max(blocks, pending[rid]) for rid, blocks in matched.items()}
            held = {rid: blocks + self._recent.pending_blocks(rid) for rid, blocks in held.items()}
        return replace(features, prefix=replace(prefix, matched=matched, held=held))

    def _session_owners(self, key: str, fleet: tuple[str, ...]) -> tuple[str, ...]:
        # Asked twice per decision (to widen the sample, then for the policy): the last answer is kept.
        last_key, last_fleet, owners = self._last_owners
        if key != last_key or fleet is not last_fleet:
            assert isinstance(self._policy, SessionAffinity)
            owners = self._policy.owners(key, fleet, SESSION_OWNERS)
            self._last_owners = (key, fleet, owners)
        return owners

    def _text_prefix(self, endpoint: str, model: str, payload: dict[str, Any]) -> PrefixMatch | None:
        if self._text_index is None:
            return None
        text = prompt_text(endpoint, payload)
        if text is None:
            return None
        keys = text_keys(f"{model}\0{text}")
        return PrefixMatch(PrefixSource.ROUTED_TEXT, len(keys), CHUNK_CHARS // CHARS_PER_TOKEN, keys=tuple(keys))

    def _block_size(self, candidates: Sequence[ReplicaView]) -> int | None:
        assert self._kv_index is not None
        for candidate in candidates:
            size = self._registry.get(candidate.id).block_size or self._kv_index.block_size(candidate.id)
            if size:
                return size
        return None


def response_as_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request's `instructions` and `input` as the chat messages vLLM renders them to
    (a string input is one user message; a list holds message items), for prefix features."""
    messages: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = payload.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("role"), str):
                content = item.get("content")
                if isinstance(content, list):  # input_text parts
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                messages.append({"role": item["role"], "content": content if isinstance(content, str) else ""})
    return {**payload, "messages": messages}


def _user(payload: dict[str, Any]) -> str | None:
    user = payload.get("user")
    return user if isinstance(user, str) and user else None
