"""The official `openai` SDK against the router over 2 real vLLM CPU replicas."""

from __future__ import annotations

import time

import openai
import pytest

from dpserve.tiny_model import TINY_MODEL_NAME
from tests.integration.conftest import Fleet

pytestmark = pytest.mark.integration


@pytest.fixture
def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = list(client.models.list())
    assert models[0].id == TINY_MODEL_NAME
    # The fleet runs with LoRA on and other tests load adapters: anything else listed is one of them.
    assert all((model.model_extra or {}).get("parent") == TINY_MODEL_NAME for model in models[1:])


def test_chat_completion(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
    )
    completion = raw.parse()
    assert raw.headers["x-dpserve-replica"] in {"r0", "r1"}
    assert raw.headers["x-request-id"]
    assert completion.object == "chat.completion"
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    assert completion.choices[0].message.role == "assistant"


def test_completion_without_model_defaults_to_the_only_model(fleet: Fleet) -> None:
    import httpx

    response = httpx.post(f"{fleet.router_url}/v1/completions", json={"prompt": "Once upon", "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == TINY_MODEL_NAME


def test_completion_and_client_request_id(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=TINY_MODEL_NAME, prompt="Once upon a time", max_tokens=6, extra_headers={"x-request-id": "req-abc-123"}
    )
    assert raw.headers["x-request-id"] == "req-abc-123"
    completion = raw.parse()
    assert completion.object == "text_completion"
    assert completion.usage is not None and completion.usage.completion_tokens == 6


def test_chat_stream_is_relayed_chunk_by_chunk(client: openai.OpenAI) -> None:
    started = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    stream = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=[{"role": "user", "content": "Tell a story"}],
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        arrivals.append(time.perf_counter() - started)
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) >= 100
    total = arrivals[-1]
    # Buffering the whole answer would deliver the first chunk at the very end.
    assert arrivals[0] < total / 2, f"first chunk at {arrivals[0]:.2f}s of {total:.2f}s"


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=TINY_MODEL_NAME, prompt="The sea", max_tokens=12, stream=True))
    assert chunks and all(chunk.object == "text_completion" for chunk in chunks)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def test_unknown_model_is_a_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"


def test_embeddings_on_a_generative_model_is_an_openai_style_4xx(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(model=TINY_MODEL_NAME, input="hello")
    assert 400 <= caught.value.status_code < 500
    body = caught.value.body
    assert isinstance(body, dict) and isinstance(body.get("message"), str)
