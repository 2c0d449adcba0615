"""What `--discover` and `--discover-nameserver` accept, and the replica URL an address becomes (no network)."""

from __future__ import annotations

import pytest

from dpserve.config import RouterSettings
from dpserve.replicas.discovery import DiscoverySource, parse_discovery_source, replica_url, split_nameserver


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("dns:vllm:8000", DiscoverySource("dns", "vllm", 8000)),
        ("dns:vllm.default.svc.cluster.local.:8000", DiscoverySource("dns", "vllm.default.svc.cluster.local", 8000)),
        ("srv:_vllm._tcp.example.test", DiscoverySource("srv", "_vllm._tcp.example.test")),
    ],
)
def test_sources_parse_and_print_back(text: str, source: DiscoverySource) -> None:
    assert parse_discovery_source(text) == source
    assert parse_discovery_source(str(source)) == source


@pytest.mark.parametrize(
    "text",
    [
        "dns:vllm",
        "dns:vllm:http",
        "dns::8000",
        "dns:vllm:0",
        "dns:vllm:65536",
        "dns:a b:80",
        "dns:a/b:80",
        "srv:vllm.example",
        "srv:_vllm.example",
        "consul:vllm",
        "vllm:8000",
        "",
    ],
)
def test_bad_sources_say_what_was_expected(text: str) -> None:
    with pytest.raises(ValueError, match="--discover"):
        parse_discovery_source(text)


def test_nameserver_forms() -> None:
    assert split_nameserver("127.0.0.53") == ("127.0.0.53", 53)
    assert split_nameserver("127.0.0.53:5353") == ("127.0.0.53", 5353)
    assert split_nameserver("[::1]:5353") == ("::1", 5353)
    assert split_nameserver("[::1]") == ("::1", 53)
    assert split_nameserver("::1") == ("::1", 53)
    for bad in ("dns.example", "127.0.0.1:port", "127.0.0.1:0", "[::1]:99999"):
        with pytest.raises(ValueError, match="--discover-nameserver"):
            split_nameserver(bad)


def test_addresses_become_replica_urls() -> None:
    assert replica_url("172.18.0.3", 8000) == "http://172.18.0.3:8000"
    assert replica_url("fd00::3", 8000) == "http://[fd00::3]:8000"


def test_discovered_replicas_default_to_kv_aware_like_kv_events() -> None:
    settings = RouterSettings(replicas=("http://a:1",))
    assert (settings.routing_policy, settings.slo_inner_policy) == ("slo", "least_loaded")
    settings = RouterSettings(discover=("dns:vllm:8000",))
    assert (settings.routing_policy, settings.slo_inner_policy) == ("slo", "kv_aware")
    assert RouterSettings(discover=("dns:vllm:8000",), policy="round_robin").routing_policy == "round_robin"
