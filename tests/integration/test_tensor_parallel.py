"""`dpserve up --tensor-parallel-size 2` on the CPU: one vLLM replica of two ranks, a core each
(VLLM_CPU_OMP_THREADS_BIND "0|1"), keyed by `dpserve up` for its router only, serving the official `openai`
SDK through the router. The GPU side (grouping by NVML topology, CUDA_VISIBLE_DEVICES, `@gpu=0,1`) is planned
the same way and tested in tests/unit/test_plan.py and test_gpu_topology.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.up.plan import VLLM_SERVER_MODULE, rank_cores
from tests.integration.conftest import (
    FLEET_START_TIMEOUT_S,
    Fleet,
    bearer,
    router_status,
    running_fleet,
    wait_until,
)

pytestmark = pytest.mark.integration

if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("two ranks want a core each", allow_module_level=True)


@pytest.fixture(scope="module")
def wide_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("tensor-parallel")
    up_args = ["--replicas", "1", "--tensor-parallel-size", "2", "--cache-dir", str(work / "cache")]
    started = time.monotonic()
    # Keyed (open_replicas=False): the SDK goes through the router, which dpserve up gave the replica's key.
    with running_fleet(work, 1, up_args, FLEET_START_TIMEOUT_S, open_replicas=False) as fleet:
        print(f"tensor-parallel fleet ready in {time.monotonic() - started:.0f} s")
        yield fleet


@pytest.fixture
def client(wide_fleet: Fleet) -> openai.OpenAI:
    # The router wants no key of clients here; the replica's key is the router's business.
    return openai.OpenAI(base_url=f"{wide_fleet.router_url}/v1", api_key="unused", max_retries=0, timeout=120)


def replica_log(fleet: Fleet) -> str:
    (path,) = Path(fleet.log_path.parent / "run").glob("r0.log")
    return path.read_text(errors="replace")


def test_the_replica_runs_two_ranks_each_on_its_own_core(wide_fleet: Fleet) -> None:
    children = psutil.Process(wide_fleet.process.pid).children(recursive=True)
    (server,) = [p for p in children if VLLM_SERVER_MODULE in p.cmdline()]
    argv = server.cmdline()
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    # This machine's cores in two halves (on two cores: "0|1").
    ranks = rank_cores(sorted(os.sched_getaffinity(0)), 1, 2)[0]
    bind = "|".join(",".join(map(str, rank)) for rank in ranks)
    assert server.environ()["VLLM_CPU_OMP_THREADS_BIND"] == bind
    # The launcher's table names the replica's two core sets (printed once its router is ready).
    wait_until(lambda: f"cpu:{bind}" in wide_fleet.log_path.read_text(), 30, what="the launcher's table")
    # vLLM itself says it runs at that size, each rank's threads bound to its own core.
    log = replica_log(wide_fleet)
    assert "tensor_parallel_size=2" in log, log[-3000:]
    assert "local_world_size=2" in log, log[-3000:]
    for rank, cores in enumerate(ranks):
        assert f"local_rank={rank}, core ids={list(cores)}" in log, log[-3000:]
        assert f"world_size=2 rank={rank} local_rank={rank}" in log, log[-3000:]
    # Keyed for its router only.
    assert httpx.get(f"{wide_fleet.replica_urls[0]}/v1/models", timeout=10).status_code == 401
    (replica,) = router_status(wide_fleet.router_url)["replicas"]
    assert replica["id"] == "r0" and replica["healthy"] is True


def test_sdk_models_and_chat(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [TINY_MODEL_NAME]
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
    )
    assert raw.headers["x-dpserve-replica"] == "r0"
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage is not None and completion.usage.completion_tokens > 0


def test_sdk_completion_is_deterministic_across_the_ranks(client: openai.OpenAI) -> None:
    first = client.completions.create(model=TINY_MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0)
    second = client.completions.create(model=TINY_MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert first.object == "text_completion"
    assert first.usage is not None and first.usage.completion_tokens == 6
    assert first.choices[0].text == second.choices[0].text


def test_sdk_streams(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=[{"role": "user", "content": "Tell a story"}],
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces = []
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(pieces) >= 20
    assert usage is not None and usage.completion_tokens == 40


def test_dpserve_up_keys_its_replicas_for_its_router_only(wide_fleet: Fleet) -> None:
    """No key given: `dpserve up` makes one, hands it to vLLM and to its router in their environments (not
    their command lines), and the replica refuses anyone else."""
    chat = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    answer = httpx.post(f"{wide_fleet.router_url}/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 200, answer.text
    assert httpx.get(f"{wide_fleet.replica_urls[0]}/v1/models", timeout=10).status_code == 401
    children = psutil.Process(wide_fleet.process.pid).children(recursive=True)
    (vllm,) = [p for p in children if VLLM_SERVER_MODULE in p.cmdline()]
    (router,) = [p for p in children if p.cmdline()[1:4] == ["-m", "dpserve", "router"]]
    key = vllm.environ()["VLLM_API_KEY"]
    assert len(key) >= 32 and router.environ()["DPSERVE_REPLICA_API_KEY"] == key
    assert not [arg for arg in (*vllm.cmdline(), *router.cmdline()) if key in arg or arg == "--api-key"]
    assert httpx.get(f"{wide_fleet.replica_urls[0]}/v1/models", headers=bearer(key), timeout=10).status_code == 200
