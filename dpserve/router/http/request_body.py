"""Reading and checking a client's JSON body: only what routing needs, everything else passes through."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.types import Message, Receive

from dpserve.disconnect import ClientGone
from dpserve.router.http.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, Endpoint
from dpserve.router.http.errors import OpenAIError, bad_request


@dataclass(init=False)
class ParsedBody:
    payload: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool

    def __init__(self, payload: dict[str, Any], raw: bytes, model: str | None, stream: bool) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see policies.base.RequestFeatures).
        self.payload = payload
        self.raw = raw
        self.model = model
        self.stream = stream


async def receive_limited(headers: Mapping[str, str], receive: Receive, limit: int) -> bytes:
    """An ASGI request's whole body, read straight from `receive` (on the hot path: no async generator per
    request), refusing early (413) when it is, or announces it will be, over `limit` bytes; ClientGone when the
    client leaves first."""
    check_declared(headers, limit)
    message: Message = await receive()
    parts: list[bytes] = []
    size = 0
    while True:
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        if not message.get("more_body", False):
            return b"".join(parts) + chunk if parts else chunk
        parts.append(chunk)
        message = await receive()


def check_declared(headers: Mapping[str, str], limit: int) -> None:
    declared = headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large(limit)
        except ValueError:
            raise bad_request("Invalid Content-Length header.") from None


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
    if field is not None:
        if field not in payload or payload[field] is None:
            raise bad_request(f"Missing required parameter: `{field}`.", param=field)
        if endpoint.path in _SHAPED:
            _check_field(endpoint, payload[field])
    return ParsedBody(payload=payload, raw=raw, model=model, stream=stream)


_SHAPED = frozenset({CHAT.path, COMPLETIONS.path, EMBEDDINGS.path})
"""Endpoints whose required field the router checks the shape of (it reads them for routing); the rest
the replica validates."""


FORM_FIELDS_READ = frozenset({"model", "stream"})


def parse_form(raw: bytes, content_type: str | None, endpoint: Endpoint) -> ParsedBody:
    """A multipart/form-data body (audio uploads): its `model` and `stream` fields are read for routing,
    the rest (the audio itself) is relayed as it came, unparsed. A malformed body is a 400 here rather
    than a confused replica."""
    mime, params = parse_options_header(content_type or "")
    if mime != b"multipart/form-data":
        raise bad_request(f"{endpoint.path} takes a multipart/form-data body.")
    boundary = params.get(b"boundary")
    if not boundary:
        raise bad_request("The multipart body has no boundary in its Content-Type.")
    fields, names = _form_fields(raw, boundary)
    if endpoint.required_field is not None and endpoint.required_field not in names:
        param = endpoint.required_field
        raise bad_request(f"Missing required form field: `{param}`.", param=param)
    model = fields.get("model") or None
    stream_text = fields.get("stream", "false").strip().lower()
    if stream_text not in ("true", "false", ""):
        raise bad_request("`stream` must be true or false.", param="stream")
    return ParsedBody(payload={}, raw=raw, model=model, stream=stream_text == "true")


def _form_fields(raw: bytes, boundary: bytes) -> tuple[dict[str, str], set[str]]:
    """The short text fields the router reads, and the names of every part."""
    names: set[str] = set()
    fields: dict[str, str] = {}
    state: dict[str, Any] = {"name": None, "header_name": b"", "header_value": b"", "value": [], "ended": False}

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["header_name"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["header_value"] += data[start:end]

    def on_header_end() -> None:
        if state["header_name"].lower() == b"content-disposition":
            _, options = parse_options_header(state["header_value"])
            name = options.get(b"name")
            state["name"] = name.decode("utf-8", "replace") if name is not None else None
        state["header_name"] = state["header_value"] = b""

    def on_part_begin() -> None:
        state["name"], state["value"] = None, []

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["name"] in FORM_FIELDS_READ:
            state["value"].append(data[start:end])

    def on_part_end() -> None:
        name = state["name"]
        if name is None:
            raise bad_request("A part of the multipart body has no Content-Disposition name.")
        names.add(name)
        if name in FORM_FIELDS_READ:
            fields[name] = b"".join(state["value"]).decode("utf-8", "replace")

    def on_end() -> None:
        state["ended"] = True

    callbacks = {
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_begin": on_part_begin,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
        "on_end": on_end,
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]  # its callbacks are a TypedDict we fill as a dict
    try:
        parser.write(raw)
        parser.finalize()
    except MultipartParseError as exc:
        raise bad_request(f"The multipart body is malformed: {exc}.") from None
    if not state["ended"] or not names:
        raise bad_request("The multipart body is malformed: it has no parts or no closing boundary.")
    return fields, names


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
    properties: dict[str, Any] = {"model": {"type": "string", "minLength": 1}}
    if endpoint.can_stream:
        properties["stream"] = {"type": ["boolean", "null"]}
    if endpoint.path not in _SHAPED:
        required_fields = [endpoint.required_field] if endpoint.required_field else []
        return {"type": "object", "required": required_fields, "properties": properties, "additionalProperties": True}
    assert endpoint.required_field is not None
    required = {
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "required": ["role"], "properties": {"role": {"type": "string"}}},
        },
        "prompt": _TEXT_OR_TOKENS,
        "input": _TEXT_OR_TOKENS,
    }[endpoint.required_field]
    properties[endpoint.required_field] = required
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
