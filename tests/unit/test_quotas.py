"""Per-tenant quotas over a sliding window, with a fake clock: refusals, Retry-After, sliding, peers, bounds."""

from __future__ import annotations

import pytest

from dpserve.router.flow.quotas import CONCURRENT_RETRY_S, OverQuota, Quota, QuotaBook


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def over(result: OverQuota | None) -> OverQuota:
    assert result is not None, "expected a refusal"
    return result


def test_limited_means_any_limit_set() -> None:
    assert not Quota().limited
    assert Quota(requests_per_min=1).limited and Quota(tokens_per_min=1).limited and Quota(concurrent=1).limited


def test_requests_per_minute_refused_past_the_limit_with_retry_after_to_the_oldest_bucket() -> None:
    clock = Clock(1000.0)
    book = QuotaBook(clock)
    quota = Quota(requests_per_min=3)
    book.start("acme")  # bucket 1000, leaves the window at 1060
    clock.now = 1010.5
    book.start("acme")
    book.start("acme")
    for _ in range(3):
        book.finish("acme", 0)
    clock.now = 1020.25
    refused = over(book.check("acme", quota))
    assert refused.limit == "requests_per_min"
    assert refused.retry_after_s == pytest.approx(39.75)  # 1060 - 1020.25: the oldest request's bucket leaves
    assert "acme" in refused.message and "requests_per_min" in refused.message and "3" in refused.message
    assert book.check("other", quota) is None  # tenants are counted apart
    clock.now += refused.retry_after_s
    assert book.check("acme", quota) is None  # passes exactly when Retry-After said
    assert book.used("acme") == (2, 0)


def test_retry_after_covers_as_many_old_buckets_as_needed() -> None:
    clock = Clock(0.0)
    book = QuotaBook(clock)
    for second in (0.0, 5.0, 9.0):
        clock.now = second
        book.start("t")
    clock.now = 30.0
    # Limit 1 with 3 in the window: 3 must leave for one more to pass, the last of them (bucket 9) at 69.
    assert over(book.check("t", Quota(requests_per_min=1))).retry_after_s == pytest.approx(39.0)
    # Limit 2: two must leave, the second (bucket 5) at 65.
    assert over(book.check("t", Quota(requests_per_min=2))).retry_after_s == pytest.approx(35.0)


def test_tokens_per_minute_refused_at_the_limit_and_pass_after_the_window_slides() -> None:
    clock = Clock(500.0)
    book = QuotaBook(clock)
    quota = Quota(tokens_per_min=100)
    book.start("t")
    book.finish("t", 60)
    assert book.check("t", quota) is None  # 60 < 100
    clock.now = 520.0
    book.start("t")
    book.finish("t", 40)
    assert book.used("t") == (2, 100)
    refused = over(book.check("t", quota))
    assert refused.limit == "tokens_per_min" and "100" in refused.message
    assert refused.retry_after_s == pytest.approx(40.0)  # the 60 tokens at 500 leave at 560; 40 left pass
    clock.now = 559.9
    assert book.check("t", quota) is not None
    clock.now = 560.0
    assert book.check("t", quota) is None and book.used("t") == (1, 40)
    clock.now = 580.0
    assert book.used("t") == (0, 0)


def test_retry_after_is_at_least_one_bucket_and_at_most_the_window() -> None:
    clock = Clock(100.0)
    book = QuotaBook(clock)
    book.start("t")
    book.finish("t", 10)
    refused = over(book.check("t", Quota(tokens_per_min=5)))
    assert refused.retry_after_s == pytest.approx(60.0)  # all of it in the current bucket: a whole window
    clock.now = 159.99  # the bucket leaves in 0.01 s: still one bucket length
    assert over(book.check("t", Quota(tokens_per_min=5))).retry_after_s == pytest.approx(1.0)


def test_buckets_set_the_granularity() -> None:
    clock = Clock(0.0)
    book = QuotaBook(clock, window_s=60.0, buckets=6)  # 10 s buckets
    book.start("t")
    clock.now = 3.0
    assert over(book.check("t", Quota(requests_per_min=1))).retry_after_s == pytest.approx(57.0)
    clock.now = 59.0
    assert book.used("t") == (1, 0)
    clock.now = 60.0
    assert book.used("t") == (0, 0)


def test_concurrency_refused_while_in_flight_and_passes_after_finish() -> None:
    book = QuotaBook(Clock())
    quota = Quota(concurrent=2)
    book.start("t")
    assert book.check("t", quota) is None
    book.start("t")
    refused = over(book.check("t", quota))
    assert refused.limit == "concurrent" and refused.retry_after_s == CONCURRENT_RETRY_S
    assert book.in_flight("t") == 2
    book.finish("t", 0)
    assert book.in_flight("t") == 1 and book.check("t", quota) is None
    book.finish("t", 0)
    book.finish("t", 0)  # one finish too many does not go below zero
    assert book.in_flight("t") == 0


def test_of_several_limits_the_longest_wait_is_named() -> None:
    clock = Clock(0.0)
    book = QuotaBook(clock)
    book.start("t")
    book.finish("t", 0)
    clock.now = 30.0
    book.start("t")
    book.finish("t", 500)
    quota = Quota(requests_per_min=2, tokens_per_min=100, concurrent=5)
    refused = over(book.check("t", quota))
    assert refused.limit == "tokens_per_min" and refused.retry_after_s == pytest.approx(60.0)
    book.start("t")  # in flight: concurrency (1 s) is shorter than both windows
    assert over(book.check("t", Quota(requests_per_min=2, concurrent=1))).limit == "requests_per_min"


def test_no_limit_passes_anything() -> None:
    book = QuotaBook(Clock())
    for _ in range(1000):
        book.start("t")
    assert book.check("t", Quota()) is None


def test_remote_usage_counts_in_the_window_but_is_not_passed_on() -> None:
    clock = Clock(0.0)
    book = QuotaBook(clock)
    quota = Quota(requests_per_min=10, tokens_per_min=1000)
    book.add_remote("router-b", "t", requests=9, tokens=200)
    assert book.used("t") == (9, 200) and book.check("t", quota) is None
    book.start("t")
    assert over(book.check("t", quota)).limit == "requests_per_min"
    book.finish("t", 100)
    book.add_remote("router-c", "t", requests=0, tokens=700)
    assert book.used("t") == (10, 1000) and book.in_flight("t") == 0
    assert book.take_news() == {"t": (1, 100)}  # only this router's own usage
    clock.now = 60.0
    assert book.used("t") == (0, 0) and book.check("t", quota) is None


def test_take_news_resets() -> None:
    book = QuotaBook(Clock())
    book.start("a")
    book.start("b")
    book.finish("a", 30)
    book.start("a")
    assert book.take_news() == {"a": (2, 30), "b": (1, 0)}
    assert book.take_news() == {}
    book.finish("b", 7)
    assert book.take_news() == {"b": (0, 7)}
    assert book.used("a") == (2, 30)  # taking news does not touch the window


def test_news_is_bounded_when_nobody_takes_it() -> None:
    book = QuotaBook(Clock(), max_tenants=10)
    for n in range(50):
        book.start(f"t{n}")
        book.finish(f"t{n}", 1)
    news = book.take_news()
    assert len(news) == 10 and book.news_dropped == 80  # 40 tenants' starts and finishes
    assert news["t0"] == (1, 1)


def test_memory_stays_bounded_with_many_tenants() -> None:
    clock = Clock(0.0)
    book = QuotaBook(clock, max_tenants=1000)
    book.start("busy")  # in flight throughout: never forgotten
    for n in range(100_000):
        book.start(f"tenant-{n}")
        book.finish(f"tenant-{n}", 5)
        assert book.tenants <= 1000
    assert book.in_flight("busy") == 1
    assert book.used("tenant-99999") == (1, 5)  # the most recent are kept
    assert book.used("tenant-0") == (0, 0)  # the least recently used went
    assert book.evicted > 0
    book.finish("busy", 3)
    assert book.in_flight("busy") == 0 and book.used("busy") == (1, 3)


def test_tenants_in_flight_can_exceed_the_bound_but_are_never_lost() -> None:
    book = QuotaBook(Clock(), max_tenants=3)
    for n in range(5):
        book.start(f"t{n}")
    assert book.tenants == 5
    assert all(book.in_flight(f"t{n}") == 1 for n in range(5))
    for n in range(5):
        book.finish(f"t{n}", 1)
    book.start("new")
    assert book.tenants <= 3


def test_idle_tenants_are_dropped() -> None:
    clock = Clock(0.0)
    book = QuotaBook(clock)
    book.start("t")
    book.finish("t", 0)
    assert book.tenants == 1
    clock.now = 61.0
    assert book.used("t") == (0, 0) and book.tenants == 0
    book.start("a")
    book.finish("a", 0)
    clock.now = 200.0
    book.start("b")  # a new tenant sweeps an idle one off the old end
    assert book.tenants == 1


def test_a_check_does_not_track_a_tenant() -> None:
    book = QuotaBook(Clock())
    for n in range(100):
        assert book.check(f"t{n}", Quota(requests_per_min=1, tokens_per_min=1, concurrent=1)) is None
    assert book.tenants == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        QuotaBook(window_s=0)
    with pytest.raises(ValueError):
        QuotaBook(buckets=0)
