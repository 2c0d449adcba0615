"""`dpserve kube`: the routers' /metrics behind a key when asked (`--metrics-key`), which the routers read from
the keys Secret and the ServiceMonitor sends; and stops in step (vLLM's `--shutdown-timeout`, each pod's grace
period above its preStop sleep and drain). Checked against Kubernetes' schemas and dpserve's own parser."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from dpserve.cli import _overrides, main
from dpserve.config import RouterSettings, load_settings
from dpserve.deploy.kube import KubeOptions, render
from dpserve.router.flow.access import load_keys
from tests.unit.test_kube import (
    CRD_GROUPS,
    KUBERNETES_VERSIONS,
    _mounted_file,
    documents,
    only,
    parse_pod_command,
    router_and_agent,
)
from tests.unit.test_kube_tls import error_line, flag, vllm_container, written

METRICS = KubeOptions(replicas=2, metrics_key=True, service_monitor=True)


def router_settings(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], RouterSettings]:
    """The router pod's spec, and the settings its command gives it (as `dpserve router` reads them)."""
    deployment, _ = router_and_agent(docs)
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, load_settings(RouterSettings, _overrides(parse_pod_command(container["command"])), env={})


def monitor_endpoints(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m["spec"]["endpoints"][0] for m in only(docs, "ServiceMonitor")}


def scrape_annotations(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Each workload's `prometheus.io/scrape` annotation, by its name."""
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]
    return {
        w["metadata"]["name"]: w["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"]
        for w in workloads
    }


# (a) /metrics behind a key


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("tls", [False, True])
def test_a_metrics_key_validates(version: str, tls: bool) -> None:
    for doc in documents(dataclasses.replace(METRICS, tls=tls)):
        if doc["apiVersion"].startswith(CRD_GROUPS):
            # No schema of the Prometheus Operator's CRDs here: test_the_routers_read_the_metrics_key... checks
            # the fields it carries.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("tls", [False, True])
def test_the_routers_read_the_metrics_key_the_header_creates_and_the_service_monitor_sends_it(
    tls: bool, tmp_path: Path
) -> None:
    options = dataclasses.replace(METRICS, tls=tls)
    text = render(options)
    create = next(line for line in text.splitlines() if f"create secret generic {options.keys_secret}" in line)
    entries = dict(re.findall(r"--from-file=([a-z-]+)=(\S+)", create))
    assert set(entries) == {"api-keys", "admin-keys", "metrics-keys"}
    assert "authorization: credentials_file" in text, "the header says how a Prometheus of one's own sends it"
    docs = documents(options)
    spec, settings = router_settings(docs)
    assert settings.metrics_key_file is not None
    secret, entry = _mounted_file(spec, str(settings.metrics_key_file))
    assert (secret, entry) == (options.keys_secret, "metrics-keys")
    # The ServiceMonitor of the routers sends that entry as a bearer token (the Prometheus Operator reads the
    # Secret from the monitor's own namespace); vLLM's and the agents' /metrics take no key and get none.
    (monitor,) = [m for m in only(docs, "ServiceMonitor") if m["metadata"]["name"] == "dpserve-router"]
    assert monitor["metadata"]["namespace"] == options.namespace
    endpoints = monitor_endpoints(docs)
    assert endpoints["dpserve-router"]["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": secret, "key": entry},
    }
    assert "bearerTokenSecret" not in endpoints["dpserve-router"], "deprecated: authorization replaces it"
    assert all("authorization" not in endpoints[name] for name in ("vllm", "dpserve-agent"))
    assert endpoints["dpserve-router"].get("scheme") == ("https" if tls else None)
    # The annotated-pods job cannot send a key: the routers leave it (a target down otherwise); the rest stay.
    assert scrape_annotations(docs) == {"vllm": "true", "dpserve-router": "false", "dpserve-agent": "true"}
    # What the header's file holds, as the kubelet mounts it, is a key that reads /metrics and nothing else.
    (tmp_path / "api-keys").write_text("team-a:key-one-1234\n")
    (tmp_path / "metrics-keys").write_text("metrics-key-5678\n")
    local = dataclasses.replace(
        settings,
        api_key_file=tmp_path / "api-keys",
        admin_key_file=None,
        metrics_key_file=tmp_path / "metrics-keys",
        replica_api_key_file=None,
    )
    keys = load_keys(local)
    assert keys.reads_metrics(b"metrics-key-5678") and not keys.reads_metrics(b"key-one-1234")
    assert keys.find(b"metrics-key-5678") is None


def test_no_metrics_key_unless_asked() -> None:
    options = KubeOptions(replicas=2, service_monitor=True)
    text = render(options)
    assert "metrics-key" not in text
    docs = documents(options)
    spec, settings = router_settings(docs)
    assert settings.metrics_key_file is None
    assert all("authorization" not in endpoint for endpoint in monitor_endpoints(docs).values())
    assert set(scrape_annotations(docs).values()) == {"true"}
    (keys,) = [v["secret"] for v in spec["volumes"] if v["name"] == "keys"]
    assert [item["key"] for item in keys["items"]] == ["api-keys", "admin-keys"]


def test_the_cli_passes_metrics_key(capsys: pytest.CaptureFixture[str]) -> None:
    docs = written(["kube", "--replicas", "1", "--metrics-key", "--service-monitor"], capsys)
    _, settings = router_settings(docs)
    assert settings.metrics_key_file == Path("/etc/dpserve/keys/metrics-keys")
    assert "authorization" in monitor_endpoints(docs)["dpserve-router"]


# (b) Stops in step


def pre_stop_s(container: dict[str, Any]) -> int:
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    return int(sleep[1])


@pytest.mark.parametrize("timeout", [None, 0, 120])
def test_vllm_drains_for_its_shutdown_timeout_within_its_grace_period(
    timeout: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    given = [] if timeout is None else ["--shutdown-timeout", str(timeout)]
    docs = written(["kube", "--replicas", "2", *given], capsys)
    container = vllm_container(docs)
    drain = int(flag(container["command"], "--shutdown-timeout"))
    (statefulset,) = only(docs, "StatefulSet")
    grace = statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # The preStop sleep (the routers drop the pod meanwhile), vLLM's drain, then its engine's teardown (about
    # 10 s): all before the kubelet's SIGKILL.
    assert grace >= pre_stop_s(container) + drain + 10
    # vLLM's default, 0, aborts what it runs on SIGTERM: by default it waits as long as a router drains.
    _, settings = router_settings(docs)
    assert drain == (settings.shutdown_grace_s if timeout is None else timeout)


def test_a_router_drains_within_its_grace_period_and_a_replica_leaves_the_routers_first() -> None:
    docs = documents(KubeOptions(replicas=2, router_replicas=3))
    spec, settings = router_settings(docs)
    (router,) = spec["containers"]
    # The preStop sleep (the Service's endpoints drop the pod), the drain of what it holds, then its exit.
    assert spec["terminationGracePeriodSeconds"] > pre_stop_s(router) + settings.shutdown_grace_s
    # A replica keeps serving past the routers' next DNS read (the headless Service drops a stopping pod), so
    # none sends it a request after its SIGTERM.
    assert pre_stop_s(vllm_container(docs)) > settings.discover_interval_s


@pytest.mark.parametrize("bad", ["-1", "3601", "soon"])
def test_a_bad_shutdown_timeout_is_refused_by_name(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["kube", "--replicas", "1", "--shutdown-timeout", bad]
    if bad.lstrip("-").isdigit():
        err = error_line(argv, capsys)
    else:  # not a number: argparse's own error, after the usage
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--shutdown-timeout" in err and bad in err and "Traceback" not in err, err


@pytest.mark.parametrize("after", [["--shutdown-timeout", "5"], ["--shutdown-timeout=5"], ["--shutdown-t", "5"]])
def test_the_shutdown_timeout_goes_to_kube_itself_not_after_the_separator(
    after: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = error_line(["kube", "--replicas", "1", "--", *after], capsys)
    assert "give --shutdown-timeout to dpserve kube itself" in err
