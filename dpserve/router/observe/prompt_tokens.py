"""The token ids a replica will see for a request, computed on the router side (for the KV index).

Two sources, chosen by measurement (`dpserve bench policies` prints both costs):
- `LocalTokenizer`: the model's own `tokenizer.json` and chat template, loaded in the router. No network;
  a prompt is encoded piece by piece (`token_pieces.py`), so what it shares with earlier prompts costs a
  lookup; needs the model's files next to the router (found for it by `model_tokenizers.py`).
- `RemoteTokenizer`: the replica's `/tokenize` endpoint (vLLM's, or the simulator's). Exact by
  construction, works for any model, costs a round trip to a busy replica.
Both sit behind `TokenCache`, so a prompt sent again (a retry, a benchmark, the same system prompt in a
batch) is tokenized once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from dpserve.router.observe.token_pieces import PieceEncoder, token_ids

log = logging.getLogger("dpserve.tokens")

TokenIds = Sequence[int]
"""An array of 4-byte ids where the router encoded them (`token_pieces.token_ids`)."""
THREAD_MIN_CHARS = 1024
"""Prompts with at least this much new text are tokenized off the event loop (a thread hop costs tens of µs)."""
JSON = {"content-type": "application/json"}


class PromptTokenizer(Protocol):
    name: str

    @property
    def failures(self) -> int:
        """Prompts it could not tokenize (batches of prompts, which have no single prefix, are not failures)."""
        ...

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        """The prompt's token ids, or None when they cannot be known (the request then routes on load)."""
        ...

    def source(self, model: str) -> str:
        """Where `model`'s tokens come from now: `local` or `remote`."""
        ...


def single_prompt(payload: dict[str, Any]) -> str | list[int] | None:
    """A completions request's one prompt (text or ids); None for a batch of prompts."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


class LocalTokenizer:
    name = "local"

    def __init__(self, model_dir: Path, max_pieces: int = 4096) -> None:
        """`max_pieces`: how many distinct prompt pieces (a system prompt, a turn) keep their ids."""
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.pieces = PieceEncoder(self._tokenizer, max_pieces)
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text()
        self._specials = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
        # transformers renders templates with these flags; vLLM's text (and so its tokens) follows it.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template) if isinstance(template, str) else None
        self.failures = 0

    @staticmethod
    def available(model_dir: Path) -> bool:
        return (model_dir / "tokenizer.json").is_file()

    def source(self, model: str) -> str:
        return self.name

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        text = self._text(endpoint, payload)
        if text is None:
            return self._ids(endpoint, payload)
        if self.pieces.uncached_chars(text[0]) < THREAD_MIN_CHARS:
            return self.pieces.encode(*text)
        # A long new text takes milliseconds to encode; the Rust encoder lets go of the GIL, so in a
        # worker thread it no longer stalls every other request's relay on the event loop.
        return await asyncio.to_thread(self.pieces.encode, *text)

    def tokens_now(self, endpoint: str, payload: dict[str, Any]) -> TokenIds | None:
        text = self._text(endpoint, payload)
        return self.pieces.encode(*text) if text is not None else self._ids(endpoint, payload)

    def _text(self, endpoint: str, payload: dict[str, Any]) -> tuple[str, bool] | None:
        """The text to encode and whether the tokenizer adds its special tokens; None for no text."""
        if endpoint == "chat":
            if self._template is None:
                self.failures += 1
                return None
            messages = [
                m if m.get("content") is not None else {**m, "content": ""} for m in payload.get("messages", [])
            ]
            try:
                text = self._template.render(messages=messages, add_generation_prompt=True, **self._specials)
            except (TemplateError, TypeError, KeyError):
                self.failures += 1
                return None  # the replica will answer the client with its own 400
            # The template writes BOS itself: no special tokens on top, as vLLM does for chat.
            return text, False
        prompt = single_prompt(payload)
        return (prompt, True) if isinstance(prompt, str) else None

    @staticmethod
    def _ids(endpoint: str, payload: dict[str, Any]) -> TokenIds | None:
        """A completion prompt given as token ids is its own answer."""
        prompt = single_prompt(payload) if endpoint != "chat" else None
        return token_ids(prompt) if isinstance(prompt, list) else None


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class RemoteTokenizer:
    name = "remote"

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float = 5.0) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.failures = 0

    def source(self, model: str) -> str:
        return self.name

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        if endpoint == "chat":
            body: dict[str, Any] = {"model": model, "messages": payload.get("messages"), "add_generation_prompt": True}
        else:
            prompt = single_prompt(payload)
            if prompt is None:
                return None
            if not isinstance(prompt, str):
                return token_ids(prompt)
            body = {"model": model, "prompt": prompt}
        try:
            async with self._session.post(
                replica_url + "/tokenize", data=orjson.dumps(body), headers=JSON, timeout=self._timeout
            ) as resp:
                answer = orjson.loads(await resp.read()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.debug("tokenize on %s failed: %s", replica_url, exc)
            answer = None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            self.failures += 1
            return None
        return token_ids(tokens)


class TokenCache:
    """An LRU of prompt content -> token ids in front of a tokenizer."""

    def __init__(self, tokenizer: PromptTokenizer, max_entries: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, TokenIds | None] = OrderedDict()

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        key = content_key(endpoint, model, payload)
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        tokens = await self.tokenizer.tokens(endpoint, payload, model, replica_url)
        self._entries[key] = tokens
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return tokens

    def __len__(self) -> int:
        return len(self._entries)


def content_key(endpoint: str, model: str, payload: dict[str, Any]) -> bytes:
    """What the tokens depend on: the endpoint, the model and the prompt or messages."""
    field = payload.get("messages") if endpoint == "chat" else payload.get("prompt")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{endpoint}\0{model}\0".encode())
    digest.update(orjson.dumps(field, option=orjson.OPT_SORT_KEYS))
    return digest.digest()


def prompt_text(endpoint: str, payload: dict[str, Any]) -> str | None:
    """The request's text as the approximate (text) prefix policy sees it: no tokenizer involved."""
    if endpoint == "chat":
        parts: list[str] = []
        for message in payload.get("messages", []):
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{message.get('role')}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    prompt = single_prompt(payload)
    if isinstance(prompt, str):
        return prompt
    return None if prompt is None else ",".join(map(str, prompt))
