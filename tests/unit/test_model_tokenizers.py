"""With no --tokenizer, each model's own tokenizer is found here (its served path, the Hugging Face cache, the
tiny model's cache), used once it has agreed with the replicas' /tokenize, and never where it disagrees."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants

from dpserve import tiny_model as tiny
from dpserve.router.observe.model_tokenizers import ModelTokenizers, find_model_dir
from dpserve.router.observe.prompt_tokens import LocalTokenizer, TokenIds
from dpserve.router.observe.token_pieces import token_ids

pytestmark = pytest.mark.engine  # the tiny model is built with transformers, the engine's

CHAT = {"messages": [{"role": "system", "content": "Route well. " * 40}, {"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny-auto"))


class Replica:
    """The replicas' /tokenize: the tiny model's ids, or shifted ones (a replica with another tokenizer)."""

    name = "remote"

    def __init__(self, model_dir: Path, shift: int = 0) -> None:
        self._truth = LocalTokenizer(model_dir)
        self.shift = shift
        self.calls = 0
        self.failures = 0

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        self.calls += 1
        await asyncio.sleep(0)  # a round trip: other requests run meanwhile
        ids = self._truth.tokens_now(endpoint, payload)
        return None if ids is None else token_ids([i + self.shift for i in ids])

    def source(self, model: str) -> str:
        return self.name


def test_a_copy_is_found_where_the_replicas_serve_it_from(model_dir: Path, tmp_path: Path) -> None:
    assert find_model_dir("served-name", str(model_dir), tmp_path) == model_dir  # the card's root
    assert find_model_dir(str(model_dir), None, tmp_path) == model_dir  # the name is a path
    assert find_model_dir("served-name", "/nowhere/model", tmp_path) is None
    assert find_model_dir(tiny.TINY_MODEL_NAME, "dpserve-sim/dpserve-tiny", tmp_path) is None  # not built here
    shutil.copytree(model_dir, tmp_path / f"tiny-v{tiny.BUILD_VERSION}")
    assert find_model_dir(tiny.TINY_MODEL_NAME, None, tmp_path) == tmp_path / f"tiny-v{tiny.BUILD_VERSION}"


def test_a_copy_is_found_in_the_hugging_face_cache(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub cache's own layout: refs/main names the snapshot that holds the files."""
    repo = tmp_path / "hub" / "models--org--tiny-chat"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert find_model_dir("org/tiny-chat", "org/tiny-chat", tmp_path) == snapshot
    assert find_model_dir("org/other", None, tmp_path) is None
    assert find_model_dir("not a repo id!", None, tmp_path) is None


async def settle(tokenizers: ModelTokenizers, model: str) -> None:
    """Until the model's copy has been looked for and loaded (a thread of its own)."""
    await tokenizers.tokens("chat", CHAT, model, "")
    for _ in range(200):
        state = tokenizers._models[model]
        if state.loading is not None and state.loading.done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the tokenizer never loaded")


async def test_the_local_copy_is_used_once_it_agrees(model_dir: Path) -> None:
    replica = Replica(model_dir)
    tokenizers = ModelTokenizers(replica, lambda model: str(model_dir), Path("/nonexistent"), checks=3)
    await settle(tokenizers, "m")
    assert tokenizers.source("m") == "remote"
    for _ in range(3):  # checked against the replica
        await tokenizers.tokens("chat", CHAT, "m", "")
    assert tokenizers.source("m") == "local"
    calls = replica.calls
    ids = await tokenizers.tokens("chat", CHAT, "m", "")
    assert replica.calls == calls  # the replica is no longer asked
    assert list(ids or ()) == list(LocalTokenizer(model_dir).tokens_now("chat", CHAT) or ())


async def test_checks_in_flight_together_still_end_in_trust(model_dir: Path) -> None:
    """Requests side by side all start a check before the first one ends: more checks pass than were
    asked for, and the copy is trusted all the same (found by `dpserve bench cost`: a count below zero
    kept every request checking, asking the replica and tokenizing twice)."""
    replica = Replica(model_dir)
    tokenizers = ModelTokenizers(replica, lambda model: str(model_dir), Path("/nonexistent"), checks=3)
    await settle(tokenizers, "m")
    await asyncio.gather(*(tokenizers.tokens("chat", CHAT, "m", "") for _ in range(8)))
    assert tokenizers.source("m") == "local"
    calls = replica.calls
    await tokenizers.tokens("chat", CHAT, "m", "")
    assert replica.calls == calls


async def test_a_copy_that_disagrees_is_dropped_for_good(model_dir: Path) -> None:
    replica = Replica(model_dir, shift=1)  # say, a simulator's stand-in tokenizer
    tokenizers = ModelTokenizers(replica, lambda model: str(model_dir), Path("/nonexistent"), checks=3)
    await settle(tokenizers, "m")
    for _ in range(10):
        ids = await tokenizers.tokens("chat", CHAT, "m", "")
        assert ids is not None and ids[0] == 1  # the replica's ids (BOS 0, shifted), not the copy's
    assert tokenizers.source("m") == "remote"
    assert tokenizers._models["m"].local is None


async def test_no_copy_means_the_replicas_tokenize(model_dir: Path) -> None:
    replica = Replica(model_dir)
    tokenizers = ModelTokenizers(replica, lambda model: None, Path("/nonexistent"))
    await settle(tokenizers, "elsewhere")
    for _ in range(20):
        await tokenizers.tokens("chat", CHAT, "elsewhere", "")
    assert tokenizers.source("elsewhere") == "remote" and replica.calls == 21
