"""`--discover` against a real DNS server: Debian's dnsmasq on 127.0.0.53 (a port of the test's own), with
records that point at `dpserve sim` replicas on 127.0.0.x addresses, each standing for a host. The router
runs as users run it (`dpserve router --discover ...`), and is watched through /status and /metrics."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import RouterProcess, sim_command, start_router, stop_process, stop_router
from tests.integration.hosts import Dns, dns_server, free_port_on, sims_at, start_sim
from tests.integration.traffic import Load, chat, long_prompt, wait_for

pytestmark = pytest.mark.integration


def _status(router: RouterProcess) -> dict[str, Any]:
    return httpx.get(f"{router.url}/status", timeout=5).json()


def _healthy(router: RouterProcess) -> set[str]:
    return {replica["url"] for replica in _status(router)["replicas"] if replica["healthy"]}


def _known(router: RouterProcess) -> set[str]:
    return {replica["url"] for replica in _status(router)["replicas"]}


def _metric(router: RouterProcess, name: str, source: str) -> float:
    for line in httpx.get(f"{router.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'{name}{{source="{source}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} for {source}")


@contextlib.contextmanager
def discovering_router(
    dns: Dns, *discover: str, healthy: int, interval: str = "0.3", probe_interval: str = "0.2"
) -> Iterator[RouterProcess]:
    flags = [arg for source in discover for arg in ("--discover", source)]
    flags += ["--discover-nameserver", dns.nameserver, "--discover-interval", interval]
    flags += ["--probe-interval", probe_interval]
    router = start_router([], "least_loaded", *flags, expect_healthy=healthy)
    try:
        yield router
    finally:
        stop_router(router)


def test_a_records_follow_a_changing_record_set_with_no_failed_request(tmp_path: Path) -> None:
    port = free_port_on("127.0.0.2", "127.0.0.3", "127.0.0.4")
    url = {address: f"http://{address}:{port}" for address in ("127.0.0.2", "127.0.0.3", "127.0.0.4")}
    with dns_server(tmp_path) as dns, sims_at(port, "127.0.0.2", "127.0.0.3") as sims:
        dns.set_records({"vllm.test": ["127.0.0.2", "127.0.0.3"]})
        with discovering_router(dns, f"dns:vllm.test:{port}", healthy=2) as router:
            assert _healthy(router) == {url["127.0.0.2"], url["127.0.0.3"]}
            assert chat(router.url, "hello").status_code == 200
            load = Load(router.url)
            with load.running():
                wait_for(lambda: load.count() >= 20, 10, "load flowing")
                sims["127.0.0.4"] = start_sim("127.0.0.4", port, None)
                dns.set_records({"vllm.test": ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
                joined = wait_for(lambda: url["127.0.0.4"] in _healthy(router), 10, "the new address admitted")
                before = load.count()
                # One address leaves DNS: drained, then removed; its replica keeps running until then.
                dns.set_records({"vllm.test": ["127.0.0.3", "127.0.0.4"]})
                left = wait_for(lambda: url["127.0.0.2"] not in _known(router), 10, "the vanished address removed")
                stop_process(sims.pop("127.0.0.2").process, 10)
                wait_for(lambda: load.count() >= before + 40, 20, "load on the new set")
            assert load.failures == [], load.failures[:5]
            assert _known(router) == {url["127.0.0.3"], url["127.0.0.4"]}
            served = {replica["url"]: replica["served_total"] for replica in _status(router)["replicas"]}
            assert served[url["127.0.0.4"]] > 0
            (source,) = _status(router)["discovery"]
            assert source["source"] == f"dns:vllm.test:{port}" and source["ok"] and source["error"] is None
            assert source["replicas"] == sorted([url["127.0.0.3"], url["127.0.0.4"]])
            print(f"\njoined after {joined:.1f}s, left after {left:.1f}s; {load.ok} requests, 0 failed")


def test_a_dns_server_that_stops_answering_keeps_the_fleet_and_says_so(tmp_path: Path) -> None:
    port = free_port_on("127.0.0.2", "127.0.0.3")
    source = f"dns:vllm.test:{port}"
    with dns_server(tmp_path) as dns, sims_at(port, "127.0.0.2", "127.0.0.3"):
        dns.set_records({"vllm.test": ["127.0.0.2", "127.0.0.3"]})
        with discovering_router(dns, source, healthy=2) as router:
            fleet = _healthy(router)
            assert _metric(router, "dpserve_discovery_failures_total", source) == 0
            dns.stop()
            wait_for(lambda: not _status(router)["discovery"][0]["ok"], 15, "the failure shown in /status")
            wait_for(lambda: _metric(router, "dpserve_discovery_failures_total", source) >= 2, 15, "more failures")
            (state,) = _status(router)["discovery"]
            assert state["error"] and state["replicas"] == sorted(fleet)
            assert _metric(router, "dpserve_discovery_stale", source) == 1
            assert _metric(router, "dpserve_discovery_replicas", source) == 2
            assert _healthy(router) == fleet, "a DNS outage never empties the fleet"
            for index in range(10):
                assert chat(router.url, f"during the outage {index}").status_code == 200
            dns.start()
            wait_for(lambda: _status(router)["discovery"][0]["ok"], 15, "recovery shown in /status")
            assert _metric(router, "dpserve_discovery_stale", source) == 0
            assert _healthy(router) == fleet


def test_srv_records_give_each_replica_its_host_and_port(tmp_path: Path) -> None:
    port_a, port_b = free_port_on("127.0.0.5"), free_port_on("127.0.0.6")
    records = (
        f"--srv-host=_vllm._tcp.svc.test,a.svc.test,{port_a}",
        f"--srv-host=_vllm._tcp.svc.test,b.svc.test,{port_b}",
    )
    with dns_server(tmp_path, *records) as dns, sims_at(port_a, "127.0.0.5"), sims_at(port_b, "127.0.0.6"):
        dns.set_records({"a.svc.test": ["127.0.0.5"], "b.svc.test": ["127.0.0.6"]})
        with discovering_router(dns, "srv:_vllm._tcp.svc.test", healthy=2) as router:
            assert _healthy(router) == {f"http://127.0.0.5:{port_a}", f"http://127.0.0.6:{port_b}"}
            for index in range(4):
                assert chat(router.url, f"srv {index}").status_code == 200


def test_discovered_replicas_publish_kv_events_at_the_kv_port(tmp_path: Path) -> None:
    port = free_port_on("127.0.0.2", "127.0.0.3")
    kv_port = free_port_on("127.0.0.2", "127.0.0.3")
    with dns_server(tmp_path) as dns, sims_at(port, "127.0.0.2", "127.0.0.3", kv_port=kv_port):
        dns.set_records({"vllm.test": ["127.0.0.2", "127.0.0.3"]})
        flags = ["--discover", f"dns:vllm.test:{port}", "--discover-nameserver", dns.nameserver]
        flags += ["--discover-kv-port", str(kv_port)]
        router = start_router([], "kv_aware", *flags, expect_healthy=2)
        try:
            words = iter("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split())

            def both_published() -> bool:
                replicas = _status(router)["replicas"]
                if all(r["kv_events"]["batches"] > 0 for r in replicas):
                    return True
                body = {"model": "dpserve-tiny", "prompt": long_prompt(next(words)), "max_tokens": 2}
                assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=30).status_code == 200
                return False

            wait_for(both_published, 20, "KV events from both discovered replicas", interval_s=0.1)
            for replica in _status(router)["replicas"]:
                host = replica["url"].removeprefix("http://").rpartition(":")[0]
                assert replica["kv_events"]["endpoint"] == f"tcp://{host}:{kv_port}"
                assert replica["kv_events"]["indexed_blocks"] > 0
        finally:
            stop_router(router)


def test_a_refused_request_looks_dns_up_again_at_once(tmp_path: Path) -> None:
    port = free_port_on("127.0.0.2", "127.0.0.3")
    source = f"dns:vllm.test:{port}"
    with dns_server(tmp_path) as dns, sims_at(port, "127.0.0.2", "127.0.0.3") as sims:
        dns.set_records({"vllm.test": ["127.0.0.2", "127.0.0.3"]})
        # 30 s between lookups and between probes: only the refused requests can make it look again soon.
        with discovering_router(dns, source, healthy=2, interval="30", probe_interval="30") as router:
            lookups = _metric(router, "dpserve_discovery_lookups_total", source)
            dns.set_records({"vllm.test": ["127.0.0.2"]})
            stop_process(sims.pop("127.0.0.3").process, 10)
            started = time.monotonic()
            # Ties go at random: 16 requests all missing the lost replica is a 1-in-65536 chance.
            for index in range(16):
                assert chat(router.url, f"after the loss {index}").status_code == 200
            gone = wait_for(lambda: f"http://127.0.0.3:{port}" not in _known(router), 10, "the refused one removed")
            assert time.monotonic() - started < 15
            assert _metric(router, "dpserve_discovery_lookups_total", source) > lookups
            print(f"\nremoved {gone:.1f}s after its refusals, with a 30 s lookup interval")


def test_a_refused_probe_looks_dns_up_again_at_once(tmp_path: Path) -> None:
    port = free_port_on("127.0.0.2", "127.0.0.3")
    source = f"dns:vllm.test:{port}"
    with dns_server(tmp_path) as dns, sims_at(port, "127.0.0.2", "127.0.0.3") as sims:
        dns.set_records({"vllm.test": ["127.0.0.2", "127.0.0.3"]})
        # No traffic and 30 s between lookups: the probe that finds nothing listening makes it look again.
        with discovering_router(dns, source, healthy=2, interval="30") as router:
            lookups = _metric(router, "dpserve_discovery_lookups_total", source)
            dns.set_records({"vllm.test": ["127.0.0.2"]})
            stop_process(sims.pop("127.0.0.3").process, 10)
            gone = wait_for(lambda: f"http://127.0.0.3:{port}" not in _known(router), 10, "the refused one removed")
            assert _metric(router, "dpserve_discovery_lookups_total", source) > lookups
            print(f"\nremoved {gone:.1f}s after it stopped, with a 30 s lookup interval and no traffic")


def test_bad_discover_values_are_clear_errors() -> None:
    for bad in ("dns:vllm", "dns:vllm:http", "srv:vllm.example", "consul:vllm", "dns:a b:80"):
        result = subprocess.run(
            [*sim_command(0, "x")[:3], "router", "--discover", bad], capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 2, bad
        assert "--discover" in result.stderr and "Traceback" not in result.stderr, result.stderr
    result = subprocess.run([*sim_command(0, "x")[:3], "router"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "--replica URL or --discover" in result.stderr
    for bad in ("dns.example", "127.0.0.1:port", "127.0.0.1:70000"):
        command = [*sim_command(0, "x")[:3], "router", "--discover", "dns:vllm:8000", "--discover-nameserver", bad]
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and "--discover-nameserver" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
