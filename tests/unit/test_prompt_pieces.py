"""Encoding a prompt piece by piece between its special tokens, with the pieces remembered, gives
exactly the ids of encoding it whole, for the tokenizers where that holds, and falls back to whole
encoding where it does not."""

from __future__ import annotations

import gc
import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from kvmesh.common.core.tiny_model import MODEL_DIR
from kvmesh.frontend.prompt_pieces import PieceCachedEncoder, pieces_are_independent

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = [
    "the",
    "cache",
    "router",
    "worker",
    "prefix",
    "token",
    "Block",
    "héllo",
    "wörld",
    "数据",
    "kv",
    "",
    "llm,\n",
    "Ünïcode",
    "ﬁne",
    "２０２６",
    "...",
]


def whole(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids


def trained(pre_tokenizer, normalizer=None, model=None, specials=SPECIALS) -> Tokenizer:
    tokenizer = Tokenizer(model or models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    corpus = [" ".join(random.Random(i).choices(WORDS, k=40)) for i in range(200)]
    trainer_class = trainers.WordPieceTrainer if isinstance(model, models.WordPiece) else trainers.BpeTrainer
    tokenizer.train_from_iterator(corpus, trainer_class(vocab_size=300, special_tokens=["[UNK]"]))
    tokenizer.add_special_tokens([AddedToken(s, normalized=False) for s in specials])
    return tokenizer


def chat_like_texts(count: int, seed: int) -> list[str]:
    """Texts with special tokens anywhere (also back to back, at the ends), pieces that repeat."""
    rng = random.Random(seed)
    shared = [" ".join(rng.choices(WORDS, k=60)) for _ in range(3)]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randrange(0, 8)):
            roll = rng.random()
            if roll < 0.4:
                parts.append(rng.choice(SPECIALS))
            elif roll < 0.7:
                parts.append(rng.choice(shared))
            else:
                parts.append(" ".join(rng.choices(WORDS, k=rng.randrange(0, 12))))
        texts.append("".join(parts))
    return texts


TOKENIZERS = {
    "the tiny model's (byte level)": lambda: Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")),
    "BPE, NFKC, byte level with a prefix space": lambda: trained(
        pre_tokenizers.ByteLevel(add_prefix_space=True), normalizers.NFKC()
    ),
    "WordPiece, lower case, BERT's splitting": lambda: trained(
        pre_tokenizers.BertPreTokenizer(), normalizers.Lowercase(), models.WordPiece(unk_token="[UNK]")
    ),
    "BPE, Metaspace always": lambda: trained(pre_tokenizers.Metaspace(prepend_scheme="always")),
    "BPE, digits then whitespace": lambda: trained(
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Whitespace()])
    ),
}


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_piece_by_piece_gives_the_ids_of_the_whole_text_first_time_and_from_memory(name: str):
    tokenizer = TOKENIZERS[name]()
    encoder = PieceCachedEncoder(tokenizer)
    assert encoder.splits
    texts = chat_like_texts(300, seed=len(name))
    for text in texts + texts:  # the second round comes from the remembered pieces
        assert encoder.encode(text) == whole(tokenizer, text), text


def test_a_tokenizer_that_treats_the_first_piece_apart_is_encoded_whole():
    tokenizer = trained(pre_tokenizers.Metaspace(prepend_scheme="first"))
    text = "hello<|im_start|>world cache"
    pieces = ["hello", "<|im_start|>", "world cache"]
    # what splitting would get wrong: only the text's first piece gets the ▁ prefix
    assert [i for piece in pieces for i in whole(tokenizer, piece)] != whole(tokenizer, text)
    assert not pieces_are_independent(tokenizer)
    encoder = PieceCachedEncoder(tokenizer)
    assert not encoder.splits
    assert encoder.encode(text) == whole(tokenizer, text)


def test_added_tokens_that_strip_or_match_after_normalising_turn_splitting_off():
    assert pieces_are_independent(trained(pre_tokenizers.ByteLevel()))
    stripping = trained(pre_tokenizers.ByteLevel(), specials=[])
    stripping.add_special_tokens([AddedToken("<|im_end|>", lstrip=True, normalized=False)])
    assert not pieces_are_independent(stripping)
    normalized = trained(pre_tokenizers.ByteLevel(), specials=[])
    normalized.add_tokens([AddedToken("<sep>", normalized=True)])
    assert not pieces_are_independent(normalized)
    assert not pieces_are_independent(Tokenizer(models.BPE()))  # no added token: nothing to split at


def test_the_remembered_pieces_stay_within_their_budget_and_the_ids_stay_exact():
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    encoder = PieceCachedEncoder(tokenizer, max_chars=1600)  # a piece over 100 characters is never kept
    texts = chat_like_texts(200, seed=7)
    for text in texts:
        assert encoder.encode(text) == whole(tokenizer, text)
        assert encoder._chars <= 1600 and all(len(piece) <= 100 for piece in encoder._pieces)
        assert encoder._chars == sum(len(piece) for piece in encoder._pieces)
    assert encoder._pieces  # short pieces were kept


def test_the_remembered_pieces_are_out_of_the_garbage_collectors_view():
    # thousands of remembered pieces must not make the full collections a service pays for (decision 28)
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    encoder = PieceCachedEncoder(tokenizer)
    for text in chat_like_texts(50, seed=3):
        encoder.encode(text)
    gc.collect()
    assert encoder._pieces and not any(gc.is_tracked(ids) for ids in encoder._pieces.values())
