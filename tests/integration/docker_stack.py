"""The Compose stack on the real Docker engine, as a user brings it up: `make compose-up` / `make compose-down`,
under a project name and router port of the test's own, so it never touches a stack someone else runs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.compose_files import ROOT
from tests.conftest import free_port

UP_TIMEOUT_S = 900  # a cold host builds the base image and the router's image first


def engine_problem() -> str | None:
    """Why the tests cannot use a Docker engine here, or None. `make test` starts one where it can."""
    try:
        info = subprocess.run(
            ["docker", "info", "-f", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
        compose = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no docker command: {exc}"
    if info.returncode != 0:
        return f"no Docker engine answers (tools/docker-engine.sh starts one): {info.stderr.strip()[:300]}"
    if compose.returncode != 0:
        return "no Docker Compose v2 plugin (tools/docker-engine.sh installs one)"
    return None


def needs_engine() -> None:
    problem = engine_problem()
    if problem is not None:
        pytest.skip(problem)


@dataclass
class Stack:
    project: str
    variant: str
    scaled: bool
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The shell `make compose-up` runs Compose in: its generated secrets (as `docker compose` run by hand
        needs them exported), the test's project and port."""
        return {**os.environ, **compose_secrets(), "COMPOSE_PROJECT_NAME": self.project, "ROUTER_PORT": str(self.port)}

    def make(self, target: str, timeout_s: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        args = ["make", "--no-print-directory", target, f"VARIANT={self.variant}"]
        args += ["SCALED=1"] if self.scaled else []
        result = subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert result.returncode == 0, f"make {target}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result

    def compose(self, *args: str, timeout_s: float = 300) -> str:
        stem = "compose.scaled" if self.scaled else "compose"
        files = ["-f", f"{stem}.yaml"] + ([] if self.variant == "gpu" else ["-f", f"{stem}.{self.variant}.yaml"])
        result = subprocess.run(
            ["docker", "compose", *files, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert result.returncode == 0, f"docker compose {' '.join(args)}: {result.stderr[-3000:]}"
        return result.stdout

    def containers(self, service: str | None = None, every: bool = False) -> list[dict[str, Any]]:
        """`docker ps` entries of this project (running ones unless `every`)."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = docker("ps", *(["-a"] if every else []), *filters, "--format", "{{json .}}")
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def leftovers(self) -> dict[str, list[str]]:
        """What of the stack is still on the engine: containers, networks, volumes (images are kept)."""
        label = f"label=com.docker.compose.project={self.project}"
        return {
            kind: docker(*command, "--filter", label, "-q").split()
            for kind, command in (
                ("containers", ("ps", "-a")),
                ("networks", ("network", "ls")),
                ("volumes", ("volume", "ls")),
            )
        }

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/status", timeout=5).json()


def compose_secrets() -> dict[str, str]:
    """REPLICA_API_KEY and GRAFANA_ADMIN_PASSWORD as `make compose-up` exports them (the shell's, else .env.secrets)."""
    script = subprocess.run([str(ROOT / "tools" / "compose-secrets.sh")], capture_output=True, text=True, check=True)
    return dict(line.split("=", 1) for line in script.stdout.splitlines())


def docker(*args: str, timeout_s: float = 120) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"docker {' '.join(args)}: {result.stderr[-2000:]}"
    return result.stdout


@contextlib.contextmanager
def compose_stack(variant: str, scaled: bool = False, name: str = "") -> Iterator[Stack]:
    """`make compose-up` for this variant, then `make compose-down` (which must leave nothing behind).
    `name` sets this stack's project apart from another of the same variant that may still be up."""
    project = f"dpserve-test-{os.getpid()}-{variant}{'-scaled' if scaled else ''}{name and '-' + name}"
    stack = Stack(project, variant, scaled, free_port())
    try:
        stack.make("compose-up")
        yield stack
    finally:
        stack.make("compose-down", timeout_s=300)
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
