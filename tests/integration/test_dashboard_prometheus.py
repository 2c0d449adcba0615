"""The Grafana dashboard's queries, run by a real Prometheus (Debian's) that scrapes the router and a real
vLLM CPU replica with the compose stack's own scrape jobs: every query parses and evaluates, and the panels
show data once requests have gone through. Grafana's own image cannot be pulled here; what Grafana adds over
this is drawing the answers (its provisioning files are checked in tests/unit/test_compose.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dpserve.config import RouterSettings
from dpserve.deploy import grafana
from dpserve.deploy.compose import ComposeOptions, prometheus_config
from dpserve.router.app import create_app
from tests.compose_files import ROOT
from tests.conftest import free_port, serving
from tests.fake_nvml import two_gpus
from tests.integration.conftest import Fleet, wait_until

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 0.5
SCRAPE = "500ms"  # Prometheus durations are whole numbers of a unit
WINDOW = "15s"
"""What `$__rate_interval` stands for: several scrapes, as Grafana picks it."""
ONLY_WITH_EVENTS = {
    "Refused by the router/s, by status": "only 429s and 503s the router answered itself",
    "Desired-count changes, by direction": "the signal moves only after its scale-down delay (an hour here)",
    "Replica start-up": "measured when a replica starts on the signal: none does here",
}
"""Panels that stay empty here, and why: nothing in this test makes what they count."""


@contextmanager
def prometheus(config: dict[str, Any], work: Path) -> Iterator[str]:
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    assert PROMETHEUS is not None
    command = [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}"]
    command += [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: process.poll() is not None or _answers(f"{url}/-/ready"), 30, what="Prometheus ready")
        assert process.poll() is None, process.communicate()[1].decode()[-2000:]
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def scrape_config(router: str, replica: str) -> dict[str, Any]:
    """The compose stack's Prometheus configuration for one replica, its service names turned into these
    loopback addresses (labels kept: the vLLM target is `replica="r0"`, as the router names it)."""
    config = prometheus_config(ComposeOptions(gpus=1))
    config["global"] = {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["dpserve-router"]["static_configs"][0]["targets"] = [router]
    jobs["vllm"]["static_configs"][0]["targets"] = [replica]
    del jobs["gpu-agent"]  # the router reads GPUs itself here (NVML faked), as on a single host
    config["scrape_configs"] = list(jobs.values())
    return config


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, the variables set as Grafana sets them at `All`."""
    dashboard = json.loads((ROOT / grafana.DASHBOARD_FILE).read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"].replace("$__rate_interval", WINDOW).replace("$__interval", WINDOW)
            queries.append((panel["title"], expr.replace("$replica", ".*").replace("$model", ".*")))
    return queries


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (make test installs Debian's)")
async def test_every_dashboard_query_evaluates_in_prometheus_and_panels_show_data(fleet: Fleet, tmp_path: Path) -> None:
    replica = fleet.replica_urls[0]
    # No scale-down during the test: the changes panel stays empty (ONLY_WITH_EVENTS), whatever its length.
    settings = RouterSettings(
        replicas=(f"r0={replica}",), probe_interval_s=0.2, gpu_interval_s=0.05, scale_down_delay_s=3600
    )
    async with serving(create_app(settings, nvml=two_gpus)) as router, httpx.AsyncClient(timeout=60) as client:
        await asyncio.to_thread(wait_until, lambda: _answers(f"{router}/ready"), 20, what="router ready")
        config = scrape_config(router.removeprefix("http://"), replica.removeprefix("http://"))
        with prometheus(config, tmp_path) as prom:
            # Prometheus takes up new targets every 5 s: the requests go once both are scraped.
            await _query_until(client, prom, "sum(up)", 2)
            body: dict[str, Any] = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": "hi"}]}
            for turn in range(6):
                # Streams teach the latency models (the prediction error panel); an SLO is met (goodput).
                slo = {"x-slo-ttft-ms": "60000"} if turn >= 4 else {}
                answer = await client.post(
                    f"{router}/v1/chat/completions",
                    json={**body, "max_tokens": 4, "stream": turn % 2 == 1},
                    headers=slo,
                )
                assert answer.status_code == 200
                await asyncio.sleep(SCRAPE_S)
            await _query_until(client, prom, "sum(dpserve_requests_total)", 6)
            await _query_until(client, prom, "sum(rate(dpserve_requests_total[15s]))", 1e-9)
            await _query_until(client, prom, "sum(rate(vllm:generation_tokens_total[15s]))", 1e-9)
            empty, failed = await _evaluate(client, prom)
    assert failed == [], failed
    assert empty == set(ONLY_WITH_EVENTS), empty


async def _query_until(client: httpx.AsyncClient, prom: str, expr: str, at_least: float, timeout_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        result = (await client.get(f"{prom}/api/v1/query", params={"query": expr})).json()["data"]["result"]
        if result and float(result[0]["value"][1]) >= at_least:
            return
        await asyncio.sleep(SCRAPE_S)
    raise AssertionError(f"Prometheus never read {expr} >= {at_least}")


async def _evaluate(client: httpx.AsyncClient, prom: str) -> tuple[set[str], list[str]]:
    """The titles of panels none of whose queries returned a number, and the queries Prometheus refused."""
    shown: set[str] = set()
    titles: set[str] = set()
    failed: list[str] = []
    for title, expr in dashboard_queries():
        titles.add(title)
        answer = (await client.get(f"{prom}/api/v1/query", params={"query": expr})).json()
        if answer["status"] != "success":
            failed.append(f"{title}: {expr}: {answer.get('error')}")
        elif any(series["value"][1] != "NaN" for series in answer["data"]["result"]):
            shown.add(title)
    return titles - shown, failed
