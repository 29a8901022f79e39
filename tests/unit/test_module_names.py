"""Every ``kvmesh.X.Y`` module the code names is a file a reader can open from the checkout, without
installing anything: the committed ``kvmesh`` link points at ``services/``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT = re.compile(r"^\s*(?:from|import) (kvmesh(?:\.\w+)*)", re.MULTILINE)


def named_modules() -> set[str]:
    names: set[str] = set()
    for folder in ("services", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(IMPORT.findall(path.read_text(encoding="utf-8")))
    return names


def test_the_kvmesh_link_points_at_the_services_folder():
    link = ROOT / "kvmesh"
    assert link.is_symlink() and link.resolve() == (ROOT / "services").resolve()


def test_every_kvmesh_module_named_in_the_code_is_a_file_under_the_link():
    names = named_modules()
    assert "kvmesh.common.calling.request_path" in names  # the scan finds what it should
    missing = []
    for name in sorted(names):
        path = ROOT.joinpath(*name.split("."))
        if not (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
            missing.append(name)
    assert missing == []
