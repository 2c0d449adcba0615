from __future__ import annotations

import orjson
import pytest
from starlette.types import Message, Receive

from dpserve.router.http.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, Endpoint
from dpserve.router.http.errors import OpenAIError
from dpserve.router.http.request_body import (
    parse_body,
    receive_limited,
    with_model,
)


def _chunks(*parts: bytes) -> Receive:
    """An ASGI `receive` that gives `parts` as the body's messages, the last without more_body."""
    messages = iter(enumerate(parts, 1))

    async def receive() -> Message:
        index, part = next(messages)
        return {"type": "http.request", "body": part, "more_body": index < len(parts)}

    return receive


def _error(raw: bytes, endpoint: Endpoint = CHAT) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse_body(raw, endpoint)
    return caught.value


def test_chat_body_parses_model_and_stream() -> None:
    parsed = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}', CHAT)
    assert parsed.model == "m" and parsed.stream is True


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"", None),
        (b"{", None),
        (b"null", None),
        (b'"text"', None),
        (b"{}", "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [1]}', "messages[0]"),
        (b'{"messages": [{"role": 1}]}', "messages[0]"),
        (b'{"messages": [{"role": "user"}], "model": ""}', "model"),
        (b'{"messages": [{"role": "user"}], "stream": 1}', "stream"),
    ],
)
def test_malformed_chat_bodies_are_400_with_the_param(raw: bytes, param: str | None) -> None:
    error = _error(raw)
    assert error.status == 400 and error.param == param
    body = orjson.loads(error.body())
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_shapes_accepted(prompt: object) -> None:
    assert parse_body(orjson.dumps({"prompt": prompt}), COMPLETIONS).model is None


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], [[1], []], [-1], [True]])
def test_completion_prompt_shapes_refused(prompt: object) -> None:
    assert _error(orjson.dumps({"prompt": prompt}), COMPLETIONS).param == "prompt"


def test_embeddings_cannot_stream() -> None:
    assert _error(b'{"input": "x", "stream": true}', EMBEDDINGS).param == "stream"


def test_with_model_keeps_the_raw_bytes_unless_the_model_was_filled_in() -> None:
    raw = b'{"model":"m","prompt":"x","extra_field":{"kept":true}}'
    parsed = parse_body(raw, COMPLETIONS)
    assert with_model(parsed, "m") is raw
    filled = parse_body(b'{"prompt":"x","seed":3}', COMPLETIONS)
    assert orjson.loads(with_model(filled, "m")) == {"prompt": "x", "seed": 3, "model": "m"}


async def test_receive_limited_refuses_declared_and_actual_oversize() -> None:
    assert await receive_limited({}, _chunks(b"ab", b"cd"), 4) == b"abcd"
    with pytest.raises(OpenAIError) as declared:
        await receive_limited({"content-length": "5"}, _chunks(b"abcde"), 4)
    assert declared.value.status == 413
    with pytest.raises(OpenAIError) as streamed:
        await receive_limited({}, _chunks(b"abc", b"de"), 4)
    assert streamed.value.status == 413
    with pytest.raises(OpenAIError) as invalid:
        await receive_limited({"content-length": "lots"}, _chunks(b""), 4)
    assert invalid.value.status == 400
