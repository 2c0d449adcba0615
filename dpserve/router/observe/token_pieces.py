"""Encoding a rendered prompt piece by piece, each piece's ids remembered: a shared system prompt is
encoded once, not once per request.

A tokenizer cuts its added tokens (`<s>`, `<|im_start|>`, ...) out of the text before it normalizes or
pre-tokenizes anything, and encodes the text between them one piece at a time. So the ids of a chat
prompt are the ids of its pieces, joined by the added tokens' own ids; a piece seen before (the same
system prompt, the same earlier turns) costs a dictionary lookup instead of a BPE pass over thousands of
characters. Where a tokenizer does not work that way (an added token that strips the spaces around it, a
pre-tokenizer that treats the first piece differently), the pieces would differ from the whole: every
encoder checks its first prompts, and then one in `CHECK_EVERY`, against a whole encode, and on the first
difference it encodes whole prompts from then on (`whole_only`), logging why.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer

log = logging.getLogger("dpserve.tokens")

CHECK_FIRST = 32
"""Prompts checked against a whole encode before the pieces are trusted..."""
CHECK_EVERY = 256
"""...and one in this many after."""


def token_ids(ids: Sequence[int]) -> array[int]:
    """Token ids as the router keeps them: 4 bytes each, ready to hash block by block."""
    return ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)


class PieceEncoder:
    def __init__(self, tokenizer: Tokenizer, max_pieces: int = 4096) -> None:
        self._tokenizer = tokenizer
        self.max_pieces = max_pieces
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        """Long new prompts are encoded in a worker thread (`LocalTokenizer.tokens`) while the event loop
        encodes others: the cache's lookups and evictions must not interleave."""
        added = tokenizer.get_added_tokens_decoder()
        self._added_ids = {token.content: token_id for token_id, token in added.items()}
        # Leftmost, then longest: the order a tokenizer matches its added tokens in.
        names = sorted(self._added_ids, key=len, reverse=True)
        self._splitter = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self.whole_only = any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values())
        """True where the added tokens are not plain cuts: then every prompt is encoded whole."""
        try:
            self._frame: Callable[[array[int]], array[int]] | None = special_frame(tokenizer)
        except ValueError:
            self._frame = None
        self.encoded = 0
        self.hits = 0
        self.mismatches = 0

    def encode(self, text: str, add_special_tokens: bool) -> array[int]:
        """`text`'s ids, as `Tokenizer.encode` gives them. A rendered chat template writes its own special
        tokens (no `add_special_tokens`); a completion prompt gets the tokenizer's (a BOS, say)."""
        self.encoded += 1
        whole = self.whole_only or self._splitter is None or (add_special_tokens and self._frame is None)
        if whole:
            return fast_ids(self._tokenizer, text, add_special_tokens)
        ids = self._by_pieces(text)
        if add_special_tokens:
            assert self._frame is not None
            ids = self._frame(ids)
        if self.encoded <= CHECK_FIRST or self.encoded % CHECK_EVERY == 0:
            reference = array("I", self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
            if reference != ids:
                self._give_up(text)
                return reference
        return ids

    def uncached_chars(self, text: str) -> int:
        """How many characters of `text` an encode would have to run the tokenizer over (to choose between
        encoding on the event loop and in a thread)."""
        if self.whole_only or self._splitter is None:
            return len(text)
        return sum(len(piece) for piece in self._splitter.split(text)[::2] if piece not in self._pieces)

    def _by_pieces(self, text: str) -> array[int]:
        assert self._splitter is not None
        ids: array[int] = array("I")
        parts = self._splitter.split(text)  # text, added token, text, ..., text
        for index, part in enumerate(parts):
            if index % 2:
                ids.append(self._added_ids[part])
            elif part:
                ids.extend(self._piece(part))
        return ids

    def _piece(self, piece: str) -> array[int]:
        # Short pieces too: one call into the encoder costs ~10 µs whatever the length, and the short ones
        # (the generation prompt's `<|assistant|>` turn) repeat in every request.
        pieces = self._pieces
        with self._lock:
            found = pieces.get(piece)
            if found is not None:
                self.hits += 1
                pieces.move_to_end(piece)
                return found
        found = fast_ids(self._tokenizer, piece, False)
        with self._lock:
            pieces[piece] = found
            if len(pieces) > self.max_pieces:
                pieces.popitem(last=False)
        return found

    def _give_up(self, text: str) -> None:
        self.mismatches += 1
        self.whole_only = True
        with self._lock:
            self._pieces.clear()
        log.warning(
            "this tokenizer does not encode a prompt as its pieces between added tokens (a prompt of %d chars "
            "differed): the router encodes whole prompts from now on",
            len(text),
        )


def fast_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> array[int]:
    """`tokenizer.encode(text, ...)`'s ids without the character offsets it also works out (a quarter of a short
    piece's encode, measured: 64 against 84 µs for a 16-word question); the checks above hold them to `encode`."""
    return array("I", tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)


def special_frame(tokenizer: Tokenizer) -> Callable[[array[int]], array[int]]:
    """What `encode(..., add_special_tokens=True)` puts around a text's ids (a BOS, say), as a function
    from the bare ids to the decorated ones: found once by encoding a probe both ways."""
    probe = "probe"
    bare = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
    if at is None:  # the post-processor rewrote the text's own ids: no simple frame
        raise ValueError("the tokenizer's post-processor does not frame a text's ids")
    head, tail = array("I", full[:at]), array("I", full[at + len(bare) :])

    def frame(ids: array[int]) -> array[int]:
        return head + ids + tail if head or tail else ids

    return frame
