"""Routing receipts: the classes, the sample, the ring and the counts (no sockets)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dpserve.kvindex.text_prefix import CHARS_PER_TOKEN, CHUNK_CHARS, ChunkTokens
from dpserve.policies.base import PrefixMatch, PrefixSource
from dpserve.router.quality.receipt_log import ReceiptLog
from dpserve.router.quality.receipts import (
    BALANCED,
    CLASSES,
    COLD,
    EVICTED,
    HIT,
    MISPREDICTED,
    UNSCORED,
    ReceiptBook,
    ReceiptCollector,
    classify,
)

BLOCK = 16


@pytest.mark.parametrize(
    ("predicted", "best", "realized", "expected"),
    [
        (64, 64, 64, HIT),
        (64, 64, 48, HIT),  # a fully cached prompt's last block is computed again
        (64, 64, 80, HIT),
        (0, 0, 0, COLD),  # nothing held anywhere, nothing found: a workload miss
        (0, 0, 16, COLD),
        (64, 64, 0, EVICTED),  # the index said cached, the engine had dropped it
        (64, 64, 32, EVICTED),
        (0, 0, 64, MISPREDICTED),  # the engine had blocks the index did not know
        (16, 64, 80, MISPREDICTED),
        (0, 64, 0, BALANCED),  # another replica held it: the policy chose load over cache
        (16, 64, 16, BALANCED),
        (None, None, 64, UNSCORED),  # the policy predicted nothing
        (64, 64, None, UNSCORED),  # no usage: an error, a client that left
    ],
)
def test_each_receipt_gets_the_class_that_explains_it(
    predicted: int | None, best: int | None, realized: int | None, expected: str
) -> None:
    assert classify(predicted, best, realized, BLOCK) == expected


@dataclass
class View:
    id: str
    load: int
    in_flight: int = 0
    kv_usage: float = 0.0
    capacity: int = 0
    confirmed_capacity: int = 0
    slow_refill: bool = False


def match(**blocks: int) -> PrefixMatch:
    return PrefixMatch(PrefixSource.KV_EVENTS, total_blocks=8, tokens_per_block=BLOCK, matched=blocks)


def test_a_decision_records_the_prediction_there_and_the_best_elsewhere() -> None:
    book = ReceiptBook(sample=1.0)
    receipt = book.open("req-1", "completions", "m", "alice")
    assert receipt is not None
    candidates = [View("r0", load=9), View("r1", load=1), View("r2", load=3)]
    receipt.decided("kv_aware", "r1", "load", match(r0=6, r1=2), candidates)
    assert (receipt.predicted, receipt.best, receipt.best_replica) == (32, 96, "r0")
    assert (receipt.load, receipt.best_load, receipt.prompt_blocks, receipt.source) == (1, 9, 8, "kv_events")
    book.close(receipt, 200, prompt_tokens=140, cached_tokens=32)
    assert receipt.verdict == BALANCED
    # A retry decides again: the last attempt's decision is the one kept.
    again = book.open("req-2", "completions", "m", "alice")
    assert again is not None
    again.decided("kv_aware", "r0", "cache_hit", match(r0=6), candidates)
    again.decided("kv_aware", "r2", "cache_hit", match(r2=3), candidates)
    assert (again.replica, again.predicted, again.best_replica) == ("r2", 48, "r2")
    # A policy that reads no prefix predicts nothing: the receipt has the replica and load, no class.
    plain = book.open("req-3", "completions", "m", "alice")
    assert plain is not None
    plain.decided("least_loaded", "r1", "least_loaded", None, candidates)
    book.close(plain, 200, prompt_tokens=140, cached_tokens=0)
    assert (plain.predicted, plain.verdict, plain.load) == (None, UNSCORED, 1)


def test_the_sample_is_even_and_a_request_that_asks_always_gets_one() -> None:
    book = ReceiptBook(sample=0.25)
    opened = [book.open(f"r{i}", "completions", "m", "t") is not None for i in range(40)]
    assert sum(opened) == 10 and opened[3::4] == [True] * 10
    assert book.open("asked", "completions", "m", "t", asked=True) is not None
    assert ReceiptBook(sample=0.0).open("x", "completions", "m", "t") is None
    with pytest.raises(ValueError, match=r"--receipts-sample 1\.5: must be between 0 and 1"):
        ReceiptBook(sample=1.5)


def test_the_ring_is_bounded_and_the_counts_add_up_to_the_receipts() -> None:
    book = ReceiptBook(sample=1.0, keep=5)
    outcomes = [(64, 64, 64), (0, 0, 0), (64, 64, 0), (0, 0, 64), (0, 64, 0), (64, 64, 48), (64, 64, None)]
    for index, (predicted, best, realized) in enumerate(outcomes * 3):
        receipt = book.open(f"req-{index}", "chat_completions", "m", "t")
        assert receipt is not None
        receipt.decided("kv_aware", "r0", "x", match(r0=predicted // BLOCK, r1=best // BLOCK), [View("r0", 0)])
        receipt.best = best  # as if r1, which held `best`, had been a candidate too
        if realized is None:
            book.close(receipt, 502, None, None)
        else:
            book.close(receipt, 200, 200, realized)
    recent = book.recent(100)
    assert [r["request_id"] for r in recent] == [f"req-{i}" for i in range(20, 15, -1)]  # newest first, 5 kept
    assert book.recent(2) == recent[:2]
    summary = book.summary()
    assert summary["receipts"] == 21 == sum(summary["classes"].values())
    assert summary["classes"] == {HIT: 6, COLD: 3, EVICTED: 3, MISPREDICTED: 3, BALANCED: 3, UNSCORED: 3}
    assert set(summary["classes"]) == set(CLASSES)
    # Over the 18 scored: 3x(64+0+64+0+0+64) predicted, 3x(64+0+0+64+0+48) realized, of 18x200 prompt tokens.
    assert summary["predicted_hit_rate"] == pytest.approx(576 / 3600)
    assert summary["realized_hit_rate"] == pytest.approx(528 / 3600)
    assert summary["hit_mean_error_blocks"] == pytest.approx(0.5)  # 0 and 1 block, alternately

    registry = CollectorRegistry()
    registry.register(ReceiptCollector(book))
    text = generate_latest(registry).decode()
    assert 'dpserve_receipts_total{class="hit",replica="r0"} 6.0' in text
    assert 'dpserve_receipt_tokens_total{kind="realized_cached"} 528.0' in text


def test_the_log_gets_every_closed_receipt_as_a_json_line(tmp_path: Path) -> None:
    now = [0.0]
    log = ReceiptLog(tmp_path / "receipts.jsonl", clock=lambda: now[0])
    book = ReceiptBook(sample=0.5, on_closed=log.write)
    for index in range(4):
        receipt = book.open(f"req-{index}", "completions", "m", "t")
        if receipt is not None:
            receipt.decided("kv_aware", "r0", "cache_hit", match(r0=4), [View("r0", 0)])
            book.close(receipt, 200, 100, 64)
    assert log.written == 2
    assert (tmp_path / "receipts.jsonl").read_bytes() == b""  # buffered, a second not yet passed
    now[0] = 1.5
    receipt = book.open("req-4", "completions", "m", "t", asked=True)
    assert receipt is not None
    book.close(receipt, 499, None, None)
    lines = [json.loads(line) for line in (tmp_path / "receipts.jsonl").read_text().splitlines()]
    assert [(r["request_id"], r["class"]) for r in lines] == [("req-1", HIT), ("req-3", HIT), ("req-4", UNSCORED)]
    log.close()
    with pytest.raises(ValueError, match=r"--receipts-log .*nowhere"):
        ReceiptLog(tmp_path / "nowhere" / "receipts.jsonl")


def test_routed_text_answers_teach_what_a_chunk_is_in_tokens() -> None:
    chunks = ChunkTokens()
    assert chunks.per_chunk("m") == CHUNK_CHARS // CHARS_PER_TOKEN  # nothing learned: the rough English ratio
    book = ReceiptBook(sample=1.0, chunk_tokens=chunks)
    candidates = [View("r0", load=0)]

    def answered(source: PrefixSource, model: str, chunks_in_prompt: int, prompt_tokens: int) -> None:
        receipt = book.open("req", "completions", model, "alice")
        assert receipt is not None
        per_chunk = chunks.per_chunk(model)
        text = PrefixMatch(source, chunks_in_prompt, per_chunk, matched={"r0": chunks_in_prompt}, keys=(1,))
        receipt.decided("prefix", "r0", "text_prefix", text, candidates)
        book.close(receipt, 200, prompt_tokens=prompt_tokens, cached_tokens=0)

    # A tokenizer of 1.6 characters a token: a 64-character chunk is 40 tokens (the prompt's partial chunk
    # counts as half a chunk).
    answered(PrefixSource.ROUTED_TEXT, "m", 19, 780)
    assert chunks.per_chunk("m") == 40
    answered(PrefixSource.ROUTED_TEXT, "m", 9, 380)
    assert chunks.per_chunk("m") == 40 and chunks.per_chunk("other") == 16  # per model
    answered(PrefixSource.KV_EVENTS, "other", 9, 3800)  # a KV-event match counts real blocks: nothing to learn
    assert chunks.per_chunk("other") == 16


def test_a_text_prediction_is_rounded_down_to_the_engines_block() -> None:
    book = ReceiptBook(sample=1.0)
    receipt = book.open("req", "completions", "m", "alice")
    assert receipt is not None
    text = PrefixMatch(PrefixSource.ROUTED_TEXT, 60, 40, matched={"r0": 52, "r1": 10}, keys=(1,))
    receipt.decided("prefix", "r1", "least_loaded", text, [View("r0", load=3), View("r1", load=0)], engine_block=128)
    # 10 chunks of 40 tokens: 400, of which vLLM can hold 3 whole blocks; the best, 52 chunks: 2080 -> 16 blocks.
    assert (receipt.predicted, receipt.best, receipt.block_tokens) == (384, 2048, 128)
    kv = PrefixMatch(PrefixSource.KV_EVENTS, 8, 16, matched={"r0": 5}, keys=tuple(range(8)))
    receipt.decided("kv_aware", "r0", "cache_hit", kv, [View("r0", load=3)], engine_block=128)
    assert (receipt.predicted, receipt.block_tokens) == (80, 16)  # KV events count the engine's own blocks


def test_a_receipt_times_the_answer_from_its_send_to_its_end() -> None:
    now = [10.0]
    book = ReceiptBook(sample=1.0, timer=lambda: now[0])
    receipt = book.open("req", "completions", "m", "alice")
    assert receipt is not None
    receipt.decided("kv_aware", "r0", "cache_hit", match(r0=2), [View("r0", load=0)])
    receipt.dispatched = 10.5  # the dispatcher's clock when it sent the last attempt
    now[0] = 10.75
    book.close(receipt, 200, prompt_tokens=140, cached_tokens=32, completion_tokens=4)
    assert receipt.replica_s == 0.25 and receipt.to_dict()["replica_s"] == 0.25
    failed = book.open("req-2", "completions", "m", "alice")
    assert failed is not None
    failed.dispatched = 10.5
    book.close(failed, 502, prompt_tokens=None, cached_tokens=None)
    assert failed.replica_s is None  # no answer: nothing to time
