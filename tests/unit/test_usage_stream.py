"""Token usage of answers and streams (dpserve.router.flow.usage_stream), against answers captured from a real
vLLM 0.32.0 replica (tests/unit/fixtures/usage_stream/) and against the simulator."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from dpserve.config import SimSettings
from dpserve.router.flow.usage_stream import Usage, UsageTap, ask_for_usage, usage_of, usage_of_answer
from dpserve.sim.replica import build_simulator

FIXTURES = Path(__file__).parent / "fixtures" / "usage_stream"
VLLM = "vllm-0.32.0"
FINGERPRINT = b',"system_fingerprint":"vllm-0.32.0-d467f2bb"'


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{VLLM}.{name}").read_bytes()


def events(stream: bytes) -> list[bytes]:
    """The stream's SSE events, each with its blank-line end."""
    parts = stream.split(b"\n\n")
    assert parts[-1] == b"", "a captured stream ends with a whole event"
    return [part + b"\n\n" for part in parts[:-1]]


def groupings(stream: bytes) -> Iterator[list[bytes]]:
    """The stream cut at event boundaries in several ways: whole, one event a chunk, and k events a chunk."""
    evs = events(stream)
    yield [stream]
    for size in range(1, len(evs)):
        yield [b"".join(evs[i : i + size]) for i in range(0, len(evs), size)]


def tapped(tap: UsageTap, chunks: list[bytes]) -> bytes:
    return b"".join(tap.feed(chunk) for chunk in chunks) + tap.flush()


def usage_chunk(stream: bytes) -> dict[str, Any]:
    """The stream's usage chunk, parsed: the test's own reading, to check the tap's against."""
    (chunk,) = [orjson.loads(ev[6:]) for ev in events(stream) if ev.startswith(b"data: {") and b'"choices":[]' in ev]
    assert isinstance(chunk, dict)
    return chunk


# What the captures show about vLLM 0.32 with include_usage, which the tap's stripping relies on.


@pytest.mark.parametrize("name", ["chat", "completion"])
def test_include_usage_adds_one_chunk_and_moves_the_fingerprint(name: str) -> None:
    plain, usage = events(fixture(f"{name}.plain.sse")), events(fixture(f"{name}.usage.sse"))
    assert len(usage) == len(plain) + 1
    assert usage[-2].startswith(b'data: {"id":') and b'"choices":[],"usage":{' in usage[-2]
    assert usage[-2].endswith(FINGERPRINT + b"}\n\n")
    # Every other chunk is the same, but the terminal one, which loses its fingerprint: no `"usage":null`.
    assert usage[:-3] == plain[:-2]
    assert plain[-2].endswith(FINGERPRINT + b"}\n\n") and b'"finish_reason":"length"' in plain[-2]
    assert usage[-3] == plain[-2].replace(FINGERPRINT, b"")
    assert usage[-1] == plain[-1] == b"data: [DONE]\n\n"
    assert b'"usage"' not in b"".join(plain) and b'"usage"' not in b"".join(usage[:-2])


# ask_for_usage


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}


@pytest.mark.parametrize(
    "payload",
    [
        chat(),
        chat(stream=False),
        chat(stream=False, stream_options={"include_usage": False}),
        chat(stream="true"),
        chat(stream=1),
    ],
    ids=["no-stream", "stream-false", "stream-false-with-options", "stream-string", "stream-int"],
)
def test_ask_for_usage_leaves_unstreamed_requests(payload: dict[str, Any]) -> None:
    assert ask_for_usage(payload) is None


@pytest.mark.parametrize(
    "options",
    [
        {"include_usage": True},
        {"include_usage": True, "continuous_usage_stats": True},
        # vLLM's lax booleans read these as true (and refuses "maybe" or 2 itself): the client asked.
        {"include_usage": 1},
        {"include_usage": "yes"},
        {"include_usage": "True"},
        {"include_usage": "maybe"},
        {"include_usage": 2},
    ],
    ids=["include-usage", "and-continuous", "one", "yes", "True", "maybe", "two"],
)
def test_ask_for_usage_leaves_requests_that_asked_already(options: dict[str, Any]) -> None:
    assert ask_for_usage(chat(stream=True, stream_options=options)) is None


@pytest.mark.parametrize("options", [None, {}], ids=["null", "empty"])
def test_ask_for_usage_adds_stream_options(options: dict[str, Any] | None) -> None:
    payload = chat(stream=True) if options is None else chat(stream=True, stream_options=options)
    assert ask_for_usage(payload) == chat(stream=True, stream_options={"include_usage": True})


@pytest.mark.parametrize("false", [False, 0, 0.0, "false", "No", "off", "0", "f", "n"])
def test_ask_for_usage_sets_include_usage_that_vllm_reads_as_false(false: Any) -> None:
    changed = ask_for_usage(chat(stream=True, stream_options={"include_usage": false}))
    assert changed is not None and changed["stream_options"] == {"include_usage": True}


def test_ask_for_usage_keeps_the_other_stream_options_and_the_payload() -> None:
    payload = chat(stream=True, max_tokens=3, stream_options={"include_obfuscation": False, "include_usage": False})
    before = orjson.dumps(payload)
    changed = ask_for_usage(payload)
    assert changed == chat(
        stream=True, max_tokens=3, stream_options={"include_obfuscation": False, "include_usage": True}
    )
    assert orjson.dumps(payload) == before, "the client's payload is not changed in place"


@pytest.mark.parametrize("continuous", [True, False, None])
def test_ask_for_usage_turns_continuous_usage_stats_off(continuous: bool | None) -> None:
    # Without include_usage vLLM ignores continuous_usage_stats; with it every chunk would carry usage.
    changed = ask_for_usage(chat(stream=True, stream_options={"continuous_usage_stats": continuous}))
    assert changed is not None and changed["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("options", [[1], "yes", 3])
def test_ask_for_usage_leaves_malformed_stream_options_to_the_replica(options: Any) -> None:
    assert ask_for_usage(chat(stream=True, stream_options=options)) is None


# usage_of_answer and usage_of


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("chat.answer.json", Usage(29, 6, 0)),
        ("completion.answer.json", Usage(12, 6, 0)),
        ("responses.answer.json", Usage(30, 6, 0)),
    ],
)
def test_usage_of_real_answers(name: str, expected: Usage) -> None:
    body = fixture(name)
    assert usage_of_answer(body) == expected
    usage = orjson.loads(body)["usage"]
    assert (usage.get("prompt_tokens", usage.get("input_tokens")), usage["total_tokens"]) == (
        expected.prompt_tokens,
        expected.prompt_tokens + expected.completion_tokens,
    )


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 5}}, Usage(7, 3, 5)),
        ({"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": None}, Usage(7, 3, 0)),
        (
            {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": None}},
            Usage(7, 3, 0),
        ),
        ({"prompt_tokens": 7, "completion_tokens": 3}, Usage(7, 3, 0)),
        ({"prompt_tokens": 7, "completion_tokens": None, "total_tokens": 7}, Usage(7, 0, 0)),  # vLLM allows null
        ({"input_tokens": 9, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 8}}, Usage(9, 4, 8)),
        ({"input_tokens": 9, "output_tokens": 4}, Usage(9, 4, 0)),
    ],
)
def test_usage_of_shapes(usage: dict[str, Any], expected: Usage) -> None:
    assert usage_of(usage) == expected
    assert usage_of_answer(orjson.dumps({"id": "x", "usage": usage})) == expected


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 5}},
        {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": None, "completion_tokens_details": {}},
        {"input_tokens": 9, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 8}},
    ],
)
def test_a_compact_answer_gives_the_usage_a_whole_parse_gives(usage: dict[str, Any]) -> None:
    """Only the usage object of a compact answer is parsed: the answer's text may hold anything, a usage-like
    key and braces included, and a usage nested in another field before it is not the answer's."""
    text = 'Say {"usage":{"prompt_tokens":1}} and } or {{ "usage":{ done'
    answer = {
        "id": "x",
        "choices": [{"index": 0, "message": {"content": text}, "extra": {"usage": {"prompt_tokens": 99}}}],
        "usage": usage,
        "kv_transfer_params": None,
    }
    body = orjson.dumps(answer)
    assert usage_of_answer(body) == usage_of(usage) is not None
    assert usage_of_answer(json.dumps(answer, indent=1).encode()) == usage_of(usage)  # not compact: parsed whole


GARBAGE: list[bytes] = [
    b"",
    b"{",
    b"\xff\xfe\x00",
    b"null",
    b"[]",
    b'"usage"',
    b"{}",
    b'{"usage": null}',
    b'{"usage": []}',
    b'{"usage": {}}',
    b'{"usage": {"completion_tokens": 3}}',
    b'{"usage": {"prompt_tokens": "3", "completion_tokens": 1}}',
    b'{"usage": {"prompt_tokens": true, "completion_tokens": 1}}',
    b'{"usage": {"prompt_tokens": -1, "completion_tokens": 1}}',
    b'{"usage": {"prompt_tokens": 1.5, "completion_tokens": 1}}',
    b'{"usage": {"prompt_tokens": 3, "completion_tokens": "1"}}',
    b'{"usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": "2"}}}',
    b'{"usage": {"input_tokens": 3, "output_tokens": false}}',
    b'{"usage":{"prompt_tokens":3,"completion_tokens":1',
    b'{"usage":{"prompt_tokens":3,"completion_tokens":"1"}}',
    b'{"usage":{}}',
    b'{"error": {"message": "bad", "type": "BadRequestError", "code": 400}}',
]


@pytest.mark.parametrize("body", GARBAGE)
def test_usage_of_answer_on_garbage_is_none(body: bytes) -> None:
    assert usage_of_answer(body) is None


@pytest.mark.parametrize("obj", [None, 3, "usage", [1, 2], {"prompt_tokens": None}])
def test_usage_of_on_non_usage_is_none(obj: Any) -> None:
    assert usage_of(obj) is None


# UsageTap on the real vLLM streams


STREAMS = {"chat": Usage(29, 6, 0), "completion": Usage(169, 4, 128)}


@pytest.mark.parametrize("name", STREAMS)
def test_stripped_stream_is_the_stream_without_include_usage(name: str) -> None:
    plain, usage = fixture(f"{name}.plain.sse"), fixture(f"{name}.usage.sse")
    for chunks in groupings(usage):
        tap = UsageTap(strip=True)
        assert tapped(tap, chunks) == plain, [len(chunk) for chunk in chunks]
        assert tap.usage == STREAMS[name]


@pytest.mark.parametrize("name", STREAMS)
def test_tap_reads_the_usage_chunk(name: str) -> None:
    usage = fixture(f"{name}.usage.sse")
    numbers = usage_chunk(usage)["usage"]
    details = numbers.get("prompt_tokens_details") or {}
    expected = Usage(numbers["prompt_tokens"], numbers["completion_tokens"], details.get("cached_tokens") or 0)
    assert STREAMS[name] == expected
    for strip in (True, False):
        tap = UsageTap(strip=strip)
        assert tap.usage is None
        tapped(tap, events(usage))
        assert tap.usage == expected


@pytest.mark.parametrize("name", STREAMS)
def test_without_strip_the_stream_passes_unchanged(name: str) -> None:
    usage = fixture(f"{name}.usage.sse")
    for chunks in groupings(usage):
        tap = UsageTap(strip=False)
        assert [tap.feed(chunk) for chunk in chunks] == chunks
        assert tap.flush() == b""


def test_without_strip_continuous_usage_ends_with_the_final_usage() -> None:
    stream = fixture("chat.continuous.sse")
    assert stream.count(b'"usage":{') == len(events(stream)) - 1  # every chunk but [DONE] carries usage
    tap = UsageTap(strip=False)
    assert tapped(tap, events(stream)) == stream
    assert tap.usage == Usage(29, 6, 0)


def test_a_stream_with_no_usage_passes_and_reads_none() -> None:
    plain = fixture("chat.plain.sse")
    for strip in (True, False):
        for chunks in groupings(plain):
            tap = UsageTap(strip=strip)
            assert tapped(tap, chunks) == plain
            assert tap.usage is None


def test_chunks_with_nothing_to_change_come_back_uncopied() -> None:
    # The hot path: a chunk with no usage and no finish_reason is returned as it is, not split and joined.
    head = events(fixture("chat.usage.sse"))[:-3]
    for strip in (True, False):
        tap = UsageTap(strip=strip)
        for chunk in [b"".join(head), *head]:
            assert tap.feed(chunk) is chunk


def test_two_choices_keep_their_order_and_the_last_one_its_fingerprint() -> None:
    plain, usage = fixture("chat_n2.plain.sse"), fixture("chat_n2.usage.sse")
    # Choice 0 finished while choice 1 still generated: its terminal chunk goes out when the next chunk
    # comes, before the usage chunk says the fingerprint, so that one chunk lacks it.
    first_end = plain.index(FINGERPRINT)
    assert b'"finish_reason":"length"' in plain[plain.rindex(b"data: ", 0, first_end) : first_end]
    expected = plain[:first_end] + plain[first_end + len(FINGERPRINT) :]
    assert expected.count(FINGERPRINT) == 1
    for chunks in groupings(usage):
        tap = UsageTap(strip=True)
        assert tapped(tap, chunks) == expected
        assert tap.usage == Usage(29, 10, 0)


def test_a_replica_without_fingerprints_gives_the_terminal_chunk_back_unchanged() -> None:
    # vLLM with --fingerprint-mode none: no fingerprint on the terminal chunk nor on the usage chunk.
    plain = fixture("chat.plain.sse").replace(FINGERPRINT, b"")
    usage = fixture("chat.usage.sse").replace(FINGERPRINT, b"")
    tap = UsageTap(strip=True)
    assert tapped(tap, events(usage)) == plain
    assert tap.usage == Usage(29, 6, 0)


@pytest.mark.parametrize("odd", [b"null", b"7", b'["x"]'])
def test_a_fingerprint_that_is_no_string_is_not_copied(odd: bytes) -> None:
    plain = fixture("chat.plain.sse").replace(FINGERPRINT, b"")
    usage = fixture("chat.usage.sse").replace(FINGERPRINT, b',"system_fingerprint":' + odd)
    tap = UsageTap(strip=True)
    assert tapped(tap, events(usage)) == plain


# The hot path: only the usage event is parsed.


@pytest.mark.parametrize("strip", [True, False])
@pytest.mark.parametrize("name", STREAMS)
def test_only_the_usage_event_is_parsed(name: str, strip: bool) -> None:
    tap = UsageTap(strip=strip)
    tapped(tap, events(fixture(f"{name}.usage.sse")))
    assert tap.parsed == 1 and tap.usage is not None
    tap = UsageTap(strip=strip)
    tapped(tap, events(fixture(f"{name}.plain.sse")))
    assert tap.parsed == 0, "a stream without usage is not parsed at all"


def test_generated_text_that_looks_like_usage_is_not_parsed() -> None:
    text = 'He wrote "usage":{"prompt_tokens":1} and "finish_reason":"stop"'
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    stream = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
    for strip in (True, False):
        tap = UsageTap(strip=strip)
        assert tap.feed(stream) == stream
        assert tap.usage is None and tap.parsed == 0


# Odd input: never raises, passes what it does not know.

ODD: list[bytes] = [
    b"",
    b"data: [DONE]\n\n",
    b": keep-alive\n\n",
    b"event: ping\ndata: {}\n\n",
    b'data: {"error":{"message":"The replica failed.","type":"server_error","param":null,"code":"stream_broken"}}\n\n',
    b'data: {"usage":{broken\n\n',
    b'data: ["usage":{]\n\n',
    b'data: {"id":"c","choices":[{"finish_reason":"stop"',  # a partial last event
    b'event: message\ndata: {"choices":[{"index":0,"finish_reason":"stop"}]}\n\n',  # not vLLM's framing
    b"\xff\xfe\n\n\x00",
    b"\n\n\n\n",
]


@pytest.mark.parametrize("strip", [True, False])
@pytest.mark.parametrize("odd", ODD)
def test_odd_input_passes_through(odd: bytes, strip: bool) -> None:
    tap = UsageTap(strip=strip)
    assert tap.feed(odd) == odd
    assert tap.flush() == b""
    assert tap.usage is None


@pytest.mark.parametrize("numbers", [b"{}", b'{"prompt_tokens":"x"}'])
def test_usage_only_chunk_without_counts_is_stripped_and_read_as_none(numbers: bytes) -> None:
    # choices == [] with a usage object is the chunk vLLM sends only because include_usage was asked for:
    # dropped with strip even when its numbers make no sense, and passed without.
    odd = b'data: {"id":"c","choices":[],"usage":' + numbers + b"}\n\n"
    stripping, passing = UsageTap(strip=True), UsageTap(strip=False)
    assert stripping.feed(odd) == b""
    assert passing.feed(odd) == odd
    assert stripping.usage is None and passing.usage is None


def terminal_and_rest(name: str) -> tuple[bytes, bytes, bytes]:
    """A captured include_usage stream's chunks up to the terminal one, that one, and the usage chunk."""
    evs = events(fixture(name))
    return b"".join(evs[:-3]), evs[-3], evs[-2]


def test_terminal_chunk_is_held_until_the_next_event() -> None:
    head, terminal, usage_event = terminal_and_rest("chat.usage.sse")
    plain_terminal = events(fixture("chat.plain.sse"))[-2]
    tap = UsageTap(strip=True)
    assert tap.feed(head) == head
    assert tap.feed(terminal) == b""
    assert tap.feed(usage_event) == plain_terminal
    assert tap.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert tap.flush() == b""


@pytest.mark.parametrize(
    "after",
    [
        b"data: [DONE]\n\n",
        b'data: {"error":{"message":"broke","type":"server_error","param":null,"code":"stream_broken"}}\n\n',
        b": comment\n\n",
    ],
)
def test_held_terminal_chunk_goes_out_unchanged_before_any_other_event(after: bytes) -> None:
    _, terminal, _ = terminal_and_rest("chat.usage.sse")
    tap = UsageTap(strip=True)
    assert tap.feed(terminal) == b""
    assert tap.feed(after) == terminal + after
    assert tap.usage is None


def test_terminal_chunk_that_has_its_fingerprint_is_not_held() -> None:
    plain_terminal = events(fixture("chat.plain.sse"))[-2]
    _, _, usage_event = terminal_and_rest("chat.usage.sse")
    tap = UsageTap(strip=True)
    assert tap.feed(plain_terminal) == plain_terminal
    assert tap.feed(usage_event) == b""
    assert tap.usage == Usage(29, 6, 0)


def test_strip_removes_only_the_usage_only_chunk_of_continuous_usage() -> None:
    # ask_for_usage turns continuous_usage_stats off, but should a replica send per-chunk usage anyway,
    # those chunks have choices: only the chunk without any is the one to drop.
    stream = fixture("chat.continuous.sse")
    evs = events(stream)
    assert b'"choices":[]' in evs[-2]
    tap = UsageTap(strip=True)
    assert tapped(tap, evs) == b"".join(evs[:-2] + evs[-1:])
    assert tap.usage == Usage(29, 6, 0)


def test_flush_gives_back_a_terminal_chunk_when_the_stream_broke_off() -> None:
    head, terminal, _ = terminal_and_rest("completion.usage.sse")
    tap = UsageTap(strip=True)
    assert tap.feed(head + terminal) == head
    assert tap.flush() == terminal
    assert tap.flush() == b""


# The simulator (dpserve.sim mimics vLLM 0.32): the same stripping gives its stream without include_usage.


def sim_stream(endpoint: str, payload: dict[str, Any]) -> bytes:
    """One request to a fresh simulator: with the same seed, the same tokens every time."""
    settings = SimSettings(sim_speed=0, sim_num_blocks=64, sim_block_size=16, max_model_len=2048, sim_seed=3)
    with TestClient(build_simulator(settings).app()) as client, client.stream("POST", endpoint, json=payload) as r:
        assert r.status_code == 200
        return r.read()


def normalised(stream: bytes) -> bytes:
    """The sim's ids are random and `created` is the clock: the only parts of two runs that differ."""
    stream = re.sub(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]{16}"', rb'"id":"\1-X"', stream)
    return re.sub(rb'"created":\d+', b'"created":0', stream)


@pytest.mark.parametrize(
    ("endpoint", "payload"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}),
        ("/v1/completions", {"prompt": "Hello there", "max_tokens": 4}),
    ],
)
def test_sim_stream_stripped_is_its_stream_without_include_usage(endpoint: str, payload: dict[str, Any]) -> None:
    request = {**payload, "stream": True}
    asked = ask_for_usage(request)
    assert asked is not None
    plain, usage = sim_stream(endpoint, request), sim_stream(endpoint, asked)
    assert normalised(plain) != normalised(usage)
    numbers = usage_chunk(usage)["usage"]
    for chunks in groupings(usage):
        tap = UsageTap(strip=True)
        assert normalised(tapped(tap, chunks)) == normalised(plain)
        assert tap.usage == Usage(
            numbers["prompt_tokens"], numbers["completion_tokens"], numbers["prompt_tokens_details"]["cached_tokens"]
        )
        assert tap.usage.completion_tokens == 4
