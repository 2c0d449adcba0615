"""Which tokenizer gives a model's prompt tokens when `--tokenizer` is not given: the model's own, loaded in
the router, wherever a copy of it can be found here; the replicas' `/tokenize` until it is loaded and has
agreed with them, and for good where no copy is found or it disagrees.

A copy is looked for, in order, at the path the replicas serve the model from (their /v1/models card's
`root`: vLLM's `--model PATH`), at the model's name as a path, in the Hugging Face hub cache under either
name (where `huggingface_hub` is installed), and for the tiny model in dpserve's own cache. A copy found
is loaded off the event loop, then its ids are held against the replica's for the model's first `CHECKS`
prompts: another revision of the tokenizer, or a replica whose tokenizer is not the model's (a simulator's
stand-in), shows there, and the replicas' tokens are used from then on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpserve.router.observe.prompt_tokens import LocalTokenizer, PromptTokenizer, TokenIds
from dpserve.tiny_model import BUILD_VERSION, TINY_MODEL_NAME

log = logging.getLogger("dpserve.tokens")

CHECKS = 8
"""Prompts whose local ids must equal the replica's before the local tokenizer is trusted."""


def find_model_dir(model: str, root: str | None, cache_dir: Path) -> Path | None:
    """A local copy of `model`'s tokenizer (see the module's docstring), or None."""
    names = [name for name in (root, model) if name]
    for name in names:
        path = Path(name).expanduser()
        if LocalTokenizer.available(path):
            return path
    for name in names:
        found = hub_snapshot(name)
        if found is not None:
            return found
    tiny = cache_dir / f"tiny-v{BUILD_VERSION}"
    if model == TINY_MODEL_NAME and LocalTokenizer.available(tiny):
        return tiny
    return None


def hub_snapshot(repo_id: str) -> Path | None:
    """The snapshot folder holding `repo_id`'s tokenizer.json in the Hugging Face hub cache, if any."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "tokenizer.json")
    except ValueError:  # not a repository id (a path, a name with spaces)
        return None
    return Path(found).parent if isinstance(found, str) else None


@dataclass
class _Model:
    local: LocalTokenizer | None = None
    checks_left: int = CHECKS
    loading: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def trusted(self) -> LocalTokenizer | None:
        """The local tokenizer once it has passed its checks (checks still in flight may end below 0)."""
        return self.local if self.checks_left <= 0 else None


class ModelTokenizers:
    name = "auto"

    def __init__(
        self, remote: PromptTokenizer, root_of: Callable[[str], str | None], cache_dir: Path, checks: int = CHECKS
    ) -> None:
        """`root_of`: where the replicas serve a model from (its card's `root`), read on the event loop;
        `cache_dir`: dpserve's cache, where the tiny model is built."""
        self._remote = remote
        self._root_of = root_of
        self._cache_dir = cache_dir
        self._checks = checks
        self._models: dict[str, _Model] = {}

    @property
    def failures(self) -> int:
        return self._remote.failures + sum(m.local.failures for m in self._models.values() if m.local is not None)

    def source(self, model: str) -> str:
        """`local` once the model's own tokenizer is trusted, else `remote` (the metrics' label)."""
        state = self._models.get(model)
        return "local" if state is not None and state.trusted is not None else "remote"

    async def tokens(self, endpoint: str, payload: dict[str, Any], model: str, replica_url: str) -> TokenIds | None:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _Model(checks_left=self._checks)
            state.loading = asyncio.create_task(self._load(model, state))
        trusted = state.trusted
        if trusted is not None:
            return await trusted.tokens(endpoint, payload, model, replica_url)
        local = state.local
        theirs = await self._remote.tokens(endpoint, payload, model, replica_url)
        if local is not None and theirs is not None:
            self._check(model, state, await local.tokens(endpoint, payload, model, replica_url), theirs)
        return theirs

    def _check(self, model: str, state: _Model, mine: TokenIds | None, theirs: TokenIds) -> None:
        if mine is not None and list(mine) == list(theirs):
            state.checks_left -= 1
            if state.checks_left == 0:
                log.info("model %s: prompts are tokenized in the router from now on", model)
            return
        state.local = None
        log.warning(
            "model %s: the tokenizer found here gives other ids than the replica's /tokenize; the replicas "
            "tokenize its prompts (give --tokenizer DIR to choose the copy)",
            model,
        )

    async def _load(self, model: str, state: _Model) -> None:
        try:
            state.local = await asyncio.to_thread(self._open, model, self._root_of(model))
        except Exception as exc:  # a broken copy (the Rust loader raises plain Exception): stay remote
            log.warning("model %s: could not load the tokenizer found for it: %s", model, exc)

    def _open(self, model: str, root: str | None) -> LocalTokenizer | None:
        found = find_model_dir(model, root, self._cache_dir)
        if found is None:
            log.info("model %s: no copy of its tokenizer here; the replicas tokenize its prompts", model)
            return None
        log.info("model %s: loading its tokenizer from %s", model, found)
        return LocalTokenizer(found)
