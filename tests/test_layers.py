"""The package's layers, kept by a test (PGQueuer keeps its with import-linter).

Every ``import`` in ``src/conveyor`` (at module level or inside a function) is
read from the source; each contract names a layer and what it may never reach.
A new arrow that breaks one fails here, with the importing module named.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "conveyor"
TOOLS = ROOT / "tools" / "conveyor_tools"

# The shared vocabulary: the words every layer speaks. It imports only itself.
VOCABULARY = {"conveyor.errors", "conveyor.outcomes", "conveyor.validation", "conveyor.retry",
              "conveyor.types", "conveyor.states", "conveyor.records", "conveyor.filters",
              "conveyor.patterns", "conveyor.notify", "conveyor.config", "conveyor.log_context",
              "conveyor.trace_context", "conveyor.version", "conveyor.holder", "conveyor.canvas"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of the package -> every module it imports, inside it or not."""
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
        graph[name] = found
    return graph


ALL_IMPORTS = _imports()
GRAPH = {name: {m for m in found if m == "conveyor" or m.startswith("conveyor.")}
         for name, found in ALL_IMPORTS.items()}


def _reaches(importer: str, target: str) -> bool:
    return any(m == target or m.startswith(target + ".") for m in GRAPH[importer])


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _modules(graph_filter: str) -> list[str]:
    return sorted(m for m in GRAPH if _in(m, graph_filter))


def test_the_import_graph_is_read() -> None:
    assert len(GRAPH) > 50
    assert _reaches("conveyor.worker.parts", "conveyor.worker.executor")


@pytest.mark.parametrize("module", sorted(VOCABULARY & set(GRAPH)))
def test_the_shared_vocabulary_imports_only_itself(module: str) -> None:
    outside = sorted(m for m in GRAPH[module]
                     if m not in VOCABULARY and not any(m.startswith(v + ".") for v in VOCABULARY)
                     and m != "conveyor")
    assert not outside, f"{module} imports {outside}"


@pytest.mark.parametrize("module", _modules("conveyor.db"))
def test_the_database_seam_knows_no_worker_producer_or_cli(module: str) -> None:
    for target in ("conveyor.worker", "conveyor.producer", "conveyor.admin", "conveyor.cli",
                   "conveyor.consumers", "conveyor.testing", "conveyor.multitenant",
                   "conveyor.tenancy"):
        assert not _reaches(module, target), f"{module} imports {target}"


@pytest.mark.parametrize("module", _modules("conveyor.consumers"))
def test_consumers_never_import_the_worker(module: str) -> None:
    assert not _reaches(module, "conveyor.worker"), f"{module} imports conveyor.worker"


# manage.py's conveyor commands are the CLI reached through Django: they run it.
CLI_LAYERS = ("conveyor.cli", "conveyor.contrib.django.management")


@pytest.mark.parametrize("module", sorted(m for m in GRAPH
                                          if not any(_in(m, layer) for layer in CLI_LAYERS)))
def test_the_library_never_imports_the_cli(module: str) -> None:
    assert not _reaches(module, "conveyor.cli"), f"{module} imports conveyor.cli"


@pytest.mark.parametrize("module", _modules("conveyor.worker"))
def test_the_worker_imports_no_producer_admin_or_cli(module: str) -> None:
    for target in ("conveyor.producer", "conveyor.admin", "conveyor.cli", "conveyor.testing"):
        assert not _reaches(module, target), f"{module} imports {target}"


# Tooling is not library: the benchmark, the demo and the chaos ledger live in
# tools/ (distribution conveyor-tools), which the CLI finds through the
# "conveyor.commands" entry points; the library never knows they exist.
@pytest.mark.parametrize("path", ["bench", "demo", "testing/ledger.py"])
def test_the_tools_are_not_part_of_the_library(path: str) -> None:
    assert not (PACKAGE / path).exists(), f"src/conveyor/{path} belongs in tools/conveyor_tools"


def test_the_tools_live_in_their_own_distribution() -> None:
    for part in ("bench", "demo", "chaos"):
        assert (TOOLS / part / "__init__.py").is_file(), f"tools/conveyor_tools/{part} is missing"


def test_the_library_never_imports_the_tools() -> None:
    found = sorted(f"{module} imports {target}" for module, targets in ALL_IMPORTS.items()
                   for target in targets if _in(target, "conveyor_tools"))
    assert not found


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and _in(node.module, "conveyor"):
            found += [f"{path.name}:{node.lineno} {node.module}.{alias.name}"
                      for alias in node.names if alias.name.startswith("_")]
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{path.name}:{node.lineno} {node.module}")
    return found


def test_benchmarks_and_tools_import_no_private_names_of_the_library() -> None:
    scripts = [*(ROOT / "benchmarks").glob("*.py"), *TOOLS.rglob("*.py")]
    assert scripts
    found = [line for path in scripts for line in _private_imports(path)]
    assert not found


def _node(target: str) -> str | None:
    """The module an imported name lives in: ``conveyor.workflow.types.Trigger`` -> its module."""
    while target and target not in GRAPH:
        target = target.rpartition(".")[0]
    return target or None


def _cycle_within(package: str) -> list[str] | None:
    """One import cycle among the modules of ``package`` (its ``__init__`` included), or None."""
    members = set(_modules(package))
    edges = {m: sorted({n for t in GRAPH[m] if (n := _node(t)) in members and n != m})
             for m in members}
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for nxt in edges[module]:
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(members):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The finder itself must be able to fail: the package __init__ imports its
    # modules, so a module importing the package back closes a loop.
    saved = GRAPH["conveyor.workflow.errors"]
    GRAPH["conveyor.workflow.errors"] = {*saved, "conveyor.workflow.WorkflowRegistry"}
    try:
        assert _cycle_within("conveyor.workflow")
    finally:
        GRAPH["conveyor.workflow.errors"] = saved


@pytest.mark.parametrize("package", ["conveyor.workflow", "conveyor.consumers"])
def test_the_imports_within_a_package_form_a_tree(package: str) -> None:
    cycle = _cycle_within(package)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


CONSUMER_SUPPORT = ("webhooks", "webhook_signing", "workbook", "workbook_reader", "workbook_limits",
                    "filestore", "engine_client")


@pytest.mark.parametrize("name", CONSUMER_SUPPORT)
def test_consumer_support_lives_under_consumers(name: str) -> None:
    assert not (PACKAGE / f"{name}.py").exists(), f"src/conveyor/{name}.py belongs in consumers/"
    assert (PACKAGE / "consumers" / f"{name}.py").is_file()


# The HTTP workflow adapter is handed an engine client; it names the type only
# (under TYPE_CHECKING), so workflow needs no HTTP extra until one is built.
CONSUMER_IMPORTERS = {"conveyor.workflow.adapters": "conveyor.consumers.engine_client"}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH
                                          if not _in(m, "conveyor.consumers")
                                          and not _in(m, "conveyor.cli")))
def test_consumers_are_leaves_only_the_cli_composes_them(module: str) -> None:
    allowed = CONSUMER_IMPORTERS.get(module)
    found = sorted(m for m in GRAPH[module] if _in(m, "conveyor.consumers")
                   and not (allowed and _in(m, allowed)))
    assert not found, f"{module} imports {found}"


def test_the_package_has_no_import_cycle() -> None:
    # Every import counts, in a function or under TYPE_CHECKING too: a cycle a
    # lazy import hides is still two modules that cannot be read one at a time.
    cycle = _cycle_within("conveyor")
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_package_cycle_finder_sees_a_lazy_import() -> None:
    saved = GRAPH["conveyor.patterns"]
    GRAPH["conveyor.patterns"] = {*saved, "conveyor.router.Router"}
    try:
        assert _cycle_within("conveyor")
    finally:
        GRAPH["conveyor.patterns"] = saved


# The rooms of the package and the rooms each may import, lowest first;
# CONTRIBUTING.md draws the same map. A module belongs to the room of its
# longest matching prefix; a new module must find a room here.
ROOMS: dict[str, tuple[str, ...]] = {
    "vocabulary": tuple(sorted(VOCABULARY)),
    "db": ("conveyor.db", "conveyor.vacuum_health"),
    "schema": ("conveyor.schema", "conveyor.embedded"),
    "routing": ("conveyor.router", "conveyor.tasks", "conveyor.cron", "conveyor.flow",
                "conveyor.middleware"),
    "tracing": ("conveyor.tracing",),
    "producer": ("conveyor.producer", "conveyor.producer_async", "conveyor.producer_core"),
    "admin": ("conveyor.admin", "conveyor.admin_async", "conveyor.admin_core",
              "conveyor.admin_status", "conveyor.admin_controls", "conveyor.admin_controls_async",
              "conveyor.admin_workflows", "conveyor.admin_workflows_async",
              "conveyor.admin_history", "conveyor.admin_history_async",
              "conveyor.admin_results", "conveyor.admin_results_async",
              "conveyor.admin_controls_core"),
    "worker": ("conveyor.worker", "conveyor.completion", "conveyor.completion_async",
               "conveyor.completion_core"),
    "relay": ("conveyor.relay",),
    "tenancy": ("conveyor.multitenant", "conveyor.tenancy"),
    "metrics": ("conveyor.metrics",),
    "dashboard": ("conveyor.dashboard",),
    "consumers": ("conveyor.consumers",),
    "workflow": ("conveyor.workflow",),
    "testing": ("conveyor.testing",),
    "contrib": ("conveyor.contrib",),
    "cli": ("conveyor.cli",),
    "face": ("conveyor",),
}
BASE = {"vocabulary"}
MAY_IMPORT: dict[str, set[str]] = {
    "vocabulary": set(),
    "db": BASE,
    "schema": BASE | {"db"},
    "routing": BASE,
    "tracing": BASE | {"routing"},                       # its middleware is a handler hook
    "producer": BASE | {"db", "tracing"},                # tracing: probed once, when present
    "admin": BASE | {"db"},
    "worker": BASE | {"db", "schema", "routing"},
    "relay": BASE | {"db", "schema", "routing"},
    "tenancy": BASE | {"db", "schema", "routing", "worker"},
    "metrics": BASE | {"db", "routing", "worker", "relay", "tenancy"},
    "dashboard": BASE | {"db", "admin"},
    "consumers": BASE | {"db", "routing", "producer"},
    "workflow": BASE | {"routing", "producer", "admin", "consumers"},
    "testing": BASE | {"db", "schema", "routing", "producer", "admin", "worker"},
    "contrib": BASE | {"db", "schema", "routing", "producer", "admin", "worker", "cli"},
    "cli": set(ROOMS),
    "face": BASE | {"db", "schema", "routing", "producer", "admin", "worker"},
}
# Arrows a room's rules forbid, each made inside a function (never when the
# module loads) and said why.
LAZY_ARROWS = {
    ("conveyor.tasks", "conveyor.producer"): "Task builds its default Producer on first use",
    ("conveyor.tasks", "conveyor.producer_async"): "and its AsyncProducer",
}


def _room(module: str) -> str | None:
    found = [(len(prefix), room) for room, prefixes in ROOMS.items() for prefix in prefixes
             if _in(module, prefix) and (prefix != "conveyor" or module == "conveyor")]
    return max(found)[1] if found else None


def _arrows() -> list[tuple[str, str]]:
    return sorted({(m, n) for m, targets in GRAPH.items() for t in targets
                   if (n := _node(t)) is not None and n != m})


def test_every_module_has_a_room() -> None:
    assert [m for m in GRAPH if _room(m) is None] == []
    assert set(MAY_IMPORT) == set(ROOMS)


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_room_imports_only_the_rooms_below_it(room: str) -> None:
    found = sorted(f"{m} imports {n} ({_room(n)})" for m, n in _arrows()
                   if _room(m) == room and _room(n) not in {room, *MAY_IMPORT[room]}
                   and (m, n) not in LAZY_ARROWS)
    assert not found


def _load_time_imports(path: Path) -> set[str]:
    """The conveyor modules ``path`` imports when it loads: not in a function, not for
    type checkers only."""
    package = _module_name(path) if path.name == "__init__.py" else \
        _module_name(path).rpartition(".")[0]
    found: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = (".".join([*base, node.module] if node.module else base)
                          if node.level else node.module or "")
                found.update({module, *(f"{module}.{alias.name}" for alias in node.names)})
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk([*node.body, *node.orelse, *node.finalbody,
                      *(s for h in node.handlers for s in h.body)])
            elif isinstance(node, ast.ClassDef):
                walk(node.body)

    walk(ast.parse(path.read_text(), str(path)).body)
    return {n for t in found if _in(t, "conveyor") and (n := _node(t)) is not None}


LOAD_GRAPH = {_module_name(path): _load_time_imports(path) for path in PACKAGE.rglob("*.py")}


def _loaded_by(module: str) -> set[str]:
    """Every module that loading ``module`` loads (its parent packages' ``__init__`` aside)."""
    seen, todo = set(), [module]
    while todo:
        for nxt in LOAD_GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize("arrow", sorted(LAZY_ARROWS))
def test_a_lazy_arrow_stays_lazy(arrow: tuple[str, str]) -> None:
    importer, target = arrow
    assert target in GRAPH[importer], f"{importer} no longer imports {target}: drop the entry"
    assert target not in LOAD_GRAPH[importer], f"{importer} imports {target} when it loads"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _room(m) == "routing"))
def test_loading_routing_loads_no_producer_worker_or_admin(module: str) -> None:
    loaded = sorted(m for m in _loaded_by(module)
                    if _room(m) in {"producer", "worker", "admin", "tracing", "cli"})
    assert not loaded, f"loading {module} loads {loaded}"


def test_the_load_graph_is_read() -> None:
    assert "conveyor.router" in LOAD_GRAPH["conveyor.worker.executor"]
    assert "conveyor.producer" not in LOAD_GRAPH["conveyor.tasks"]    # a lazy import
    assert "conveyor.relay.ordered" not in LOAD_GRAPH["conveyor.relay.core"]
