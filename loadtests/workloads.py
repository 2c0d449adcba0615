"""What the load test sends: OpenAI request bodies for three workloads, reproducible from a seed.

- random: every prompt different (no prefix cache help), `prompt_tokens` words long.
- shared_prefix: `groups` long system prompts (`prefix_tokens` words each) shared by every user; each
  request picks a group and adds a short question of its own (what KV-aware routing is for).
- multi_turn: each user holds a conversation of `turns` turns, resending the history with the replica's
  own replies; then it starts a new one.

Lengths are in words from a small fixed vocabulary (about one token per word for common BPE
vocabularies; the tiny model's 512-token BPE needs one or two per word). Output lengths are fixed with
`max_tokens` plus vLLM's `ignore_eos` (off with `ignore_eos=False` for backends that reject it).
No Locust import here: the bodies are plain data, tested without a load generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("random", "shared_prefix", "multi_turn")
APIS = ("chat", "completions", "mixed")

VOCABULARY = (
    "the a of and to in is for on with as by at from that this it be are was were have has can will "
    "model token prompt answer system user question data cache block replica router request stream "
    "batch queue latency memory engine prefix decode prefill layer weight tensor kernel parallel serving "
    "throughput schedule attention vector matrix number value time first last next every each other "
    "small large fast slow high low open close read write send keep find make take give show tell"
).split()


@dataclass(frozen=True)
class WorkloadOptions:
    kind: str = "random"
    api: str = "chat"
    """chat, completions, or mixed (each request picks one at random)."""
    stream_ratio: float = 1.0
    """Share of requests that stream (1: all, 0: none)."""
    prompt_tokens: int = 128
    output_tokens: int = 64
    prefix_tokens: int = 512
    groups: int = 8
    turns: int = 4
    model: str = "dpserve-tiny"
    ignore_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}: choose from {', '.join(WORKLOADS)}")
        if self.api not in APIS:
            raise ValueError(f"unknown api {self.api!r}: choose from {', '.join(APIS)}")
        if not 0.0 <= self.stream_ratio <= 1.0:
            raise ValueError("stream ratio must be between 0 and 1")
        for name in ("prompt_tokens", "output_tokens", "groups", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass(frozen=True)
class LlmRequest:
    path: str
    body: dict[str, Any]
    stream: bool

    @property
    def api(self) -> str:
        return "chat" if self.path.endswith("/chat/completions") else "completions"


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


def group_prompts(options: WorkloadOptions) -> list[str]:
    """The shared system prompts: the same for every user and every load process (seeded by `seed` alone)."""
    rng = random.Random(f"groups-{options.seed}")
    return [f"Group {g}. " + words(rng, options.prefix_tokens) for g in range(options.groups)]


@dataclass
class RequestFactory:
    """One user's request sequence. Users differ by `user_index`; the same (seed, index) repeats exactly."""

    options: WorkloadOptions
    user_index: int
    _rng: random.Random = field(init=False)
    _groups: list[str] = field(init=False)
    _history: list[dict[str, str]] = field(init=False, default_factory=list)
    _turn: int = field(init=False, default=0)
    _serial: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._rng = random.Random(f"user-{self.options.seed}-{self.user_index}")
        self._groups = group_prompts(self.options) if self.options.kind == "shared_prefix" else []

    def next(self) -> LlmRequest:
        self._serial += 1
        messages = self._messages()
        api = self.options.api if self.options.api != "mixed" else self._rng.choice(("chat", "completions"))
        stream = self._rng.random() < self.options.stream_ratio
        return self._request(messages, api, stream)

    def record_reply(self, text: str) -> None:
        """A multi-turn conversation continues with the replica's actual reply."""
        if self.options.kind == "multi_turn" and self._history and self._history[-1]["role"] == "user":
            self._history.append({"role": "assistant", "content": text})

    def _messages(self) -> list[dict[str, str]]:
        options, rng = self.options, self._rng
        tag = f"u{self.user_index}-{self._serial}"
        if options.kind == "random":
            # The unique tag first: no two prompts share even their first block.
            return [{"role": "user", "content": f"{tag}: " + words(rng, options.prompt_tokens)}]
        if options.kind == "shared_prefix":
            question = f"Question {tag}: " + words(rng, options.prompt_tokens)
            return [{"role": "system", "content": rng.choice(self._groups)}, {"role": "user", "content": question}]
        if self._turn == 0 or self._turn >= options.turns or self._history[-1]["role"] != "assistant":
            # A new conversation (or the last reply never came: start over rather than send two user turns).
            opening = f"Conversation {tag}. " + words(rng, options.prefix_tokens)
            self._history = [{"role": "system", "content": opening}]
            self._turn = 0
        self._turn += 1
        self._history.append({"role": "user", "content": f"Turn {self._turn}: " + words(rng, options.prompt_tokens)})
        return [dict(message) for message in self._history]

    def _request(self, messages: list[dict[str, str]], api: str, stream: bool) -> LlmRequest:
        options = self.options
        body: dict[str, Any] = {"model": options.model, "max_tokens": options.output_tokens, "stream": stream}
        if options.ignore_eos:
            body["ignore_eos"] = True
        if stream:
            # The last event then carries the exact token count (chunks can hold more than one token).
            body["stream_options"] = {"include_usage": True}
        if api == "chat":
            return LlmRequest("/v1/chat/completions", {**body, "messages": messages}, stream)
        prompt = "\n\n".join(f"{message['role']}: {message['content']}" for message in messages) + "\n\nassistant:"
        return LlmRequest("/v1/completions", {**body, "prompt": prompt}, stream)
