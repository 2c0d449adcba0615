"""A vLLM data-parallel server's engines routed as replicas of their own (no sockets): found from the
metrics' `engine` label or stated with `@dp=N`, pinned by rank, their KV events at the endpoint's port plus
the rank, their load from their own series, their share of the server's GPUs."""

from __future__ import annotations

import pytest

from dpserve.gpu.placement import ReplicaClue, place_replicas
from dpserve.gpu.sample import GpuProcess, GpuSample
from dpserve.replicas.kv_events import engine_endpoint
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.replicas.registry import ReplicaRegistry, split_engine_count

DP_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
"""


def test_the_engines_are_read_from_the_engine_label_and_each_reads_its_own_series() -> None:
    samples = parse_samples(
        DP_METRICS, {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:cache_config_info"}
    )
    assert samples.engines("vllm:num_requests_running") == [0, 1]
    one = samples.of_engine(1)
    assert (one.total("vllm:num_requests_running"), one.total("vllm:num_requests_waiting")) == (1.0, 0.0)
    # A series no engine is named on is the server's: every engine keeps it.
    assert one.first_labels("vllm:cache_config_info") == {"block_size": "16", "num_gpu_blocks": "100"}
    single = parse_samples('vllm:num_requests_running{engine="0"} 1.0\n', {"vllm:num_requests_running"})
    assert single.engines("vllm:num_requests_running") == [0]


def test_a_server_splits_into_engines_named_after_it_and_pinned_by_rank() -> None:
    registry = ReplicaRegistry(["r0=http://10.0.0.1:8000@gpu=0,1,2,3", "http://10.0.0.2:8000"])
    added = []
    registry.on_added(added.append)
    engines = registry.split_engines("r0", [0, 1])
    assert [(e.id, e.url, e.rank, e.gpu_hint) for e in engines] == [
        ("r0:dp0", "http://10.0.0.1:8000", 0, ("0", "1")),
        ("r0:dp1", "http://10.0.0.1:8000", 1, ("2", "3")),
    ]
    assert "r0" not in registry and added == engines
    assert [r.id for r in registry.at_url("http://10.0.0.1:8000/")] == ["r0:dp0", "r0:dp1"]
    # Across routers an engine is its server's URL and its rank, whatever each router names the server.
    assert [e.where for e in engines] == ["http://10.0.0.1:8000#dp0", "http://10.0.0.1:8000#dp1"]
    assert registry.get("10.0.0.2:8000").where == "http://10.0.0.2:8000"


def test_engines_stated_with_dp_are_added_at_once() -> None:
    registry = ReplicaRegistry(["r0=http://10.0.0.1:8000@gpu=0,1@dp=2", "http://10.0.0.2:8000@dp=1"])
    assert [(r.id, r.rank, r.gpu_hint) for r in registry] == [
        ("r0:dp0", 0, ("0",)),
        ("r0:dp1", 1, ("1",)),
        ("10.0.0.2:8000", None, ()),
    ]
    assert split_engine_count("http://h:1@dp=4") == ("http://h:1", 4)
    for bad in ("http://h:1@dp=0", "http://h:1@dp=x", "http://h:1@dp="):
        with pytest.raises(ValueError, match="data-parallel-size"):
            split_engine_count(bad)


def test_a_draining_server_splits_into_draining_engines() -> None:
    registry = ReplicaRegistry(["r0=http://10.0.0.1:8000"])
    registry.set_draining("r0", True)
    assert all(engine.draining for engine in registry.split_engines("r0", [0, 1]))


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://10.0.0.1:5557", 0, "tcp://10.0.0.1:5557"),
        ("tcp://10.0.0.1:5557", 3, "tcp://10.0.0.1:5560"),
        ("tcp://*:0", 1, "tcp://*:0"),  # a port the OS picks: vLLM leaves it
        ("inproc://cache", 2, "inproc://cache_dp2"),
        ("tcp://10.0.0.1:5557", None, "tcp://10.0.0.1:5557"),
    ],
)
def test_an_engines_events_come_where_vllm_publishes_them(endpoint: str, rank: int | None, expected: str) -> None:
    assert engine_endpoint(endpoint, rank) == expected


def test_an_engine_holds_its_share_of_its_servers_gpus_in_index_order() -> None:
    server = frozenset({100, 101, 102})  # the API server and its two engine processes, one GPU pair each
    gpus = [
        GpuSample(index=i, uuid=f"GPU-{i}", name="H100", processes=(GpuProcess(pid=101 + i // 2, used_memory_bytes=1),))
        for i in range(4)
    ]
    clues = [ReplicaClue("r0:dp0", (), server, (0, 2)), ReplicaClue("r0:dp1", (), server, (1, 2))]
    assert place_replicas(clues, gpus) == {"r0:dp0": (0, 1), "r0:dp1": (2, 3)}
    assert place_replicas([ReplicaClue("r0", (), server)], gpus) == {"r0": (0, 1, 2, 3)}
