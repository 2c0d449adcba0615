"""Deterministic tokenization for the simulator: the tiny model's own tokenizer, or a fast stand-in.

`tiny` gives the very token ids a vLLM replica of the tiny model computes (same BPE, same chat template,
BOS handling as vLLM's), so the router's KV-aware code sees the same blocks from a sim as from vLLM.
`fast` hashes words to ids: no BPE, for large sims where tokenization cost matters more than fidelity.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any, Protocol

from jinja2.sandbox import ImmutableSandboxedEnvironment

from dpserve.tiny_model import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, train_tokenizer

TOKENIZER_KINDS = ("tiny", "fast")


class SimTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def piece(self, token_id: int) -> str:
        """The text of one generated token."""
        ...

    def output_ids(self) -> Sequence[int]:
        """Token ids a simulated model may generate: each decodes to clean text on its own."""
        ...


class _ChatTemplate:
    """The tiny model's chat template, rendered with the flags transformers uses (so vLLM's text matches)."""

    def __init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(CHAT_TEMPLATE)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return str(
            self._template.render(
                messages=messages, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, add_generation_prompt=add_generation_prompt
            )
        )


class TinyTokenizer(_ChatTemplate):
    def __init__(self) -> None:
        super().__init__()
        self._tokenizer = train_tokenizer()
        self.vocab_size = self._tokenizer.get_vocab_size()
        special = {self._tokenizer.token_to_id(token) for token in (BOS_TOKEN, EOS_TOKEN)}
        self._pieces = {i: self._tokenizer.decode([i]) for i in range(self.vocab_size) if i not in special}
        self._output_ids = [i for i, text in self._pieces.items() if text.isascii() and text.isprintable() and text]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def piece(self, token_id: int) -> str:
        return self._pieces.get(token_id, "")

    def output_ids(self) -> Sequence[int]:
        return self._output_ids


_WORDS = re.compile(r"\w+|[^\w\s]|\s+")
_FAST_WORDS = ("the", " of", " and", " data", " model", " token", " cache", " route", ".", ",", " fast", " sim")


class FastTokenizer(_ChatTemplate):
    """Words, punctuation and runs of spaces, each hashed (crc32, stable across processes) to an id."""

    BOS_ID = 0

    def __init__(self, vocab_size: int = 32000) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self._by_id = {self._id(word): word for word in _FAST_WORDS}

    def _id(self, piece: str) -> int:
        return 3 + zlib.crc32(piece.encode()) % (self.vocab_size - 3)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._id(piece) for piece in _WORDS.findall(text.replace(BOS_TOKEN, ""))]
        bos = add_special_tokens or text.startswith(BOS_TOKEN)
        return [self.BOS_ID, *ids] if bos else ids

    def piece(self, token_id: int) -> str:
        return self._by_id.get(token_id, "")

    def output_ids(self) -> Sequence[int]:
        return list(self._by_id)


def make_tokenizer(kind: str) -> SimTokenizer:
    if kind == "tiny":
        return TinyTokenizer()
    if kind == "fast":
        return FastTokenizer()
    raise ValueError(f"unknown tokenizer {kind!r}; choose from {', '.join(TOKENIZER_KINDS)}")
