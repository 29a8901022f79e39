"""LoRA adapters on the mesh: which a worker serves, and how a request names one.

A request names an adapter by putting its name where the model goes (``"model": "sql-expert"``, as
vLLM's OpenAI server takes it); the frontend sends it on as the base model plus ``lora_name``. A
worker advertises the adapters it serves in its discovery record (``extra["lora_adapters"]``) and,
when it holds fewer loaded at once than it serves (``--max-loras``), which are loaded now
(``extra["lora_resident"]``). The router considers only workers that serve the adapter a request
names, and charges one that must load it first the prefill its load is worth (``--lora-load-tokens``).
An adapter's KV blocks are hashed with its name (``hashing.lora_seed``), so blocks are never shared
between adapters or with the base model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

ADAPTERS_KEY = "lora_adapters"
RESIDENT_KEY = "lora_resident"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def adapter_paths(text: str) -> dict[str, str | None]:
    """``NAME`` or ``NAME=PATH`` entries of a comma-separated list, in order: each name's path (None
    where none is given); ValueError naming a bad or repeated name, or an empty path."""
    found: dict[str, str | None] = {}
    for part in (part.strip() for part in text.split(",")):
        if not part:
            continue
        name, sep, path = (piece.strip() for piece in part.partition("="))
        if not _NAME.fullmatch(name):
            raise ValueError(f"bad LoRA adapter name {name!r} (letters, digits and . _ : / -)")
        if sep and not path:
            raise ValueError(f"adapter {name!r} has an empty path (NAME=PATH)")
        if name in found:
            raise ValueError(f"an adapter is named twice in {text!r}")
        found[name] = path if sep else None
    return found


def served_adapters(extra: Mapping[str, Any]) -> frozenset[str]:
    """The adapters a worker's discovery record says it serves."""
    return frozenset(extra.get(ADAPTERS_KEY) or ())


def must_load(extra: Mapping[str, Any], adapter: str) -> bool:
    """Whether a worker serving ``adapter`` must load it before its next request for it (it
    advertises the adapters loaded now, and this one is not among them)."""
    resident = extra.get(RESIDENT_KEY)
    return resident is not None and adapter not in resident


def adapters_of(records: Iterable[Any], model: str) -> frozenset[str]:
    """Every adapter some worker of ``model`` serves (records are discovery records)."""
    found: set[str] = set()
    for record in records:
        if record.model == model:
            found |= served_adapters(record.extra)
    return frozenset(found)
