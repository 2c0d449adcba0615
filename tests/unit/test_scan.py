"""checkov, the infrastructure-as-code scanner, over what dpserve ships for deployment: the Dockerfiles, the
committed compose files and `dpserve kube`'s manifests. Every finding is fixed or waived, with why, in
deploy/scan-waivers.yaml; a finding not waived fails, and so does a waiver no finding needs. checkov runs
once per session over all the files (it takes seconds to start). `make test` installs it in a virtual
environment of its own (.venv/checkov): its pins clash with the bench extra's (aiodns)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

from dpserve.deploy.compose import ComposeOptions
from dpserve.deploy.kube import KubeOptions, render
from tests.compose_files import ROOT

WAIVERS = ROOT / "deploy" / "scan-waivers.yaml"
DOCKERFILES = ("router/Dockerfile", "replicas/Dockerfile.cpu")
COMPOSE_FILES = tuple(
    ComposeOptions(scaled=scaled).file_name(overlay) for scaled in (False, True) for overlay in (None, "cpu", "sim")
)
KUBE_VARIANTS = {
    "kube.yaml": KubeOptions(replicas=2),
    "kube-everything.yaml": KubeOptions(
        replicas=4,
        router_replicas=3,
        router_workers=2,
        service_monitor=True,
        model_cache_pvc="models",
        lora_pvc="adapters",
        otlp_traces_endpoint="http://otel-collector.monitoring:4317",
        metrics_key=True,
        shutdown_timeout=120,
    ),
    # `--autoscale 0:4` (KEDA, from zero) and `--autoscale 1:4 --autoscaler hpa`.
    "kube-keda.yaml": KubeOptions(replicas=4, autoscale_min=0, service_monitor=True),
    "kube-hpa.yaml": KubeOptions(replicas=4, autoscale_min=1, autoscaler="hpa"),
    # The issue's `dpserve kube --tls --replicas 2 -- --dtype half`, and TLS with everything else.
    "kube-tls.yaml": KubeOptions(replicas=2, tls=True, vllm_args=("--dtype", "half")),
    "kube-tls-everything.yaml": KubeOptions(
        replicas=4,
        router_replicas=3,
        tls=True,
        cert_manager_issuer="ClusterIssuer/ca",
        service_monitor=True,
        vllm_egress=("0.0.0.0/0:443",),
        router_clients=("ingress-nginx",),
        vllm_memory_limit="64Gi",
        otlp_traces_endpoint="http://otel-collector.monitoring:4317",
        metrics_key=True,
    ),
}
FRAMEWORKS = ("dockerfile", "kubernetes", "secrets")


@dataclass(frozen=True)
class Finding:
    check: str
    resource: str
    file: str
    name: str


def checkov_binary() -> Path:
    return Path(os.environ.get("CHECKOV") or Path(sys.executable).parent.parent / "checkov" / "bin" / "checkov")


@pytest.fixture(scope="session")
def scan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    binary = checkov_binary()
    if not binary.exists():
        pytest.skip(f"checkov is not installed at {binary} (`make test` installs it)")
    manifests = tmp_path_factory.mktemp("kube")
    for name, options in KUBE_VARIANTS.items():
        (manifests / name).write_text(render(options))
    files = [*DOCKERFILES, *COMPOSE_FILES, *(str(manifests / name) for name in KUBE_VARIANTS)]
    command = [str(binary), "--compact", "--skip-download", "-o", "json", "--framework", *FRAMEWORKS]
    for path in files:
        command += ["-f", path]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: some check failed
    reports = json.loads(result.stdout)
    return {report["check_type"]: report for report in (reports if isinstance(reports, list) else [reports])}


def findings(scan: dict[str, Any]) -> list[Finding]:
    return [
        Finding(check["check_id"], check["resource"], check["file_path"], check["check_name"])
        for report in scan.values()
        for check in report["results"]["failed_checks"]
    ]


def load_waivers() -> list[dict[str, Any]]:
    waivers: list[dict[str, Any]] = yaml.safe_load(WAIVERS.read_text())["waivers"]
    for waiver in waivers:
        assert set(waiver) == {"check", "resources", "why"}, waiver
        assert len(waiver["why"].split()) >= 8, f"{waiver['check']}: say why"
    return waivers


def unwaived(found: list[Finding], waivers: list[dict[str, Any]]) -> list[Finding]:
    return [f for f in found if not any(_covers(waiver, f) for waiver in waivers)]


def unused(found: list[Finding], waivers: list[dict[str, Any]]) -> list[str]:
    return [
        f"{waiver['check']} {pattern}"
        for waiver in waivers
        for pattern in waiver["resources"]
        if not any(f.check == waiver["check"] and fnmatch(f.resource, pattern) for f in found)
    ]


def _covers(waiver: dict[str, Any], finding: Finding) -> bool:
    return finding.check == waiver["check"] and any(fnmatch(finding.resource, p) for p in waiver["resources"])


def test_checkov_finds_nothing_that_is_not_fixed_or_waived_with_a_reason(scan: dict[str, Any]) -> None:
    found = findings(scan)
    left = unwaived(found, load_waivers())
    assert left == [], "fix these, or waive them with why in deploy/scan-waivers.yaml:\n" + "\n".join(
        f"  {f.check} {f.resource} ({f.file}): {f.name}" for f in left
    )


def test_every_waiver_is_still_needed(scan: dict[str, Any]) -> None:
    assert unused(findings(scan), load_waivers()) == [], "drop these waivers from deploy/scan-waivers.yaml"


def test_checkov_read_every_file_it_was_given(scan: dict[str, Any]) -> None:
    assert set(scan) == set(FRAMEWORKS) - {"secrets"} or set(scan) == set(FRAMEWORKS), set(scan)
    assert all(report["summary"]["parsing_errors"] == 0 for report in scan.values())
    seen = {
        check["file_path"].lstrip("/")
        for report in scan.values()
        for kind in ("passed_checks", "failed_checks")
        for check in report["results"][kind]
    }
    assert set(DOCKERFILES) <= seen
    assert {name for name in KUBE_VARIANTS if any(path.endswith("/" + name) for path in seen)} == set(KUBE_VARIANTS)
    kinds = {check["resource"].split(".")[0] for check in scan["kubernetes"]["results"]["passed_checks"]}
    assert {"StatefulSet", "Deployment", "DaemonSet", "NetworkPolicy"} <= kinds or "Pod" in kinds


def test_a_finding_not_waived_is_reported_and_a_waiver_nothing_needs_is_too() -> None:
    waivers = [{"check": "CKV_K8S_11", "resources": ["Deployment.*.dpserve-router"], "why": "w " * 8}]
    router = Finding("CKV_K8S_11", "Deployment.llm.dpserve-router", "kube.yaml", "CPU limits")
    vllm = Finding("CKV_K8S_11", "StatefulSet.llm.vllm", "kube.yaml", "CPU limits")
    other = Finding("CKV_K8S_8", "Deployment.llm.dpserve-router", "kube.yaml", "liveness")
    assert unwaived([router, vllm, other], waivers) == [vllm, other]
    assert unused([router], waivers) == [] and unused([vllm], waivers) == ["CKV_K8S_11 Deployment.*.dpserve-router"]
