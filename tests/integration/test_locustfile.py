"""The locustfile, headless for a few seconds against the router over sims: its custom LLM entries
(TTFT, ITL, output tokens) exist and are positive, warm-up requests are reported apart, failures count,
and it runs distributed (`--processes`) and open-loop (`--arrival-rate`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Fleet, locust_stats, running_fleet

pytestmark = pytest.mark.integration

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtests" / "locustfile.py"


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("locust-sims")
    args = ["--sim", "2", "--policy", "least_loaded", "--", "--decode-ms-per-token", "5"]
    with running_fleet(work, 2, args, timeout_s=60) as fleet:
        yield fleet


def run_locust(host: str, prefix: Path, *args: str, seconds: int = 5) -> dict[tuple[str, str], dict[str, str]]:
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host]
    command += ["-t", f"{seconds}s", "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert Path(f"{prefix}_stats.csv").exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return locust_stats(prefix)


def test_streams_report_ttft_itl_and_tokens(sims: Fleet, tmp_path: Path) -> None:
    stats = run_locust(
        sims.router_url, tmp_path / "stream", "-u", "4", "-r", "4", "--output-tokens", "16", "--warmup", "1.5"
    )
    requests = stats[("POST", "/v1/chat/completions [stream]")]
    assert int(requests["Request Count"]) > 5 and int(requests["Failure Count"]) == 0
    # Requests ending in the warm-up are reported apart (the first ones take ~0.1 s, so there are some).
    assert int(stats[("POST", "(warmup) /v1/chat/completions [stream]")]["Request Count"]) > 0
    ttft, itl, tokens = stats[("LLM", "TTFT")], stats[("LLM", "ITL")], stats[("LLM", "output_tokens")]
    assert int(ttft["Request Count"]) == int(requests["Request Count"])
    assert float(ttft["Average Response Time"]) > 0 and float(ttft["Min Response Time"]) > 0
    # 16 tokens: 15 gaps per stream, each about the sim's 5 ms per token.
    assert int(itl["Request Count"]) == 15 * int(requests["Request Count"])
    assert 2 < float(itl["Average Response Time"]) < 50
    assert float(tokens["Average Content Size"]) == 16
    # A stream's own time is the whole stream, not just its headers: at least TTFT + 15 gaps.
    assert float(requests["Average Response Time"]) >= float(ttft["Average Response Time"]) + 15 * 2


def test_distributed_mixed_apis_and_non_streamed(sims: Fleet, tmp_path: Path) -> None:
    stats = run_locust(
        sims.router_url,
        tmp_path / "mixed",
        *("-u", "6", "-r", "6", "--processes", "2", "--api", "mixed", "--stream-ratio", "0.5"),
        *("--output-tokens", "8", "--workload", "shared_prefix", "--prefix-tokens", "100"),
    )
    names = {name for kind, name in stats if kind == "POST"}
    assert {"/v1/chat/completions", "/v1/completions [stream]"} <= names
    assert all(int(row["Failure Count"]) == 0 for (kind, _), row in stats.items() if kind == "POST")
    assert float(stats[("LLM", "output_tokens")]["Average Content Size"]) == 8
    assert float(stats[("LLM", "TTFT")]["Average Response Time"]) > 0


def test_open_loop_arrivals_and_failures_count(sims: Fleet, tmp_path: Path) -> None:
    stats = run_locust(
        sims.router_url, tmp_path / "open", "-u", "2", "-r", "2", "--arrival-rate", "20", "--output-tokens", "4"
    )
    requests = stats[("POST", "/v1/chat/completions [stream]")]
    # 20 arrivals/s for ~5 s whatever the latency: Poisson, so roughly 100.
    assert 50 < int(requests["Request Count"]) < 160
    # A model no replica serves: every request fails, and Locust counts it as a failure.
    failing = run_locust(sims.router_url, tmp_path / "bad", "-u", "2", "-r", "2", "--model", "no-such-model", seconds=3)
    bad = failing[("POST", "/v1/chat/completions [stream]")]
    assert int(bad["Request Count"]) > 0 and int(bad["Failure Count"]) == int(bad["Request Count"])
    assert ("LLM", "TTFT") not in failing
