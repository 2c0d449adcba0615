"""Reading an OpenAI server-sent-event stream as it arrives: when each token came, how many there were,
the text, and whether the stream failed. Pure: fed lines and clock readings, so it is tested without a
load generator or a server.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamRecord:
    started: float
    """Clock reading when the request was sent (seconds)."""
    token_times: list[float] = field(default_factory=list)
    """When each token-carrying event arrived."""
    text_parts: list[str] = field(default_factory=list)
    usage_tokens: int | None = None
    error: str | None = None
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def output_tokens(self) -> int:
        """The server's own count when it sent usage, else one per token event."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.started if self.token_times else None

    @property
    def gaps_s(self) -> list[float]:
        """Inter-token latencies: the time between successive token events."""
        times = self.token_times
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time they took (a user's reading speed)."""
        times = self.token_times
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        return (self.output_tokens - 1) / (times[-1] - times[0])

    def feed(self, line: bytes | str, now: float) -> None:
        """One line of the stream (with or without its newline)."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.strip()
        if not line.startswith("data:") or self.done:
            return  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.error = f"undecodable event: {data[:120]}"
            return
        if not isinstance(event, dict):
            self.error = f"unexpected event: {data[:120]}"
            return
        if "error" in event:
            self.error = _error_message(event["error"])
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        piece = _piece(event)
        if piece is not None:
            self.token_times.append(now)
            self.text_parts.append(piece)

    def failure(self) -> str | None:
        """Why the stream failed, or None: an error event, or an end without `[DONE]`."""
        if self.error:
            return self.error
        if not self.done:
            return "stream ended without [DONE]"
        return None


def _piece(event: dict[str, Any]) -> str | None:
    """The text of a token event; None for events without a token (the usage chunk)."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta")
    # Chat's opening chunk (role, empty content) comes with the first token but is not one.
    if isinstance(delta, dict) and "role" not in delta and isinstance(delta.get("content"), str):
        return delta["content"]
    return None


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def completion_text(body: dict[str, Any]) -> str:
    """The text of a non-streamed completion or chat completion."""
    choices = body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    if isinstance(choice.get("text"), str):
        return choice["text"]
    message = choice.get("message")
    return message.get("content") or "" if isinstance(message, dict) else ""


def completion_tokens(body: dict[str, Any]) -> int | None:
    usage = body.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"]
    return None


def bearer_key(api_keys: str) -> str:
    """The API key to send: the first of a comma-separated list (compose passes the router's API_KEYS as they
    are), without its tenant name when written `NAME:KEY`."""
    key = api_keys.split(",")[0].strip()
    name, sep, secret = key.partition(":")
    if sep and secret and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        return secret
    return key
