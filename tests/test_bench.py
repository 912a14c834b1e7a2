"""``conveyor bench --quick --json`` runs end to end on a fresh database.

Only shape and sanity are checked here: speed is for the benchmark itself,
never a test threshold on a shared machine.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from conveyor.config import BATCH_SIZE_DEFAULT
from conveyor_tools.bench import scratch
from conveyor_tools.bench.app import NOOP_TOPIC
from conveyor_tools.bench.baseline import RawVariant, claim_sql
from conveyor_tools.bench.measure import percentile, raw_backlog
from conveyor_tools.bench.report import format_table
from conveyor_tools.bench.suite import Plan, worker_commit

MakeDb = Callable[..., contextlib.AbstractContextManager[str]]

# serial: a benchmark: it loads both cores.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

RATES = ("enqueue_single_per_s", "enqueue_batch_per_s", "enqueue_batch_in_tx_per_s",
         "enqueue_batch_ids_per_s",
         "raw_copy_per_s", "raw_single_per_s",
         "drain_default_per_s", "drain_window_per_s", "drain_best_per_s",
         "raw_drain_same_batch_per_s",
         "raw_drain_best_per_s",
         "enqueue_one_tx_per_s", "raw_insert_one_tx_per_s", "enqueue_autocommit_per_s",
         "raw_insert_autocommit_per_s", "outbox_business_per_s",
         "outbox_business_enqueue_per_s", "outbox_business_raw_insert_per_s",
         "raw_drain_strongest_per_s", "raw_drain_same_commit_per_s")
OTHERS = ("wake_p50_ms", "wake_p99_ms", "raw_wake_p50_ms", "raw_wake_p99_ms", "worker_rss_mb",
          "enqueue_single_ratio",
          "enqueue_batch_ratio", "enqueue_batch_in_tx_ratio", "enqueue_batch_ids_ratio",
          "drain_default_ratio",
          "drain_best_ratio", "enqueue_one_tx_ratio", "enqueue_autocommit_ratio",
          "drain_default_vs_best_ratio", "worker_cpu_us_per_event", "raw_cpu_us_per_event",
          "worker_cpu_ratio", "drain_default_wal_ratio", "drain_best_wal_ratio",
          "enqueue_bulk_wal_bytes", "enqueue_bulk_wal_ratio", "enqueue_single_wal_ratio")
# ratio: (numerator, denominator), each a key or a path into the result
QUOTIENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "enqueue_single_ratio": (("enqueue_single_per_s",), ("raw_single_per_s",)),
    "enqueue_one_tx_ratio": (("enqueue_one_tx_per_s",), ("raw_insert_one_tx_per_s",)),
    "enqueue_autocommit_ratio": (("enqueue_autocommit_per_s",), ("raw_insert_autocommit_per_s",)),
    "drain_default_ratio": (("drain_default_per_s",), ("raw_drain_same_commit_per_s",)),
    "drain_window_ratio": (("drain_window_per_s",), ("raw_drain_same_commit_per_s",)),
    "drain_best_ratio": (("drain_best_per_s",), ("raw_drain_strongest_per_s",)),
    "drain_default_vs_best_ratio": (("drain_default_per_s",), ("drain_best_per_s",)),
    "worker_cpu_ratio": (("worker_cpu_us_per_event",), ("raw_cpu_us_per_event",)),
    "drain_default_wal_ratio": (("wal_bytes_per_event", "drain_default"),
                                ("wal_bytes_per_event", "raw_same_commit")),
    "drain_best_wal_ratio": (("wal_bytes_per_event", "drain_best"),
                             ("wal_bytes_per_event", "raw_strongest")),
    "enqueue_bulk_wal_ratio": (("wal_bytes_per_event", "enqueue_bulk"),
                               ("wal_bytes_per_event", "raw_copy")),
    "enqueue_single_wal_ratio": (("wal_bytes_per_event", "enqueue_single"),
                                 ("wal_bytes_per_event", "raw_insert_one_tx")),
}
NEW_TARGETS = {"drain_default_vs_best_ratio", "worker_cpu_ratio", "drain_default_wal_ratio",
               "drain_best_wal_ratio", "enqueue_one_tx_ratio", "enqueue_autocommit_ratio",
               "outbox_marginal_cost_ratio", "enqueue_bulk_wal_bytes"}
VARIANT = re.compile(r"^(mark|delete) batch=[1-9][0-9]* commit=[a-z_]+$")


def _bench(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
         "bench", "--quick", "--json", *extra],
        capture_output=True, text=True, timeout=240, check=False)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _at(result: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        result = result[key]
    return result


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


@pytest.fixture(scope="module")
def quick_run(make_db: MakeDb, template_db: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """One ``bench --quick --json`` on a database of its own: its URL and the JSON object."""
    with make_db(prefix="conveyor_bench_", template=template_db) as url:
        done = _bench(url)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)  # exactly one JSON object on stdout
        assert isinstance(result, dict)
        yield url, result


def test_quick_json_reports_every_figure_and_leaves_nothing_behind(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    url, result = quick_run
    for key in RATES + OTHERS:
        assert _positive(result.get(key)), f"{key} = {result.get(key)!r}"
    settings = result["drain_best_settings"]
    assert _positive(settings["batch_size"]) and _positive(settings["concurrency"])
    assert result["wake_missing"] == 0
    # The chord's callback starts after its last member and within the
    # dependency service's longest wait (2 s) plus a loaded machine's claim.
    assert result["chord_members"] == 1_000
    assert 0 < result["chord_callback_after_last_ms"] < 10_000
    assert 0 < result["chord_members_done_s"] < result["chord_total_s"]
    assert set(result["targets"]) >= {"drain_default_ratio", "drain_best_ratio",
                                      "enqueue_batch_ratio", "wake_p50_ms", "wake_p99_ms",
                                      "worker_rss_mb"} | NEW_TARGETS
    schemas, connections = _leftovers(url)
    assert schemas == []
    assert connections == 0


def test_ratios_are_the_quotients_of_the_figures_they_compare(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, result = quick_run
    for ratio, (mine, theirs) in QUOTIENTS.items():
        expected = _at(result, mine) / _at(result, theirs)
        assert result[ratio] == pytest.approx(expected, rel=2e-3, abs=2e-4), ratio
        assert result["targets"].get(ratio, {"value": result[ratio]})["value"] == result[ratio]
    # The one-transaction pair is the old single-event pair under its new name.
    assert result["enqueue_single_per_s"] == result["enqueue_one_tx_per_s"]
    assert result["raw_single_per_s"] == result["raw_insert_one_tx_per_s"]


def _rounding_us(rate: float) -> float:
    """How far 1e6 / rate can move when the report rounds ``rate`` (report.rounded)."""
    half_unit = 0.05 if abs(rate) >= 100 else 0.00005
    return 1e6 * half_unit / (abs(rate) - half_unit) ** 2


def test_outbox_cost_is_what_each_event_adds_to_the_business_transaction(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, result = quick_run
    business = 1e6 / result["outbox_business_per_s"]
    keys = {"enqueue": "outbox_business_enqueue_per_s",
            "raw_insert": "outbox_business_raw_insert_per_s"}
    added = {shape: 1e6 / result[key] - business for shape, key in keys.items()}
    # The report computes from the measured rates, then rounds them (1 decimal from
    # 100/s): recomputing from the rounded rates is off by up to 1e6 * 0.05 / rate**2
    # per rate, which the fixed rel=2e-3 missed on a loaded machine (rates of a few
    # hundred a second: 185.2 reported, 186.33 recomputed).
    slack = {shape: _rounding_us(result[key]) + _rounding_us(result["outbox_business_per_s"])
             + 0.05 for shape, key in keys.items()}
    for shape, want in added.items():
        got = result["outbox_marginal_us"][shape]
        assert abs(got - want) <= max(slack[shape], 2e-3 * abs(want), 0.05), (shape, got, want)
    ratio = result["outbox_marginal_cost_ratio"]
    if added["raw_insert"] > 0:
        rel = slack["enqueue"] / abs(added["enqueue"]) + slack["raw_insert"] / added["raw_insert"]
        assert ratio == pytest.approx(added["enqueue"] / added["raw_insert"],
                                      rel=max(rel, 5e-3), abs=2e-4)
    else:  # noise above the effect: no ratio, and the target is not met
        assert ratio is None and result["targets"]["outbox_marginal_cost_ratio"]["met"] is False


def test_strongest_raw_drain_is_the_fastest_finalist_of_the_search(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, result = quick_run
    variants = result["runs"]["raw_drain_variants"]
    assert {(v["finish"], v["commit"]) for v in variants} == {
        (finish, commit) for finish in ("mark", "delete") for commit in ("server", "off")}
    assert {v["batch"] for v in variants} >= {BATCH_SIZE_DEFAULT, 1000}
    for v in variants:
        assert VARIANT.match(v["variant"]), v
        assert _positive(v["per_s"]) and _positive(v["wal_bytes_per_event"]), v
    finalists = result["runs"]["raw_drain_finalists"]
    fastest = sorted(variants, key=lambda v: v["per_s"], reverse=True)
    assert [f["variant"] for f in finalists] == [
        v["variant"] for v in fastest[:result["plan"]["raw_finalists"]]]
    strongest = max(finalists, key=lambda f: f["median_per_s"])
    assert result["raw_drain_strongest_variant"] == strongest["variant"]
    assert result["raw_drain_strongest_per_s"] == strongest["median_per_s"]
    assert len(result["runs"]["raw_drain_strongest"]) == result["plan"]["reps"]


def test_defaults_are_compared_with_the_raw_loop_at_the_workers_commit(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, result = quick_run
    commit = result["worker_synchronous_commit"]
    assert commit == worker_commit() or (commit == "server" and worker_commit() is None)
    assert result["raw_drain_same_commit_variant"] == (
        f"mark batch={BATCH_SIZE_DEFAULT} commit={commit}")
    assert len(result["runs"]["raw_drain_same_commit"]) == result["plan"]["reps"]
    table = format_table(result)
    assert result["raw_drain_same_commit_variant"] in table
    assert result["raw_drain_strongest_variant"] in table


def test_wal_and_cpu_per_event_are_plausible(quick_run: tuple[str, dict[str, Any]]) -> None:
    """Every drained event writes at least its claim's new tuple version, and none
    writes kilobytes (a fill counted in would: its rows and FPIs); CPU per
    event is microseconds, not milliseconds."""
    _, result = quick_run
    for who, wal in result["wal_bytes_per_event"].items():
        assert 50 < wal < 10_000, (who, wal)
    for key in ("worker_cpu_us_per_event", "raw_cpu_us_per_event"):
        assert 0 < result[key] < 1000, (key, result[key])


def test_the_windowed_drain_runs_beside_the_defaults(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    """The drain at defaults with claim windows is measured as often as the defaults
    (its WAL per event is proven deterministically by test_hot_path_counts)."""
    _, result = quick_run
    assert len(result["runs"]["drain_window"]) == result["plan"]["reps"]
    assert result["drain_window_seconds"] > 0
    assert "claim window" in format_table(result)


@pytest.mark.parametrize("system", ["conveyor", "raw"])
def test_fill_reads_the_wal_position_after_its_own_rows(fresh_db: str, system: str) -> None:
    """WAL counted from the position a fill returns is the drain's: the fill's rows come before."""
    schemas = scratch.schemas_for("conveyor_walprobe")
    fill = scratch.fill_conveyor if system == "conveyor" else scratch.fill_raw
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        scratch.create(admin, schemas)
        try:
            before = scratch.wal_lsn(admin)
            lsn = fill(fresh_db, getattr(schemas, system), NOOP_TOPIC, 2_000)
            after_fill = scratch.wal_since(admin, lsn)  # the commit record, little else
            written = scratch.wal_since(admin, before) - after_fill
        finally:
            scratch.drop(admin, schemas)
    assert written > 2_000 * 60  # at least a heap tuple per row
    assert after_fill < written / 20


def test_the_raw_loop_claims_from_its_index_from_the_first_claim(fresh_db: str) -> None:
    """The baseline's backlog is analyzed before ``go``: planned from the empty
    table's statistics, its first claims read and sorted the whole backlog."""
    schemas = scratch.schemas_for("conveyor_rawplan")
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        scratch.create(admin, schemas)
        try:
            scratch.settle(admin, schemas.raw)      # as before every drain: an empty table
            raw_backlog(admin, fresh_db, schemas.raw, 20_000)
            with psycopg.connect(fresh_db) as drainer:
                plan = drainer.execute("EXPLAIN (FORMAT JSON) " + claim_sql(schemas.raw),
                                       (BATCH_SIZE_DEFAULT,), prepare=False).fetchone()
        finally:
            scratch.drop(admin, schemas)
    assert plan is not None
    text = json.dumps(plan[0])
    assert '"Index Name": "events_claim_idx"' in text
    assert '"Node Type": "Sort"' not in text


def test_raw_variant_survives_the_command_line() -> None:
    for variant in Plan.from_args(20_000, quick=False).raw_variants():
        assert RawVariant.from_argv(variant.argv()) == variant
        assert VARIANT.match(variant.label)
    assert RawVariant.from_argv(["100"]) == RawVariant("mark", 100, None)


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


def test_quick_observability_measures_metrics_and_tracing_beside_a_plain_worker(
        make_db: MakeDb, template_db: str) -> None:
    with make_db(prefix="conveyor_bench_", template=template_db) as url:
        done = _bench(url, "--observability")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert _leftovers(url) == ([], 0)
    for kind in ("plain", "plain_head_sampled", "metrics", "tracing", "tracing_sampled"):
        row = result[f"drain_{kind}"]
        assert _positive(row["per_s"]) and _positive(row["worker_cpu_us_per_event"]), row
        assert len(row["runs_per_s"]) == 1
    for kind in ("metrics", "tracing", "tracing_sampled"):
        assert result[f"drain_{kind}_ratio"] == pytest.approx(
            result[f"drain_{kind}"]["per_s"] / result["drain_plain"]["per_s"], rel=1e-3)
    assert result["drain_tracing_sampled_same_rows_ratio"] == pytest.approx(
        result["drain_tracing_sampled"]["per_s"] / result["drain_plain_head_sampled"]["per_s"],
        rel=1e-3)
    # The 1 % sampler is judged against a plain worker draining the same rows.
    assert "drain_tracing_sampled_ratio" not in result["targets"]
    for key in ("drain_metrics_ratio", "drain_tracing_ratio",
                "drain_tracing_sampled_same_rows_ratio"):
        target = result["targets"][key]
        assert target["value"] == result[key]
        assert target["met"] == (target["value"] >= float(target["target"].split()[1]))
    for name in ("all", "sampled_1pct"):
        assert _positive(result["sdk_span_us"][name]), result["sdk_span_us"]
        assert _positive(result["tracing_middleware_us"][name]), result["tracing_middleware_us"]
        assert result["tracing_middleware_beyond_sdk_us"][name] == pytest.approx(
            result["tracing_middleware_us"][name] - result["sdk_span_us"][name], abs=0.11)
    # What tracing adds beyond the SDK's span: the worker's added CPU less the span's.
    assert result["tracing_beyond_sdk_us_per_event"] == pytest.approx(
        result["tracing_cpu_us_per_event_added"] - result["sdk_span_us"]["all"], abs=0.11)
    target = result["targets"]["tracing_middleware_beyond_sdk_us"]
    assert target["target"] == "<= 5"
    assert target["value"] == result["tracing_middleware_beyond_sdk_us"]["all"]
    assert target["met"] == (target["value"] <= 5)
