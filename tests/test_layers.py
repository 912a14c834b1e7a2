"""The package's layers, kept by a test (PGQueuer keeps its with import-linter).

Every ``import`` in ``src/conveyor`` (at module level or inside a function) is
read from the source; each contract names a layer and what it may never reach.
A new arrow that breaks one fails here, with the importing module named.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "conveyor"

# The shared vocabulary: the words every layer speaks. It imports only itself.
VOCABULARY = {"conveyor.errors", "conveyor.outcomes", "conveyor.validation", "conveyor.retry",
              "conveyor.types", "conveyor.config", "conveyor.clock", "conveyor.log_context"}
# Tooling that still lives in the package and reaches up into the CLI; it is
# on its way out of src/conveyor, and each entry goes when it moves.
TOOLING = ("conveyor.bench", "conveyor.demo")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                found.add(module)
                # "from conveyor import worker" imports a module, not a name.
                found.update(f"{module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m == "conveyor" or m.startswith("conveyor.")}
    return graph


GRAPH = _imports()


def _reaches(importer: str, target: str) -> bool:
    return any(m == target or m.startswith(target + ".") for m in GRAPH[importer])


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _modules(graph_filter: str) -> list[str]:
    return sorted(m for m in GRAPH if _in(m, graph_filter))


def test_the_import_graph_is_read() -> None:
    assert len(GRAPH) > 50
    assert _reaches("conveyor.worker.worker", "conveyor.worker.executor")


@pytest.mark.parametrize("module", sorted(VOCABULARY & set(GRAPH)))
def test_the_shared_vocabulary_imports_only_itself(module: str) -> None:
    outside = sorted(m for m in GRAPH[module]
                     if m not in VOCABULARY and not any(m.startswith(v + ".") for v in VOCABULARY)
                     and m != "conveyor")
    assert not outside, f"{module} imports {outside}"


@pytest.mark.parametrize("module", _modules("conveyor.db"))
def test_the_database_seam_knows_no_worker_producer_or_cli(module: str) -> None:
    for target in ("conveyor.worker", "conveyor.producer", "conveyor.admin", "conveyor.cli",
                   "conveyor.consumers", "conveyor.testing", "conveyor.multitenant"):
        assert not _reaches(module, target), f"{module} imports {target}"


@pytest.mark.parametrize("module", _modules("conveyor.consumers"))
def test_consumers_never_import_the_worker(module: str) -> None:
    assert not _reaches(module, "conveyor.worker"), f"{module} imports conveyor.worker"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if not _in(m, "conveyor.cli")
                                          and not any(_in(m, t) for t in TOOLING)))
def test_the_library_never_imports_the_cli(module: str) -> None:
    assert not _reaches(module, "conveyor.cli"), f"{module} imports conveyor.cli"


@pytest.mark.parametrize("module", _modules("conveyor.worker"))
def test_the_worker_imports_no_producer_admin_or_cli(module: str) -> None:
    for target in ("conveyor.producer", "conveyor.admin", "conveyor.cli", "conveyor.testing"):
        assert not _reaches(module, target), f"{module} imports {target}"
