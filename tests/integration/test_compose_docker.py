"""The Compose stack on the real Docker engine: `make compose-up VARIANT=sim` (the router over `dpserve sim`
containers: the same images, networks, healthchecks, service names and KV-event ports as the vLLM stack), the
SDK through the published port, a replica container killed under load, the scaled variant following
`--scale`, and `make compose-down` leaving nothing. Skipped, saying why, where no engine can run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dpserve.version import package_version
from tests.conftest import free_port
from tests.fake_nvml import FAKE_NVML_FILE, FakeGpu, write_gpus
from tests.integration.docker_stack import (
    Stack,
    compose_secrets,
    compose_stack,
    docker,
    engine_problem,
    needs_engine,
)
from tests.integration.traffic import MODEL, Load, chat, long_prompt, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker]

FOLLOW_S = 10  # the scaled stack's router must follow `--scale` within this
IMAGE = f"dpserve-router:{package_version()}"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@pytest.fixture(scope="module")
def sim_stack() -> Iterator[Stack]:
    needs_engine()
    with compose_stack("sim") as stack:
        yield stack


def _replicas(stack: Stack) -> dict[str, dict[str, Any]]:
    return {replica["url"]: replica for replica in stack.status()["replicas"]}


def _healthy(stack: Stack) -> set[str]:
    return {url for url, replica in _replicas(stack).items() if replica["healthy"]}


def test_published_port_binds_loopback_only(sim_stack: Stack) -> None:
    (router,) = sim_stack.containers("router")
    assert router["Ports"] == f"127.0.0.1:{sim_stack.port}->8000/tcp"
    for replica in sim_stack.containers("vllm-0") + sim_stack.containers("vllm-1"):
        assert "->" not in replica["Ports"], "replicas publish nothing"


def test_sdk_chat_and_stream_through_the_published_port_and_kv_events_from_every_replica(sim_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{sim_stack.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6)
    assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=6, stream=True
    )
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) == 6
    # Chat prompts share the template's prefix, which kv_aware keeps on one replica; long plain prompts
    # with different first words share nothing and go to either (ties at random), until both have published.
    # Each replica's KV events then reach the router across the container network, from tcp://vllm-N:5557.
    for word in WORDS:
        if all(replica["kv_events"]["batches"] > 0 for replica in _replicas(sim_stack).values()):
            break
        client.completions.create(model=MODEL, prompt=long_prompt(word), max_tokens=4)

    def every_replica_publishes() -> bool:
        replicas = _replicas(sim_stack)
        return len(replicas) == 2 and all(r["kv_events"]["batches"] > 0 for r in replicas.values())

    wait_for(every_replica_publishes, 10, "KV events from both replicas")
    replicas = _replicas(sim_stack)
    assert set(replicas) == {"http://vllm-0:8000", "http://vllm-1:8000"}
    for url, replica in replicas.items():
        assert replica["healthy"]
        assert replica["kv_events"]["endpoint"] == url.replace("http://", "tcp://").replace(":8000", ":5557")


def _served(stack: Stack, url: str) -> int:
    return int(_replicas(stack)[url]["served_total"])


PROBE = """
import socket, sys, urllib.request
host, key = sys.argv[1], sys.argv[2]
try:
    socket.create_connection((host, 8000), timeout=3).close()
except OSError as exc:
    print(f"unreachable: {exc!r}")
    sys.exit(3)
def status(path, headers):
    request = urllib.request.Request(f"http://{host}:8000{path}", headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code
print(status("/health", {}), status("/v1/models", {}), status("/v1/models", {"Authorization": f"Bearer {key}"}))
"""


def _probe_from(network: str, host: str) -> subprocess.CompletedProcess[str]:
    """A throwaway container of the stack's own image on `network`, connecting to a replica at `host`."""
    key = compose_secrets().get("REPLICA_API_KEY") or os.environ["REPLICA_API_KEY"]
    command = ["docker", "run", "--rm", "--network", network, "--entrypoint", "python3", IMAGE, "-c", PROBE, host, key]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_only_the_stacks_replica_network_reaches_a_replica_and_it_wants_the_key(sim_stack: Stack) -> None:
    (replica,) = sim_stack.containers("vllm-0")
    networks = json.loads(docker("inspect", replica["ID"]))[0]["NetworkSettings"]["Networks"]
    (name,) = networks  # the replicas' network alone: no way out, no other network to be reached on
    assert name == f"{sim_stack.project}_replicas"
    assert json.loads(docker("network", "inspect", name))[0]["Internal"] is True
    address = networks[name]["IPAddress"]
    # Outside the stack (Docker's default bridge), and on the stack's own default network (Grafana's,
    # Locust's, the agent's): no route to it, and its name resolves to nothing.
    for network in ("bridge", f"{sim_stack.project}_default"):
        outside = _probe_from(network, address)
        assert outside.returncode == 3 and "unreachable" in outside.stdout, (network, outside.stdout, outside.stderr)
    named = _probe_from(f"{sim_stack.project}_default", "vllm-0")
    assert named.returncode == 3 and "unreachable" in named.stdout, named.stdout + named.stderr
    # On the replicas' network (as the router is): reached, and /v1 wants the generated key, as vLLM's does.
    inside = _probe_from(name, address)
    assert (inside.returncode, inside.stdout.split()) == (0, ["200", "401", "200"]), inside.stdout + inside.stderr


def test_killed_replica_is_ejected_restarted_and_readmitted_with_no_failed_request(sim_stack: Stack) -> None:
    victim = "http://vllm-1:8000"
    wait_for(lambda: _healthy(sim_stack) == {"http://vllm-0:8000", victim}, 30, "both replicas healthy")
    load = Load(sim_stack.url)
    with load.running():
        wait_for(lambda: load.count() >= 20, 30, "load flowing")
        (container,) = sim_stack.containers("vllm-1")
        # `docker kill`: the engine counts it a manual stop and does not restart it; compose brings it back.
        docker("kill", container["ID"])
        ejected_after = wait_for(lambda: victim not in _healthy(sim_stack), 30, "the killed replica ejected")
        ok_at_ejection = load.count()
        sim_stack.compose("up", "-d", "--no-recreate", "--wait", "vllm-1")
        wait_for(lambda: victim in _healthy(sim_stack), 30, "the replica re-admitted")
        before = _served(sim_stack, victim)
        wait_for(lambda: _served(sim_stack, victim) > before + 5, 30, "the re-admitted replica serving")

        # A crash (its process killed from outside, not `docker kill`): the engine restarts it by the
        # service's `restart: unless-stopped`, with no one's help. The engine can have it back before two
        # probes fail (connections to its vanished address wait rather than being refused), so the router
        # need not eject it; what must hold is no failed request and the router reading it afresh.
        (container,) = sim_stack.containers("vllm-1")
        pid = int(docker("inspect", "-f", "{{.State.Pid}}", container["ID"]).strip())
        os.kill(pid, signal.SIGKILL)

        def restarts() -> int:
            return int(docker("inspect", "-f", "{{.RestartCount}}", container["ID"]).strip())

        wait_for(lambda: restarts() >= 1, 30, "the engine restarting the crashed replica")
        wait_for(lambda: victim in _healthy(sim_stack), 60, "the crashed replica re-admitted")
        before = _served(sim_stack, victim)
        wait_for(lambda: _served(sim_stack, victim) > before + 5, 30, "the restarted replica serving")
        # Its KV events come back too: the router's subscriber reconnects to tcp://vllm-1:5557.
        words = iter(WORDS)
        batches = _replicas(sim_stack)[victim]["kv_events"]["batches"]

        def publishing_again() -> bool:
            if _replicas(sim_stack)[victim]["kv_events"]["batches"] > batches:
                return True
            client = openai.OpenAI(base_url=f"{sim_stack.url}/v1", api_key="unused", max_retries=0)
            client.completions.create(model=MODEL, prompt=long_prompt(next(words)), max_tokens=2)
            return False

        wait_for(publishing_again, 30, "KV events from the restarted replica")
    assert load.failures == [], load.failures[:5]
    assert load.ok > ok_at_ejection > 0
    print(f"\nkill: ejected after {ejected_after:.1f}s; {load.ok} requests, 0 failed; crash: restarts={restarts()}")


@pytest.fixture(scope="module")
def scaled_stack() -> Iterator[Stack]:
    needs_engine()
    with compose_stack("sim", scaled=True) as stack:
        yield stack


def _scale(stack: Stack, count: int) -> None:
    stack.compose("up", "-d", "--no-recreate", "--no-build", "--scale", f"vllm={count}", "--wait")


def _replica_addresses(stack: Stack) -> set[str]:
    addresses = set()
    for container in stack.containers("vllm"):
        networks = docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", container["ID"])
        addresses.update(f"http://{address}:8000" for address in networks.split())
    return addresses


def test_scaled_stack_follows_scale_up_and_down_with_no_failed_request(scaled_stack: Stack) -> None:
    stack = scaled_stack
    wait_for(lambda: _healthy(stack) == _replica_addresses(stack) and len(_healthy(stack)) == 2, 30, "2 replicas")
    load = Load(stack.url)
    with load.running():
        wait_for(lambda: load.count() >= 10, 30, "load flowing")
        started = time.monotonic()
        _scale(stack, 4)
        scaled_at = time.monotonic() - started
        grown = wait_for(lambda: len(_healthy(stack)) == 4 and _healthy(stack) == _replica_addresses(stack), 30, "4")
        four = _healthy(stack)
        _scale(stack, 2)
        shrunk = wait_for(
            lambda: set(_replicas(stack)) == _replica_addresses(stack) and len(_replica_addresses(stack)) == 2,
            30,
            "the router back to 2",
        )
        served_by = {url: int(replica["served_total"]) for url, replica in _replicas(stack).items()}
    assert load.failures == [], load.failures[:5]
    assert grown <= FOLLOW_S and shrunk <= FOLLOW_S, (grown, shrunk)
    assert len(four) == 4 and all(count > 0 for count in served_by.values())
    discovery = stack.status()["discovery"]
    print(
        f"\nscale 2->4: compose {scaled_at:.1f}s, router followed {grown:.1f}s later; 4->2 followed in {shrunk:.1f}s;"
        f" {load.ok} requests, 0 failed; discovery: {discovery}"
    )


def test_every_stack_make_compose_up_can_run_is_accepted_by_the_engines_compose() -> None:
    """What `make compose-up` would run, for each variant, checked by the Compose that runs it (the Compose
    of the unit tests is a newer release, with no engine behind it)."""
    needs_engine()
    for scaled in (False, True):
        for variant in ("sim", "cpu", "gpu"):
            Stack("dpserve-config-check", variant, scaled, 8000).compose("config", "--quiet")


def test_engine_problem_says_why_when_docker_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    problem = engine_problem()
    assert problem is not None and "docker" in problem


def test_the_gpu_less_stack_starts_no_gpu_agent_and_its_router_asks_none(sim_stack: Stack) -> None:
    # No GPU in the sim (and CPU) stacks: the agent stays in its profile, unstarted; the router reads no agent.
    assert sim_stack.containers("gpu-agent", every=True) == []
    assert not sim_stack.status()["gpus"].get("agents")


def test_compose_agent_sees_where_replica_containers_gpu_processes_listen(sim_stack: Stack, tmp_path: Path) -> None:
    """What compose's (and Kubernetes') agent rests on, with real containers: given GPU processes that run in
    other containers (their host pids, as NVML lists them), the agent finds the port each listens on inside
    its container's network namespace, spelled with the container's address, and the container's id. One
    replica runs as the image's user (nobody, as the sim replicas do), one as root (as vLLM's images do):
    the agent must read both. It is the stack's own `gpu-agent` service (`docker compose run`: its pid
    namespace, user and capabilities); NVML is the fake (no GPU here), /proc, the namespaces and the
    cgroups are the engine's."""
    (replica,) = sim_stack.containers("vllm-1")
    (network,) = json.loads(docker("inspect", replica["ID"]))[0]["NetworkSettings"]["Networks"]
    root_replica = docker(
        "run", "-d", "--user", "0:0", "--network", network, "--entrypoint", "dpserve", IMAGE,
        "sim", "--host", "0.0.0.0", "--port", "8000", "--model", "dpserve-tiny",
    ).strip()  # fmt: skip
    port, name = free_port(), f"{sim_stack.project}-agent-probe"
    try:
        expected: dict[int, tuple[str, str]] = {}  # host pid -> (ADDRESS:PORT, container id)
        for container in (replica["ID"], root_replica):
            inspected = json.loads(docker("inspect", container))[0]
            (address,) = [net["IPAddress"] for net in inspected["NetworkSettings"]["Networks"].values()]
            expected[inspected["State"]["Pid"]] = (f"{address}:8000", inspected["Id"])
        gpus = [FakeGpu(f"GPU-docker-{i}", util_gpu=50, processes=[(pid, 20 << 30)]) for i, pid in enumerate(expected)]
        write_gpus(tmp_path / "gpus.json", gpus)
        tmp_path.chmod(0o755)  # readable whatever user the service runs as: only /proc may stand in its way
        tests = Path(__file__).resolve().parents[1]
        sim_stack.compose(
            "run", "-d", "--no-deps", "--name", name, "--publish", f"127.0.0.1:{port}:9400",
            "-v", f"{tests}:/opt/fake/tests:ro", "-v", f"{tmp_path}:/opt/gpus:ro",
            "-e", "PYTHONPATH=/opt/fake", "-e", f"{FAKE_NVML_FILE}=/opt/gpus/gpus.json",
            "gpu-agent", "--host", "0.0.0.0", "--port", "9400", "--hostname", "docker-host",
            "--nvml", "tests.fake_nvml:from_file",
        )  # fmt: skip

        def listens_found() -> bool:
            reading = httpx.get(f"http://127.0.0.1:{port}/gpus", timeout=2).json()
            return all(p["listens"] for gpu in reading["gpus"] for p in gpu["processes"])

        try:
            wait_for(listens_found, 60, "the agent finding both replicas' ports")
        except AssertionError:
            logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=30)
            raise AssertionError(f"{(logs.stdout + logs.stderr)[-3000:]}\n{_agent_gpus(port)}") from None
        reading = httpx.get(f"http://127.0.0.1:{port}/gpus", timeout=5).json()
    finally:
        subprocess.run(["docker", "rm", "-f", name, root_replica], capture_output=True, timeout=60)
    assert reading["host"] == "docker-host"
    found = {p["pid"]: (p["listens"], p["container"]) for gpu in reading["gpus"] for p in gpu["processes"]}
    assert set(found) == set(expected)
    for pid, (endpoint, container_id) in expected.items():
        listens, container = found[pid]
        assert endpoint in listens and container == container_id, (pid, found[pid])


def _agent_gpus(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/gpus", timeout=2).text[-2000:]
    except httpx.HTTPError as exc:
        return repr(exc)


def test_compose_down_leaves_no_container_network_or_volume(sim_stack: Stack) -> None:
    """The module's stack, after every other test of it (so it is last in this file): `make compose-down` on a
    stack that has served, had a replica killed and restarted, and run the agent, leaves nothing of it."""
    made = sim_stack.leftovers()
    assert len(made["containers"]) == 3 and made["networks"] and made["volumes"]  # 2 replicas, router
    assert chat(sim_stack.url, "one request").status_code == 200
    sim_stack.make("compose-down", timeout_s=300)
    assert sim_stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
    images = docker("image", "ls", "--format", "{{.Repository}}").split()
    assert "dpserve-router" in images, "compose-down keeps the images it built"
