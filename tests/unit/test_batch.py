"""The Batch API's pure parts and its SQLite store, without sockets: a file's lines, a line's checks, the
room batch lines may take, and the store's claims, leases and endings (each line's answer kept once)."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest

from dpserve.policies.base import ReplicaSnapshot
from dpserve.router.batch.lines import FileError, Refused, Request, check_lines, group_of, read_file
from dpserve.router.batch.objects import batch_object
from dpserve.router.batch.room import batch_room
from dpserve.router.batch.routes import window_seconds
from dpserve.router.batch.store import Answer, BatchStore, Counts
from dpserve.router.http.errors import OpenAIError

CHAT = "/v1/chat/completions"


def line(custom_id: str, **overrides: object) -> str:
    value = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"model": "m", "messages": []}}
    value.update(overrides)
    return orjson.dumps(value).decode()


def test_a_file_is_its_json_object_lines_and_a_bad_one_is_named_by_its_number() -> None:
    assert read_file(f"{line('a')}\n\n{line('b')}\n".encode(), 10) == [line("a"), line("b")]
    with pytest.raises(FileError, match=r"^line 3: not JSON"):
        read_file(f"{line('a')}\n{line('b')}\n{{oops\n".encode(), 10)
    with pytest.raises(FileError, match=r"^line 2: a JSON object is expected, got list"):
        read_file(f"{line('a')}\n[1]\n".encode(), 10)
    with pytest.raises(FileError, match=r"^line 2: not UTF-8"):
        read_file(b"{}\n\xff\n", 10)
    with pytest.raises(FileError, match=r"more than 2 requests"):
        read_file("\n".join(line(str(i)) for i in range(3)).encode(), 2)
    with pytest.raises(FileError, match="no requests"):
        read_file(b"\n \n", 10)


def test_each_line_is_checked_alone_and_refused_with_its_number_and_code() -> None:
    lines = [
        line("ok"),
        line("ok"),
        line("", method="POST"),
        line("get", method="GET"),
        line("elsewhere", url="/v1/embeddings"),
        line("no-body", body=[1]),
        line("streams", body={"model": "m", "stream": True}),
    ]
    checked = check_lines(lines, CHAT)
    assert isinstance(checked[0], Request) and checked[0].line == 1 and orjson.loads(checked[0].body)["model"] == "m"
    codes = [(item.line, item.code) for item in checked[1:] if isinstance(item, Refused)]
    assert codes == [
        (2, "duplicate_custom_id"),
        (3, "missing_custom_id"),
        (4, "invalid_method"),
        (5, "mismatched_url"),
        (6, "invalid_body"),
        (7, "invalid_body"),
    ]
    refused = checked[4]
    assert isinstance(refused, Refused) and refused.message.startswith("line 5: ")


def test_lines_group_by_their_model_and_prompts_start() -> None:
    system = {"role": "system", "content": "You are helpful." * 10}
    one = group_of({"model": "m", "messages": [system, {"role": "user", "content": "a"}]})
    two = group_of({"model": "m", "messages": [system, {"role": "user", "content": "b"}]})
    other_model = group_of({"model": "n", "messages": [system, {"role": "user", "content": "a"}]})
    assert one == two != other_model
    assert group_of({"model": "m", "prompt": "x" * 600 + "1"}) == group_of({"model": "m", "prompt": "x" * 600 + "2"})
    assert group_of({"model": "m", "input": ["a"]}) != group_of({"model": "m", "input": ["b"]})


def test_the_window_is_24h_or_a_duration_up_to_a_week() -> None:
    assert window_seconds("24h") == 86_400 and window_seconds("90s") == 90 and window_seconds("5m") == 300
    for bad in ("", "24", "0h", "169h", 24, None, "1d"):
        with pytest.raises(OpenAIError):
            window_seconds(bad)


def test_batch_lines_take_only_the_room_other_requests_leave() -> None:
    idle = [ReplicaSnapshot("a"), ReplicaSnapshot("b")]
    assert batch_room(idle, running=0, slots=2, reserve=0.1, queued=0) == 4
    # Two of this router's lines run (sent: in the replicas' load): two more may start.
    sent = [ReplicaSnapshot("a", in_flight=1), ReplicaSnapshot("b", in_flight=1)]
    assert batch_room(sent, running=2, slots=2, reserve=0.1, queued=0) == 2
    # Other requests take slots back, from any client (another router's, the replica's own).
    busy = [ReplicaSnapshot("a", in_flight=2), ReplicaSnapshot("b", running=1, waiting=1)]
    assert batch_room(busy, running=0, slots=2, reserve=0.1, queued=0) == 0
    # Requests waiting in the router's queue: none.
    assert batch_room(idle, running=0, slots=2, reserve=0.1, queued=1) == 0
    # A learned capacity less the reserve bounds a replica's slots (4 seen, 1 kept free: 3 of 8 offered).
    small = [ReplicaSnapshot("a", confirmed_capacity=4, capacity=4), ReplicaSnapshot("b")]
    assert batch_room(small, running=0, slots=8, reserve=0.25, queued=0) == 3 + 8
    # While other requests come, the reserve share of the fleet's slots is theirs too (never the last one).
    assert batch_room(idle, running=0, slots=1, reserve=0.1, queued=0, urgent=True) == 1
    assert batch_room(idle * 5, running=0, slots=2, reserve=0.1, queued=0, urgent=True) == 20 - 2
    assert batch_room(idle[:1], running=0, slots=1, reserve=0.5, queued=0, urgent=True) == 1
    # Lines claimed but not sent yet are not in the load: the others' load never goes below 0.
    assert batch_room(idle, running=3, slots=2, reserve=0.1, queued=0) == 1


@pytest.fixture
def store(tmp_path: Path) -> BatchStore:
    return BatchStore(str(tmp_path / "deep" / "store.sqlite3"))


def add_batch(store: BatchStore, lines: int, batch_id: str = "batch_1", created: int = 100, **extra: object) -> None:
    checked = check_lines([line(str(i), body={"model": "m", "prompt": str(i % 2)}) for i in range(lines)], CHAT)
    record = {
        "id": batch_id, "tenant": "acme", "endpoint": CHAT, "input_file_id": "file-1", "completion_window": "24h",
        "status": "in_progress", "created_at": created, "in_progress_at": created, "expires_at": created + 86_400,
        "metadata": {"k": "v"}, "total": lines, **extra,
    }  # fmt: skip
    store.add_batch(record, checked)


def ids() -> itertools.count[int]:
    return itertools.count()


def new_id_from(counter: itertools.count[int]):  # type: ignore[no-untyped-def]
    return lambda prefix: f"{prefix}{next(counter)}"


def ok(text: str) -> Answer:
    return Answer(
        True, {"response": {"status_code": 200, "request_id": "r", "body": {"text": text}}, "error": None}, 3, 2
    )


def test_claims_go_to_one_router_and_an_answer_is_kept_once(store: BatchStore) -> None:
    add_batch(store, 4)
    store.heartbeat("r1", 1e12, 0)
    store.heartbeat("r2", 1e12, 0)
    first = store.claim("r1", ["batch_1"], 3)
    second = store.claim("r2", ["batch_1"], 3)
    assert len(first) == 3 and len(second) == 1
    assert {c.line for c in first} | {c.line for c in second} == {1, 2, 3, 4}
    # A group's lines together: prompts "0" (lines 1, 3) and "1" (2, 4) are claimed group by group.
    assert sorted(c.line for c in first[:2]) in ([1, 3], [2, 4])
    assert first[0].tenant == "acme" and orjson.loads(first[0].body)["model"] == "m"
    assert store.finish("r1", "batch_1", first[0].line, ok("a"))
    assert not store.finish("r1", "batch_1", first[0].line, ok("again"))  # done: never twice
    assert not store.finish("r1", "batch_1", second[0].line, ok("not mine"))
    counts = store.counts(["batch_1"])["batch_1"]
    assert counts == Counts(total=4, queued=0, running=3, completed=1, prompt_tokens=3, completion_tokens=2)


def test_a_silent_routers_lines_are_queued_again_and_its_late_answer_dropped(store: BatchStore) -> None:
    add_batch(store, 2)
    store.heartbeat("dead", 10.0, 0)
    claimed = store.claim("dead", ["batch_1"], 2)
    assert store.heartbeat("alive", 100.0, now=5.0) == 0  # its lease holds until 10
    assert store.heartbeat("alive", 100.0, now=11.0) == 2
    again = store.claim("alive", ["batch_1"], 5)
    assert sorted(c.line for c in again) == [1, 2]
    assert not store.finish("dead", "batch_1", claimed[0].line, ok("late"))
    assert store.finish("alive", "batch_1", claimed[0].line, ok("kept"))


def test_a_stopping_router_hands_its_lines_back_at_once(store: BatchStore) -> None:
    add_batch(store, 2)
    store.heartbeat("r1", 1e12, 0)
    claimed = store.claim("r1", ["batch_1"], 2)
    store.leave("r1", [("batch_1", claimed[0].line)])
    assert [c.line for c in store.claim("r2", ["batch_1"], 2)] == [claimed[0].line]


def test_a_finished_batch_ends_once_with_its_output_and_error_files(store: BatchStore) -> None:
    lines = [line("a"), line("b"), line("bad", url="/v1/embeddings")]
    record = {
        "id": "batch_1", "tenant": "acme", "endpoint": CHAT, "input_file_id": "file-1", "completion_window": "24h",
        "status": "in_progress", "created_at": 1, "expires_at": 10**9, "total": 3,
    }  # fmt: skip
    store.add_batch(record, check_lines(lines, CHAT))
    new_id = new_id_from(ids())
    claimed = store.claim("r", ["batch_1"], 5)
    assert [c.custom_id for c in claimed] == ["a", "b"]
    assert not store.finalize("batch_1", 50, new_id, expired=False)  # lines still running
    store.finish("r", "batch_1", 1, ok("A"))
    failed = {"response": {"status_code": 400, "request_id": "r", "body": {"error": {}}}, "error": None}
    store.finish("r", "batch_1", 2, Answer(False, failed))
    assert store.finalize("batch_1", 60, new_id, expired=False)
    assert not store.finalize("batch_1", 61, new_id, expired=False)  # ended already
    batch = store.batch("batch_1", "acme")
    assert batch is not None and batch["status"] == "completed" and batch["completed_at"] == 60
    assert store.batch("batch_1", "globex") is None
    output = [orjson.loads(text) for text in store.file_lines(batch["output_file_id"])]
    errors = [orjson.loads(text) for text in store.file_lines(batch["error_file_id"])]
    assert [entry["custom_id"] for entry in output] == ["a"] and output[0]["response"]["body"] == {"text": "A"}
    assert [entry["custom_id"] for entry in errors] == ["b", "bad"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[1]["response"] is None and errors[1]["error"]["line"] == 3
    output_file = store.file(batch["output_file_id"], "acme")
    assert output_file is not None and output_file["purpose"] == "batch_output"
    assert output_file["bytes"] == sum(len(text.encode()) + 1 for text in store.file_lines(batch["output_file_id"]))
    counts = store.counts(["batch_1"])["batch_1"]
    shown = batch_object(batch, counts)
    assert shown["request_counts"] == {"total": 3, "completed": 1, "failed": 2} and shown["metadata"] is None


def test_cancelling_waits_for_running_lines_and_expiry_ends_the_rest(store: BatchStore) -> None:
    add_batch(store, 3)
    new_id = new_id_from(ids())
    running = store.claim("r", ["batch_1"], 1)
    cancelling = store.cancel("batch_1", "acme", 70)
    assert cancelling is not None and cancelling["status"] == "cancelling"
    assert store.cancel("batch_1", "globex", 70) is None or store.batch("batch_1", "globex") is None
    assert store.claim("r", ["batch_1"], 5) == []  # no more lines of a cancelled batch
    assert not store.finalize("batch_1", 71, new_id, expired=False)
    store.finish("r", "batch_1", running[0].line, ok("kept"))
    assert store.finalize("batch_1", 72, new_id, expired=False)
    batch = store.batch("batch_1", None)
    assert batch is not None and batch["status"] == "cancelled"
    codes = [orjson.loads(text)["error"]["code"] for text in store.file_lines(batch["error_file_id"])]
    assert codes == ["batch_cancelled", "batch_cancelled"]

    add_batch(store, 2, batch_id="batch_2")
    store.claim("r", ["batch_2"], 1)
    assert store.finalize("batch_2", 80, new_id, expired=True)
    expired = store.batch("batch_2", None)
    assert expired is not None and expired["status"] == "expired" and expired["expired_at"] == 80
    assert not store.finish("r", "batch_2", 1, ok("too late"))


def test_files_are_listed_per_tenant_in_order_with_a_cursor(store: BatchStore) -> None:
    for number in range(3):
        record = {"id": f"file-{number}", "tenant": "acme", "purpose": "batch", "filename": "f", "bytes": 1,
                  "created_at": 100 + number}  # fmt: skip
        store.add_file(record, [line(str(number))])
    store.add_file({**record, "id": "file-other", "tenant": "globex"}, [line("x")])
    newest = [f["id"] for f in store.files("acme", None, None, 10, newest_first=True)]
    assert newest == ["file-2", "file-1", "file-0"]
    assert [f["id"] for f in store.files("acme", "batch", "file-2", 1, newest_first=True)] == ["file-1"]
    assert [f["id"] for f in store.files("acme", None, "file-0", 10, newest_first=False)] == ["file-1", "file-2"]
    assert not store.delete_file("file-1", "globex")
    assert store.delete_file("file-1", "acme") and store.file("file-1", "acme") is None
    assert store.file_lines("file-1") == []
    add_batch(store, 1, batch_id="batch_a", created=5)
    add_batch(store, 1, batch_id="batch_b", created=6)
    assert [b["id"] for b in store.batches("acme", None, 10)] == ["batch_b", "batch_a"]
    assert [b["id"] for b in store.batches("acme", "batch_b", 10)] == ["batch_a"]
    assert store.batches("globex", None, 10) == []


def test_the_store_survives_a_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "store.sqlite3")
    first = BatchStore(path)
    add_batch(first, 2)
    (claimed,) = first.claim("r", ["batch_1"], 1)
    assert first.finish("r", "batch_1", claimed.line, ok("done"))
    first.close()
    second = BatchStore(path)
    assert second.counts(["batch_1"])["batch_1"].completed == 1
    # The finished line is not run again.
    assert [c.line for c in second.claim("r2", ["batch_1"], 5)] == [3 - claimed.line]
