"""Encoding a prompt piece by piece between added tokens gives the tokenizer's own ids, a shared piece is
encoded once, and a tokenizer for which pieces differ from the whole falls back to whole encodes."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from dpserve import tiny_model as tiny
from dpserve.kvindex.index import ROOT_KEY, block_keys, chain_key
from dpserve.kvindex.prefix_keys import PrefixKeys
from dpserve.router.observe import token_pieces
from dpserve.router.observe.token_pieces import CHECK_FIRST, PieceEncoder, token_ids

WORDS = ["route", "cache", " ", "  ", "\n", "Ünï", "ć", "token", "block", "<s", "s>", "</s>", "<s>", "<pad>", "ab", "."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_file(str(tiny.build_tiny_model(tmp_path_factory.mktemp("tiny-pieces")) / "tokenizer.json"))


def random_text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(words))


@pytest.mark.engine
def test_pieces_give_the_tokenizers_own_ids(tokenizer: Tokenizer) -> None:
    """Texts with added tokens anywhere (at the ends, doubled, inside words) and odd spacing: by pieces,
    after the checks stop, the ids are exactly the whole encode's, with and without special tokens."""
    encoder = PieceEncoder(tokenizer)
    rng = random.Random(7)
    systems = [random_text(rng, 80) for _ in range(4)]
    for _ in range(CHECK_FIRST + 300):
        text = rng.choice(systems) + rng.choice(["</s>", "<s>", ""]) + random_text(rng, rng.randrange(0, 30))
        for special in (False, True):
            assert list(encoder.encode(text, special)) == tokenizer.encode(text, add_special_tokens=special).ids
    assert encoder.mismatches == 0 and not encoder.whole_only
    assert encoder.hits > 0


@pytest.mark.engine
def test_a_shared_prefix_is_encoded_once(tokenizer: Tokenizer) -> None:
    encoder = PieceEncoder(tokenizer)
    system = "You are the router's assistant. " * 20
    first = f"<s><|system|>\n{system}</s>\n<|user|>\nQuestion one</s>\n<|assistant|>\n"
    second = first.replace("Question one", "Another question entirely")
    assert encoder.uncached_chars(first) >= len(system)
    encoder.encode(first, False)
    # Only the piece not seen before is left to encode: the new question's turn.
    assert encoder.uncached_chars(second) == len("\n<|user|>\nAnother question entirely")
    assert list(encoder.encode(second, False)) == tokenizer.encode(second, add_special_tokens=False).ids
    assert encoder.hits == 2  # the system prompt's piece and the generation prompt's


@pytest.mark.engine
def test_the_piece_cache_is_bounded(tokenizer: Tokenizer) -> None:
    encoder = PieceEncoder(tokenizer, max_pieces=3)
    texts = [f"{i} " + "long piece of a prompt " * 5 for i in range(5)]
    for text in texts:
        encoder.encode(text + "</s>", False)
    assert encoder.uncached_chars(texts[0]) == len(texts[0])  # the oldest were dropped
    assert encoder.uncached_chars(texts[4]) == 0


def first_only_tokenizer() -> Tokenizer:
    """A tokenizer that treats the text before its first added token differently (a Metaspace that prepends
    to the first piece only, as some SentencePiece conversions do): its pieces are not the whole."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"])
    tokenizer.train_from_iterator(["route the cache to the block " * 20], trainer)
    return tokenizer


def test_a_tokenizer_whose_pieces_differ_is_encoded_whole() -> None:
    tokenizer = first_only_tokenizer()
    text = "route the<s>cache the block"
    pieces = [*tokenizer.encode("route the").ids, 1, *tokenizer.encode("cache the block").ids]
    assert tokenizer.encode(text).ids != pieces
    encoder = PieceEncoder(tokenizer)
    assert list(encoder.encode(text, False)) == tokenizer.encode(text, add_special_tokens=False).ids
    assert encoder.whole_only and encoder.mismatches == 1
    assert list(encoder.encode(text, False)) == tokenizer.encode(text, add_special_tokens=False).ids


def test_added_tokens_that_strip_spaces_are_never_cut_around() -> None:
    tokenizer = first_only_tokenizer()
    tokenizer.add_special_tokens([AddedToken("<sep>", lstrip=True)])
    assert PieceEncoder(tokenizer).whole_only


@pytest.mark.engine
def test_checks_run_first_then_sampled(monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer) -> None:
    """The whole encode runs for the first prompts and then one in CHECK_EVERY: a difference that shows
    late is still caught."""
    monkeypatch.setattr(token_pieces, "CHECK_EVERY", 10)
    encoder = PieceEncoder(tokenizer)
    text = "route the cache " * 10 + "</s>tail"
    for _ in range(CHECK_FIRST):
        encoder.encode(text, False)
    encoder._added_ids["</s>"] = 2  # from now on the pieces are wrong
    results = [list(encoder.encode(text, False)) for _ in range(10)]
    assert encoder.mismatches == 1 and encoder.whole_only
    assert results[-1] == tokenizer.encode(text, add_special_tokens=False).ids


def test_block_keys_are_the_chained_keys_of_the_index(tmp_path: Path) -> None:
    """The keys of a prompt computed at once over its bytes equal the keys the index chains from events."""
    rng = random.Random(3)
    ids = [rng.randrange(50_000) for _ in range(100)]
    for adapter in (None, "lora-a"):
        expected, parent = [], ROOT_KEY
        for start in range(0, 96, 16):
            parent = chain_key(parent, ids[start : start + 16], (adapter,) if adapter else None)
            expected.append(parent)
        assert block_keys(ids, 16, adapter) == expected
        assert block_keys(token_ids(ids), 16, adapter) == expected
        assert block_keys(tuple(ids), 16, adapter) == expected


def test_prefix_keys_are_block_keys_and_reuse_shared_beginnings() -> None:
    """Prompts of a few groups (a shared beginning each, then their own tail), with adapters and two block
    sizes: always exactly `block_keys`, most blocks of a group's later prompts not hashed again, and with a
    memo too small for them all, still exact and within its bound."""
    for max_entries, reuse in ((256, 2.0), (8, 0.0)):
        rng = random.Random(9)
        memo = PrefixKeys(max_entries)
        systems = [[rng.randrange(50_000) for _ in range(rng.randrange(300, 600))] for _ in range(4)]
        for _ in range(400):
            ids = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(0, 40))]
            block_size, adapter = rng.choice([16, 32]), rng.choice([None, None, "lora-a"])
            assert memo.keys(token_ids(ids), block_size, adapter) == block_keys(ids, block_size, adapter)
            assert len(memo) <= max_entries
        assert memo.reused_blocks >= reuse * memo.hashed_blocks


@pytest.mark.engine
def test_encodes_from_several_threads_share_the_cache_safely(tokenizer: Tokenizer) -> None:
    """The event loop and worker threads encode side by side (long new prompts go to a thread): with a cache
    small enough to evict all the time, every thread still gets the tokenizer's own ids."""
    encoder = PieceEncoder(tokenizer, max_pieces=4)
    texts = [f"system {i % 6} " * 20 + "</s>" + f"question {i}" for i in range(60)]
    expected = {text: tokenizer.encode(text, add_special_tokens=False).ids for text in texts}

    def work(offset: int) -> list[bool]:
        return [list(encoder.encode(text, False)) == expected[text] for text in texts[offset:] + texts[:offset]]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(0, 60, 15)))
    assert all(all(found) for found in results)
    assert encoder.mismatches == 0
