"""The contract between `dpserve sim` and vLLM: the same checks run against a real vLLM CPU replica and a
sim, and what the router relies on must agree: response shapes (whole and streamed), usage fields, error
shapes, token ids, metric names/types/labels/buckets, and the KV-event wire format."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import orjson
import pytest
import zmq

from dpserve.replicas.prometheus_text import parse_samples
from tests.integration.conftest import Fleet, running_sim

pytestmark = pytest.mark.integration

MODEL = "dpserve-tiny"
# What the router and the benchmarks read: each must exist on both sides with the same labels.
REQUIRED_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
)


@dataclass
class Target:
    name: str
    url: str
    kv_events: str


@pytest.fixture(scope="module")
def targets(fleet: Fleet) -> Iterator[dict[str, Target]]:
    vllm = Target("vllm", fleet.replica_urls[0], fleet.kv_event_endpoints[0])
    text = httpx.get(f"{vllm.url}/metrics", timeout=10).text
    block_size = parse_samples(text, {"vllm:cache_config_info"}).first_labels("vllm:cache_config_info")["block_size"]
    # Same block size as the real replica, so both publish the same blocks for the same prompt.
    with running_sim("--block-size", block_size, "--decode-ms-per-token", "1") as sim:
        yield {"vllm": vllm, "sim": Target("sim", sim.url, sim.kv_events)}


def shape(value: Any) -> Any:
    """Keys all the way down; lists by their first item; scalars by nothing (values differ by design)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return "*"


def both(targets: dict[str, Target], method: str, path: str, **kwargs: Any) -> dict[str, httpx.Response]:
    with httpx.Client(timeout=120) as client:
        return {name: client.request(method, t.url + path, **kwargs) for name, t in targets.items()}


def sse_events(response: httpx.Response) -> list[Any]:
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.text
    assert text.endswith("data: [DONE]\n\n")
    frames = [frame for frame in text.split("\n\n") if frame]
    assert all(frame.startswith("data: ") for frame in frames)
    return [orjson.loads(frame[6:]) for frame in frames[:-1]]


def unique_text(words: int) -> str:
    tag = uuid.uuid4().hex
    return " ".join(f"{tag[i % 32]}word{i}" for i in range(words))


def test_health_and_models(targets: dict[str, Target]) -> None:
    health = both(targets, "GET", "/health")
    assert {r.status_code for r in health.values()} == {200}
    models = both(targets, "GET", "/v1/models")
    assert shape(models["sim"].json()) == shape(models["vllm"].json())
    assert models["sim"].json()["data"][0]["id"] == models["vllm"].json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_whole_responses_have_the_same_shape_and_usage(targets: dict[str, Target], path: str) -> None:
    text = unique_text(200)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "ignore_eos": True}
    if "chat" in path:
        body["messages"] = [{"role": "system", "content": text}, {"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = text
    first = both(targets, "POST", path, json=body)
    again = both(targets, "POST", path, json=body)
    for name in targets:
        assert first[name].status_code == again[name].status_code == 200, first[name].text
        assert first[name].headers["content-type"].startswith("application/json")
    assert shape(first["sim"].json()) == shape(first["vllm"].json())
    sim_usage, vllm_usage = again["sim"].json()["usage"], again["vllm"].json()["usage"]
    # Same tokenizer and chat template: the same prompt length, and the repeat hits the same cached prefix.
    assert sim_usage["prompt_tokens"] == vllm_usage["prompt_tokens"]
    assert sim_usage["completion_tokens"] == vllm_usage["completion_tokens"] == 5
    assert sim_usage["prompt_tokens_details"]["cached_tokens"] == vllm_usage["prompt_tokens_details"]["cached_tokens"]
    assert vllm_usage["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_have_the_same_chunk_format(targets: dict[str, Target], path: str) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "Tell me a story"}]
    else:
        body["prompt"] = "Once upon a time"
    for include_usage in (True, False):
        body["stream_options"] = {"include_usage": include_usage}
        responses = both(targets, "POST", path, json=body)
        streams = {name: sse_events(response) for name, response in responses.items()}
        sim, vllm = streams["sim"], streams["vllm"]
        # One chunk per token (chat opens with a role chunk). vLLM's completions skip a token whose text
        # is still an incomplete UTF-8 sequence (its random model writes some): it may send fewer.
        opening = 1 if "chat" in path else 0
        assert len(sim) == opening + 4 + include_usage
        assert opening + include_usage < len(vllm) <= len(sim)
        finishing = -2 if include_usage else -1
        # The opening chunk, every token chunk, the finishing one and the usage chunk: the same shapes.
        assert shape(sim[0]) == shape(vllm[0])
        vllm_tokens = {str(shape(c)) for c in vllm[opening:finishing]}
        assert vllm_tokens in ({str(shape(c)) for c in sim[opening:finishing]}, set())
        assert shape(sim[finishing]) == shape(vllm[finishing])
        assert shape(sim[-1]) == shape(vllm[-1])
        assert sim[finishing]["choices"][0]["finish_reason"] == vllm[finishing]["choices"][0]["finish_reason"]
        if include_usage:
            assert sim[-1]["choices"] == vllm[-1]["choices"] == []
            assert sim[-1]["usage"]["prompt_tokens"] == vllm[-1]["usage"]["prompt_tokens"]


def test_tokenize_gives_the_same_ids(targets: dict[str, Target]) -> None:
    for body in (
        {"model": MODEL, "prompt": "Hello there, how are you? 123 ünïcode"},
        {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    ):
        responses = both(targets, "POST", "/tokenize", json=body)
        assert responses["sim"].json()["tokens"] == responses["vllm"].json()["tokens"]
        assert shape(responses["sim"].json()) == shape(responses["vllm"].json())


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "no-such-model", "prompt": "x", "max_tokens": 2}, 404),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400),
        ({"model": MODEL, "prompt": "word " * 5000, "max_tokens": 2}, 400),
    ],
)
def test_errors_have_the_same_shape_status_and_type(
    targets: dict[str, Target], body: dict[str, Any], status: int
) -> None:
    responses = both(targets, "POST", "/v1/completions", json=body)
    assert {r.status_code for r in responses.values()} == {status}
    errors = {name: r.json()["error"] for name, r in responses.items()}
    assert shape(errors["sim"]) == shape(errors["vllm"])
    assert errors["sim"]["type"] == errors["vllm"]["type"]
    assert errors["sim"]["code"] == errors["vllm"]["code"] == status


def metric_families(text: str) -> dict[str, tuple[str, set[frozenset[str]], set[str]]]:
    """Per sample name: its family's TYPE, the label-name sets of its series, and histogram buckets."""
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    samples = parse_samples(text, names)
    families = {}
    for name, series in samples.by_name.items():
        family = next((f for f in types if name == f or name.startswith(f + "_")), name)
        label_sets = {frozenset(k for k in labels if k != "le") for labels, _ in series}
        buckets = {labels["le"] for labels, _ in series if "le" in labels}
        families[name] = (types.get(family, "untyped"), label_sets, buckets)
    return families


def test_metrics_use_vllm_names_types_labels_and_buckets(targets: dict[str, Target]) -> None:
    both(targets, "POST", "/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 2})
    responses = both(targets, "GET", "/metrics")
    sim, vllm = (metric_families(responses[name].text) for name in ("sim", "vllm"))
    for name in REQUIRED_METRICS:
        assert name in sim and name in vllm, name
    sim_vllm_names = {name for name in sim if name.startswith("vllm:")}
    assert len(sim_vllm_names) > 20
    for name in sim_vllm_names:
        assert name in vllm, f"the sim exports {name}, which vLLM does not"
        assert sim[name] == vllm[name], (name, sim[name], vllm[name])


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)

    def join(self, url: str, timeout_s: float = 30) -> None:
        """Until the subscription has reached the publisher (ZMQ's slow joiner drops what is published before):
        a prompt of its own sent to the replica at `url` until one of its events comes back."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=60) as client:
            while True:
                body = {"model": MODEL, "prompt": unique_text(100), "max_tokens": 1}
                assert client.post(f"{url}/v1/completions", json=body).status_code == 200
                if self.socket.poll(500):
                    return
                assert time.monotonic() < deadline, "no KV event reached the subscriber"

    def drain(self, wait_s: float) -> list[list[bytes]]:
        messages = []
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.socket.poll(100):
                messages.append(self.socket.recv_multipart())
        return messages

    def close(self) -> None:
        self.socket.close(linger=0)


def test_kv_events_use_vllm_wire_format_and_the_same_blocks(targets: dict[str, Target]) -> None:
    subscribers = {name: Subscriber(t.kv_events) for name, t in targets.items()}
    try:
        for name, sub in subscribers.items():
            sub.join(targets[name].url)
            sub.drain(0.3)
        prompt = unique_text(400)
        responses = both(targets, "POST", "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert {r.status_code for r in responses.values()} == {200}
        messages = {name: sub.drain(1.5) for name, sub in subscribers.items()}
    finally:
        for sub in subscribers.values():
            sub.close()
    stored: dict[str, list[dict[str, Any]]] = {name: [] for name in messages}
    for name, frames in messages.items():
        assert frames, f"{name} published no KV event"
        sequences = []
        for topic, seq, payload in frames:
            assert topic == b"" and len(seq) == 8
            sequences.append(int.from_bytes(seq, "big"))
            batch = msgspec.msgpack.decode(payload)
            assert isinstance(batch, list) and isinstance(batch[0], float) and isinstance(batch[1], list)
            stored[name] += [event for event in batch[1] if event["type"] == "BlockStored"]
        assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
        # vLLM may store one prompt in several events (chunked prefill): each names the last as parent.
        for previous, event in zip(stored[name], stored[name][1:], strict=False):
            assert event["parent_block_hash"] == previous["block_hashes"][-1]
    sim, vllm = stored["sim"][0], stored["vllm"][0]
    assert sorted(sim) == sorted(vllm)
    assert {k: type(v).__name__ for k, v in sim.items()} == {k: type(v).__name__ for k, v in vllm.items()}
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in sim["block_hashes"])
    assert sim["block_size"] == vllm["block_size"]
    # Same tokenizer, same block size: the same blocks, token for token.
    tokens = {name: [t for event in events for t in event["token_ids"]] for name, events in stored.items()}
    assert tokens["sim"] == tokens["vllm"]
    assert sum(len(e["block_hashes"]) for e in stored["sim"]) == sum(len(e["block_hashes"]) for e in stored["vllm"])
