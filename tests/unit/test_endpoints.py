"""The relayed endpoints' table, multipart bodies, stored-response ids and engine operations, without sockets."""

from __future__ import annotations

import orjson
import pytest

from dpserve.router.control.engine_ops import ENGINE_OPS, engine_op, fill_path
from dpserve.router.http.endpoints import PROXIED_ENDPOINTS, RESPONSES, BodyKind, Prompt, by_id_endpoint, route
from dpserve.router.http.errors import OpenAIError
from dpserve.router.http.proxied_paths import is_proxied
from dpserve.router.http.request_body import parse_body, parse_form
from dpserve.router.http.stored_responses import ResponseOwners, id_of_answer, id_of_stream
from dpserve.router.routing.features import response_as_chat
from dpserve.router.routing.proxied_endpoints import proxied_openapi_paths, request_id_error, upstream_path

TRANSCRIPTIONS = next(endpoint for endpoint in PROXIED_ENDPOINTS if endpoint.path == "/v1/audio/transcriptions")
FORM = "multipart/form-data; boundary=XX"


def form(*parts: tuple[str, bytes, str | None]) -> bytes:
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += b"--XX\r\nContent-Disposition: " + disposition.encode() + b"\r\n\r\n" + value + b"\r\n"
    return out + b"--XX--\r\n"


def test_paths_are_unique_and_no_engine_operation_is_a_user_endpoint() -> None:
    paths = [endpoint.path for endpoint in PROXIED_ENDPOINTS]
    assert len(paths) == len(set(paths))
    assert not {op.path for op in ENGINE_OPS.values()} & set(paths)
    # Only generation endpoints feed the prefix and session policies.
    with_prompt = {endpoint.path for endpoint in PROXIED_ENDPOINTS if endpoint.prompt is not None}
    assert with_prompt == {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}


def test_the_openapi_document_lists_every_relayed_path_with_unique_operation_ids() -> None:
    paths = proxied_openapi_paths(PROXIED_ENDPOINTS)
    assert set(paths) >= {endpoint.path for endpoint in PROXIED_ENDPOINTS}
    ids = [operation["operationId"] for item in paths.values() for operation in item.values()]  # type: ignore[attr-defined]
    assert len(ids) == len(set(ids))
    assert "multipart/form-data" in paths["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]  # type: ignore[index]
    assert "get" in paths["/version"]  # type: ignore[operator]


def test_a_multipart_body_gives_its_model_and_stream_and_is_relayed_unchanged() -> None:
    raw = form(("model", b"whisper", None), ("stream", b"true", None), ("file", b"RIFF\x00\xff audio", "a.wav"))
    parsed = parse_form(raw, FORM, TRANSCRIPTIONS)
    assert (parsed.model, parsed.stream, parsed.raw) == ("whisper", True, raw)
    assert parse_form(form(("file", b"x", "a.wav")), FORM, TRANSCRIPTIONS).model is None


@pytest.mark.parametrize(
    ("raw", "content_type", "words"),
    [
        (form(("file", b"x", "a.wav")), "application/json", "multipart/form-data"),
        (form(("file", b"x", "a.wav")), "multipart/form-data", "boundary"),
        (form(("model", b"m", None)), FORM, "`file`"),
        (form(("file", b"x", "a.wav"))[:-8], FORM, "malformed"),
        (b"garbage", FORM, "malformed"),
        (b"", FORM, "malformed"),
        (form(("file", b"x", "a.wav"), ("stream", b"maybe", None)), FORM, "`stream`"),
    ],
)
def test_a_malformed_multipart_body_is_a_400_that_says_why(raw: bytes, content_type: str, words: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_form(raw, content_type, TRANSCRIPTIONS)
    assert caught.value.status == 400 and words in caught.value.message


def test_responses_need_input_and_read_as_chat_for_the_policies() -> None:
    with pytest.raises(OpenAIError):
        parse_body(b'{"model": "m"}', RESPONSES)
    payload = {
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    }
    assert response_as_chat(payload)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert response_as_chat({"input": "hello"})["messages"] == [{"role": "user", "content": "hello"}]
    assert RESPONSES.prompt is Prompt.RESPONSE and RESPONSES.body is BodyKind.JSON


def test_stored_response_paths_and_ids() -> None:
    get = by_id_endpoint("/v1/responses/resp_abc123", "GET")
    cancel = by_id_endpoint("/v1/responses/resp_abc123/cancel", "POST")
    assert get is not None and get.method == "GET" and cancel is not None and cancel.method == "POST"
    for bad in ("/v1/responses/", "/v1/responses/resp_1/other", "/v1/responses/a b", "/v1/responses/" + "x" * 300):
        assert by_id_endpoint(bad, "GET") is None
    assert id_of_answer(orjson.dumps({"id": "resp_1", "object": "response"})) == "resp_1"
    assert id_of_answer(b"not json") is None
    created = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_9"}}\n\n'
    assert id_of_stream(created) == "resp_9"
    assert id_of_stream(b"event: x\ndata: {broken\n\n") is None


def test_response_owners_are_bounded_and_forget_the_least_recently_used() -> None:
    owners = ResponseOwners(max_entries=2)
    owners.remember("a", "r0")
    owners.remember("b", "r1")
    assert owners.get("a") == "r0"  # a is now the most recent
    owners.remember("c", "r0")
    assert (owners.get("a"), owners.get("b"), owners.get("c"), len(owners)) == ("r0", None, "r0", 2)


def test_engine_operations_are_checked_by_name_and_method() -> None:
    assert engine_op("reset_prefix_cache", "POST").path == "/reset_prefix_cache"
    with pytest.raises(OpenAIError) as unknown:
        engine_op("rm_rf", "POST")
    assert unknown.value.status == 404
    with pytest.raises(OpenAIError) as wrong:
        engine_op("is_sleeping", "POST")
    assert wrong.value.status == 405 and wrong.value.headers == {"allow": "GET"}


def test_request_ids_are_bounded_visible_ascii() -> None:
    assert request_id_error("a" * 128) is None
    for bad in ("a" * 129, "a b", "tab\there", "é"):
        error = request_id_error(bad)
        assert error is not None and error.status == 400


def test_the_upstream_path_keeps_the_raw_path_and_query() -> None:
    scope = {"path": "/v1/responses/r 1", "raw_path": b"/v1/responses/r%201", "query_string": b"stream=true&x=1"}
    assert upstream_path(scope) == "/v1/responses/r%201?stream=true&x=1"
    assert upstream_path({"path": "/version", "query_string": b""}) == "/version"


def test_the_hot_path_answers_the_proxied_endpoints_and_stored_responses_only() -> None:
    assert all(is_proxied(endpoint.path) for endpoint in PROXIED_ENDPOINTS)
    assert is_proxied("/v1/responses/resp_1") and is_proxied("/v1/responses/resp_1/cancel")
    assert not any(is_proxied(path) for path in ("/health", "/v1/models", "/metrics", "/admin/replicas", "/v1/x"))


def test_an_engine_path_with_a_name_takes_it_from_the_query() -> None:
    op = engine_op("unload_adapter", "DELETE")
    assert fill_path(op, "adapter_name=tiny%20lora&x=1") == ("/adapters/tiny%20lora", "x=1")
    assert fill_path(engine_op("sleep", "POST"), "level=1") == ("/sleep", "level=1")
    with pytest.raises(OpenAIError) as missing:
        fill_path(op, "")
    assert missing.value.status == 400


def test_a_route_names_a_stored_response_by_template_not_by_id() -> None:
    assert route(RESPONSES) == "/v1/responses"
    get, cancel = by_id_endpoint("/v1/responses/resp_1", "GET"), by_id_endpoint("/v1/responses/resp_1/cancel", "POST")
    assert get is not None and cancel is not None
    assert (route(get), route(cancel)) == ("/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel")
