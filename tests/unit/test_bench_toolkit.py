"""The benchmarks' shared toolkit: tables, CSV, figures, router commands, CPU time, paths in results."""

from __future__ import annotations

import csv
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import pytest

from benchmarks.fleet import (
    CHECKOUT,
    bench_tool,
    cpu_seconds,
    first_ephemeral_port,
    port_block,
    relative_source_paths,
    router_command,
)
from benchmarks.report import figure, format_table, read_rows, shown, write_csv
from dpserve.config import RouterSettings
from dpserve.up.plan import RouterTarget, router_flags

URLS = ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
EVENTS = ["tcp://127.0.0.1:8200", "tcp://127.0.0.1:8201"]


def test_format_table_aligns_columns_without_trailing_spaces() -> None:
    assert format_table(("a", "bb"), [(1, "x"), (22, "")]) == "a   bb\n1   x\n22"
    assert format_table(("a", "bb"), [(1, "x"), (22, "")], align="right") == " a  bb\n 1   x\n22"
    with pytest.raises(ValueError):
        format_table(("a",), [], align="centre")


def test_write_csv_writes_the_columns_given_or_the_first_rows(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", [{"x": 1, "y": 2.5}, {"x": 3, "y": ""}])
    with open(tmp_path / "a.csv", newline="") as handle:
        assert list(csv.DictReader(handle)) == [{"x": "1", "y": "2.5"}, {"x": "3", "y": ""}]
    write_csv(tmp_path / "b.csv", [], ["x", "y"])
    assert (tmp_path / "b.csv").read_bytes() == b"x,y\r\n"


@dataclass
class _Row:
    name: str
    count: int
    share: float
    note: str = "default"


def test_read_rows_reads_each_cell_as_its_fields_type(tmp_path: Path) -> None:
    rows = [_Row("a", 3, 0.25, "x"), _Row("b", 0, math.inf, "")]
    write_csv(tmp_path / "rows.csv", [asdict(row) for row in rows])
    assert read_rows(_Row, tmp_path / "rows.csv") == rows
    # An older CSV without a later column: the field keeps its default.
    write_csv(tmp_path / "old.csv", [{"name": "c", "count": 1, "share": 1.5}])
    assert read_rows(_Row, tmp_path / "old.csv") == [_Row("c", 1, 1.5)]


def test_figure_draws_titles_and_saves_a_png(tmp_path: Path) -> None:
    path = tmp_path / "f.png"
    with figure(path, ("left", "right"), (6, 3), xlabel="x", legend="figure", legend_columns=2) as axes:
        assert len(axes) == 2
        axes[0].plot([1, 2], [3, 4], label="one")
        axes[1].plot([1, 2], [4, 3], label="one")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(RuntimeError), figure(tmp_path / "g.png", ("only",), (3, 3)):
        raise RuntimeError("a failed drawing saves nothing")
    assert not (tmp_path / "g.png").exists()


def test_dpserves_router_command_is_dpserve_ups_router_flags() -> None:
    command = router_command(
        "dpserve", "kv_aware", URLS, 9000, kv_events=EVENTS, tokenizer="remote", settings={"gpu_interval_s": 0.0}
    )
    settings = RouterSettings(policy="kv_aware", port=9000, log_level="warning", gpu_interval_s=0.0)
    targets = [RouterTarget(url, None, events) for url, events in zip(URLS, EVENTS, strict=True)]
    assert command == [sys.executable, "-m", "dpserve", "router", *router_flags(settings, targets, "remote")]
    plain = router_command("dpserve", "least_loaded", URLS, 9000, extra=["--retries=0"])
    assert "--kv-events" not in plain and plain[-1] == "--retries=0"


def test_rust_routers_commands() -> None:
    vllm = router_command("vllm-router", "kv_aware", URLS, 9000, kv_events=EVENTS, block_size=32)
    assert vllm[0] == (bench_tool("vllm-router") or "vllm-router")
    assert vllm[vllm.index("--prometheus-port") + 1] == "9001"
    assert vllm.count("--kv-event-source") == 2 and vllm[-1] == "32"
    assert "--kv-event-source" not in router_command("vllm-router", "round_robin", URLS, 9000, kv_events=EVENTS)
    sglang = router_command("sglang-router", "round_robin", URLS, 9000)
    assert sglang[1:3] == ["-m", "sglang_router.launch_router"]
    with pytest.raises(ValueError):
        router_command("nginx", "round_robin", URLS, 9000)


def test_cpu_seconds_counts_children_recursively() -> None:
    spin = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(60)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"]
    )
    try:
        process = psutil.Process(parent.pid)
        deadline = time.monotonic() + 20
        while cpu_seconds([process]) - sum(process.cpu_times()[:2]) < 0.5:
            assert time.monotonic() < deadline, "the grandchild's CPU time was never counted"
            time.sleep(0.1)
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
    assert cpu_seconds([process]) == 0.0  # gone: nothing to count, no error


def test_results_name_paths_as_the_repository_does(tmp_path: Path) -> None:
    assert shown(CHECKOUT / "benchmarks" / "results" / "overhead") == "benchmarks/results/overhead"
    assert shown(tmp_path) == str(tmp_path)
    text = (
        f'"file":"{CHECKOUT}/dpserve/router/relay.py" "/x/.venv/lib/python3.11/site-packages/aiohttp/client.py" '
        '"name":"f (/root/.pyenv/versions/3.11.7/lib/python3.11/asyncio/locks.py:3)" '
        '"name":"process 7:\\"/x/.venv/bin/python -m dpserve router\\""'
    )
    assert relative_source_paths(text) == (
        '"file":"dpserve/router/relay.py" "site-packages/aiohttp/client.py" "name":"f (python3.11/asyncio/locks.py:3)" '
        '"name":"process 7:\\"python -m dpserve router\\""'
    )


def test_benchmark_ports_come_from_below_the_ephemeral_range() -> None:
    """A port found free in the ephemeral range can be handed to an outgoing connection before the router
    meant for it binds: the soak benchmark's router once exited with "address already in use"."""
    first = first_ephemeral_port()
    if first - 4 <= 20000:
        pytest.skip(f"this host's ephemeral ports start at {first}: no room below them")
    starts = [port_block(4, random.Random(seed)) for seed in range(50)]
    assert all(20000 <= start and start + 4 <= first for start in starts)


def test_bench_overheads_loadgens_share_the_connections_with_every_url_reached_first() -> None:
    from benchmarks import overhead

    args = overhead.parse_args(["--loadgens", "2"])
    scripts = {"json": Path("/work/json.lua")}
    ctx = overhead.Context(args, "wrk", Path("/work"), {"json": b"{}"}, scripts, [], [], {})
    commands = overhead.load_commands(ctx, URLS, "json", 7, 2.0)
    urls = [url + overhead.PATH for url in URLS]
    assert [(command[-1], command[2]) for command in commands] == [
        (urls[0], "-c2"),
        (urls[1], "-c2"),
        (urls[0], "-c2"),
        (urls[1], "-c1"),
    ]
    assert all(command[1] == "-t1" for command in commands)  # one thread each: its CPU says when it is the limit
    # Fewer connections than generators: the empty ones are dropped, the first URLs served first.
    assert [command[-1] for command in overhead.load_commands(ctx, URLS, "json", 2, 2.0)] == urls
    assert len(overhead.load_commands(ctx, URLS[:1], "json", 1, 2.0)) == 1
    with pytest.raises(SystemExit):
        overhead.parse_args(["--loadgens", "0"])


def test_bench_overhead_reports_router_cpu_per_request_beside_the_rates() -> None:
    """On a machine the backends and load generators fill, the rates understate a leaner router: the report
    also gives its CPU per request against the other's, round by round (a round missing either is skipped)."""
    from benchmarks import overhead

    ours, theirs = overhead.Target("dpserve", "least_loaded"), overhead.Target("vllm-router", "round_robin")

    def run(target: overhead.Target, round_: int, req_s: float, router_cpu: float | None) -> overhead.Run:
        return overhead.Run(
            target, "sse", 32, 64, 100, req_s, 1.0, 2.0, 0, "wrk", 0.2, 0.2, router_cpu, 0.9, 0.5, round_
        )

    runs = [
        run(ours, 0, 1000.0, 0.75),
        run(theirs, 0, 700.0, 0.98),  # 0.75 ms against 1.4 ms a stream
        run(ours, 1, 900.0, 0.9),
        run(theirs, 1, 600.0, 0.9),  # 1.0 ms against 1.5 ms
        run(ours, 2, 900.0, None),  # no CPU figure: no ratio
        run(theirs, 2, 600.0, 0.9),
    ]
    ratios = overhead.cpu_ratios(runs, ours, theirs, "sse", 32)
    assert ratios == pytest.approx([0.75 / 1.4, 1.0 / 1.5])
    args = overhead.parse_args(["--targets", "dpserve,vllm-router", "--dpserve-policies", "least_loaded"])
    lines = [line for line, _ in overhead.ratio_lines(runs, args)]
    assert any("router CPU per request = 0.60x (rounds: 0.54, 0.67)" in line for line in lines), lines
