"""The bundled default model ``kvmesh-tiny``: a byte-level tokenizer with a ChatML chat template.

Token id ``b`` (0–255) is the byte ``b``, so any text round-trips and a shared text prefix is always
a shared token prefix; ids 256+ are the special tokens. The mock engine's default output ids
(lowercase letters, space, full stop) therefore decode to readable text. The files in
``services/common/models/kvmesh-tiny`` are written by ``python -m kvmesh.common.core.tiny_model``; a test
checks they match this module.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

MODEL_NAME = "kvmesh-tiny"
MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / MODEL_NAME
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """The standard byte-level BPE alphabet: printable bytes map to themselves, the rest are shifted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def build_tokenizer() -> Tokenizer:
    alphabet = _byte_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    return {
        "model_max_length": 1 << 20,
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
    }


def write_model(directory: Path = MODEL_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"), pretty=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


if __name__ == "__main__":
    write_model()
    print(f"wrote {MODEL_DIR}")
