"""A LoRA adapter of the bundled tiny model, built locally (no adapter can be downloaded here)."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_lora(directory: Path, model: Path, rank: int = 4, seed: int = 7) -> Path:
    """A LoRA adapter for the tiny model in PEFT's layout (random A and B on q_proj and v_proj), so
    that its answers differ from the base model's."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(layers):
        for name, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model),
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(adapter))
    return directory
