"""LoRA adapters on the mesh: which a worker serves, and how a request names one.

A request names an adapter by putting its name where the model goes (``"model": "sql-expert"``, as
vLLM's OpenAI server takes it); the frontend sends it on as the base model plus ``lora_name``. A
worker advertises the adapters it serves in its discovery record (``extra["lora_adapters"]``); the
router considers only workers that serve the adapter a request names. An adapter's KV blocks are
hashed with its name (``hashing.lora_seed``), so blocks are never shared between adapters or with
the base model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

ADAPTERS_KEY = "lora_adapters"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def parse_adapters(text: str) -> tuple[str, ...]:
    """Adapter names from a comma-separated list; ValueError naming a bad or repeated one."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        if not _NAME.fullmatch(name):
            raise ValueError(f"bad LoRA adapter name {name!r} (letters, digits and . _ : / -)")
    if len(set(names)) != len(names):
        raise ValueError(f"an adapter is named twice in {text!r}")
    return names


def served_adapters(extra: Mapping[str, Any]) -> frozenset[str]:
    """The adapters a worker's discovery record says it serves."""
    return frozenset(extra.get(ADAPTERS_KEY) or ())


def adapters_of(records: Iterable[Any], model: str) -> frozenset[str]:
    """Every adapter some worker of ``model`` serves (records are discovery records)."""
    found: set[str] = set()
    for record in records:
        if record.model == model:
            found |= served_adapters(record.extra)
    return frozenset(found)
