"""`dpserve sim --data-parallel-size N`: N engines behind one server, as `vllm serve --data-parallel-size N`
with internal load balancing: pinning by header, vLLM's load score, per-engine caches, metrics and KV events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import orjson
import pytest
import zmq
from starlette.testclient import TestClient

from dpserve.config import SimSettings
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.sim.cache import PrefixCache
from dpserve.sim.dp import EngineGroup, RankOutOfRange, header_rank
from dpserve.sim.engine import GenerationRequest, LatencyModel, RequestStats, SimEngine
from dpserve.sim.kv_publisher import offset_endpoint
from dpserve.sim.replica import Simulator, build_simulator
from tests.conftest import free_port_range

RANK = "X-data-parallel-rank"
ENGINE_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:cache_config_info",
)


def dp_settings(size: int = 2, **overrides: Any) -> SimSettings:
    base: dict[str, Any] = {
        "sim_speed": 0,
        "sim_num_blocks": 64,
        "sim_block_size": 16,
        "max_model_len": 1024,
        "sim_data_parallel_size": size,
    }
    return SimSettings(**{**base, **overrides})


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(build_simulator(dp_settings()).app()) as test_client:
        yield test_client


def complete(client: TestClient, prompt: str, rank: str | None = None, **body: Any) -> httpx.Response:
    headers = {RANK: rank} if rank is not None else {}
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **body}, headers=headers)


def by_engine(text: str, name: str) -> dict[str, float]:
    """Each engine's value of `name` (summed over its other labels)."""
    totals: dict[str, float] = {}
    for labels, value in parse_samples(text, {name}).by_name.get(name, []):
        totals[labels["engine"]] = totals.get(labels["engine"], 0.0) + value
    return totals


def test_header_rank_is_read_as_vllm_reads_it() -> None:
    assert header_rank(None) is None
    assert header_rank("1") == 1
    assert header_rank(" 2 ") == 2  # Python's int(), as vLLM's
    assert header_rank("-1") == -1  # an integer: refused later as out of range
    assert header_rank("one") is None
    assert header_rank("1.0") is None


def test_each_engine_publishes_on_vllm_s_offset_endpoint() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"  # port 0: the OS picks each
    assert offset_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    with pytest.raises(ValueError, match="inproc"):
        offset_endpoint("ipc:///tmp/kv", 1)


def test_a_pinned_request_runs_on_its_engine_alone(client: TestClient) -> None:
    for rank in ("1", "1", "0"):
        assert complete(client, "a pinned prompt", rank).status_code == 200
    text = client.get("/metrics").text
    assert by_engine(text, "vllm:request_success_total") == {"0": 1, "1": 2}
    assert by_engine(text, "vllm:generation_tokens_total") == {"0": 2, "1": 4}
    queries = by_engine(text, "vllm:prefix_cache_queries_total")
    assert queries["1"] == 2 * queries["0"] > 0


def test_every_engine_series_carries_its_engine_label(client: TestClient) -> None:
    text = client.get("/metrics").text
    for name in ENGINE_SERIES:
        assert set(by_engine(text, name)) == {"0", "1"}, name
    configs = parse_samples(text, {"vllm:cache_config_info"}).by_name["vllm:cache_config_info"]
    # The KV settings apply to each engine: both report the whole --num-blocks.
    assert sorted((labels["engine"], labels["num_gpu_blocks"]) for labels, _ in configs) == [("0", "64"), ("1", "64")]


def test_each_engine_has_its_own_prefix_cache(client: TestClient) -> None:
    prompt = " ".join(f"word{i}" for i in range(120))

    def cached(rank: str) -> int:
        response = complete(client, prompt, rank)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("0") == 0
    assert cached("0") > 0
    assert cached("1") == 0  # cached on engine 0 only: a miss on engine 1
    assert cached("1") > 0
    client.post("/reset_prefix_cache")
    assert (cached("0"), cached("1")) == (0, 0)  # every engine's cache was reset


@pytest.mark.parametrize("rank", ["2", "-1"])
def test_a_rank_out_of_range_is_refused_as_vllm_refuses_it(client: TestClient, rank: str) -> None:
    message = f"data_parallel_rank {rank} is out of range [0, 2)."
    whole = complete(client, "hi", rank)
    assert whole.status_code == 400
    assert whole.json()["error"] == {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    # Streamed, vLLM finds it once its stream has begun: an error event, then [DONE].
    streamed = complete(client, "hi", rank, stream=True)
    assert streamed.status_code == 200
    frames = [frame for frame in streamed.text.split("\n\n") if frame]
    assert frames[-1] == "data: [DONE]"
    assert [orjson.loads(frame[6:])["error"]["message"] for frame in frames[:-1]] == [message]
    assert by_engine(client.get("/metrics").text, "vllm:request_success_total") == {"0": 0, "1": 0}


def test_a_rank_that_is_not_an_integer_is_ignored(client: TestClient) -> None:
    assert complete(client, "hi", "first").status_code == 200
    assert sum(by_engine(client.get("/metrics").text, "vllm:request_success_total").values()) == 1


def test_one_engine_refuses_rank_1_as_vllm_without_data_parallelism() -> None:
    with TestClient(build_simulator(dp_settings(size=1)).app()) as one:
        assert complete(one, "hi", "0").status_code == 200
        assert complete(one, "hi", "1").json()["error"]["message"] == "data_parallel_rank 1 is out of range [0, 1)."
        assert set(by_engine(one.get("/metrics").text, "vllm:num_requests_running")) == {"0"}


def test_the_data_parallel_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--data-parallel-size 0"):
        dp_settings(size=0)


# The load balancer.
def engines(count: int, blocks: int = 64, max_num_seqs: int = 8) -> EngineGroup:
    latency = LatencyModel(prefill_s_per_token=0.0, decode_s_per_token=0.05)
    return EngineGroup([SimEngine(PrefixCache(blocks, 4), latency, max_num_seqs) for _ in range(count)])


async def start(group: EngineGroup, rank: int, prompt: list[int], max_tokens: int = 50) -> asyncio.Task[None]:
    """A request on engine `rank`, running (or waiting) until it ends or its task is cancelled."""
    request = GenerationRequest(prompt, max_tokens, "length")
    tokens = group.generate(rank, request, [7] * max_tokens, RequestStats(0.0), True)

    async def consume(tokens: AsyncIterator[int]) -> None:
        async for _ in tokens:
            pass

    task = asyncio.ensure_future(consume(tokens))
    await asyncio.sleep(0.001)
    return task


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_ties_go_round_robin_and_a_pinned_rank_is_checked() -> None:
    group = engines(3)
    assert [group.choose(None) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert group.choose(2) == 2
    with pytest.raises(RankOutOfRange):
        group.choose(3)


async def test_unpinned_requests_go_to_the_engine_vllm_s_score_prefers() -> None:
    group = engines(2)
    busy = [await start(group, 0, [1, 2, 3]) for _ in range(2)]
    assert (group.score(0), group.score(1)) == (2.0, 0.0)
    # Engine 0 runs two: wherever the scan starts, the next requests go to engine 1 until it runs as many.
    chosen = []
    for _ in range(4):
        rank = group.choose(None)
        chosen.append(rank)
        busy.append(await start(group, rank, [4, 5, 6]))
    assert chosen == [1, 1, 0, 1]
    await stop(busy)
    assert (group.in_flight(0), group.in_flight(1)) == (0, 0)


async def test_waiting_requests_weigh_more_on_an_engine_short_of_kv() -> None:
    """score = max(in flight, waiting + running) + waiting x 6 x max(0, KV usage - 0.5)."""
    group = engines(2, blocks=16, max_num_seqs=8)
    # Engine 0: one request holding 14 of 16 blocks and one waiting for room (usage 0.875, 2 in flight).
    held = [await start(group, 0, list(range(40)), max_tokens=16), await start(group, 0, list(range(100, 108)), 8)]
    assert (group.engines[0].running, group.engines[0].waiting, group.engines[0].cache.usage) == (1, 1, 0.875)
    assert group.score(0) == pytest.approx(2 + 1 * 6 * 0.375)
    # Engine 1: three running with little KV used: 3 < 4.25, so engine 1 is the choice though it runs more.
    held += [await start(group, 1, [1, 2, 3], 4) for _ in range(3)]
    assert group.score(1) == 3.0
    assert [group.choose(None) for _ in range(2)] == [1, 1]
    await stop(held)
    assert (group.in_flight(0), group.in_flight(1)) == (0, 0)


async def test_a_request_never_started_is_no_longer_counted_in_flight() -> None:
    group = engines(2)
    tokens = group.generate(0, GenerationRequest([1, 2], 2, "length"), [7, 7], RequestStats(0.0), True)
    assert group.in_flight(0) == 1
    del tokens  # a streamed answer whose client left before it began
    assert group.in_flight(0) == 0


async def test_over_http_a_busy_engine_0_sends_new_requests_to_engine_1() -> None:
    simulator = build_simulator(dp_settings(sim_speed=1, sim_decode_ms_per_token=20, sim_prefill_ms_per_token=0))
    transport = httpx.ASGITransport(app=simulator.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as http:
        long = asyncio.ensure_future(
            http.post("/v1/completions", json={"prompt": "busy", "max_tokens": 50}, headers={RANK: "0"})
        )
        await asyncio.sleep(0.1)
        for _ in range(4):
            response = await http.post("/v1/completions", json={"prompt": "quick", "max_tokens": 1})
            assert response.status_code == 200
        text = (await http.get("/metrics")).text
        assert by_engine(text, "vllm:num_requests_running") == {"0": 1, "1": 0}
        assert by_engine(text, "vllm:request_success_total") == {"0": 0, "1": 4}
        assert (await long).status_code == 200


# KV events, on a real ZMQ subscription.
def subscribe(endpoint: str) -> zmq.Socket[bytes]:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    return socket


def drain(socket: zmq.Socket[bytes], wait_s: float) -> list[list[Any]]:
    batches = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if socket.poll(50):
            _, seq, payload = socket.recv_multipart()
            batches.append([int.from_bytes(seq, "big"), *msgspec.msgpack.decode(payload)])
    return batches


def stored_tokens(batches: list[list[Any]]) -> list[int]:
    return [t for batch in batches for event in batch[2] if event["type"] == "BlockStored" for t in event["token_ids"]]


def test_each_engine_publishes_its_kv_events_on_its_own_port_with_its_rank() -> None:
    port = free_port_range(2)
    simulator: Simulator = build_simulator(dp_settings(sim_kv_events=f"tcp://127.0.0.1:{port}"))
    assert [p.endpoint for p in simulator.publishers] == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    sockets = [subscribe(f"tcp://127.0.0.1:{port + rank}") for rank in (0, 1)]
    try:
        with TestClient(simulator.app()) as client:
            time.sleep(0.5)  # ZMQ's slow joiner: let the subscriptions reach the publishers
            prompts = {"0": " ".join(f"zero{i}" for i in range(40)), "1": " ".join(f"one{i}" for i in range(40))}
            ids = {rank: client.post("/tokenize", json={"prompt": p}).json()["tokens"] for rank, p in prompts.items()}
            for rank in ("1", "0"):
                assert complete(client, prompts[rank], rank).status_code == 200
            batches = [drain(socket, 1.0) for socket in sockets]
    finally:
        for socket in sockets:
            socket.close(linger=0)
    for rank, received in enumerate(batches):
        assert received, f"engine {rank} published nothing"
        assert {batch[3] for batch in received} == {rank}  # [seq, ts, events, data_parallel_rank]
        assert [batch[0] for batch in received] == list(range(len(received)))  # each engine its own sequence
        tokens = stored_tokens(received)
        assert tokens and tokens == ids[str(rank)][: len(tokens)]
