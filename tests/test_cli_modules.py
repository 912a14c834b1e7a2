"""The CLI's modules form a tree: no command module imports another one back.

Before, ``cli/commands.py`` and ``cli/multi.py`` imported each other (hidden
behind imports inside functions); process plumbing now lives in
``cli/process.py`` and ``cli/main.py`` is the only module that gathers commands.
"""

from __future__ import annotations

from test_layers import GRAPH


def _cli_edges() -> dict[str, set[str]]:
    return {m: {t for t in targets if t.startswith("conveyor.cli.") and t in GRAPH}
            for m, targets in GRAPH.items() if m.startswith("conveyor.cli")}


def test_the_cli_modules_import_each_other_without_a_cycle() -> None:
    edges = _cli_edges()
    assert len(edges) >= 8
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, " -> ".join([*path, module])
        if module in done:
            return
        for target in edges.get(module, ()):
            visit(target, [*path, module])
        done.add(module)

    for module in edges:
        visit(module, [])


def test_only_main_gathers_the_commands() -> None:
    command_modules = {"conveyor.cli.commands", "conveyor.cli.events",
                       "conveyor.cli.worker_command", "conveyor.cli.worker_multi_command",
                       "conveyor.cli.workflow_command", "conveyor.cli.relay_command"}
    importers = {m for m, targets in _cli_edges().items() if targets & command_modules}
    assert importers == {"conveyor.cli.main"}
