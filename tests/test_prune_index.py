"""Retention pruning reads only what it deletes: events_prunable_idx (migration 0003).

Failed events are kept until an operator acts, so a queue can hold a great many
old ones. events_finished_idx (0001) held them next to the rows pruning
deletes, and every prune pass walked all of them; events_prunable_idx holds
succeeded and cancelled rows only. The module database holds 50,000 failed
rows older than the retention, 20,000 succeeded rows younger than it and 40
prunable rows, so a plan that touched the failed rows would show it in its
row counts and buffers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import psycopg
import pytest
from psycopg import sql

from conveyor import Admin, Migrator
from conveyor.db.named_queries import queries_for
from conveyor.schema import migrator_core as migrator_module
from conveyor.schema.migrator import latest_version, load_migrations, migration_script
from conveyor.types import FINISHED_STATES, EventState
from query_plans import plan_session, scans

Q = queries_for("conveyor")
Conn = psycopg.Connection[Any]

DAY = 86_400
RETENTION = 15 * DAY
OLD_FAILED = 50_000
YOUNG_SUCCEEDED = 20_000
PRUNABLE = {"succeeded": 30, "cancelled": 10}
# The states the worker's prune asks for, computed as maintenance.py does.
WORKER_STATES = sorted(s.value for s in FINISHED_STATES if s is not EventState.FAILED)

# The index 0003 replaced, as 0001 created it.
OLD_INDEX = ("CREATE INDEX events_finished_idx ON conveyor.events (finished_at)"
             " WHERE finished_at IS NOT NULL")


def _fill(conn: Conn) -> None:
    conn.execute("SET conveyor.notify = 'off'")
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, max_attempts,
                                     finished_at, last_error)
        SELECT 'dead.' || g %% 7, '{}', 'failed', 1, 1,
               now() - interval '40 days' + g * interval '1 s', 'boom'
        FROM generate_series(1, %s) AS g""", (OLD_FAILED,))
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at)
        SELECT 'live', '{}', 'succeeded', 1, now() - interval '1 hour' + g * interval '1 ms'
        FROM generate_series(1, %s) AS g""", (YOUNG_SUCCEEDED,))
    for state, n in PRUNABLE.items():
        conn.execute("""
            INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at)
            SELECT 'old', '{}', %s, 1, now() - interval '20 days'
            FROM generate_series(1, %s)""", (state, n))


@pytest.fixture(scope="module")
def failed_db(make_db: Callable[..., AbstractContextManager[str]], template_db: str) -> Iterator[str]:
    """A migrated database with 50 k old failed rows and 40 prunable ones."""
    with make_db(prefix="conveyor_prune_", template=template_db) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            _fill(conn)
            conn.execute("VACUUM ANALYZE conveyor.events")
        yield url


@pytest.fixture
def big(failed_db: str) -> Iterator[Conn]:
    """A connection to the module database, in a transaction rolled back afterwards."""
    with plan_session(failed_db) as conn:
        yield conn


# ------------------------------------------------------------------ plans

def _ran(plan: Any) -> list[dict[str, Any]]:
    """The scans of an EXPLAIN ANALYZE plan that ran: a branch behind a one-time
    filter that was false shows its plan, never executed."""
    return [n for n in scans(plan) if n.get("Actual Loops", 1) > 0]


def _indexes(plan: Any) -> set[str]:
    return {n["Index Name"] for n in _ran(plan) if "Index Name" in n}


def _examined(plan: Any) -> int:
    """Rows the plan's table and index accesses produced or read and threw away."""
    return sum((n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0)
                + n.get("Rows Removed by Index Recheck", 0)) * n.get("Actual Loops", 1)
               for n in _ran(plan)
               if n["Node Type"] in ("Seq Scan", "Index Scan", "Index Only Scan",
                                     "Bitmap Heap Scan"))


def _buffers(plan: dict[str, Any]) -> int:
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


def _pages(conn: Conn) -> int:
    row = conn.execute("SELECT relpages FROM pg_class"
                       " WHERE oid = 'conveyor.events_live'::regclass").fetchone()
    assert row is not None and row[0] > 0
    return int(row[0])


# About 3 buffers per deleted row (its primary-key descent, its heap page)
# plus a few for the new index; the failed rows alone fill hundreds of pages.
BUFFER_BOUND = 8 * sum(PRUNABLE.values())

PRUNE_PARAMS = {"older_than": RETENTION, "states": WORKER_STATES, "limit": 5000}
PRUNE_TYPES = {"older_than": "float8", "states": "text[]", "limit": "int"}


def _explain_prune(conn: Conn, *, generic: bool) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of one prune batch; ``generic`` forces the plan a
    prepared statement falls back to (the worker's connection prepares its queries),
    planned without knowing the states."""
    if not generic:
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + Q["event_prune"],
                           PRUNE_PARAMS).fetchone()
    else:
        text = Q["event_prune"]
        for i, name in enumerate(PRUNE_PARAMS, 1):
            text = text.replace(f"%({name})s", f"${i}")
        assert "%(" not in text
        types = ", ".join(PRUNE_TYPES[name] for name in PRUNE_PARAMS)
        conn.execute(f"PREPARE prune_generic ({types}) AS {text}".encode())
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        args = sql.SQL(", ").join(sql.Literal(v) for v in PRUNE_PARAMS.values())
        row = conn.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)"
                                   " EXECUTE prune_generic ({})").format(args)).fetchone()
        conn.execute("DEALLOCATE prune_generic")
    assert row is not None
    return dict(row[0][0]["Plan"])


@pytest.mark.parametrize("generic", [False, True], ids=["custom_plan", "generic_plan"])
def test_prune_plan_reads_only_prunable_rows_among_50k_old_failed_rows(
    big: Conn, generic: bool,
) -> None:
    plan = _explain_prune(big, generic=generic)
    ran = _ran(plan)
    assert all(n["Node Type"] != "Seq Scan" for n in ran), ran
    assert _indexes(plan) == {"events_prunable_idx", "events_pkey"}, ran
    prunable = sum(PRUNABLE.values())
    # The prunable rows once through the new index, once through the primary
    # key to delete them; not one failed row, not one young succeeded row.
    assert _examined(plan) == 2 * prunable, ran
    (by_key,) = [n for n in ran if n.get("Index Name") == "events_pkey"]
    assert by_key["Actual Rows"] == prunable
    assert _buffers(plan) < BUFFER_BOUND, _buffers(plan)


def test_prune_dry_run_counts_through_the_prunable_index_past_50k_failed_rows(
    big: Conn,
) -> None:
    row = big.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + Q["event_prune_count"],
                      {"older_than": RETENTION, "states": WORKER_STATES}).fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    assert all(n["Node Type"] != "Seq Scan" for n in _ran(plan)), _ran(plan)
    assert _indexes(plan) == {"events_prunable_idx"}, _ran(plan)
    assert _examined(plan) == sum(PRUNABLE.values())      # not one failed row
    assert Admin().prune(big, older_than=RETENTION, dry_run=True) == sum(PRUNABLE.values())
    assert Admin().prune(big, older_than=RETENTION, states=["failed"],
                         dry_run=True) == OLD_FAILED


def test_old_finished_index_made_prune_walk_every_old_failed_row(big: Conn) -> None:
    """The instrument is live: against 0001's index the bounds above fail."""
    big.execute("DROP INDEX conveyor.events_prunable_idx")
    big.execute(OLD_INDEX)
    big.execute("ANALYZE conveyor.events")
    plan = _explain_prune(big, generic=False)
    assert _examined(plan) >= OLD_FAILED, scans(plan)
    assert _buffers(plan) > _pages(big) // 2 > BUFFER_BOUND


def test_prune_deletes_old_succeeded_and_cancelled_and_keeps_failed(big: Conn) -> None:
    deleted = Admin().prune(big, older_than=RETENTION, states=WORKER_STATES)
    assert deleted == sum(PRUNABLE.values())
    left = dict(big.execute("SELECT state, count(*) FROM conveyor.events GROUP BY state"
                            ).fetchall())
    assert left == {"failed": OLD_FAILED, "succeeded": YOUNG_SUCCEEDED}
    assert Admin().prune(big, older_than=RETENTION, states=WORKER_STATES) == 0


def test_status_sample_walks_the_new_index_past_the_old_failed_rows(big: Conn) -> None:
    row = big.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + Q["status_finished_sample"],
                      {"limit": 10_001}).fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    assert _indexes(plan) == {"events_prunable_idx"}, scans(plan)
    assert _examined(plan) == 10_001     # the 40 old prunable rows, then young ones
    status = Admin().status(big)
    assert status.counts["failed"] == OLD_FAILED
    assert status.estimated_states == ["succeeded", "cancelled"]


# ------------------------------------------- prune's contract, small tables

def _make(conn: Conn, state: str, days_ago: float | None) -> int:
    running = state == "running"
    row = conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at,
                                     lease_owner, lease_expires_at)
        VALUES ('p', '{}', %s, 1, now() - %s * interval '1 day',
                CASE WHEN %s THEN gen_random_uuid() END,
                CASE WHEN %s THEN now() + interval '1 minute' END)
        RETURNING id""", (state, days_ago, running, running)).fetchone()
    assert row is not None
    return int(row[0])


def _ids(conn: Conn) -> set[int]:
    return {r[0] for r in conn.execute("SELECT id FROM conveyor.events")}


def test_prune_of_every_finished_state_still_deletes_old_failed_rows(conn: Conn) -> None:
    conn.execute("DELETE FROM conveyor.events")
    old = [_make(conn, s, 20) for s in ("succeeded", "cancelled", "failed", "failed")]
    kept = {_make(conn, s, 1) for s in ("succeeded", "cancelled", "failed")}
    kept |= {_make(conn, "pending", None), _make(conn, "running", None)}
    assert Admin().prune(conn, older_than=RETENTION,
                         states=["succeeded", "cancelled", "failed"]) == len(old)
    assert _ids(conn) == kept


def test_prune_batch_limit_holds_across_both_branches(conn: Conn) -> None:
    conn.execute("DELETE FROM conveyor.events")
    for state in ("succeeded", "failed") * 3:
        _make(conn, state, 20)
    params = {"older_than": RETENTION, "states": ["cancelled", "failed", "succeeded"],
              "limit": 4}
    assert [conn.execute(Q["event_prune"], params).rowcount for _ in range(3)] == [4, 2, 0]


def test_prune_spares_an_event_retried_while_it_waits_for_the_row(fresh_db: str) -> None:
    """The batch is chosen first, then deleted by id: a row retried meanwhile is
    checked again after the retry commits, and kept."""
    with psycopg.connect(fresh_db, autocommit=True) as setup:
        event_id = _make(setup, "cancelled", 20)
    with psycopg.connect(fresh_db) as operator, \
            psycopg.connect(fresh_db, autocommit=True) as worker:
        operator.execute(Q["event_retry"], {"id": event_id})     # holds the row
        pid = worker.info.backend_pid
        deleted: list[int] = []
        pruning = threading.Thread(target=lambda: deleted.append(
            worker.execute(Q["event_prune"], PRUNE_PARAMS).rowcount))
        pruning.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            row = operator.execute("SELECT wait_event_type FROM pg_stat_activity"
                                   " WHERE pid = %s", (pid,)).fetchone()
            if row is not None and row[0] == "Lock":
                break
            time.sleep(0.01)
        else:
            pytest.fail("the prune never waited for the retried row")
        operator.commit()
        pruning.join(timeout=10)
        assert deleted == [0]
        state = operator.execute("SELECT state FROM conveyor.events WHERE id = %s",
                                 (event_id,)).fetchone()
        assert state == ("pending",)


# --------------------------------------------------- upgrading version 2

def _migrate_to_version_2(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(migrator_module, "load_migrations", lambda: load_migrations()[:2])
        with psycopg.connect(url, autocommit=True) as conn:
            assert [m.version for m in Migrator().apply(conn)] == [1, 2]


def _index_definitions(conn: Conn) -> dict[str, str]:
    """The table's indexes; since 0025 its live partition's, read as the table's."""
    return {name: d.replace(" ON conveyor.events_live ", " ON conveyor.events ")
            for name, d in conn.execute(
        "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index"
        " WHERE indrelid = coalesce(to_regclass('conveyor.events_live'),"
        " 'conveyor.events'::regclass) AND indisvalid AND indisready")}


@pytest.mark.parametrize("how", ["migrator", "script"])
def test_migration_0003_upgrades_a_version_2_database_with_rows(
    empty_db: str, monkeypatch: pytest.MonkeyPatch, how: str,
) -> None:
    _migrate_to_version_2(empty_db, monkeypatch)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        _fill(conn)
        conn.execute("INSERT INTO conveyor.events (topic, payload) VALUES ('q', '{}')")
        assert "conveyor.events_finished_idx" in _index_definitions(conn)
        before = conn.execute("SELECT state, count(*) FROM conveyor.events GROUP BY state"
                              " ORDER BY state").fetchall()
        if how == "migrator":
            assert [m.version for m in Migrator().apply(conn)] == list(range(3, latest_version() + 1))
        else:
            with conn.transaction():
                conn.execute(migration_script("conveyor").encode())
        assert Migrator().pending(conn) == []
        conn.execute("ANALYZE conveyor.events")

        indexes = _index_definitions(conn)
        assert "conveyor.events_finished_idx" not in indexes
        assert indexes["conveyor.events_prunable_idx"] == (
            "CREATE INDEX events_prunable_idx ON conveyor.events USING btree (finished_at)"
            " WHERE (state = ANY (ARRAY['succeeded'::text, 'cancelled'::text]))")
        assert "conveyor.events_failed_idx" in indexes
        assert conn.execute("SELECT state, count(*) FROM conveyor.events GROUP BY state"
                            " ORDER BY state").fetchall() == before

        # The queries that read events_finished_idx still read an index, and
        # the right one, on the upgraded table.
        conn.execute("BEGIN")
        conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        expected: dict[str, tuple[dict[str, Any], set[str]]] = {
            "status_finished_sample": ({"limit": 10_001}, {"events_prunable_idx"}),
            "event_prune": (PRUNE_PARAMS, {"events_prunable_idx", "events_pkey"})}
        for name, (params, wanted) in expected.items():
            row = conn.execute("EXPLAIN (FORMAT JSON) " + Q[name], params).fetchone()
            assert row is not None
            plan = row[0][0]["Plan"]
            assert all(n["Node Type"] != "Seq Scan" for n in scans(plan)), (name, plan)
            assert _indexes(plan) == wanted, (name, plan)
        status = Admin().status(conn)
        assert (status.counts["failed"], status.counts["pending"]) == (OLD_FAILED, 1)
        assert Admin().prune(conn, older_than=RETENTION,
                             states=WORKER_STATES) == sum(PRUNABLE.values())
        conn.execute("ROLLBACK")


def test_migration_0003_skips_what_was_built_concurrently_by_hand(
    empty_db: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The route docs/operations.md gives for a table too big to pause writes on."""
    _migrate_to_version_2(empty_db, monkeypatch)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        _fill(conn)
        conn.execute("CREATE INDEX CONCURRENTLY events_prunable_idx ON conveyor.events"
                     " (finished_at) WHERE state IN ('succeeded', 'cancelled')")
        conn.execute("DROP INDEX CONCURRENTLY conveyor.events_finished_idx")
        built = _index_definitions(conn)
        assert [m.version for m in Migrator().apply(conn)] == list(range(3, latest_version() + 1))
        after = _index_definitions(conn)
        # 0009 rebuilds the claim index with topic and tenant included; 0028 fills
        # the primary key's pages to the brim; the rest stand as built.
        claim, pkey = "conveyor.events_claim_idx", "conveyor.events_pkey"
        assert after[pkey] == built[pkey] + " WITH (fillfactor='100')"
        assert {name: after[name] for name in built if name not in (claim, pkey)} == {
            name: d for name, d in built.items() if name not in (claim, pkey)}
        assert "INCLUDE (topic, tenant)" in after[claim]
        assert set(after) - set(built) == {"conveyor.events_stopped_topic_idx",
                                           "conveyor.events_stopped_tenant_idx",  # 0004's
                                           "conveyor.events_fair_idx",            # 0015's
                                           "conveyor.events_relay_order_idx"}     # 0016's
