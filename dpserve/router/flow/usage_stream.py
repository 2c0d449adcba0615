"""Token usage of every answer, streamed ones included: read from a JSON body, or tapped from an SSE stream.

A streamed chat/completions answer carries usage only when the request set
`stream_options.include_usage`. The router sets it on the requests whose client did not (`ask_for_usage`),
reads the usage chunk as the stream goes by and hands the client the stream it would have had without
(`UsageTap(strip=True)`). What vLLM 0.32 changes in a stream when include_usage is on (checked against its
source, `entrypoints/openai/{chat_completion,completion}/serving.py`, and against captured streams in
tests/unit/fixtures/usage_stream/):

- one more event before `data: [DONE]`: the usage chunk, `{"id","object","created","model","choices":[],
  "usage":{...},"system_fingerprint":...}` (plus `"metrics"` when the replica runs with per-request metrics);
- the stream's terminal chunk (the one with a `finish_reason`) loses its `"system_fingerprint"`, which
  moves to the usage chunk. The tap puts it back, at the end of that chunk, where vLLM writes it;
- nothing else: the other chunks are dumped with `exclude_unset`, so no `"usage":null` appears in them.
- `continuous_usage_stats` counts only together with include_usage: with it, every chunk carries
  `"usage":{...}`. A client that set it without include_usage saw no usage at all, so `ask_for_usage`
  turns it off when it turns include_usage on.

Pure functions, no I/O; of the router it imports only `Usage` (`observe/life.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from dpserve.router.observe.life import Usage

EVENT_END = b"\n\n"
USAGE_KEY = b'"usage":{'
"""In compact JSON (vLLM's and the simulator's) an unescaped `"` only delimits a string, so these bytes are
a `usage` key holding an object, never a piece of generated text (which would read `\\"usage\\":{`)."""
FINISHED_KEY = b'"finish_reason":"'
"""A chunk whose finish_reason is a string: the stream's (or a choice's) terminal chunk."""
FINGERPRINT_KEY = b'"system_fingerprint":'
ORDINARY_KEY = b'"finish_reason":null'
"""In a token event that ends no choice."""
TAIL_SEARCH_BYTES = 1024
"""Chunks up to this long are searched whole; longer ones only in their last three events."""


def usage_of(obj: Any) -> Usage | None:
    """The `usage` object of an answer or chunk, in the chat/completions shape (prompt_tokens,
    completion_tokens, prompt_tokens_details.cached_tokens) or the responses API's (input_tokens,
    output_tokens, input_tokens_details.cached_tokens). None when missing or malformed; never raises.
    Read once per answer: plain lookups and type checks, no helper calls on the common path."""
    if type(obj) is not dict:
        return None
    prompt = obj.get("prompt_tokens")
    if prompt is not None:
        completion, details = obj.get("completion_tokens"), obj.get("prompt_tokens_details")
    elif "input_tokens" in obj:
        prompt, completion, details = obj["input_tokens"], obj.get("output_tokens"), obj.get("input_tokens_details")
    else:
        return None
    if type(prompt) is not int or prompt < 0:
        return None
    # vLLM's UsageInfo allows a null completion_tokens (and the pooling endpoints generate nothing).
    if completion is None:
        completion = 0
    elif type(completion) is not int or completion < 0:
        return None
    cached = details.get("cached_tokens") if type(details) is dict else None
    if cached is None:
        cached = 0
    elif type(cached) is not int or cached < 0:
        return None
    return Usage(prompt, completion, cached)


def usage_of_answer(body: bytes) -> Usage | None:
    """The usage of a non-streamed JSON answer (chat/completions, completions, responses); None for a body
    that is not JSON, has no usage, or has one of another shape. Never raises.

    In compact JSON (vLLM's) only the usage object is parsed, found as the last `"usage":{` (see USAGE_KEY; the
    answer's own comes after its choices): a long answer's text is not parsed a second time. Any other body is
    parsed whole."""
    start = body.rfind(USAGE_KEY)
    if start >= 0:
        start += len(USAGE_KEY) - 1
        end = _object_end(body, start)
        if end > 0:
            try:
                return usage_of(orjson.loads(body[start:end]))
            except orjson.JSONDecodeError:
                pass
    try:
        parsed = orjson.loads(body)
    except (orjson.JSONDecodeError, TypeError):
        return None
    return usage_of(parsed.get("usage")) if isinstance(parsed, dict) else None


def _object_end(body: bytes, start: int) -> int:
    """Where the object opening at `start` ends (past its `}`), for objects whose strings hold no braces (a
    usage's: numbers, nulls and objects of them); -1 when it does not. Anything else fails to parse after."""
    depth, at = 0, start
    while True:
        close = body.find(b"}", at)
        if close < 0:
            return -1
        depth += body.count(b"{", at, close) - 1
        at = close + 1
        if depth <= 0:
            return at


_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def _false(value: Any) -> bool:
    """Whether vLLM reads `value` as a false bool (pydantic's lax booleans: 0, "no", "off", ...) or unset."""
    if value is None or value is False:
        return True
    if isinstance(value, str):
        return value.lower() in _FALSE_WORDS
    return isinstance(value, int | float) and value == 0


def ask_for_usage(payload: dict[str, Any]) -> dict[str, Any] | None:
    """For a streamed chat/completions or completions request whose client did not ask for usage: the payload
    to send instead, with `stream_options.include_usage` true (the client's other stream_options kept, and
    `continuous_usage_stats` off: without include_usage it did nothing, with it every chunk would carry
    usage). None when nothing needs changing: the request does not stream, its client asked for usage
    already (include_usage anything vLLM does not read as false: true, 1, "yes"...; what it would refuse
    is left for its 400 too), or its stream_options is not an object (the replica answers with a 400)."""
    if payload.get("stream") is not True:
        return None
    options = payload.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return None
    if not _false(options.get("include_usage")):
        return None  # asked already (or sent something the replica will refuse)
    changed = {key: value for key, value in options.items() if key != "continuous_usage_stats"}
    changed["include_usage"] = True
    return {**payload, "stream_options": changed}


def _events(chunk: bytes) -> Iterator[bytes]:
    """`chunk`'s SSE events, each with its blank-line end; bytes after the last end come as one more."""
    start = 0
    while True:
        end = chunk.find(EVENT_END, start)
        if end < 0:
            if start < len(chunk):
                yield chunk[start:]
            return
        yield chunk[start : end + 2]
        start = end + 2


def _tail(chunk: bytes) -> int:
    """Where `chunk`'s last three events start; 0 for a chunk short enough to search whole."""
    if len(chunk) <= TAIL_SEARCH_BYTES:
        return 0
    end = len(chunk) - len(EVENT_END)
    for _ in range(3):
        end = chunk.rfind(EVENT_END, 0, end)
        if end < 0:
            return 0
    return end + len(EVENT_END)


def _first_of(chunk: bytes, start: int, *needles: bytes) -> int:
    """Where the first of `needles` is in `chunk` from `start` on, -1 when none is."""
    found = [at for at in (chunk.find(needle, start) for needle in needles) if at >= 0]
    return min(found) if found else -1


def _data(event: bytes) -> Any:
    """The JSON of a one-line `data:` event; None for anything else (comments, [DONE], broken JSON)."""
    if not event.startswith(b"data:"):
        return None
    try:
        return orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return None


def _with_fingerprint(event: bytes, fingerprint: bytes) -> bytes:
    """`event`'s JSON object with `"system_fingerprint":...` as its last key, where vLLM writes it."""
    close = event.rfind(b"}")
    return event[:close] + b"," + FINGERPRINT_KEY + fingerprint + event[close:]


class UsageTap:
    """Reads the usage of a stream as it goes by, and with `strip` gives the client the stream its request
    would have had without include_usage.

    `feed` takes whole SSE events (the relay cuts at event boundaries; bytes past the last event end are
    passed through as they are) and returns what to send on; that may be empty, so send nothing then.
    With `strip`, a terminal chunk (one with a finish_reason) is held back until the next event: when that
    is the usage chunk (vLLM sends it right after the last terminal chunk), the usage chunk is dropped and
    the held chunks go out with the `system_fingerprint` it carried; any other event first lets them out as
    they came. So with one choice the stream is the one vLLM sends without include_usage; with `n` > 1, a
    choice that finished while another still generated keeps its place but not its fingerprint. At the
    end of a stream that broke off, call `flush` for whatever is still held.

    Only events that contain `"usage":{` are parsed, or with `strip` ones that end a choice. A chunk whose
    last event is an ordinary token event passes at once: within one stream every such event ends alike
    after its `"finish_reason":null` (the same later fields), so one comparison at the offset learned from
    the first tells it, where searching the chunk would cost about a nanosecond a byte. Such a chunk holds
    nothing the tap acts on: the usage chunk comes after every token event (only [DONE] follows it), and
    a terminal chunk followed by a token event is let out as it came in any case."""

    __slots__ = ("_held", "_ordinary_at", "_strip", "parsed", "usage")

    def __init__(self, strip: bool) -> None:
        self._strip = strip
        self._held: list[bytes] = []
        self.usage: Usage | None = None
        self._ordinary_at = 0
        """How far from a chunk's end an ordinary token event has `"finish_reason":null`; 0 until learned."""
        self.parsed = 0
        """JSON documents parsed: all the tap does besides searching bytes is these (one per stream with usage)."""

    def _parse(self, event: bytes) -> Any:
        self.parsed += 1
        return _data(event)

    def feed(self, chunk: bytes) -> bytes:
        at = self._ordinary_at
        if at and not self._held and len(chunk) >= at and chunk.startswith(ORDINARY_KEY, len(chunk) - at):
            return chunk
        if not at:
            self._learn_ordinary(chunk)
        # A long chunk is searched only in its last three events: a stream ends with its last terminal chunk,
        # the usage chunk and [DONE], so what the tap acts on is among them, or is the last event of a chunk
        # that the next one follows up. (Searching costs about a nanosecond a byte, and a replica that
        # outruns the relay sends many events in one read.)
        start = 0 if self._held else _tail(chunk)
        if not self._strip:
            if chunk.find(USAGE_KEY, start) >= 0:
                for event in _events(chunk[start:] if start else chunk):
                    if USAGE_KEY in event:
                        self._read(self._parse(event))
            return chunk
        if not self._held and chunk.find(USAGE_KEY, start) < 0 and chunk.find(FINISHED_KEY, start) < 0:
            return chunk
        out: list[bytes] = []
        if not self._held:
            # Only the stream's end needs a look: the events before the first that ends a choice or carries
            # usage pass as they are (a replica that outruns the relay sends many events in one read).
            first = _first_of(chunk, start, USAGE_KEY, FINISHED_KEY)
            if first < 0:
                return chunk
            boundary = chunk.rfind(EVENT_END, max(0, start - len(EVENT_END)), first)
            if boundary >= 0:
                start = boundary + len(EVENT_END)
                out.append(chunk[:start])
                chunk = chunk[start:]
        for event in _events(chunk):
            self._stripped(event, out)
        return b"".join(out)

    def _learn_ordinary(self, chunk: bytes) -> None:
        """The offset of `"finish_reason":null` from the end, when `chunk`'s last event is a token event."""
        found = chunk.rfind(ORDINARY_KEY)
        if found >= 0 and chunk.endswith(EVENT_END) and chunk.find(EVENT_END, found, len(chunk) - len(EVENT_END)) < 0:
            self._ordinary_at = len(chunk) - found

    def flush(self) -> bytes:
        """The chunks still held back, as they came (the stream ended before its usage chunk)."""
        held = b"".join(self._held)
        self._held.clear()
        return held

    def _read(self, parsed: Any) -> None:
        if isinstance(parsed, dict):
            usage = usage_of(parsed.get("usage"))
            if usage is not None:
                self.usage = usage

    def _stripped(self, event: bytes, out: list[bytes]) -> None:
        """Appends to `out` what the client gets for `event` (and for the chunks held before it)."""
        if USAGE_KEY in event:
            parsed = self._parse(event)
            self._read(parsed)
            if isinstance(parsed, dict) and parsed.get("choices") == [] and isinstance(parsed.get("usage"), dict):
                # The usage chunk, there only because include_usage was asked for: dropped, and its
                # fingerprint goes back on the terminal chunks before it.
                fingerprint = parsed.get("system_fingerprint")
                if isinstance(fingerprint, str):
                    value = orjson.dumps(fingerprint)
                    out.extend(_with_fingerprint(held, value) for held in self._held)
                else:
                    out.extend(self._held)
                self._held.clear()
                return
        elif (
            FINISHED_KEY in event
            and FINGERPRINT_KEY not in event
            and event.startswith(b"data: {")
            and event.endswith(b"}" + EVENT_END)
        ):
            self._held.append(event)
            return
        out.extend(self._held)
        self._held.clear()
        out.append(event)
