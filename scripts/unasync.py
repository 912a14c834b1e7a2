"""Generate Conveyor's sync twins from their async sources.

The async module is the one people edit; its sync twin is generated from it
by rewriting words: ``async def`` becomes ``def``, ``await`` goes, and each
async name in :data:`NAMES` becomes its sync twin (``AsyncAdmin`` ->
``Admin``, ``run_async`` -> ``run``), in code and docstrings alike. The same
idea as httpcore's scripts/unasync.py and psycopg's tools/async_to_sync.py,
kept to words so a reader can predict the output from the input.

One directive: a source line ``# unasync: <code>`` becomes ``<code>`` in the
sync twin, untouched; it lets a generated public module re-export its async
twin (``from conveyor.admin_async import AsyncAdmin as AsyncAdmin``). Inside
an import group, the blank line isort puts before the comment goes with it.

Usage::

    python scripts/unasync.py           # rewrite every generated file
    python scripts/unasync.py --check   # exit 1 naming each stale file (CI runs this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Every async source and the sync file generated from it, relative to the repo root.
ALL_INPUTS: dict[str, str] = {
    "src/conveyor/admin_async.py": "src/conveyor/admin.py",
    "src/conveyor/admin_controls_async.py": "src/conveyor/admin_controls.py",
    "src/conveyor/admin_workflows_async.py": "src/conveyor/admin_workflows.py",
    "src/conveyor/admin_history_async.py": "src/conveyor/admin_history.py",
    "src/conveyor/admin_results_async.py": "src/conveyor/admin_results.py",
    "src/conveyor/schema/migrator_async.py": "src/conveyor/schema/migrator.py",
    "src/conveyor/producer_async.py": "src/conveyor/producer.py",
    "src/conveyor/db/connect_async.py": "src/conveyor/db/connect.py",
    "src/conveyor/db/execute_async.py": "src/conveyor/db/execute.py",
    "src/conveyor/testing/assertions_async.py": "src/conveyor/testing/assertions.py",
    "src/conveyor/testing/working_async.py": "src/conveyor/testing/working.py",
    "src/conveyor/workflow/publisher_async.py": "src/conveyor/workflow/publisher.py",
    "src/conveyor/completion_async.py": "src/conveyor/completion.py",
}

# Async name -> sync name, replaced as whole words.
NAMES: dict[str, str] = {
    "AsyncAdmin": "Admin",
    "AsyncAdminControls": "AdminControls",
    "AsyncAdminWorkflows": "AdminWorkflows",
    "AsyncAdminHistory": "AdminHistory",
    "AsyncAdminResults": "AdminResults",
    "AsyncMigrator": "Migrator",
    "AsyncProducer": "Producer",
    "AsyncCommittingProducer": "CommittingProducer",
    "AsyncConnection": "Connection",
    "AsyncCursor": "Cursor",
    "AsyncIterator": "Iterator",
    "run_async": "run",
    "run_past_moves_async": "run_past_moves",
    "execute_past_moves_async": "execute_past_moves",
    "complete_async": "complete",
    "connect_for_statements_async": "connect_for_statements",
    "connect_async": "connect",
    "behind_pooler_async": "behind_pooler",
    "assert_enqueued_async": "assert_enqueued",
    "refute_enqueued_async": "refute_enqueued",
    "_found_async": "_found",
    "work_event_async": "work_event",
    "_run_async": "_run",
    "AsyncWorkflowPublisher": "WorkflowPublisher",
    "_PublishAsync": "_Publish",
    "_fetch_async": "_fetch",
    "_run_flow_async": "_run_flow",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "aclose": "close",
}

HEADER = "# Generated from {source} by scripts/unasync.py; DO NOT EDIT.\n"

_KEYWORDS = re.compile(r"\basync (def|with|for)\b")
_AWAIT = re.compile(r"\bawait ")
# Not in a file name: "connect_async.py" names the source, in either twin.
_NAMES = re.compile(r"\b(" + "|".join(map(re.escape, NAMES)) + r")\b(?!\.py\b)")
_DIRECTIVE = re.compile(r"^(\s*)# unasync: (.*)$")


def unasync_line(line: str) -> str:
    """One source line in its sync form."""
    directive = _DIRECTIVE.match(line)
    if directive:
        return directive[1] + directive[2]
    line = _KEYWORDS.sub(r"\1", line)
    line = _AWAIT.sub("", line)
    return _NAMES.sub(lambda m: NAMES[m[1]], line)


def _package(line: str) -> str | None:
    """The top-level package an import line imports from."""
    match = re.match(r"\s*(?:from|import) (\w+)", line)
    return match[1] if match else None


def generate(source_text: str, source: str) -> str:
    """The whole sync file for ``source_text``, with its DO NOT EDIT header."""
    out: list[str] = []
    for line in source_text.split("\n"):
        directive = _DIRECTIVE.match(line)
        if directive and len(out) > 1 and not out[-1] and _package(out[-2]) == _package(directive[2]):
            out.pop()   # isort wants a blank line before a comment, not inside an import group
        out.append(unasync_line(line))
    return HEADER.format(source=source) + "\n".join(out)


def stale(root: Path) -> list[str]:
    """The generated files that differ from what their sources generate now."""
    out = []
    for source, target in ALL_INPUTS.items():
        wanted = generate((root / source).read_text("utf-8"), source)
        path = root / target
        if not path.exists() or path.read_text("utf-8") != wanted:
            out.append(target)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a generated file is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root")
    args = parser.parse_args(argv)
    root: Path = args.root
    outdated = stale(root)
    if args.check:
        for target in outdated:
            source = next(s for s, t in ALL_INPUTS.items() if t == target)
            print(f"{target} is stale: run python scripts/unasync.py"
                  f" (after editing {source}, not {target})", file=sys.stderr)
        return 1 if outdated else 0
    for source, target in ALL_INPUTS.items():
        if target in outdated:
            (root / target).write_text(generate((root / source).read_text("utf-8"), source),
                                       "utf-8")
            print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
