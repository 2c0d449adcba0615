"""`dpserve tune` on a trace recorded through the real router over sims: the receipts log holds every
request's blocks and time, the fitted timing is the sims', the replay's defaults hit what the sims
reported, and the best setting is printed; on a recorded burst of one prefix, a setting other than the
defaults is the one recommended."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import kv_router_over_sims
from tests.integration.test_kv_routing import long_prompt

pytestmark = pytest.mark.integration


def in_threads(count: int, client: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=client, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_a_recorded_trace_is_replayed_and_the_best_weights_printed(tmp_path: Path) -> None:
    log = tmp_path / "receipts.jsonl"
    with kv_router_over_sims(
        4, ("--decode-ms-per-token", "2"), "--receipts-sample", "1", "--receipts-log", str(log)
    ) as router:  # the log is written whole once the router stops

        def client(thread: int) -> None:
            for turn in range(10):
                group = (thread + turn) % 6
                prompt = f"{long_prompt(700 + group, words=150)} {long_prompt(800 + 10 * thread + turn, words=10)}"
                body = {"prompt": prompt, "max_tokens": 2 + (thread + 3 * turn) % 7}  # answers of 2 to 8 tokens
                assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).status_code == 200

        in_threads(3, client)
        summary = httpx.get(f"{router.url}/admin/receipts?limit=0", timeout=5).json()["summary"]
    assert summary["receipts"] == 30 and len(log.read_text().splitlines()) == 30
    command = [sys.executable, "-m", "dpserve", "tune", "--receipts", str(log)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    print(done.stdout)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("30 requests over ") and "4 replicas" in lines[0]
    # The sims' timing, fitted to the receipts' times: 0.1 ms a computed prompt token, 2 ms an output token
    # (the router's own time and the sims' batch slowdown on top).
    timing = re.fullmatch(r"timing: prefill (\S+) ms/token \((.+)\), decode (\S+) ms/token \((.+)\)", lines[1])
    assert timing is not None, lines[1]
    assert timing[2] == timing[4] == "fitted to 30 receipts' times"
    assert 0.07 < float(timing[1]) < 0.15 and 1.5 < float(timing[3]) < 3.0, lines[1]
    defaults = next(line.split() for line in lines if line.startswith("defaults"))
    # The model, with kv_aware's default weights, hits what the sims reported for the same requests.
    assert abs(float(defaults[5]) - summary["realized_hit_rate"]) < 0.05, (defaults, summary)
    assert any(line.startswith("best: --kv-load-weight ") for line in lines)


def test_a_recorded_burst_on_one_prefix_is_tuned_to_the_loosest_guard(tmp_path: Path) -> None:
    """16 requests of one prompt group at once. Replayed with their answers lasting seconds (50 ms a token)
    and no batch slowdown, all 16 are in flight together: the default guard (1.5 x the lightest load + 8)
    moves the 10th off the group's replica, which recomputes the shared prefix; the loosest guard in the
    grid (2 x + 16) keeps the burst together, so it (with a load weight under 1/15) must be recommended.
    Modelled on the 4 replicas the router had (the receipts name only those it used)."""
    log = tmp_path / "receipts.jsonl"
    with kv_router_over_sims(
        4, ("--decode-ms-per-token", "2"), "--receipts-sample", "1", "--receipts-log", str(log)
    ) as router:

        def client(thread: int) -> None:
            prompt = f"{long_prompt(900, words=150)} {long_prompt(950 + thread, words=10)}"
            body = {"prompt": prompt, "max_tokens": 100}
            assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).status_code == 200

        in_threads(16, client)
    model = ["--replicas", "4", "--decode-ms-per-token", "50", "--prefill-ms-per-token", "0.1", "--batch-slowdown", "0"]
    command = [sys.executable, "-m", "dpserve", "tune", "--receipts", str(log), *model]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    print(done.stdout)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("16 requests over ") and "4 replicas" in lines[0]
    best = next(line for line in lines if line.startswith("best: "))
    assert best.endswith(" --balance-rel 2 --balance-abs 16"), best
    assert float(best.split()[2]) <= 0.05, best
    defaults = next(line.split() for line in lines if line.startswith("defaults"))
    first = next(line.split() for line in lines if line.startswith("#1"))
    assert float(first[5]) > float(defaults[5]) and float(first[6]) < float(defaults[6]), (first, defaults)
