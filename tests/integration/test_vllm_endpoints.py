"""Everything a real vLLM replica serves, through the router: its whole route table, answers of any size,
stored responses on the replica that holds them (the shared fleet runs with the Responses store on)."""

from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import openai
import orjson
import pytest

from dpserve.router.control.engine_ops import ENGINE_OPS, ROUTER_OWN
from dpserve.router.http.endpoints import PROXIED_ENDPOINTS, RESPONSE_BY_ID
from dpserve.tiny_model import TINY_MODEL_NAME
from tests.integration.conftest import Fleet, RouterFactory

pytestmark = pytest.mark.integration

REPLICA_HEADER = "x-dpserve-replica"
# What vLLM draws afresh for every request (and so differs between two runs of one request).
OWN_ANSWERS = {(400, "invalid_request_error"), (404, "not_found_error")}
PER_REQUEST = re.compile(rb'"(id|created|request_id)":("[^"]*"|\d+)')


@pytest.fixture
def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_every_client_route_vllm_serves_is_relayed_and_engine_routes_are_admin_only(fleet: Fleet) -> None:
    direct = fleet.replica_urls[0]
    table = httpx.get(f"{direct}/openapi.json", timeout=10).json()["paths"]
    relayed = {(endpoint.path, endpoint.method) for endpoint in PROXIED_ENDPOINTS}
    relayed |= {(f"{RESPONSE_BY_ID}{{response_id}}", "GET"), (f"{RESPONSE_BY_ID}{{response_id}}/cancel", "POST")}
    engine = {(op.path, op.method) for op in ENGINE_OPS.values()}
    checked = refused = answered = 0
    missing = [
        f"{method.upper()} {template}"
        for template, operations in table.items()
        for method in operations
        if template not in ROUTER_OWN and (template, method.upper()) not in relayed | engine
    ]
    assert not missing, f"vLLM serves these; the router neither relays them nor has them as admin operations: {missing}"
    with httpx.Client(timeout=60) as http:
        for template, operations in table.items():
            if template in ROUTER_OWN:
                continue
            path = template.replace("{response_id}", "resp_nothing_here")
            for method in (name.upper() for name in operations):
                if (template, method) in engine:
                    assert http.request(method, f"{fleet.router_url}{path}").status_code == 404, path
                    continue
                body = {"model": TINY_MODEL_NAME} if method == "POST" else None
                replica_answer = http.request(method, f"{direct}{path}", json=body)
                at_replica = replica_answer.status_code
                via_router = http.request(method, f"{fleet.router_url}{path}", json=body)
                if REPLICA_HEADER in via_router.headers:  # relayed: the replica's own answer, as it sent it
                    assert via_router.status_code == at_replica, (method, path, at_replica, via_router.text)
                    same = PER_REQUEST.sub(b"", via_router.content) == PER_REQUEST.sub(b"", replica_answer.content)
                    assert same, (method, path, via_router.text, replica_answer.text)
                    answered += 1
                else:
                    # The router's own answer: a refusal of a body it reads (before any replica saw it), or a
                    # stored response no replica holds; an OpenAI error either way, never a 404/405/502/503
                    # where the replica would have answered.
                    error = via_router.json()["error"]["type"]
                    assert (via_router.status_code, error) in OWN_ANSWERS, (method, path, at_replica, via_router.text)
                    assert via_router.status_code == at_replica, (method, path, at_replica, via_router.text)
                    refused += 1
                checked += 1
    assert checked >= 10 and answered >= 4, (checked, answered, refused)


def test_a_680_kb_logprobs_answer_arrives_whole_and_as_the_replica_sent_it(fleet: Fleet) -> None:
    body = {
        "model": TINY_MODEL_NAME,
        "prompt": "hello",
        "max_tokens": 1500,
        "logprobs": 20,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"x-request-id": "wire-logprobs"}  # vLLM names the completion after it: the same id both ways
    with httpx.Client(timeout=120) as http:
        direct = http.post(f"{fleet.replica_urls[0]}/v1/completions", json=body, headers=headers)
        routed = http.post(f"{fleet.router_url}/v1/completions", json=body, headers=headers)
    assert direct.status_code == routed.status_code == 200
    assert len(routed.content) > 600_000
    # Only the creation time (whole seconds) may differ between two runs of the same greedy request.
    created = re.compile(rb'"created":\d+')
    assert created.sub(b"", routed.content) == created.sub(b"", direct.content)


def test_tokenize_detokenize_and_version_with_curl(fleet: Fleet) -> None:
    curl = shutil.which("curl")
    assert curl is not None, "curl is part of the test tools"

    def call(base: str, path: str, payload: dict[str, object] | None = None) -> object:
        command = [curl, "-sS", "--fail-with-body", f"{base}{path}"]
        if payload is not None:
            command += ["-H", "content-type: application/json", "-d", orjson.dumps(payload).decode()]
        return orjson.loads(subprocess.run(command, capture_output=True, check=True, timeout=30).stdout)

    replica = fleet.replica_urls[0]
    tokenized = call(fleet.router_url, "/tokenize", {"model": TINY_MODEL_NAME, "prompt": "hello world"})
    assert tokenized == call(replica, "/tokenize", {"model": TINY_MODEL_NAME, "prompt": "hello world"})
    tokens = tokenized["tokens"]  # type: ignore[index]
    text = call(fleet.router_url, "/detokenize", {"model": TINY_MODEL_NAME, "tokens": tokens})
    assert text == call(replica, "/detokenize", {"model": TINY_MODEL_NAME, "tokens": tokens})
    assert "hello world" in text["prompt"]  # type: ignore[index]
    version = call(fleet.router_url, "/version")
    assert version == call(replica, "/version") and version["version"]  # type: ignore[index]


def test_responses_create_plain_and_streamed_with_the_official_sdk(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=TINY_MODEL_NAME, input="Say hi", max_output_tokens=8)
    assert plain.id.startswith("resp_") and plain.output_text
    events = list(client.responses.create(model=TINY_MODEL_NAME, input="Say hi", max_output_tokens=8, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert any(kind == "response.output_text.delta" for kind in kinds)


def test_a_stored_response_is_retrieved_from_the_replica_that_made_it(
    fleet: Fleet, client: openai.OpenAI, router_factory: RouterFactory
) -> None:
    assert len(fleet.replica_urls) >= 2
    raw = client.responses.with_raw_response.create(model=TINY_MODEL_NAME, input="Remember me", max_output_tokens=8)
    made = raw.parse()
    owner = raw.headers[REPLICA_HEADER]
    for _ in range(4):  # whatever the policy would pick for load, the id decides
        fetched = client.responses.with_raw_response.retrieve(made.id)
        assert fetched.headers[REPLICA_HEADER] == owner
        assert fetched.parse().id == made.id and fetched.parse().output_text == made.output_text
    # A continuation goes where its previous response lives.
    follow = client.responses.with_raw_response.create(
        model=TINY_MODEL_NAME, input="And then?", previous_response_id=made.id, max_output_tokens=8
    )
    assert follow.headers[REPLICA_HEADER] == owner
    # A router that never saw the id (restarted, or another one) finds it by asking the replicas.
    other = router_factory("round_robin")
    fresh = openai.OpenAI(base_url=f"{other.url}/v1", api_key="unused", max_retries=0, timeout=60)
    fetched = fresh.responses.with_raw_response.retrieve(made.id)
    assert fetched.headers[REPLICA_HEADER] == owner and fetched.parse().id == made.id
    with pytest.raises(openai.NotFoundError):
        fresh.responses.retrieve("resp_0000000000000000")
    assert fresh.responses.create(model=TINY_MODEL_NAME, input="still serving", max_output_tokens=4).id


def test_engine_operations_go_through_the_admin_api(fleet: Fleet) -> None:
    with httpx.Client(timeout=60) as http:
        everywhere = http.post(f"{fleet.router_url}/admin/engine/reset_prefix_cache")
        assert everywhere.status_code == 200
        assert sorted(answer["status"] for answer in everywhere.json()["replicas"]) == [200, 200]
        one = http.get(f"{fleet.router_url}/admin/replicas/r1/engine/is_sleeping").json()
        assert one["replicas"] == [{"replica": "r1", "status": 200, "body": {"is_sleeping": False}}]
        assert http.post(f"{fleet.router_url}/admin/engine/no_such_op").status_code == 404
        assert http.get(f"{fleet.router_url}/admin/engine/sleep").status_code == 405
        assert http.post(f"{fleet.router_url}/reset_prefix_cache").status_code == 404  # not a user path
