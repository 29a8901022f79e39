"""The distribution installs the ``services/`` folders as the ``kvmesh`` import package, and nothing
else at the top level (a generic ``services`` package would collide with other projects')."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON_TREES = ("services", "tests", "bench", "examples")


def test_wheel_holds_only_the_kvmesh_package(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("kvmesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/", 1)[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"kvmesh"}
    # every subpackage of the folders travels, and the data files with them
    for expected in ("kvmesh/router/server.py", "kvmesh/common/proto/kvmesh/v1/router_pb2.py", "kvmesh/cli.py"):
        assert expected in names
    assert any(name.startswith("kvmesh/common/models/kvmesh-tiny/") for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvmesh = kvmesh.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    return modules


def test_no_code_imports_the_folder_name():
    offenders = []
    for tree in PYTHON_TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            offenders += [
                f"{path.relative_to(REPO)}: {module}"
                for module in _imported_modules(path)
                if module == "services" or module.startswith("services.")
            ]
    assert offenders == [], "import kvmesh.…, not services.…"


def test_the_installed_package_is_the_services_folder():
    import kvmesh

    assert Path(kvmesh.__file__).resolve().parent == REPO / "services"
