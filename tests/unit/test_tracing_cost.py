"""`python -m benchmarks.tracing_cost` refuses its own nonsense: no CPU, or not the spans a ratio asks for."""

from __future__ import annotations

from benchmarks.tracing_cost import Row, problems


def test_sane_rows_pass() -> None:
    rows = [Row(1, "off", None, "json", 1000, 300.0, 0), Row(1, "sampled 0.1", 0.1, "json", 1000, 350.0, 200)]
    rows.append(Row(1, "sampled 1", 1.0, "sse", 1000, 700.0, 2000))
    # 1000 requests sampled at 0.1: 100 expected, sd 9.5, so 53..147 sampled requests (2 spans each) are sane.
    rows += [Row(1, "sampled 0.1", 0.1, "sse", 1000, 350.0, spans) for spans in (106, 294)]
    assert problems(rows) == []


def test_no_cpu_spans_when_off_or_too_few_spans_are_nonsense() -> None:
    assert problems([Row(1, "off", None, "json", 1000, 0.0, 0)]) == ["off json: CPU per request 0.0"]
    assert problems([Row(1, "off", None, "json", 1000, 300.0, 4)]) == ["off json: 4 spans for 1000 requests"]
    # A ratio of 1.0 exports 2 spans per request: one request's pair missing is nonsense.
    assert problems([Row(1, "sampled 1", 1.0, "json", 1000, 500.0, 1998)]) == [
        "sampled 1 json: 1998 spans for 1000 requests"
    ]
    # At 0.1: more than 5 sd from 100 sampled requests either way, or half a request's spans.
    for spans in (104, 296, 201):
        assert problems([Row(1, "sampled 0.1", 0.1, "json", 1000, 350.0, spans)]) == [
            f"sampled 0.1 json: {spans} spans for 1000 requests"
        ]
