"""What the user-facing docs name exists: every ``python -m bench.X``, every ``kvmesh <command>``,
every module path and ``kvmesh.X`` module, every relative link, and every flag of the README's
``kvmesh up`` table. The decision records, the benchmark history and the lab notes tell the past
(retired tools and removed flags included) and are not checked."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvmesh.cli import COMMANDS
from kvmesh.common.runtime.config import flag_name
from kvmesh.up.config import UpConfig

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"


def user_docs() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "bench" / "README.md"]
    past = ("history.md", "serving-cpu-notes.md")  # the benchmark history and the lab notes tell the past
    docs += [p for p in (ROOT / "docs").rglob("*.md") if "decisions" not in p.parts and p.name not in past]
    return sorted(docs)


DOCS = user_docs()


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_bench_named_exists(doc: Path):
    for name in re.findall(r"\bbench\.(\w+)", doc.read_text(encoding="utf-8")):
        assert (ROOT / "bench" / f"{name}.py").is_file(), f"{doc.name} names bench.{name}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_kvmesh_command_named_exists(doc: Path):
    text = doc.read_text(encoding="utf-8")
    for name in re.findall(r"`kvmesh ([a-z][a-z-]+)", text):
        assert name in COMMANDS, f"{doc.name} names `kvmesh {name}`"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_module_named_exists(doc: Path):
    text = doc.read_text(encoding="utf-8")
    packages = "common|router|worker|indexer|frontend|planner|replay|profiler|loadgen|client|up|cli|inspector"
    for name in re.findall(rf"\bkvmesh\.((?:{packages})(?:\.[a-z_]+)*)", text):
        parts = name.split(".")
        # a name may end in a class or function: the longest prefix that is a module must exist
        found = any(
            (SERVICES.joinpath(*parts[:n]).with_suffix(".py")).is_file()
            or (SERVICES.joinpath(*parts[:n]) / "__init__.py").is_file()
            for n in range(len(parts), 0, -1)
        )
        assert found, f"{doc.name} names kvmesh.{name}"
    folders = "common|router|worker|indexer|frontend|planner|replay|profiler|loadgen|devtools"
    for folder, module in re.findall(rf"`((?:{folders})/(?:\w+/)*)(\w+\.py)`", text):
        assert (SERVICES / folder / module).is_file(), f"{doc.name} names {folder}{module}"
    for path in re.findall(r"`((?:services|tests|bench|scripts|protos|examples|observability)/[\w./-]+)`", text):
        assert (ROOT / path.rstrip("/")).exists(), f"{doc.name} names {path}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_relative_link_resolves(doc: Path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        assert (doc.parent / target).exists(), f"{doc.name} links to {target}"


def test_every_flag_of_the_readmes_kvmesh_up_table_is_an_option():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("### `kvmesh up` options") :]
    table = table[: table.index("\n\n", table.index("| flag |"))]
    flags = set(re.findall(r"`--([a-z][a-z0-9-]*)`", table))
    assert len(flags) > 20  # the table was found
    options = {flag_name(f)[2:] for f in dataclasses.fields(UpConfig)}
    options |= {"no-" + name for name in options}
    assert flags - options == set()
