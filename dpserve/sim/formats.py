"""Response bodies with vLLM 0.32's keys: completions and chat completions, whole and streamed."""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

SYSTEM_FINGERPRINT = "vllm-0.32.0-dpserve-sim"


def new_id(prefix: str) -> str:
    """vLLM's id shape: a prefix and 16 hex digits."""
    return f"{prefix}-{os.urandom(8).hex()}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        },
        "completion_tokens_details": None,
    }


class ResponseFormat(Protocol):
    def full(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]: ...

    def opening(self) -> dict[str, Any] | None:
        """The chunk streamed before any token, if the endpoint sends one."""
        ...

    def chunk(self, text: str, finish_reason: str | None, fingerprint: bool) -> dict[str, Any]:
        """One token; `fingerprint` on the stream's last chunk (vLLM puts it there, or on the usage chunk)."""
        ...

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]: ...


class _Base:
    prefix = ""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = new_id(self.prefix)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _whole(self, obj: str, choice: dict[str, Any], usage: dict[str, Any], *null_fields: str) -> dict[str, Any]:
        """A non-streamed body: vLLM's top-level keys, with the endpoint's own extra ones set to null."""
        return {
            **self._head(obj),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
            **dict.fromkeys(null_fields),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }


class CompletionFormat(_Base):
    prefix = "cmpl"

    def full(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
        return self._whole("text_completion", choice, usage)

    def opening(self) -> dict[str, Any] | None:
        return None

    def chunk(self, text: str, finish_reason: str | None, fingerprint: bool) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
        return _fingerprinted({**self._head("text_completion"), "choices": [choice]}, fingerprint)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = {**self._head("text_completion"), "choices": [], "usage": _stream_usage(usage, with_created=False)}
        return _fingerprinted(body, True)


class ChatFormat(_Base):
    prefix = "chatcmpl"

    def full(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        return self._whole("chat.completion", choice, usage, "prompt_logprobs", "prompt_token_ids", "prompt_text")

    def opening(self) -> dict[str, Any] | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {
            **self._head("chat.completion.chunk"),
            "choices": [choice],
            "prompt_token_ids": None,
            "prompt_text": None,
        }

    def chunk(self, text: str, finish_reason: str | None, fingerprint: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        return _fingerprinted({**self._head("chat.completion.chunk"), "choices": [choice]}, fingerprint)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = {**self._head("chat.completion.chunk"), "choices": [], "usage": _stream_usage(usage, with_created=True)}
        return _fingerprinted(body, True)


def _fingerprinted(body: dict[str, Any], fingerprint: bool) -> dict[str, Any]:
    if fingerprint:
        body["system_fingerprint"] = SYSTEM_FINGERPRINT
    return body


def _stream_usage(whole: dict[str, Any], with_created: bool) -> dict[str, Any]:
    # vLLM's streamed usage leaves out the fields that are null (chat reports created_cache_tokens as 0).
    details: dict[str, Any] = {"cached_tokens": whole["prompt_tokens_details"]["cached_tokens"]}
    if with_created:
        details["created_cache_tokens"] = 0
    return {
        "prompt_tokens": whole["prompt_tokens"],
        "total_tokens": whole["total_tokens"],
        "completion_tokens": whole["completion_tokens"],
        "prompt_tokens_details": details,
    }
