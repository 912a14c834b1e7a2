"""``conveyor bench --consumers --quick --json`` runs end to end (no database).

Only shape and sanity are checked here: speed is for the benchmark itself,
never a test threshold on a shared machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

# In the parallel tier, unlike the database benchmarks (tests/test_bench.py): it
# asserts no speed and no figure another process could change, and its workbook
# children and SMTP sink run one at a time beside it.
pytestmark = pytest.mark.slow


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


CONSUMER_RATES = ("xlsx_20k_rows_per_s", "openpyxl_20k_rows_per_s", "xlsx_100k_rows_per_s",
                  "openpyxl_100k_rows_per_s", "xlsx_20k_rss_mb", "openpyxl_20k_rss_mb",
                  "xlsx_100k_rss_mb", "openpyxl_100k_rss_mb", "xlsx_speedup_20k",
                  "xlsx_speedup_100k", "emails_per_s_reused", "emails_per_s_per_connection",
                  "emails_plain_per_s_reused", "emails_plain_per_s_per_connection")
HOSTILE = ("zip_bomb", "zip_bomb_lying_size", "many_entries", "billion_laughs", "xxe")


def test_quick_consumer_bench_reports_every_figure() -> None:
    """``bench --consumers`` needs no database; shape and sanity only, no speed thresholds."""
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "bench", "--consumers", "--quick", "--json"],
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # exactly one JSON object on stdout
    assert isinstance(result, dict)
    for key in CONSUMER_RATES:
        assert _positive(result.get(key)), f"{key} = {result.get(key)!r}"
    assert set(result["hostile"]) >= set(HOSTILE)
    for name, figures in result["hostile"].items():
        assert figures["refused"] is True, (name, figures)
        assert isinstance(figures["seconds"], int | float) and figures["seconds"] >= 0
        assert isinstance(figures["extra_mb"], int | float)
        assert figures["reason"] and "\n" not in figures["reason"]
    assert result["plan"]["quick"] is True
    assert set(result["targets"]) >= {"xlsx_speedup_100k", "xlsx_100k_rss_mb", "xlsx_rss_growth_mb",
                                      "hostile_all_refused"}
