"""The simulator's HTTP surface in-process: bad input is a 4xx in vLLM's error shape, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from dpserve.config import SimSettings
from dpserve.sim.replica import build_simulator
from dpserve.sim.tokenizer import FastTokenizer, TinyTokenizer


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = SimSettings(sim_speed=0, sim_num_blocks=64, sim_block_size=16, max_model_len=2048)
    with TestClient(build_simulator(settings).app()) as test_client:
        yield test_client


BAD_BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": {"a": 1}}),
    ("/v1/completions", {"prompt": [1, -2]}),
    ("/v1/completions", {"prompt": [10**9]}),
    ("/v1/completions", {"prompt": ["a", "b"]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1500}),  # fits the context, not the 64-block cache
    ("/v1/completions", {"prompt": "hi", "n": 2}),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": [1]}),
    ("/v1/completions", {"prompt": "hi", "model": "other"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": "hello"}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/tokenize", {"prompt": None}),
    ("/tokenize", {"messages": [1]}),
    ("/v1/completions/render", {"prompt": None}),
    ("/v1/chat/completions/render", {"messages": []}),
]


@pytest.mark.parametrize(("path", "body"), BAD_BODIES)
def test_bad_input_is_a_clear_4xx(client: TestClient, path: str, body: Any) -> None:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == response.status_code and error["type"]


def test_served_after_bad_input_and_null_content_is_empty_text(client: TestClient) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "?"},
    ]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_stream_ends_with_done_and_counts_tokens(client: TestClient) -> None:
    body = {"prompt": "Hello", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        text = response.read().decode()
    frames = [frame for frame in text.split("\n\n") if frame]
    assert frames[-1] == "data: [DONE]"
    chunks = [orjson.loads(frame[6:]) for frame in frames[:-1]]
    assert len(chunks) == 6 and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_without_max_tokens_the_model_stops_by_itself(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "Hello"})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and 1 <= response.json()["usage"]["completion_tokens"] <= 64


def test_repeat_reports_cached_tokens_and_reset_clears_them(client: TestClient) -> None:
    body = {"prompt": "The same long prompt, again and again. " * 10, "max_tokens": 1}
    client.post("/v1/completions", json=body)
    assert client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert client.post("/reset_prefix_cache").status_code == 200
    assert client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_tokenizers_are_deterministic_across_instances() -> None:
    text = "Deterministic: the same text, the same ids, in every process."
    assert TinyTokenizer().encode(text) == TinyTokenizer().encode(text)
    assert FastTokenizer().encode(text) == FastTokenizer().encode(text)
    assert FastTokenizer().encode(text)[0] == FastTokenizer.BOS_ID


def test_fast_tokenizer_serves_chat_and_tokenize() -> None:
    settings = SimSettings(sim_speed=0, sim_tokenizer="fast")
    with TestClient(build_simulator(settings).app()) as fast:
        chat = fast.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        )
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
        ids = fast.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
        assert ids == FastTokenizer().encode("hello world") and len(ids) == 4


def test_render_endpoints_give_the_ids_tokenize_gives(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Render me."}]
    rendered = client.post("/v1/completions/render", json={"prompt": "Render me."}).json()
    assert rendered[0]["token_ids"] == client.post("/tokenize", json={"prompt": "Render me."}).json()["tokens"]
    chat = client.post("/v1/chat/completions/render", json={"messages": messages}).json()
    assert chat["token_ids"] == client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat["request_id"].startswith("chatcmpl-") and chat["model"] == "dpserve-tiny"


KEY = "replica-key-123"
AUTH_CASES: list[tuple[str, str, dict[str, str]]] = [
    (method, path, headers)
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions/render"),
        ("GET", "/v2/anything"),
        ("POST", "/inference/v1/generate"),
        ("POST", "/cohere/v2/chat"),
        ("OPTIONS", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("POST", "/tokenize"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/v1x"),
    )
    for headers in (
        {},
        {"authorization": f"Bearer {KEY}"},
        {"authorization": f"bearer {KEY}"},
        {"authorization": "Bearer wrong"},
        {"authorization": KEY},
        {"authorization": f"Basic {KEY}"},
        {"authorization": f"Bearer {KEY} "},
    )
]


@pytest.mark.engine
def test_the_sims_api_key_guards_exactly_the_paths_vllms_does() -> None:
    """The same requests through vLLM's own middleware and the sim's, around the same app: the same answers."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from dpserve.sim.auth import RequireKey

    async def anything(request: Request) -> PlainTextResponse:
        return PlainTextResponse("through")

    inner = Starlette(routes=[Route("/{path:path}", anything, methods=["GET", "POST", "OPTIONS"])])
    guard = AuthenticationMiddleware(inner, [KEY])

    async def vllms(scope: Any, receive: Any, send: Any) -> None:  # its __call__ returns the awaitable
        await guard(scope, receive, send)

    seen = set()
    with TestClient(vllms) as vllm, TestClient(RequireKey(inner, KEY)) as sim:
        for method, path, headers in AUTH_CASES:
            theirs, ours = vllm.request(method, path, headers=headers), sim.request(method, path, headers=headers)
            assert (ours.status_code, ours.text) == (theirs.status_code, theirs.text), (method, path, headers)
            seen.add(ours.status_code)
    assert seen == {200, 401}


def test_sim_with_an_api_key_refuses_v1_without_it_and_serves_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpserve.config import load_settings

    monkeypatch.setenv("VLLM_API_KEY", KEY)  # read as vLLM reads it
    settings = load_settings(SimSettings, {"sim_speed": 0})
    assert settings.sim_api_key == KEY
    body = {"prompt": "hi", "max_tokens": 2}
    with TestClient(build_simulator(settings).app()) as sim:
        refused = sim.post("/v1/completions", json=body)
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        assert sim.get("/v1/models").status_code == 401
        assert sim.get("/health").status_code == 200 and sim.get("/metrics").status_code == 200
        served = sim.post("/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    with TestClient(build_simulator(SimSettings(sim_speed=0)).app()) as open_sim:
        assert open_sim.post("/v1/completions", json=body).status_code == 200
