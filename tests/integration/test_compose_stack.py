"""The compose stack's commands, run on loopback without containers (test_compose_docker.py starts the
stack itself on the Docker engine): the router's container command (router/Dockerfile's ENTRYPOINT +
compose.yaml's flags) over two sims, the services' healthchecks, the loadtest profile's Locust master and
worker, vLLM's own parser on the replicas' commands, and the Grafana dashboard's queries against what the
router and real vLLM export."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpserve.config import RouterSettings
from dpserve.deploy import grafana
from dpserve.deploy.compose import REPLICA_DRAIN_S, ComposeOptions, render
from dpserve.deploy.env_file import read_env_file
from dpserve.deploy.yaml_text import load
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.router.app import create_app
from tests.compose_files import ROOT, compose_config, dockerfile_instructions, exec_form
from tests.conftest import free_port, serving
from tests.fake_nvml import two_gpus
from tests.integration.conftest import Fleet, locust_stats, running_sim, wait_until
from tests.integration.docker_stack import Stack, needs_engine

pytestmark = pytest.mark.integration

ENV = read_env_file(ROOT / ".env")
BIN = Path(sys.executable).parent


def _gpu_less_stack() -> dict[str, Any]:
    """What a GPU-less host runs: compose.yaml with compose.cpu.yaml laid over it and .env substituted,
    as Docker Compose itself resolves them (`config`)."""
    return compose_config(ROOT / "compose.yaml", ROOT / "compose.cpu.yaml", profiles=("monitoring", "loadtest"))


def _on_loopback(argv: list[str], hosts: dict[str, str]) -> list[str]:
    """Service addresses as this machine reaches them: `http://vllm-0:8000` -> a sim's URL, and so on."""
    rewritten = []
    for arg in argv:
        for service_address, local in hosts.items():
            arg = arg.replace(service_address, local)
        rewritten.append(arg)
    return rewritten


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    index = argv.index(flag)
    return [*argv[: index + 1], value, *argv[index + 2 :]]


def _healthcheck_passes(service: dict[str, Any], port: int) -> bool:
    kind, *command = service["healthcheck"]["test"]
    assert kind == "CMD"
    command = [arg.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for arg in command]
    command[0] = sys.executable if command[0] == "python3" else command[0]
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


def test_router_container_command_healthchecks_and_loadtest_profile_run_over_two_sims(tmp_path: Path) -> None:
    stack = _gpu_less_stack()
    services = stack["services"]
    # No GPU here, so no agent in this stack and none asked by its router: the GPU file's agent and router (the
    # same command with `--gpu-agent`) run here on this host's real NVML, which must say there is no GPU.
    assert "gpu-agent" not in services and "--gpu-agent" not in services["router"]["command"]
    gpu_services = compose_config(ROOT / "compose.yaml")["services"]
    entrypoint = exec_form(dockerfile_instructions(ROOT / "router" / "Dockerfile"), "ENTRYPOINT")
    assert entrypoint == ["dpserve", "router"]
    with running_sim("--decode-ms-per-token", "2") as sim0, running_sim("--decode-ms-per-token", "2") as sim1:
        hosts = {"http://vllm-0:8000": sim0.url, "http://vllm-1:8000": sim1.url}
        hosts |= {"tcp://vllm-0:5557": sim0.kv_events, "tcp://vllm-1:5557": sim1.kv_events}
        # The GPU agent's container command (the router's image, `dpserve agent` as its entrypoint), on this
        # host's real NVML: there is no GPU here, and it must say so rather than fail.
        agent_port = free_port()
        agent_flags = _replace_flag(
            _replace_flag(gpu_services["gpu-agent"]["command"], "--host", "127.0.0.1"), "--port", str(agent_port)
        )
        agent_entry = gpu_services["gpu-agent"]["entrypoint"]
        agent = subprocess.Popen([str(BIN / agent_entry[0]), *agent_entry[1:], *agent_flags], stderr=subprocess.DEVNULL)
        hosts["http://gpu-agent:9400"] = f"http://127.0.0.1:{agent_port}"
        port = free_port()
        flags = _replace_flag(_on_loopback(gpu_services["router"]["command"], hosts), "--host", "127.0.0.1")
        flags = _replace_flag(flags, "--port", str(port))
        # Its key to the replicas from a file, as the container reads its secret /run/secrets/replica-api-key.
        key_file = tmp_path / "replica-api-key"
        key_file.write_text("test-replica-key\n")
        flags = _replace_flag(flags, "--replica-api-key-file", str(key_file))
        # The container's command: the `dpserve` console script, as router/Dockerfile's ENTRYPOINT runs it.
        router = subprocess.Popen([str(BIN / entrypoint[0]), *entrypoint[1:], *flags], stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            # The router's healthcheck fails until a replica is healthy behind it, then passes.
            wait_until(lambda: _healthcheck_passes(services["router"], port), 30, what="router healthcheck")
            for sim, name in ((sim0, "vllm-0"), (sim1, "vllm-1")):
                assert _healthcheck_passes(services[name], int(sim.url.rsplit(":", 1)[1]))
            status = httpx.get(f"{url}/status", timeout=5).json()
            assert status["policy"] == ENV["POLICY"] == "kv_aware"
            assert [r["url"] for r in status["replicas"]] == [sim0.url, sim1.url]
            assert [r["kv_events"]["endpoint"] for r in status["replicas"]] == [sim0.kv_events, sim1.kv_events]
            assert all(r["healthy"] for r in status["replicas"])
            wait_until(lambda: _agent_answered(url), 20, what="the router reading the GPU agent")
            (agent_state,) = httpx.get(f"{url}/status", timeout=5).json()["gpus"]["agents"]
            assert agent_state["url"] == hosts["http://gpu-agent:9400"] and agent_state["error"] is None
            assert "no NVIDIA" in agent_state["unavailable"]

            # The loadtest profile: its master and one worker, headless for a few seconds.
            loadtests = str(ROOT / "loadtests")
            master_port = free_port()
            environment = {**os.environ, "LOCUST_HOST": url}
            assert services["locust-master"]["environment"]["LOCUST_HOST"] == "http://router:8000"
            master_cmd = [arg.replace("/mnt/loadtests", loadtests) for arg in services["locust-master"]["command"]]
            master_cmd += ["--headless", "-u", "4", "-r", "4", "-t", "4s", "--expect-workers", "1"]
            master_cmd += ["--master-bind-port", str(master_port), "--csv", str(tmp_path / "run"), "--only-summary"]
            worker_cmd = [arg.replace("/mnt/loadtests", loadtests) for arg in services["locust-worker"]["command"]]
            worker_cmd = [*_replace_flag(worker_cmd, "--master-host", "127.0.0.1"), "--master-port", str(master_port)]
            locust = [sys.executable, "-m", "locust"]
            master = subprocess.Popen([*locust, *master_cmd], env=environment, cwd=tmp_path, stderr=subprocess.PIPE)
            worker = subprocess.Popen([*locust, *worker_cmd], env=environment, cwd=tmp_path, stderr=subprocess.PIPE)
            try:
                _, master_err = master.communicate(timeout=90)
            finally:
                worker.kill()
                worker.wait()
            assert master.returncode == 0, master_err.decode()[-3000:]
            stats = locust_stats(tmp_path / "run")
            requests = stats[("POST", "/v1/chat/completions [stream]")]
            assert int(requests["Request Count"]) > 5 and int(requests["Failure Count"]) == 0
            # shared_prefix (LOAD_WORKLOAD in .env), routed on KV events: both sims hold blocks.
            status = httpx.get(f"{url}/status", timeout=5).json()
            assert all(r["served_total"] > 0 and r["kv_events"]["batches"] > 0 for r in status["replicas"])
        finally:
            agent.terminate()
            agent.wait(timeout=30)
            router.terminate()
            _, router_err = router.communicate(timeout=30)
    # As `docker compose stop` stops it: SIGTERM, a clean shutdown (uvicorn then re-raises the signal).
    assert router.returncode in (0, -signal.SIGTERM), router_err.decode()[-2000:]
    assert "Application shutdown complete" in router_err.decode()


def _agent_answered(url: str) -> bool:
    agents = httpx.get(f"{url}/status", timeout=5).json()["gpus"]["agents"]
    return bool(agents) and agents[0]["read_at"] is not None


def test_vllm_accepts_the_replica_commands_of_both_files(tmp_path: Path) -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    gpu = compose_config(ROOT / "compose.yaml")["services"]["vllm-1"]
    cpu = _gpu_less_stack()["services"]["vllm-1"]
    # vLLM's own flags after `dpserve compose ... --`, in both files.
    options = ComposeOptions(vllm_args=("--dtype", "half", "--max-num-seqs", "8"))
    base, override = tmp_path / "compose.yaml", tmp_path / "compose.cpu.yaml"
    base.write_text(render(options))
    override.write_text(render(options, "cpu"))
    gpu_given = compose_config(base)["services"]["vllm-0"]
    cpu_given = compose_config(base, override)["services"]["vllm-0"]
    for service, model in (
        (gpu, ENV["MODEL"]),
        (cpu, "/models/tiny"),
        (gpu_given, ENV["MODEL"]),
        (cpu_given, "/models/tiny"),
    ):
        assert service["entrypoint"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(service["command"])
        validate_parsed_serve_args(args)
        assert (args.model, args.host, args.port, args.enable_prefix_caching) == (model, "0.0.0.0", 8000, True)
        events = args.kv_events_config
        assert (events.enable_kv_cache_events, events.publisher, events.endpoint) == (True, "zmq", "tcp://*:5557")
        assert args.enable_prompt_tokens_details is True
        # It drains on SIGTERM (0 would abort every request) for as long as a router would wait.
        assert args.shutdown_timeout == REPLICA_DRAIN_S
        given = service in (gpu_given, cpu_given)
        assert (args.dtype, args.max_num_seqs) == (("half", 8) if given else ("auto", None)), service["command"]
    assert args.served_model_name == ["dpserve-tiny"]
    # --tls: vLLM's own HTTPS flags, the files read again when they change, in both committed TLS files.
    tls_gpu = compose_config(ROOT / "compose.tls.yaml")["services"]["vllm-0"]
    tls_cpu = compose_config(ROOT / "compose.tls.yaml", ROOT / "compose.tls.cpu.yaml")["services"]["vllm-0"]
    for service in (tls_gpu, tls_cpu):
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(service["command"])
        validate_parsed_serve_args(args)
        files = (args.ssl_certfile, args.ssl_keyfile, args.enable_ssl_refresh)
        assert files == ("/run/secrets/vllm.crt", "/run/secrets/vllm.key", True), service["command"]


async def test_dashboard_queries_read_series_the_router_and_vllm_export(fleet: Fleet) -> None:
    """Every dpserve_* and vllm:* name in the Grafana dashboard is exported: by the router (GPUs faked at
    NVML, so the GPU gauges exist) and by a real vLLM CPU replica after a few requests."""
    settings = RouterSettings(replicas=tuple(fleet.replica_urls), probe_interval_s=0.2, gpu_interval_s=0.05)
    async with serving(create_app(settings, nvml=two_gpus)) as url, httpx.AsyncClient(timeout=60) as client:
        for _ in range(40):
            if (await client.get(f"{url}/ready")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        body: dict[str, Any] = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": "hi"}]}
        for stream in (False, True):
            # One with an SLO: its counters (the goodput panel's) exist once one has come.
            slo = {"x-slo-ttft-ms": "60000"} if stream else {}
            response = await client.post(
                f"{url}/v1/chat/completions", json={**body, "max_tokens": 4, "stream": stream}, headers=slo
            )
            assert response.status_code == 200
        await asyncio.sleep(0.2)
        router_text = (await client.get(f"{url}/metrics")).text
        vllm_text = (await client.get(f"{fleet.replica_urls[0]}/metrics")).text
    dashboard = json.loads((ROOT / grafana.DASHBOARD_FILE).read_text())
    wanted = grafana.metric_names(dashboard)
    assert {name for name in wanted if name.startswith("vllm:")} and {n for n in wanted if n.startswith("dpserve_gpu")}
    exported = set(parse_samples(router_text, wanted).by_name) | set(parse_samples(vllm_text, wanted).by_name)
    assert wanted - exported - grafana.EVENT_SERIES == set()
    # And the replicas' healthcheck passes against the real vLLM replica.
    replica = load((ROOT / "compose.yaml").read_text())["services"]["vllm-0"]
    assert _healthcheck_passes(replica, int(fleet.replica_urls[0].rsplit(":", 1)[1]))


class _TlsStack(Stack):
    """`make compose-up TLS=1`: compose.tls.yaml and its override, the certificates made first."""

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "TLS": "1"}


def test_the_tls_sim_stack_on_the_engine_is_https_from_the_client_to_the_replicas() -> None:
    """The sim stack with --tls, on the real engine: a request through the router's published port over HTTPS
    (its certificate checked against the stack's CA), the router reaching both replicas over HTTPS (healthy in
    /status), and nothing left after compose-down."""
    needs_engine()
    stack = _TlsStack(f"dpserve-test-{os.getpid()}-sim-tls", "sim", False, free_port())
    try:
        stack.make("compose-up")
        url = f"https://127.0.0.1:{stack.port}"
        ca = ssl.create_default_context(cafile=str(ROOT / ".secrets" / "tls" / "ca.crt"))
        with httpx.Client(verify=ca, timeout=30) as client:
            body = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            answer = client.post(f"{url}/v1/chat/completions", json=body)
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
            replicas = client.get(f"{url}/status").json()["replicas"]
        assert [replica["url"] for replica in replicas] == ["https://vllm-0:8000", "https://vllm-1:8000"]
        assert all(replica["healthy"] for replica in replicas), replicas
        # Without the stack's CA, the router's certificate is not trusted; plain HTTP gets no answer.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=10)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{stack.port}/health", timeout=10)
        # Each container's healthcheck (over HTTPS, against the CA) passed: `make compose-up` waited on them.
        for service in ("router", "vllm-0", "vllm-1"):
            assert [c["Status"] for c in stack.containers(service) if "(healthy)" in c["Status"]], service
    finally:
        stack.make("compose-down", timeout_s=300)
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
