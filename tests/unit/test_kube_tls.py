"""`dpserve kube`: vLLM's flags after `--`, the engine's and the pods' sizes, and `--tls` (HTTPS on every hop:
clients to routers, routers to vLLM, router to router), checked against Kubernetes' schemas, dpserve's own
parser, vLLM's flags, and the certificates the header's openssl commands make."""

from __future__ import annotations

import fnmatch
import importlib.util
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from dpserve.cli import _overrides, main
from dpserve.config import RouterSettings, load_settings
from dpserve.deploy.kube import KubeOptions, render
from dpserve.deploy.kube_tls import router_names, tls_commands, vllm_names
from dpserve.replicas.discovery import parse_discovery_source
from tests.unit.test_kube import (
    CRD_GROUPS,
    KUBERNETES_VERSIONS,
    containers,
    documents,
    only,
    parse_pod_command,
    pod_specs,
    router_and_agent,
)

MUST_SHOW = ["kube", "--tls", "--replicas", "2", "--", "--dtype", "half"]
"""The issue's command."""


def written(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    assert main(argv) == 0
    return [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]


def vllm_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (statefulset,) = only(docs, "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return container


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def mounted_secret(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """The Secret and its entry a file in the container comes from."""
    folder, _, entry = path.rpartition("/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True and "subPath" not in mount, "a renewed Secret reaches the files"
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume["secret"]["secretName"], entry


def error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


# (a) vLLM's flags


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_issues_command_validates_and_passes_dtype_to_every_vllm_pod(
    version: str, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = written(MUST_SHOW, capsys)
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, version, strict=True)
    container = vllm_container(docs)
    # The container runs command + args: vLLM gets `--dtype half` after the flags the manifests depend on.
    assert container["args"] == ["--dtype", "half"]
    assert container["command"][:3] == ["vllm", "serve", "Qwen/Qwen2.5-1.5B-Instruct"]
    assert "--dtype" not in container["command"]
    (statefulset,) = only(docs, "StatefulSet")
    assert statefulset["spec"]["replicas"] == 2
    header = render(KubeOptions(replicas=2, tls=True, vllm_args=("--dtype", "half"))).splitlines()[0]
    assert "`dpserve kube --replicas 2 --model Qwen/Qwen2.5-1.5B-Instruct --tls -- --dtype half`" in header


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_tls_with_everything_else_validates(version: str) -> None:
    options = KubeOptions(
        replicas=4,
        router_replicas=3,
        router_workers=2,
        tls=True,
        cert_manager_issuer="ClusterIssuer/ca",
        service_monitor=True,
        model_cache_pvc="models",
        lora_pvc="adapters",
        vllm_egress=("0.0.0.0/0:443", "[2001:db8::/32]:443"),
        router_clients=("ingress-nginx", "apps:app=chat"),
        vllm_memory_limit="64Gi",
        otlp_traces_endpoint="http://otel-collector.monitoring:4317",
        vllm_args=("--dtype", "half"),
    )
    kinds = []
    for doc in documents(options):
        if doc["apiVersion"].startswith((*CRD_GROUPS, "cert-manager.io/")):
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
        else:
            kubernetes_validate.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert kinds.count("NetworkPolicy") == 3 and kinds.count("Certificate") == 2


def test_flags_after_the_separator_win_as_on_up_and_none_is_none(capsys: pytest.CaptureFixture[str]) -> None:
    docs = written(["kube", "--replicas", "1", "--", "--no-enable-prefix-caching", "--served-model-name", "m"], capsys)
    container = vllm_container(docs)
    assert container["args"] == ["--no-enable-prefix-caching", "--served-model-name", "m"]
    assert "--enable-prefix-caching" not in container["command"], "the given flag replaces dpserve's own"
    plain = vllm_container(written(["kube", "--replicas", "1"], capsys))
    assert "args" not in plain and "--enable-prefix-caching" in plain["command"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--port", "9000"], "not for the vLLM pods"),
        (["--host=127.0.0.1"], "not for the vLLM pods"),
        (["--api-key", "sk-x"], "dpserve-replica-key"),
        (["--kv-events-config", "{}"], "KV events"),
        (["--data-parallel-size", "2"], "--replicas"),
        (["--ssl-certfile", "/x.pem"], "--tls"),
        (["--max-model-len", "4096"], "give --max-model-len to dpserve kube itself"),
        (["--max_model_len=4096"], "give --max-model-len to dpserve kube itself"),
        (["-tp", "2"], "give --tensor-parallel-size to dpserve kube itself"),
        (["--gpu-memory-utilization", "0.5"], "give --gpu-memory-utilization to dpserve kube itself"),
        (["--model", "other"], "give --model to dpserve kube itself"),
        (["--max-model", "4096"], "give --max-model-len to dpserve kube itself"),  # vLLM takes abbreviations
        (["--por", "9000"], "not for the vLLM pods"),
    ],
)
def test_vllm_flags_the_manifests_depend_on_are_refused_by_name(
    args: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "out.yaml"
    err = error_line(["kube", "--replicas", "2", "-o", str(path), "--", *args], capsys)
    assert err.startswith(f"dpserve kube: -- {args[0]}") and said in err, err
    assert not path.exists()


# (b) The engine's and the pods' sizes


def test_engine_sizes_resources_and_the_cache_are_settable(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--max-model-len", "32768", "--gpu-memory-utilization", "0.85", "--hf-cache-size", "300Gi"]
    flags += ["--vllm-cpu", "12", "--vllm-memory", "96Gi", "--vllm-memory-limit", "128Gi"]
    flags += ["--router-cpu", "2500m", "--router-memory", "2Gi", "--router-memory-limit", "4Gi"]
    docs = written(["kube", "--replicas", "2", *flags], capsys)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)
    container = vllm_container(docs)
    command = container["command"]
    assert (flag(command, "--max-model-len"), flag(command, "--gpu-memory-utilization")) == ("32768", "0.85")
    assert container["resources"] == {
        "requests": {"cpu": "12", "memory": "96Gi", "nvidia.com/gpu": 1},
        "limits": {"memory": "128Gi", "nvidia.com/gpu": 1},
    }
    (statefulset,) = only(docs, "StatefulSet")
    (cache,) = [v for v in statefulset["spec"]["template"]["spec"]["volumes"] if v["name"] == "hf-cache"]
    assert cache["emptyDir"] == {"sizeLimit": "300Gi"}
    deployment, _ = router_and_agent(docs)
    (router,) = deployment["spec"]["template"]["spec"]["containers"]
    assert router["resources"] == {"requests": {"cpu": "2500m", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
    # The defaults, as before: 8192 tokens, 0.9 of the GPU, 4 cores and 24Gi a GPU, no memory limit.
    default = vllm_container(documents(KubeOptions(replicas=1)))
    assert (flag(default["command"], "--max-model-len"), flag(default["command"], "--gpu-memory-utilization")) == (
        "8192",
        "0.9",
    )
    assert default["resources"]["limits"] == {"nvidia.com/gpu": 1}


@pytest.mark.parametrize(
    "bad",
    [
        ["--vllm-cpu", "four"],
        ["--vllm-memory", "0"],
        ["--router-memory-limit=-1Gi"],
        ["--hf-cache-size", "100GB"],
        ["--gpu-memory-utilization", "1.5"],
        ["--gpu-memory-utilization", "0"],
        ["--max-model-len", "0"],
    ],
)
def test_bad_sizes_are_refused_by_name(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kube", "--replicas", "1", *bad]) == 2
    err = capsys.readouterr().err
    assert bad[0].partition("=")[0] in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


# (c) TLS on every hop


def test_tls_on_every_hop(capsys: pytest.CaptureFixture[str]) -> None:
    options = KubeOptions(replicas=2, tls=True)
    docs = written(MUST_SHOW, capsys)
    (statefulset,) = only(docs, "StatefulSet")
    deployment, _ = router_and_agent(docs)
    vllm_spec, router_spec = (w["spec"]["template"]["spec"] for w in (statefulset, deployment))
    vllm = vllm_container(docs)
    (router,) = router_spec["containers"]
    # vLLM serves HTTPS with the vLLM Secret's files (reloaded when they change).
    command = vllm["command"]
    assert mounted_secret(vllm_spec, vllm, flag(command, "--ssl-certfile")) == ("dpserve-vllm-tls", "tls.crt")
    assert mounted_secret(vllm_spec, vllm, flag(command, "--ssl-keyfile")) == ("dpserve-vllm-tls", "tls.key")
    assert "--enable-ssl-refresh" in command
    # The routers serve HTTPS, and verify vLLM and their peers against the CA, all from the routers' Secret.
    args = parse_pod_command(router["command"])
    settings = load_settings(RouterSettings, _overrides(args), env={})
    files = {
        "ssl_certfile": "tls.crt",
        "ssl_keyfile": "tls.key",
        "ssl_ca_certs": "ca.crt",
        "replica_ssl_ca_certs": "ca.crt",
    }
    for name, entry in files.items():
        assert mounted_secret(router_spec, router, str(getattr(settings, name))) == ("dpserve-router-tls", entry)
    # Every replica by a name the vLLM certificate covers, over HTTPS, its KV events at that name.
    assert not settings.discover
    hosts = {urlsplit(url.partition("=")[2]).hostname for url in settings.replicas}
    assert len(hosts) == 2 and all(url.partition("=")[2].startswith("https://") for url in settings.replicas)
    assert all(any(fnmatch.fnmatch(host or "", name) for name in vllm_names(options)) for host in hosts)
    assert {urlsplit(text.split("=", 1)[1]).hostname for text in settings.kv_events} == hosts
    # Peers: found by a name the routers' certificate covers (each checks the others' for it).
    (source,) = [parse_discovery_source(text) for text in settings.discover_peers]
    assert source.name in router_names(options)
    assert "dpserve-router.dpserve.svc.cluster.local" in router_names(options)
    # The kubelet's probes speak HTTPS; Prometheus is told to.
    for _, container in containers(docs):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container and container["name"] != "agent":
                assert container[probe]["httpGet"]["scheme"] == "HTTPS", (container["name"], probe)
    for workload in (statefulset, deployment):
        assert workload["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    # The Secrets' modes: root alone reads vLLM's, the router's group its own.
    modes = {
        v["secret"]["secretName"]: v["secret"]["defaultMode"]
        for spec in (vllm_spec, router_spec)
        for v in spec["volumes"]
        if v["name"] == "tls"
    }
    assert modes == {"dpserve-vllm-tls": 0o400, "dpserve-router-tls": 0o440}
    assert not only(docs, "Secret") and "PRIVATE KEY" not in str(docs)


def test_tls_service_monitors_scrape_over_https_against_the_ca(capsys: pytest.CaptureFixture[str]) -> None:
    docs = written(["kube", "--replicas", "2", "--tls", "--service-monitor"], capsys)
    endpoints = {m["metadata"]["name"]: m["spec"]["endpoints"][0] for m in only(docs, "ServiceMonitor")}
    assert endpoints["dpserve-agent"].get("scheme") is None, "the agents serve plain HTTP"
    for name, secret in (("dpserve-router", "dpserve-router-tls"), ("vllm", "dpserve-vllm-tls")):
        endpoint = endpoints[name]
        assert endpoint["scheme"] == "https"
        assert endpoint["tlsConfig"]["ca"] == {"secret": {"name": secret, "key": "ca.crt"}}
        assert endpoint["tlsConfig"]["serverName"] == f"{name}.dpserve.svc.cluster.local"


def test_cert_manager_certificates_make_the_secrets_the_pods_mount(capsys: pytest.CaptureFixture[str]) -> None:
    options = KubeOptions(replicas=2, tls=True, namespace="llm")
    docs = written(
        ["kube", "--replicas", "2", "--tls", "--namespace", "llm", "--cert-manager-issuer", "ClusterIssuer/ca"], capsys
    )
    certificates = {c["spec"]["secretName"]: c for c in only(docs, "Certificate")}
    mounted = {
        v["secret"]["secretName"] for _, spec in pod_specs(docs) for v in spec.get("volumes", []) if v["name"] == "tls"
    }
    assert set(certificates) == mounted == {"dpserve-router-tls", "dpserve-vllm-tls"}
    assert certificates["dpserve-router-tls"]["spec"]["dnsNames"] == router_names(options)
    assert certificates["dpserve-vllm-tls"]["spec"]["dnsNames"] == vllm_names(options)
    for certificate in certificates.values():
        assert certificate["apiVersion"] == "cert-manager.io/v1" and certificate["metadata"]["namespace"] == "llm"
        assert certificate["spec"]["issuerRef"] == {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": "ca"}
        assert {"server auth", "client auth"} <= set(certificate["spec"]["usages"])
    assert "openssl req" not in render(KubeOptions(replicas=2, tls=True, cert_manager_issuer="ca"))
    assert (
        "Issuer"
        == only(documents(KubeOptions(replicas=1, tls=True, cert_manager_issuer="ca")), "Certificate")[0]["spec"][
            "issuerRef"
        ]["kind"]
    )
    for bad in (["--cert-manager-issuer", "ca"], ["--tls", "--cert-manager-issuer", "Secret/ca"]):
        assert "--cert-manager-issuer" in error_line(["kube", "--replicas", "1", *bad], capsys)


def test_no_tls_unless_asked() -> None:
    text = str(documents(KubeOptions(replicas=2, service_monitor=True)))
    assert "ssl" not in text and "https" not in text.lower() and "tls" not in text.lower()


@pytest.mark.engine
def test_the_vllm_flags_written_are_vllms_own() -> None:
    """vLLM's own argument classes declare the flags the pods are given (its text, not an import of seconds)."""
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.origin
    launcher = (Path(spec.origin).parent / "entrypoints" / "launchers" / "cli_args.py").read_text()
    for field in ("ssl_keyfile", "ssl_certfile", "enable_ssl_refresh"):
        assert f"    {field}: " in launcher, field


# (d) The header's certificates


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> None:
    """A TLS handshake in memory: the client checks the server's certificate for `name`."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_side = server.wrap_bio(to_server, to_client, server_side=True)
    client_side = client.wrap_bio(to_client, to_server, server_hostname=name)
    for _ in range(10):
        done = 0
        for side in (client_side, server_side):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        if done == 2:
            return
    raise AssertionError("handshake did not finish")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_the_headers_openssl_commands_make_certificates_for_every_hop(tmp_path: Path) -> None:
    options = KubeOptions(replicas=3, namespace="llm", tls=True)
    header = [line.removeprefix("#   ") for line in render(options).splitlines() if line.startswith("#   ")]
    assert [line for line in header if line in tls_commands(options)] == tls_commands(options)
    for line in tls_commands(options):
        if not line.startswith("kubectl "):
            subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    creates = [line for line in tls_commands(options) if line.startswith("kubectl ")]
    assert all(f"--from-file={entry}=" in line for line in creates for entry in ("tls.crt", "tls.key", "ca.crt"))
    client = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    servers = {}
    for part in ("router", "vllm"):
        servers[part] = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        servers[part].load_cert_chain(tmp_path / f"{part}.crt", tmp_path / f"{part}.key")
    # What each hop checks: clients and peers the routers' names, the routers each vLLM pod's.
    for name in ("dpserve-router.llm.svc.cluster.local", "dpserve-router-peers.llm.svc.cluster.local"):
        _handshake(servers["router"], client, name)
    for index in range(3):
        _handshake(servers["vllm"], client, f"vllm-{index}.vllm.llm.svc.cluster.local")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(servers["vllm"], client, "dpserve-router-peers.llm.svc.cluster.local")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(servers["router"], client, "vllm-0.vllm.llm.svc.cluster.local")
    other = ssl.create_default_context()  # the system's CAs: the header's CA is the only one that vouches
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(servers["router"], other, "dpserve-router.llm.svc.cluster.local")
