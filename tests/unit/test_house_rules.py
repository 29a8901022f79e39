"""The house rules, kept by tests rather than by memory (decision 32's rules eroded within a day of
new features when nothing checked them):

- every package's ``__init__`` opens with a module map that names exactly the modules and
  subpackages in its folder;
- no hand-written module of ``services/`` or ``bench/`` is over 450 lines (an allow-list with a
  reason per entry: empty today);
- every option a service declares is read by name by the code it configures (``--nats-creds`` was
  once declared, parsed and then looked up under another name, so every service dropped it);
- ``bench/`` holds at most 15 durable benchmarks, each listed in its README, and no test imports one.

The replay's routing options each changing a decision is tests/replay/test_replay_routing_options.py.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
BENCH = ROOT / "bench"
GENERATED = {SERVICES / "common" / "proto"}
MAX_LINES = 450
# module -> why it may be longer (none today: split a module that grows past the ceiling)
LONG_MODULES: dict[str, str] = {}
MAX_BENCHMARKS = 15


def packages() -> list[Path]:
    found = []
    for init in sorted(SERVICES.rglob("__init__.py")):
        folder = init.parent
        if not any(folder == g or g in folder.parents for g in GENERATED):
            found.append(folder)
    return found


def module_map(folder: Path) -> set[str]:
    """The names a package's map lists: each bullet's leading ``name`` (a module) or ``name/``."""
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    names: set[str] = set()
    for line in docstring.splitlines():
        bullet = re.match(r"\s*- (``[^`]+``(?:, ``[^`]+``)*)(?: (?:and|\+) ``[^`]+``)*", line)
        if bullet:
            names.update(re.findall(r"``([^`]+)``", line.split(" — ")[0]))
    return names


def contents(folder: Path) -> set[str]:
    modules = {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
    subpackages = {
        f"{p.name}/"
        for p in folder.iterdir()
        if p.is_dir() and not p.name.startswith(("_", ".")) and (p / "__init__.py").exists()
    }
    data = {f"{p.name}/" for p in folder.iterdir() if p.is_dir() and p.name in ("models",)}
    return modules | subpackages | data


@pytest.mark.parametrize("folder", packages(), ids=lambda f: str(f.relative_to(ROOT)))
def test_every_package_map_names_exactly_its_modules(folder: Path):
    listed, present = module_map(folder), contents(folder)
    assert not present - listed, f"{folder.relative_to(ROOT)}/__init__.py: add to its module map"
    assert not listed - present, f"{folder.relative_to(ROOT)}/__init__.py: its map names what is not there"


def hand_written_modules() -> list[Path]:
    modules = [p for p in SERVICES.rglob("*.py") if not any(g in p.parents for g in GENERATED)]
    return sorted(modules + list(BENCH.glob("*.py")))


def test_no_hand_written_module_is_over_the_line_ceiling():
    long = {
        str(p.relative_to(ROOT)): n
        for p in hand_written_modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    unexplained = {name: n for name, n in long.items() if name not in LONG_MODULES}
    assert unexplained == {}, f"over {MAX_LINES} lines: split them (or allow one, saying why)"
    assert set(LONG_MODULES) <= set(long), "an allowed module is back under the ceiling: drop it from the list"


# ---- every declared option is read ----------------------------------------------------------------
def option_classes() -> list[type]:
    from kvmesh.frontend.config import FrontendConfig
    from kvmesh.indexer.config import IndexerConfig
    from kvmesh.planner.service import PlannerConfig
    from kvmesh.replay.cli import ReplayArgs
    from kvmesh.router.config import RouterConfig
    from kvmesh.up.config import UpConfig
    from kvmesh.worker.config import WorkerConfig

    return [FrontendConfig, IndexerConfig, PlannerConfig, ReplayArgs, RouterConfig, UpConfig, WorkerConfig]


def declared_options() -> dict[str, list[str]]:
    """Each option's name -> the commands that declare it."""
    options: dict[str, list[str]] = {}
    for cls in option_classes():
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                options.setdefault(f.name, []).append(cls.__name__)
    return options


def names_read() -> set[str]:
    """Every attribute read anywhere in services/ (``config.nats_creds``), and every string constant
    that names one for ``getattr`` or a table (``"nats_creds"``)."""
    read: set[str] = set()
    for path in hand_written_modules():
        if BENCH in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                read.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                read.add(node.value)
    return read


def test_every_declared_option_is_read_by_name():
    read = names_read()
    unread = {name: commands for name, commands in declared_options().items() if name not in read}
    assert unread == {}, "declared and parsed, then never read: wire each to what it configures"


# ---- bench/ -------------------------------------------------------------------------------------
def test_bench_holds_at_most_fifteen_benchmarks_each_listed_and_no_test_imports_one():
    readme = (BENCH / "README.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", readme, flags=re.MULTILINE))
    helpers = set(re.findall(r"`([a-z_]+)\.py`", readme.split("Helpers the benchmarks share", 1)[1]))
    present = {p.stem for p in BENCH.glob("*.py")} - {"__init__"}
    assert present - helpers == listed, "every benchmark in bench/README.md's table, and no other"
    assert len(listed) <= MAX_BENCHMARKS, "a tool written for one investigation goes once its finding is recorded"
    importers = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("*.py")
        if re.search(r"^\s*(from bench[. ]|import bench\b)", p.read_text(), flags=re.MULTILINE)
    ]
    assert importers == [], "a test imports a benchmark: move what it tests into the package"


def test_no_code_or_doc_runs_a_benchmark_that_is_gone():
    """A tool that went once its finding was recorded is named as history, never as a command."""
    present = {p.stem for p in BENCH.glob("*.py")}
    places = [*SERVICES.rglob("*.py"), *BENCH.glob("*"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    stale = {
        f"{p.relative_to(ROOT)}: {name}"
        for p in places
        if p.is_file()
        for name in re.findall(r"python -m bench\.([a-z_]+)", p.read_text())
        if name not in present
    }
    assert stale == set()
