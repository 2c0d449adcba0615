"""The pooling endpoints through the router, against real vLLM pooling models: the tiny Llama served by
vLLM's CPU build as an embedding model (`--runner pooling --convert embed`: embeddings, pooling, score and
rerank) and as a classifier (`--convert classify`). Each answer through the router must be the replica's own,
byte for byte, but for the ids and creation times vLLM draws per request; and the official SDK reads the
same embeddings through the router as from the replica."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from dpserve.tiny_model import ensure_tiny_model
from tests.integration.conftest import answers, start_router, stop_router, vllm_replica, wait_until

pytestmark = pytest.mark.integration

EMBED, CLASSIFY = "tiny-embed", "tiny-classify"
POOLING = ("--runner", "pooling")
# The classifier's head from the tiny model's own output rows for tokens "A" and "B" (vLLM's online conversion):
# the checkpoint has no `score` weights, and without this vLLM leaves that layer as allocated, so a class's
# logit could be NaN and the replica answer 400 "Out of range float values are not JSON compliant" (1 run in 4).
CLASSIFIER_HEAD = json.dumps({"classifier_from_token": ["A", "B"], "method": "no_post_processing"})
START_TIMEOUT_S = 300
# What vLLM draws afresh for every request (and so differs between two runs of one request).
PER_REQUEST = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


@dataclass
class Pooling:
    router: str
    embed: str
    classify: str


@pytest.fixture(scope="module")
def pooling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pooling]:
    work = tmp_path_factory.mktemp("pooling")
    model = ensure_tiny_model(work / "cache")
    with (
        vllm_replica(model, EMBED, work / "embed.log", *POOLING, "--convert", "embed") as embed,
        vllm_replica(
            model, CLASSIFY, work / "classify.log", *POOLING, "--convert", "classify", "--hf-overrides", CLASSIFIER_HEAD
        ) as classify,
    ):
        # Both start at once; each must come up (its log says why not).
        wait_until(lambda: answers(f"{embed}/health") and answers(f"{classify}/health"), START_TIMEOUT_S, what="vllm")
        router = start_router([embed, classify], "least_loaded")
        try:
            yield Pooling(router.url, embed, classify)
        finally:
            stop_router(router)


CASES = [
    (EMBED, "/v1/embeddings", {"input": ["hello world", "the cat sat"]}),
    (EMBED, "/v1/embeddings", {"input": "hello", "encoding_format": "base64"}),
    (EMBED, "/pooling", {"input": "hello world"}),
    (EMBED, "/score", {"text_1": "hello", "text_2": ["hello world", "cats"]}),
    (EMBED, "/v1/score", {"text_1": "hello", "text_2": "hello world"}),
    (EMBED, "/rerank", {"query": "hello", "documents": ["hello world", "cats", "hello there"]}),
    (EMBED, "/v1/rerank", {"query": "hello", "documents": ["cats", "hello world"], "top_n": 1}),
    (EMBED, "/v2/rerank", {"query": "hello", "documents": ["cats", "hello world"]}),
    (CLASSIFY, "/classify", {"input": ["hello", "the cat sat"]}),
]


@pytest.mark.parametrize(("model", "path", "fields"), CASES, ids=[f"{case[1]}-{i}" for i, case in enumerate(CASES)])
def test_a_pooling_answer_through_the_router_is_the_replicas_own(
    pooling: Pooling, model: str, path: str, fields: dict[str, object]
) -> None:
    body = {"model": model, **fields}
    direct_url = pooling.embed if model == EMBED else pooling.classify
    with httpx.Client(timeout=60) as http:
        direct = http.post(f"{direct_url}{path}", json=body)
        routed = http.post(f"{pooling.router}{path}", json=body)
    assert direct.status_code == 200, (path, direct.text)
    assert routed.status_code == 200, (path, routed.text)
    # The model's name picks the replica: each request reached the one replica that serves it.
    assert routed.headers["x-dpserve-replica"] == ("r0" if model == EMBED else "r1")
    assert routed.headers["content-type"] == direct.headers["content-type"]
    assert PER_REQUEST.sub(b"", routed.content) == PER_REQUEST.sub(b"", direct.content)
    assert len(routed.content) > 100  # an answer with content, not an empty list


def test_the_official_sdk_reads_the_same_embeddings_through_the_router(pooling: Pooling) -> None:
    texts = ["hello world", "a longer sentence about the cat that sat on the mat"]
    vectors = []
    for base in (pooling.embed, pooling.router):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.embeddings.create(model=EMBED, input=texts)
        vectors.append([item.embedding for item in answer.data])
    assert len(vectors[0]) == 2 and len(vectors[0][0]) > 8
    assert vectors[1] == vectors[0]


def test_a_pooling_request_for_a_model_no_replica_serves_is_a_404_from_the_router(pooling: Pooling) -> None:
    answer = httpx.post(f"{pooling.router}/v1/embeddings", json={"model": "no-such-model", "input": "x"}, timeout=30)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found"
