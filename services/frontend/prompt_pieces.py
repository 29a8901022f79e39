"""Prompt encoding piece by piece: a prompt is split at its special tokens and the ids of each piece
between them are remembered, so a system prompt that many requests share is encoded once.

Why it gives the same ids as encoding the whole prompt: a ``tokenizers`` tokenizer first splits its
input at the added tokens it matches in the raw text (those not ``normalized``), then normalises,
pre-tokenises and encodes each piece between them on its own. Encoding the pieces separately and
joining their ids is therefore the same, provided nothing in the pipeline looks beyond its piece:
no added token that strips whitespace around it or must match a whole word, no added token matched
after normalising, and no pre-tokenizer that treats the piece at the start of the input differently
(``Metaspace`` with ``prepend_scheme="first"``). :func:`pieces_are_independent` checks these from
the tokenizer's own description; a tokenizer that fails it is encoded whole, as before.

Why bother: encoding is per character, and in a chat prompt most characters are the shared system
prompt. The tiny model's 1,100-character prompts took about 100 µs each to encode, 14% of the
frontend's CPU at 8 output tokens (docs/decisions/0027).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

from tokenizers import Tokenizer

# Pre-tokenizers that split each piece the same wherever the piece starts (checked recursively
# through ``Sequence``); ``Metaspace`` is on the list only with a scheme other than "first".
_POSITION_FREE_PRE_TOKENIZERS = {
    "BertPreTokenizer",
    "ByteLevel",
    "CharDelimiterSplit",
    "Digits",
    "Metaspace",
    "Punctuation",
    "Sequence",
    "Split",
    "UnicodeScripts",
    "Whitespace",
    "WhitespaceSplit",
}


def _position_free(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind not in _POSITION_FREE_PRE_TOKENIZERS:
        return False
    if kind == "Metaspace" and pre_tokenizer.get("prepend_scheme", "always") == "first":
        return False
    return all(_position_free(inner) for inner in pre_tokenizer.get("pretokenizers", ()))


def pieces_are_independent(tokenizer: Tokenizer) -> bool:
    """Whether encoding the pieces between ``tokenizer``'s added tokens one by one gives the ids of
    encoding the whole text (see the module's docstring)."""
    added = tokenizer.get_added_tokens_decoder().values()
    if not added or any(t.normalized or t.lstrip or t.rstrip or t.single_word for t in added):
        return False
    return _position_free(json.loads(tokenizer.to_str()).get("pre_tokenizer"))


class PieceCachedEncoder:
    """Encodes text as ``tokenizer.encode_batch_fast([text], add_special_tokens=False)`` would.

    Guarantees: the same ids as that call, for every text (when the tokenizer fails
    :func:`pieces_are_independent`, that call is what it makes); the pieces it remembers hold at
    most ``max_chars`` characters in all, the least recently used dropped first; a piece longer than
    a sixteenth of that is never kept. Memory: the pieces plus at most one id per character (a tuple
    of Python ints: a few tens of MB at the default, far less with a tokenizer that merges).
    Not thread-safe: one event loop uses it.
    """

    def __init__(self, tokenizer: Tokenizer, max_chars: int = 1 << 20) -> None:
        self._tokenizer = tokenizer
        self._max_chars = max_chars
        self._largest_kept = max_chars // 16
        self._chars = 0
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._special: dict[str, int] = {}
        self._splitter: re.Pattern[str] | None = None
        if pieces_are_independent(tokenizer):
            self._special = {token.content: id_ for id_, token in tokenizer.get_added_tokens_decoder().items()}
            # longest first: at one position the longest added token wins, as in the tokenizer
            ordered = sorted(self._special, key=len, reverse=True)
            self._splitter = re.compile("(" + "|".join(map(re.escape, ordered)) + ")")

    @property
    def splits(self) -> bool:
        """Whether texts are encoded piece by piece (else whole)."""
        return self._splitter is not None

    def encode(self, text: str) -> list[int]:
        if self._splitter is None:
            return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        pieces = [piece for piece in self._splitter.split(text) if piece]
        known = self._pieces
        special = self._special
        new = list(dict.fromkeys(piece for piece in pieces if piece not in special and piece not in known))
        fresh: dict[str, tuple[int, ...]] = {}
        if new:
            # one call for every piece not seen before (usually just the user's message)
            for piece, encoding in zip(
                new, self._tokenizer.encode_batch_fast(new, add_special_tokens=False), strict=True
            ):
                # a tuple of ints, unlike a list, drops out of the garbage collector's view at its
                # first look: thousands of remembered pieces make no full collections (decision 28)
                fresh[piece] = tuple(encoding.ids)
        ids: list[int] = []
        for piece in pieces:
            token = special.get(piece)
            if token is not None:
                ids.append(token)
                continue
            piece_ids = fresh.get(piece)
            if piece_ids is None:
                piece_ids = known[piece]
                known.move_to_end(piece)
            ids.extend(piece_ids)
        for piece, piece_ids in fresh.items():
            self._keep(piece, piece_ids)
        return ids

    def _keep(self, piece: str, ids: tuple[int, ...]) -> None:
        if len(piece) > self._largest_kept or piece in self._pieces:
            return
        self._pieces[piece] = ids
        self._chars += len(piece)
        while self._chars > self._max_chars:
            dropped, _ = self._pieces.popitem(last=False)
            self._chars -= len(dropped)
