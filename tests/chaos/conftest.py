"""Short chaos runs for CI: ``benchmarks/chaos.py`` as a subprocess, its JSON report checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "benchmarks" / "chaos.py"


def run_chaos(*args: str, timeout: float = 150) -> dict[str, Any]:
    """Run the chaos runner against its own private embedded PostgreSQL; its JSON report."""
    proc = subprocess.run([sys.executable, str(RUNNER), *args, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(proc.stderr[-4000:])
    assert proc.stdout.strip(), f"no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(proc.stdout)
    print(json.dumps({k: v for k, v in report.items() if k != "timeline_5s"}, indent=1))
    return report


def assert_exactly_once_where_it_counts(report: dict[str, Any]) -> None:
    c = report["check"]
    assert c["lost"] == 0, c["lost_examples"]
    assert c["unexpected"] == 0, c["unexpected_examples"]
    assert c["overlapping"] == 0, c["overlap_examples"]
    assert c["unexplained_duplicates"] == 0, c["unexplained_examples"]
    assert c["not_terminal"] == 0, c
    assert report["drained"], (report["states"], report["elapsed_s"])
    assert report["unexpected_worker_exits"] == [], report["unexpected_worker_exits"]
    assert set(report["sigterm_exit_codes"]) <= {0}, report["sigterm_exit_codes"]


@pytest.fixture
def chaos() -> Any:
    return run_chaos
