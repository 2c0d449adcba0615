"""`benchmarks/resolver.py` looks a real dnsmasq's records up with both resolvers and reports what it found."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from benchmarks.resolver import main

pytestmark = pytest.mark.integration


def test_resolver_benchmark_finds_every_address_with_both_resolvers(tmp_path: Path) -> None:
    if shutil.which("dnsmasq") is None and not Path("/usr/sbin/dnsmasq").exists():
        pytest.skip("dnsmasq is not installed")
    out = tmp_path / "resolver.csv"
    assert main(["--lookups", "30", "--addresses", "5", "--out", str(out)]) == 0
    with out.open() as handle:
        rows = {row["resolver"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"dnspython", "aiodns"}
    for row in rows.values():
        assert row["addresses"] == "5" and row["lookups"] == "30"
        assert 0 < float(row["p50_us"]) <= float(row["p99_us"])
