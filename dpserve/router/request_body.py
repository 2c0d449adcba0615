"""Reading and checking a client's JSON body: only what routing needs, everything else passes through."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import ClientDisconnect

from dpserve.disconnect import ClientGone
from dpserve.router.errors import OpenAIError, bad_request


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One proxied OpenAI endpoint and the body field it cannot do without."""

    name: str
    path: str
    required_field: str
    can_stream: bool


CHAT = Endpoint("chat", "/v1/chat/completions", "messages", can_stream=True)
COMPLETIONS = Endpoint("completions", "/v1/completions", "prompt", can_stream=True)
EMBEDDINGS = Endpoint("embeddings", "/v1/embeddings", "input", can_stream=False)
PROXIED_ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)


@dataclass(frozen=True, slots=True)
class ParsedBody:
    payload: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool


async def read_limited(headers: Mapping[str, str], chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The whole body, refusing early (413) when it is, or announces it will be, over `limit` bytes."""
    declared = headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large(limit)
        except ValueError:
            raise bad_request("Invalid Content-Length header.") from None
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            parts.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None  # the client left before its body was complete: no one to answer
    return b"".join(parts)


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"Request body is larger than the limit of {limit} bytes.", code="body_too_large")


def parse_body(raw: bytes, endpoint: Endpoint) -> ParsedBody:
    """Check the shape that routing relies on; the replica validates the rest."""
    if not raw:
        raise bad_request("Request body is empty; expected a JSON object.")
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}.") from None
    if not isinstance(payload, dict):
        raise bad_request("Request body must be a JSON object.")

    model = payload.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("`model` must be a non-empty string.", param="model")

    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.", param="stream")
    if stream and not endpoint.can_stream:
        raise bad_request(f"Streaming is not supported on {endpoint.path}.", param="stream")

    field = endpoint.required_field
    if field not in payload or payload[field] is None:
        raise bad_request(f"Missing required parameter: `{field}`.", param=field)
    _check_field(endpoint, payload[field])
    return ParsedBody(payload=payload, raw=raw, model=model, stream=stream)


def _check_field(endpoint: Endpoint, value: Any) -> None:
    if endpoint is CHAT:
        if not isinstance(value, list) or not value:
            raise bad_request("`messages` must be a non-empty array.", param="messages")
        for index, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(
                    f"`messages[{index}]` must be an object with a string `role`.", param=f"messages[{index}]"
                )
        return
    # Completions' prompt and embeddings' input share the same accepted shapes.
    if isinstance(value, str):
        return
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value) or _is_token_list(value):
            return
        if all(isinstance(item, list) and item and _is_token_list(item) for item in value):
            return
    raise bad_request(
        f"`{endpoint.required_field}` must be a string, an array of strings, or token ids.",
        param=endpoint.required_field,
    )


_TOKEN_IDS: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_TEXT_OR_TOKENS: dict[str, Any] = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
        _TOKEN_IDS,
        {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
    ]
}


def request_schema(endpoint: Endpoint) -> dict[str, Any]:
    """The JSON schema of what the router itself checks in a body (for its OpenAPI document); any other
    field passes through to the replica, which validates it."""
    required = {
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "required": ["role"], "properties": {"role": {"type": "string"}}},
        },
        "prompt": _TEXT_OR_TOKENS,
        "input": _TEXT_OR_TOKENS,
    }[endpoint.required_field]
    properties: dict[str, Any] = {"model": {"type": "string", "minLength": 1}, endpoint.required_field: required}
    if endpoint.can_stream:
        properties["stream"] = {"type": ["boolean", "null"]}
    properties["max_tokens"] = {"type": "integer", "minimum": 1}
    return {
        "type": "object",
        "required": [endpoint.required_field],
        "properties": properties,
        "additionalProperties": True,
    }


def _is_token_list(items: list[Any]) -> bool:
    return all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in items)


def with_model(parsed: ParsedBody, model: str) -> bytes:
    """The body to forward: unchanged unless the client left `model` out and the router chose it."""
    if parsed.model == model:
        return parsed.raw
    return orjson.dumps({**parsed.payload, "model": model})
