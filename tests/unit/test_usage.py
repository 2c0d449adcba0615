"""Per-tenant usage accounting, with a fake clock: totals, per-minute rollover, bounds and the "other" label."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dpserve.router.flow.usage import UsageBook, UsageCollector, UsageCounts


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:  # 20 s into a minute
        self.now = now

    def __call__(self) -> float:
        return self.now


MINUTE = 1_699_999_980  # the start of the minute that holds 1_700_000_000


def scrape(book: UsageBook) -> str:
    registry = CollectorRegistry()
    registry.register(UsageCollector(book))
    return generate_latest(registry).decode()


def test_counts_to_dict() -> None:
    assert UsageCounts(requests=2, errors=1, queue_s=0.5).to_dict() == {
        "requests": 2,
        "errors": 1,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "completion_tokens": 0,
        "queue_s": 0.5,
    }


def test_totals_add_up() -> None:
    clock = Clock()
    book = UsageBook(clock)
    book.record("acme", error=False, prompt_tokens=100, cached_tokens=64, completion_tokens=20, queue_s=0.25)
    book.record("acme", error=True, queue_s=0.5)
    book.record("beta", error=False, prompt_tokens=7)
    data = book.to_dict()
    assert data["since"] == clock.now and data["minutes"] == 60
    assert data["tenants"]["acme"]["total"] == {
        "requests": 2,
        "errors": 1,
        "prompt_tokens": 100,
        "cached_tokens": 64,
        "completion_tokens": 20,
        "queue_s": 0.75,
    }
    assert data["tenants"]["beta"]["total"]["prompt_tokens"] == 7
    assert list(data["tenants"]) == ["acme", "beta"]


def test_per_minute_rolls_over_and_keeps_only_the_last_minutes() -> None:
    clock = Clock()
    book = UsageBook(clock, minutes=3)
    book.record("t", error=False, completion_tokens=1)
    clock.now += 10  # same minute
    book.record("t", error=False, completion_tokens=2)
    clock.now += 60  # next minute
    book.record("t", error=True)
    clock.now += 120  # two minutes on: nothing in between
    book.record("t", error=False, prompt_tokens=5)
    per_minute = book.to_dict()["tenants"]["t"]["per_minute"]
    assert [m["minute"] for m in per_minute] == [MINUTE + 60, MINUTE + 180]  # the first is 3 minutes old
    assert per_minute[0]["errors"] == 1 and per_minute[0]["requests"] == 1
    assert per_minute[1]["prompt_tokens"] == 5
    assert book.to_dict()["tenants"]["t"]["total"]["requests"] == 4  # totals never roll
    clock.now += 600
    assert book.to_dict()["tenants"]["t"]["per_minute"] == []  # old minutes dropped when read, too
    assert book.to_dict()["tenants"]["t"]["total"]["requests"] == 4  # the newest among them still counted
    book.record("t", error=False, prompt_tokens=1)  # a minute opens after every one expired: counted once
    clock.now += 60
    book.record("t", error=False)
    total = book.to_dict()["tenants"]["t"]["total"]
    assert total["requests"] == 6 and total["prompt_tokens"] == 6 and total["errors"] == 1


def test_per_minute_sums_within_a_minute() -> None:
    clock = Clock()
    book = UsageBook(clock)
    for _ in range(5):
        book.record("t", error=False, prompt_tokens=10)
        clock.now += 1
    (minute,) = book.to_dict()["tenants"]["t"]["per_minute"]
    assert minute["minute"] == MINUTE and minute["requests"] == 5 and minute["prompt_tokens"] == 50


def test_a_clock_that_steps_back_adds_to_the_newest_minute() -> None:
    clock = Clock()
    book = UsageBook(clock)
    book.record("t", error=False)
    clock.now -= 3600
    book.record("t", error=False)
    (minute,) = book.to_dict()["tenants"]["t"]["per_minute"]
    assert minute["requests"] == 2


def test_names_past_the_bound_are_recorded_under_other() -> None:
    book = UsageBook(Clock(), named={"vip"}, max_tenants=3)
    for n in range(10):
        book.record(f"t{n}", error=False, prompt_tokens=1)
    book.record("vip", error=False, prompt_tokens=100)  # allow-listed: always kept by name
    tenants = book.to_dict()["tenants"]
    assert set(tenants) == {"t0", "t1", "t2", "other", "vip"}
    assert tenants["other"]["total"]["requests"] == 7 and tenants["other"]["total"]["prompt_tokens"] == 7
    assert tenants["vip"]["total"]["prompt_tokens"] == 100
    book.record("t1", error=True)  # a kept name stays kept
    assert book.to_dict()["tenants"]["t1"]["total"]["errors"] == 1


def test_memory_bounded_with_many_tenants() -> None:
    book = UsageBook(Clock(), max_tenants=100)
    for n in range(100_000):
        book.record(f"tenant-{n}", error=False)
    tenants = book.to_dict()["tenants"]
    assert len(tenants) == 101  # 100 names and "other"
    assert sum(t["total"]["requests"] for t in tenants.values()) == 100_000


def test_label_is_the_name_only_when_allow_listed() -> None:
    book = UsageBook(Clock(), named=["acme"])
    assert book.label("acme") == "acme" and book.label("someone") == "other"


def test_collector_folds_tenants_not_named_into_other() -> None:
    book = UsageBook(Clock(), named={"acme", "idle"})
    book.record("acme", error=False, prompt_tokens=10, cached_tokens=4, completion_tokens=3, queue_s=0.5)
    book.record("x", error=True, prompt_tokens=1, queue_s=0.25)
    book.record("y", error=False, completion_tokens=2, queue_s=0.25)
    text = scrape(book)
    assert 'dpserve_tenant_requests_total{tenant="acme"} 1.0' in text
    assert 'dpserve_tenant_requests_total{tenant="other"} 2.0' in text
    assert 'dpserve_tenant_errors_total{tenant="other"} 1.0' in text
    assert 'dpserve_tenant_errors_total{tenant="acme"} 0.0' in text
    assert 'dpserve_tenant_tokens_total{kind="prompt",tenant="acme"} 10.0' in text
    assert 'dpserve_tenant_tokens_total{kind="cached",tenant="acme"} 4.0' in text
    assert 'dpserve_tenant_tokens_total{kind="completion",tenant="other"} 2.0' in text
    assert 'dpserve_tenant_queue_seconds_total{tenant="other"} 0.5' in text
    assert 'dpserve_tenant_requests_total{tenant="idle"} 0.0' in text  # named, not yet seen: zero
    assert 'tenant="x"' not in text and 'tenant="y"' not in text


def test_collector_labels_stay_bounded() -> None:
    book = UsageBook(Clock(), named={"a"}, max_tenants=10_000)
    for n in range(2000):
        book.record(f"t{n}", error=False)
    text = scrape(book)
    labels = {
        line.split("{", 1)[1].split("}", 1)[0]
        for line in text.splitlines()
        if line.startswith("dpserve_tenant_requests_total")
    }
    assert labels == {'tenant="a"', 'tenant="other"'}
    assert 'dpserve_tenant_requests_total{tenant="other"} 2000.0' in text


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        UsageBook(minutes=0)
