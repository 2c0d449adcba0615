"""LoRA adapters across the fleet's 2 real vLLM CPU replicas (`--max-loras 2`), through a router given
the adapter folder (`--lora-dir`): listed with their parent, loaded on demand where placement says, one
load for concurrent first requests, an idle adapter unloaded for room, and an adapter the replica lost
(unloaded behind the router's back, or a restart) loaded again. The restart is the one of a replica killed under
traffic (test_lifecycle.py's Traffic), which fails no request through the fleet's own router."""

from __future__ import annotations

import asyncio
import collections
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import (
    FLEET_MAX_LORAS,
    Fleet,
    RouterProcess,
    router_status,
    start_router,
    stop_router,
    wait_until,
)
from tests.integration.test_lifecycle import REQUEST, StreamTraffic, Traffic, replica_process

pytestmark = pytest.mark.integration

ADAPTERS = [f"tiny-lora-{index}" for index in range(6)]
PROMPT = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def lora_dir(fleet: Fleet) -> Path:
    """6 adapters of the fleet's tiny model (`dpserve model tiny-lora`), built once."""
    work = fleet.log_path.parent
    folder = lora_dir_of(fleet)
    command = [sys.executable, "-m", "dpserve", "model", "tiny-lora", str(folder), "--count", str(len(ADAPTERS))]
    subprocess.run([*command, "--cache-dir", str(work / "cache")], check=True, capture_output=True, timeout=300)
    return folder


def lora_dir_of(fleet: Fleet) -> Path:
    return fleet.log_path.parent / "adapters"


def listed_adapters(url: str) -> set[str]:
    cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {card["id"] for card in cards if card.get("parent")}


def unload_everything(fleet: Fleet) -> None:
    for url in fleet.replica_urls:
        for name in listed_adapters(url):
            httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a router metric's samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def loads(router: RouterProcess) -> float:
    return metric(router.url, "dpserve_lora_loads_total", outcome="ok")


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={**PROMPT, "model": model}, timeout=120)


@pytest.fixture
def lora_router(fleet: Fleet, lora_dir: Path) -> Iterator[RouterProcess]:
    """A router over the fleet's replicas, which hold no adapter at first and have reported their slots."""
    unload_everything(fleet)
    for url in fleet.replica_urls:  # a request makes vLLM report `vllm:lora_requests_info` (its max_lora)
        httpx.post(f"{url}/v1/completions", json={**PROMPT, "model": "dpserve-tiny"}, timeout=120)
    # As many adapters kept per replica as its batches mix, so that 6 adapters fill the fleet's slots.
    slots = str(FLEET_MAX_LORAS)
    router = start_router(fleet.replica_urls, "least_loaded", "--lora-dir", str(lora_dir), "--lora-slots", slots)
    wait_until(
        lambda: all(
            (r["lora"] or {}).get("max_loras") == FLEET_MAX_LORAS for r in router_status(router.url)["replicas"]
        ),
        timeout_s=30,
        what="the replicas' adapter slots",
    )
    yield router
    stop_router(router)
    unload_everything(fleet)


def test_models_lists_every_adapter_with_its_parent_and_one_loads_on_demand(
    fleet: Fleet, lora_router: RouterProcess
) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{lora_router.url}/v1/models", timeout=10).json()["data"]}
    assert {name: cards[name]["parent"] for name in ADAPTERS} == dict.fromkeys(ADAPTERS, "dpserve-tiny")
    assert cards["dpserve-tiny"]["parent"] is None

    answer = complete(lora_router.url, "tiny-lora-0")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "tiny-lora-0"
    served_by = answer.headers["x-dpserve-replica"]
    holders = [i for i, url in enumerate(fleet.replica_urls) if "tiny-lora-0" in listed_adapters(url)]
    assert holders == [int(served_by[1:])]
    assert loads(lora_router) == 1
    # It ran on the adapter: the base model and another adapter answer the same prompt otherwise.
    base = complete(lora_router.url, "dpserve-tiny").json()["choices"][0]["text"]
    other = complete(lora_router.url, "tiny-lora-1").json()["choices"][0]["text"]
    assert len({answer.json()["choices"][0]["text"], base, other}) == 3
    # Loaded now: the next request goes where it is, with no second load.
    again = complete(lora_router.url, "tiny-lora-0")
    assert again.status_code == 200 and again.headers["x-dpserve-replica"] == served_by
    assert loads(lora_router) == 2  # tiny-lora-1's


def test_concurrent_first_requests_for_an_adapter_share_one_load(fleet: Fleet, lora_router: RouterProcess) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {**PROMPT, "model": "tiny-lora-2"}
            return await asyncio.gather(
                *(client.post(f"{lora_router.url}/v1/completions", json=body) for _ in range(8))
            )

    answers = asyncio.run(burst())
    assert [a.status_code for a in answers] == [200] * 8
    assert loads(lora_router) == 1
    assert sum("tiny-lora-2" in listed_adapters(url) for url in fleet.replica_urls) == 1
    assert len({a.headers["x-dpserve-replica"] for a in answers}) == 1


def test_with_every_slot_taken_the_least_recently_used_idle_adapter_is_unloaded(
    fleet: Fleet, lora_router: RouterProcess
) -> None:
    for name in ADAPTERS[:4]:  # 2 replicas x 2 slots: each loads into a free slot
        assert complete(lora_router.url, name).status_code == 200
    held = [listed_adapters(url) for url in fleet.replica_urls]
    assert [len(h) for h in held] == [2, 2] and loads(lora_router) == 4
    assert metric(lora_router.url, "dpserve_lora_unloads_total") == 0
    first_on = [min(h, key=ADAPTERS.index) for h in held]  # each replica's least recently used

    answer = complete(lora_router.url, "tiny-lora-4")
    assert answer.status_code == 200, answer.text
    after = [listed_adapters(url) for url in fleet.replica_urls]
    chosen = int(answer.headers["x-dpserve-replica"][1:])
    assert [len(h) for h in after] == [2, 2]
    assert after[chosen] == (held[chosen] - {first_on[chosen]}) | {"tiny-lora-4"}
    assert after[1 - chosen] == held[1 - chosen]
    assert metric(lora_router.url, "dpserve_lora_unloads_total", outcome="ok") == 1
    # The evicted adapter is still served: loaded again where placement says.
    assert complete(lora_router.url, first_on[chosen]).status_code == 200


def test_an_adapter_unloaded_behind_the_routers_back_is_loaded_again(fleet: Fleet, lora_router: RouterProcess) -> None:
    first = complete(lora_router.url, "tiny-lora-5")
    replica = first.headers["x-dpserve-replica"]
    url = fleet.replica_urls[int(replica[1:])]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "tiny-lora-5"}, timeout=10).status_code == 200
    # The router still thinks it is there: the replica's 404 makes it load the adapter again.
    again = complete(lora_router.url, "tiny-lora-5")
    assert again.status_code == 200, again.text
    assert again.headers["x-dpserve-replica"] == replica
    assert loads(lora_router) == 2
    assert "tiny-lora-5" in listed_adapters(url)


def test_an_adapter_loaded_through_the_admin_api_is_seen_at_once(fleet: Fleet, lora_router: RouterProcess) -> None:
    body = {"lora_name": "tiny-lora-3", "lora_path": str(lora_dir_of(fleet) / "tiny-lora-3")}
    answer = httpx.post(f"{lora_router.url}/admin/replicas/r1/engine/load_lora_adapter", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["replicas"][0]["status"] == 200
    assert router_status(lora_router.url)["replicas"][1]["lora"]["loaded"] == ["tiny-lora-3"]
    served = complete(lora_router.url, "tiny-lora-3")
    assert served.status_code == 200 and served.headers["x-dpserve-replica"] == "r1"
    assert loads(lora_router) == 0


def test_an_unknown_adapter_is_404_and_a_new_folder_is_picked_up(lora_router: RouterProcess, lora_dir: Path) -> None:
    missing = complete(lora_router.url, "late-adapter")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    # Copied into the folder while the router runs: served without a restart, from the folder watch's next
    # read (every second, off the request path), so within about a second of the copy.
    shutil.copytree(lora_dir / "tiny-lora-3", lora_dir / "late-adapter")
    copied = time.monotonic()
    try:
        wait_until(lambda: "late-adapter" in listed_adapters(lora_router.url), timeout_s=5, interval_s=0.05)
        assert time.monotonic() - copied < 3  # the watch's 1 s, with room for a busy CI host
        late = complete(lora_router.url, "late-adapter")
        assert late.status_code == 200, late.text
        assert late.json()["model"] == "late-adapter"
    finally:
        shutil.rmtree(lora_dir / "late-adapter")


@pytest.mark.disruptive
def test_a_killed_replica_fails_no_request_and_once_restarted_is_read_again_and_its_adapter_loaded_again(
    fleet: Fleet, lora_router: RouterProcess
) -> None:
    """One replica killed (SIGKILL), the one holding an adapter: through the fleet's own router, under traffic
    and streams alongside, no request fails and all go to the other replica; the launcher restarts it and both
    routers take it back; `lora_router` reads it again (it holds nothing now) and loads the adapter there again.
    (One kill for both: a vLLM restart costs most of a minute here.)"""
    answer = complete(lora_router.url, "tiny-lora-0")
    victim_id = answer.headers["x-dpserve-replica"]
    index = int(victim_id[1:])
    victim = replica_process(fleet, fleet.replica_urls[index])
    ejections = router_status(lora_router.url)["replicas"][index]["ejections"]
    with Traffic(fleet.router_url) as traffic, StreamTraffic(fleet.router_url) as streams:
        wait_until(lambda: len(traffic.served) >= 10, timeout_s=60, what="traffic to flow")
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        # Meanwhile the other replica serves the adapter, loading it there.
        other = complete(lora_router.url, "tiny-lora-0")
        assert other.status_code == 200 and other.headers["x-dpserve-replica"] != victim_id
        # Out first (a refused request ejects it at once, else its failed probes do), so that `healthy`
        # below is its re-admission and not the router not yet having noticed the kill.
        wait_until(
            lambda: router_status(lora_router.url)["replicas"][index]["ejections"] > ejections,
            timeout_s=60,
            interval_s=0.2,
            what="the killed replica to be ejected",
        )
        wait_until(
            lambda: sum(1 for t, _ in traffic.served if t > killed_at + 1) >= 20,
            timeout_s=60,
            what="requests after the kill",
        )
    other_id = other.headers["x-dpserve-replica"]
    after = [replica for t, replica in traffic.served if t > killed_at + 1]
    print(
        f"\nfailover: {len(traffic.served)} requests, {len(traffic.failures)} failed; after the kill all went to "
        f"{collections.Counter(after)}; {len(streams.served)} streams alongside, {streams.broken} cut by the kill "
        f"(ended with an error event and [DONE]), {len(streams.failures)} failed"
    )
    assert traffic.failures == [] and streams.failures == []
    assert set(after) == {other_id}

    # The launcher restarts it and the routers take it back once it answers their probes.
    wait_until(
        lambda: (
            router_status(lora_router.url)["replicas"][index]["healthy"]
            and router_status(fleet.router_url)["replicas"][index]["healthy"]
        ),
        timeout_s=300,
        interval_s=1,
        what="the killed replica to be restarted and re-admitted",
    )
    assert replica_process(fleet, fleet.replica_urls[index]).pid != victim.pid
    # Read again after its restart: it holds nothing now.
    assert router_status(lora_router.url)["replicas"][index]["lora"]["loaded"] == []
    with httpx.Client(timeout=60) as client:
        served = {
            client.post(f"{fleet.router_url}/v1/completions", json=REQUEST).headers["x-dpserve-replica"]
            for _ in range(20)
        }
    assert victim_id in served
    log = fleet.log_tail(20000)
    assert f"{victim_id} exited" in log and f"{victim_id} is back" in log
    assert httpx.post(f"{lora_router.url}/admin/replicas/{other_id}/drain", timeout=10).status_code == 200
    back = complete(lora_router.url, "tiny-lora-0")
    assert back.status_code == 200, back.text
    assert back.headers["x-dpserve-replica"] == victim_id
    assert "tiny-lora-0" in listed_adapters(fleet.replica_urls[index])
