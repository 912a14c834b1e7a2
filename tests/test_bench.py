"""``conveyor bench --quick --json`` runs end to end on a fresh database.

Only shape and sanity are checked here: speed is for the benchmark itself,
never a test threshold on a shared machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest

from conveyor_tools.bench.measure import percentile

pytestmark = pytest.mark.slow

RATES = ("enqueue_single_per_s", "enqueue_batch_per_s", "enqueue_batch_in_tx_per_s",
         "enqueue_batch_ids_per_s",
         "raw_copy_per_s", "raw_single_per_s",
         "drain_default_per_s", "drain_best_per_s", "raw_drain_same_batch_per_s",
         "raw_drain_best_per_s")
OTHERS = ("wake_p50_ms", "wake_p99_ms", "raw_wake_p50_ms", "raw_wake_p99_ms", "worker_rss_mb",
          "enqueue_single_ratio",
          "enqueue_batch_ratio", "enqueue_batch_in_tx_ratio", "enqueue_batch_ids_ratio",
          "drain_default_ratio",
          "drain_best_ratio")


def _bench(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
         "bench", "--quick", "--json", *extra],
        capture_output=True, text=True, timeout=240, check=False)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _leftovers(url: str) -> tuple[list[str], int]:
    """Scratch schemas still present; other sessions on the database (given 5 s to go)."""
    with psycopg.connect(url, autocommit=True) as conn:
        schemas = [r[0] for r in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE '%bench%'")]
        others = 0
        for _ in range(50):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()").fetchone()
            others = row[0] if row else 0
            if not others:
                break
            time.sleep(0.1)
    return schemas, others


def test_quick_json_reports_every_figure_and_leaves_nothing_behind(fresh_db: str) -> None:
    done = _bench(fresh_db)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # exactly one JSON object on stdout
    assert isinstance(result, dict)
    for key in RATES + OTHERS:
        assert _positive(result.get(key)), f"{key} = {result.get(key)!r}"
    settings = result["drain_best_settings"]
    assert _positive(settings["batch_size"]) and _positive(settings["concurrency"])
    assert result["wake_missing"] == 0
    assert set(result["targets"]) >= {"drain_default_ratio", "drain_best_ratio",
                                      "enqueue_batch_ratio", "wake_p50_ms", "wake_p99_ms",
                                      "worker_rss_mb"}
    schemas, connections = _leftovers(fresh_db)
    assert schemas == []
    assert connections == 0


def test_refuses_to_drop_a_schema_it_did_not_create(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA conveyor_bench")
        conn.execute("CREATE TABLE conveyor_bench.precious (id int)")
    done = _bench(fresh_db)
    assert done.returncode == 1
    assert "not a conveyor bench scratch schema" in done.stderr
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('conveyor_bench.precious')").fetchone() != (None,)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0], 100) == 2.0


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
