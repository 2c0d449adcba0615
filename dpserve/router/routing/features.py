"""Turning a request into the features its policy reads: the prompt's prefix keys and the session key.

Only what the policy declares it needs is computed (`Policy.needs`), so round robin and least loaded
pay nothing for tokenization. Which replica holds how much of the prefix is read later, at decision
time (`routing/selection.py`); the policy that consumes the result stays a pure function.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.prefix_keys import PrefixKeys
from dpserve.kvindex.text_prefix import ChunkTokens, TextPrefixIndex, text_keys
from dpserve.policies.base import Need, PrefixMatch, PrefixSource, RequestFeatures
from dpserve.policies.bindings import SessionBindings
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import Replica, ReplicaRegistry
from dpserve.router.http.endpoints import Endpoint, Prompt
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.observe.prompt_tokens import TokenCache, prompt_text

SESSION_HEADER = "x-session-id"


class FeatureBuilder:
    def __init__(
        self,
        needs: frozenset[Need],
        registry: ReplicaRegistry,
        catalog: ModelCatalog,
        metrics: RouterMetrics,
        kv_index: KvIndex | None = None,
        text_index: TextPrefixIndex | None = None,
        tokens: TokenCache | None = None,
        bindings: SessionBindings | None = None,
        chunk_tokens: ChunkTokens | None = None,
        prefix_keys: PrefixKeys | None = None,
    ) -> None:
        """`needs`: what the policy reads (`Policy.needs`); the rest is never computed. `bindings`: where
        sessions last went (the session policy's, shared with peers). `chunk_tokens`: what a text chunk
        is in tokens, as the answers taught it. `prefix_keys`: prompts' block keys, shared beginnings hashed
        once."""
        self._prefix_keys = prefix_keys or PrefixKeys()
        self._bindings = bindings
        self._chunk_tokens = chunk_tokens or ChunkTokens()
        self._needs = needs
        self._registry = registry
        self._catalog = catalog
        self._metrics = metrics
        self._kv_index = kv_index
        self._text_index = text_index
        self._tokens = tokens

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
            adapter = model if self._catalog.is_adapter(model) else None
            return RequestFeatures(endpoint.name, model, stream, adapter=adapter)
        if prompt is Prompt.RESPONSE:
            payload = response_as_chat(payload)
        # The tokenizers and the text index know two shapes: chat messages and completion prompts.
        shape = "completions" if prompt is Prompt.COMPLETION else "chat"
        prefix: PrefixMatch | None = None
        session_key: str | None = None
        bound: str | None = None
        if Need.SESSION in self._needs:
            session_key = headers.get(SESSION_HEADER) or _user(payload)
            if session_key and self._bindings is not None:
                bound = self._bindings.get(session_key)
        adapter = model if self._catalog.is_adapter(model) else None
        if Need.KV_PREFIX in self._needs:
            prefix = await self._kv_prefix(shape, model, payload, adapter)
        elif Need.TEXT_PREFIX in self._needs:
            prefix = self._text_prefix(shape, model, payload)
        return RequestFeatures(endpoint.name, model, stream, prefix, session_key, bound=bound, adapter=adapter)

    async def _kv_prefix(
        self, endpoint: str, model: str, payload: dict[str, Any], adapter: str | None
    ) -> PrefixMatch | None:
        if self._kv_index is None or self._tokens is None:
            return None
        serving = self._catalog.routable(model)
        if not serving:
            return None
        block_size = self._block_size(serving)
        if block_size is None:
            return None  # no replica has reported its block size yet: route on load
        started = time.perf_counter()
        # An adapter tokenizes as its base model does, and that replica may not hold the adapter.
        base = (self._catalog.adapter_parent(adapter) or model) if adapter is not None else model
        url = serving[0].url  # not read by a local tokenizer: no walk over the fleet for it
        if self._tokens.tokenizer.source(base) == "remote":  # tokens from a replica: the least busy one
            candidates = self._catalog.candidates(model)  # never empty here: backing-off ones when none other
            url = self._registry.get(min(candidates, key=lambda c: c.in_flight).id).url
        tokens = await self._tokens.tokens(endpoint, payload, base, url)
        elapsed = time.perf_counter() - started
        self._metrics.tokenize_seconds.observe((self._tokens.tokenizer.source(base),), elapsed)
        if tokens is None:
            return None
        keys = self._prefix_keys.keys(tokens, block_size, adapter)
        self._metrics.prompt_tokens.add((), len(tokens))
        # Matches are read at decision time (`selection.PrefixLookup.match`): requests tokenized side by side must see
        # each other's routing, so the index is not read here.
        return PrefixMatch(PrefixSource.KV_EVENTS, len(keys), block_size, keys=tuple(keys), prompt_tokens=len(tokens))

    def _text_prefix(self, endpoint: str, model: str, payload: dict[str, Any]) -> PrefixMatch | None:
        if self._text_index is None:
            return None
        text = prompt_text(endpoint, payload)
        if text is None:
            return None
        keys = text_keys(f"{model}\0{text}")
        per_chunk = self._chunk_tokens.per_chunk(model)
        return PrefixMatch(PrefixSource.ROUTED_TEXT, len(keys), per_chunk, keys=tuple(keys))

    def _block_size(self, serving: Sequence[Replica]) -> int | None:
        """The first that is known (the first replica's, but before its first read)."""
        assert self._kv_index is not None
        for replica in serving:
            size = replica.block_size or self._kv_index.block_size(replica.id)
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
