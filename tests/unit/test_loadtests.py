"""The load test's pure parts: workloads, the SSE reader and the load shapes (no Locust, no sockets)."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtests"))

from load_shapes import ShapePlan, arrival_gaps
from openai_stream import StreamRecord, bearer_key, completion_text, completion_tokens
from workloads import RequestFactory, WorkloadOptions, group_prompts


def _event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n"


def _chat_chunk(content: str, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


# -- workloads ---------------------------------------------------------------------------------------


def test_same_seed_and_user_repeat_exactly_and_users_differ() -> None:
    options = WorkloadOptions(kind="random", prompt_tokens=20, seed=3)
    first = [RequestFactory(options, 0).next().body for _ in range(1)]
    again = [RequestFactory(options, 0).next().body for _ in range(1)]
    other = RequestFactory(options, 1).next().body
    assert first == again
    assert other["messages"] != first[0]["messages"]


def test_random_prompts_are_unique_and_sized() -> None:
    factory = RequestFactory(WorkloadOptions(kind="random", prompt_tokens=50, output_tokens=7), 0)
    bodies = [factory.next().body for _ in range(20)]
    contents = [body["messages"][0]["content"] for body in bodies]
    assert len(set(contents)) == 20
    # The unique tag comes first, so no two prompts share their first block.
    assert len({content.split(":")[0] for content in contents}) == 20
    assert all(len(content.split()) == 51 for content in contents)
    assert all(body["max_tokens"] == 7 and body["ignore_eos"] is True for body in bodies)


def test_shared_prefix_uses_the_same_groups_for_every_user() -> None:
    options = WorkloadOptions(kind="shared_prefix", groups=3, prefix_tokens=40, prompt_tokens=5)
    systems = {
        RequestFactory(options, user).next().body["messages"][0]["content"] for user in range(30) for _ in range(2)
    }
    assert systems <= set(group_prompts(options))
    assert len(systems) == 3


def test_multi_turn_resends_history_with_replies_then_starts_over() -> None:
    factory = RequestFactory(WorkloadOptions(kind="multi_turn", turns=3, prefix_tokens=10, prompt_tokens=4), 0)
    first = factory.next().body["messages"]
    factory.record_reply("reply one")
    second = factory.next().body["messages"]
    assert second[: len(first)] == first
    assert second[len(first)] == {"role": "assistant", "content": "reply one"}
    assert second[-1]["role"] == "user"
    factory.record_reply("reply two")
    third = factory.next().body["messages"]
    assert len(third) == 6
    factory.record_reply("reply three")
    fourth = factory.next().body["messages"]  # three turns done: a new conversation
    assert len(fourth) == 2 and fourth[0] != first[0]


def test_multi_turn_without_a_reply_starts_a_new_conversation() -> None:
    factory = RequestFactory(WorkloadOptions(kind="multi_turn", turns=5), 0)
    first = factory.next().body["messages"]
    second = factory.next().body["messages"]  # the first failed: no reply recorded
    assert len(second) == 2 and second[0] != first[0]


def test_stream_ratio_api_mix_and_completions_prompt() -> None:
    factory = RequestFactory(WorkloadOptions(api="mixed", stream_ratio=0.5, seed=1), 0)
    requests = [factory.next() for _ in range(400)]
    streamed = sum(r.stream for r in requests)
    assert 150 < streamed < 250
    assert {r.api for r in requests} == {"chat", "completions"}
    completion = next(r for r in requests if r.api == "completions")
    assert completion.path == "/v1/completions" and completion.body["prompt"].endswith("assistant:")
    stream = next(r for r in requests if r.stream)
    assert stream.body["stream_options"] == {"include_usage": True}
    plain = next(r for r in requests if not r.stream)
    assert "stream_options" not in plain.body


def test_ignore_eos_can_be_turned_off_and_bad_options_are_refused() -> None:
    assert "ignore_eos" not in RequestFactory(WorkloadOptions(ignore_eos=False), 0).next().body
    with pytest.raises(ValueError, match="workload"):
        WorkloadOptions(kind="nope")
    with pytest.raises(ValueError, match="stream ratio"):
        WorkloadOptions(stream_ratio=2)
    with pytest.raises(ValueError, match="output_tokens"):
        WorkloadOptions(output_tokens=0)


# -- the SSE reader ----------------------------------------------------------------------------------


def test_stream_record_times_tokens_and_prefers_usage() -> None:
    record = StreamRecord(started=10.0)
    record.feed(b": keep-alive\n", 10.01)
    record.feed(_event(_chat_chunk("", role=True)), 10.2)  # the opening chunk is not a token
    record.feed(_event(_chat_chunk("Hel")), 10.2)
    record.feed(b"\n", 10.2)
    record.feed(_event(_chat_chunk("lo")), 10.25)
    record.feed(_event(_chat_chunk("!")), 10.35)
    record.feed(_event({"choices": [], "usage": {"completion_tokens": 4}}), 10.36)
    record.feed(b"data: [DONE]\n", 10.36)
    assert record.failure() is None
    assert record.text == "Hello!"
    assert record.ttft_s == pytest.approx(0.2)
    assert record.gaps_s == pytest.approx([0.05, 0.1])
    assert record.output_tokens == 4  # the server's count wins over the 3 events
    assert record.decode_tokens_per_s == pytest.approx(3 / 0.15)


def test_stream_record_counts_completion_events_without_usage() -> None:
    record = StreamRecord(started=0.0)
    for index in range(5):
        record.feed(_event({"choices": [{"index": 0, "text": f"t{index}"}]}).decode(), 1.0 + index)
    record.feed("data: [DONE]", 6.0)
    assert record.output_tokens == 5 and record.ttft_s == 1.0 and record.failure() is None


def test_stream_record_failures() -> None:
    cut = StreamRecord(started=0.0)
    cut.feed(_event(_chat_chunk("a")), 1.0)
    assert cut.failure() == "stream ended without [DONE]"

    errored = StreamRecord(started=0.0)
    errored.feed(_event(_chat_chunk("a")), 1.0)
    errored.feed(_event({"error": {"message": "replica died", "type": "ServiceUnavailable"}}), 1.1)
    errored.feed(b"data: [DONE]\n", 1.2)
    assert errored.failure() == "replica died"

    garbage = StreamRecord(started=0.0)
    garbage.feed(b"data: {not json\n", 1.0)
    garbage.feed(b"data: [DONE]\n", 1.0)
    assert garbage.failure() is not None and "undecodable" in garbage.failure()


def test_non_streamed_bodies() -> None:
    chat = {"choices": [{"message": {"role": "assistant", "content": "hi"}}], "usage": {"completion_tokens": 2}}
    assert completion_text(chat) == "hi" and completion_tokens(chat) == 2
    text = {"choices": [{"text": "yo"}]}
    assert completion_text(text) == "yo" and completion_tokens(text) is None


# -- load shapes -------------------------------------------------------------------------------------


def test_steady_shape_holds_then_stops() -> None:
    plan = ShapePlan("steady", users=12, spawn_rate=4.0, run_time_s=30)
    assert plan.at(0) == (12, 4.0)
    assert plan.at(29.9) == (12, 4.0)
    assert plan.at(30) is None
    assert ShapePlan("steady", users=3, spawn_rate=1.0, run_time_s=None).at(1e6) == (3, 1.0)


def test_step_ramp_adds_users_each_step_up_to_the_total() -> None:
    plan = ShapePlan("steps", users=10, spawn_rate=1.0, run_time_s=None, step_users=4, step_time_s=5)
    assert [plan.at(t)[0] for t in (0, 4.9, 5, 10, 14.9)] == [4, 4, 8, 10, 10]
    assert plan.at(15) is None  # three steps of 5 s
    assert plan.at(0)[1] == 4.0  # each step spawns at once
    longer = ShapePlan("steps", users=10, spawn_rate=1.0, run_time_s=40, step_users=4, step_time_s=5)
    assert longer.at(39)[0] == 10 and longer.at(40) is None
    with pytest.raises(ValueError, match="steps"):
        ShapePlan("steps", users=10, spawn_rate=1.0, run_time_s=None)


def test_poisson_arrival_gaps_have_the_asked_rate() -> None:
    gaps = arrival_gaps(50.0, random.Random(7))
    sample = [next(gaps) for _ in range(20000)]
    assert statistics.fmean(sample) == pytest.approx(1 / 50, rel=0.03)
    # Exponential: the standard deviation equals the mean (a fixed pacing would have none).
    assert statistics.pstdev(sample) == pytest.approx(1 / 50, rel=0.05)
    with pytest.raises(ValueError):
        next(arrival_gaps(0, random.Random()))


def test_the_bearer_key_is_the_first_of_a_list_without_its_tenant_name() -> None:
    assert bearer_key("sk-one-1234, sk-two-5678") == "sk-one-1234"
    assert bearer_key("acme:sk-one-1234,b:sk-two") == "sk-one-1234"
    assert bearer_key("") == ""
    assert bearer_key(":sk-odd-1234") == ":sk-odd-1234"  # no tenant name before the colon
