"""Router-side token ids: the model's tokenizer loaded in the router gives the ids the replica computes
(the simulator's tiny tokenizer is held to vLLM's ids by the contract test), and the cache works."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dpserve import tiny_model as tiny
from dpserve.router.observe.prompt_tokens import (
    THREAD_MIN_CHARS,
    LocalTokenizer,
    TokenCache,
    TokenIds,
    content_key,
    prompt_text,
)
from dpserve.sim.tokenizer import TinyTokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello to the router, twice."},
    {"role": "assistant", "content": None},
    {"role": "user", "content": [{"type": "text", "text": "Now in parts."}]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny-tokens"))


@pytest.mark.engine
def test_local_tokenizer_matches_the_replicas_ids(model_dir: Path) -> None:
    local = LocalTokenizer(model_dir)
    reference = TinyTokenizer()
    text = "The cache-aware router sends each prompt home. Ünïcode too."
    assert ids(local.tokens_now("completions", {"prompt": text})) == reference.encode(text)
    assert ids(local.tokens_now("completions", {"prompt": [text]})) == reference.encode(text)
    assert ids(local.tokens_now("completions", {"prompt": [5, 6, 7]})) == [5, 6, 7]
    assert local.tokens_now("completions", {"prompt": ["a", "b"]}) is None  # a batch: no single prefix
    assert local.failures == 0
    assert local.tokens_now("chat", {"messages": [{"role": "user", "content": 5}]}) is None
    assert local.failures == 1
    rendered = reference.render_chat([{**m, "content": m["content"] or ""} for m in MESSAGES])
    expected = reference.encode(rendered, add_special_tokens=False)
    assert ids(local.tokens_now("chat", {"messages": MESSAGES})) == expected


@pytest.mark.engine
async def test_long_prompts_are_tokenized_off_the_event_loop_with_the_same_ids(model_dir: Path) -> None:
    local = LocalTokenizer(model_dir)
    long_text = "route every prompt to its cache " * 200
    assert len(long_text) > THREAD_MIN_CHARS
    for endpoint, payload in (
        ("completions", {"prompt": long_text}),
        ("chat", {"messages": [{"role": "user", "content": long_text}]}),
    ):
        assert ids(await local.tokens(endpoint, payload, "m", "")) == ids(local.tokens_now(endpoint, payload))


def ids(tokens: TokenIds | None) -> list[int] | None:
    return None if tokens is None else list(tokens)


def test_a_missing_tokenizer_is_reported(tmp_path: Path) -> None:
    assert not LocalTokenizer.available(tmp_path)


class CountingTokenizer:
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0
        self.failures = 0

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        self.calls += 1
        return (len(str(payload)),)


async def test_token_cache_tokenizes_each_prompt_once_and_stays_bounded() -> None:
    inner = CountingTokenizer()
    cache = TokenCache(inner, max_entries=2)
    for prompt in ("a", "a", "b", "a", "c", "b"):
        await cache.tokens("completions", {"prompt": prompt}, "m", "http://x")
    # a, b miss; a hits; c evicts b (least recent), so b misses again.
    assert (inner.calls, cache.hits, cache.misses, len(cache)) == (4, 2, 4, 2)
    assert content_key("chat", "m", {"messages": [{"b": 1, "a": 2}]}) == content_key(
        "chat", "m", {"messages": [{"a": 2, "b": 1}]}
    )
    assert content_key("chat", "m", {"messages": []}) != content_key("chat", "n", {"messages": []})


def test_prompt_text_for_the_approximate_policy() -> None:
    assert prompt_text("completions", {"prompt": "hi"}) == "hi"
    assert prompt_text("completions", {"prompt": ["x", "y"]}) is None
    assert prompt_text("chat", {"messages": MESSAGES}).startswith("<system>You are terse.<user>Say")  # type: ignore[union-attr]
