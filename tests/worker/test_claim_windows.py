"""Claim windows (WorkerConfig.claim_window, worker/window.py): a batch held in the
claim's transaction, its fast events written once, its slow ones leased at its end."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta

import psycopg

from conveyor import AsyncProducer, Event, Router, Worker
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, query, running, wait_all_in


async def _updates(url: str) -> int:
    """Row versions the events got after their insert: updates in the live
    partition, and the moves of finished ones into the history's days (0025),
    which count as inserts there."""
    rows = await query(url, "SELECT coalesce(sum(n_tup_upd), 0) + coalesce(sum(n_tup_ins)"
                            " FILTER (WHERE relname LIKE 'events\\_done\\_%'), 0) AS n"
                            " FROM pg_stat_user_tables WHERE schemaname = 'conveyor'"
                            " AND (relname = 'events_live' OR relname LIKE 'events\\_done\\_%')")
    return int(rows[0]["n"])


async def test_fast_events_are_written_once_by_their_window(db: str) -> None:
    seen: list[int] = []

    async def handle(event: Event) -> None:
        seen.append(event.attempt)

    ids = [await enqueue(db, "win.fast", {"n": n}) for n in range(30)]
    worker = Worker(db, _router("win.fast", handle), fast_config(claim_window=0.5))
    async with running(worker):
        await wait_all_in(db, {"succeeded"}, timeout=20)
    assert seen == [1] * 30
    for event_id in ids:
        row = await event_row(db, event_id)
        assert (row["state"], row["attempts"], row["lease_owner"]) == ("succeeded", 1, None)
        assert row["attempted_at"] <= row["finished_at"]
    assert worker.stats.succeeded == 30
    # One row version per event: the success. A leased claim writes two.
    await wait_until(lambda: _updates_are(db, 30), timeout=15, what="30 row updates counted")
    assert await query(db, "SELECT count(*) AS n FROM conveyor.claim_windows") == [{"n": 0}]


async def _updates_are(url: str, n: int) -> bool:
    return await _updates(url) == n


def _router(pattern: str, handler: object) -> Router:
    router = Router()
    router.add(pattern, handler)  # type: ignore[arg-type]
    return router


async def test_an_event_that_outlives_its_window_is_leased_and_finishes(db: str) -> None:
    release = asyncio.Event()

    async def handle(event: Event) -> None:
        if event.payload["slow"]:
            await release.wait()

    router = _router("win.*", handle)
    slow = await enqueue(db, "win.slow", {"slow": True})
    fast = await enqueue(db, "win.fast", {"slow": False})
    # The lease shorter than the handler: only heartbeats keep it (3 s: a loaded
    # machine that delays a heartbeat past a 1 s lease would lose it).
    worker = Worker(db, router, fast_config(claim_window=0.2, lease_ttl=3.0))
    async with running(worker):
        await wait_until(lambda: _state_is(db, fast, "succeeded"), timeout=10,
                         what="the fast event's success")
        row = await event_row(db, slow)
        assert (row["state"], row["attempts"], row["owner"]) == ("running", 1, worker.id)
        first = row["lease_expires_at"]

        async def renewed_past_first() -> bool:
            row = await event_row(db, slow)
            assert (row["state"], row["owner"]) == ("running", worker.id)
            return bool(row["lease_expires_at"] > first + timedelta(seconds=1.5))
        # Past the first lease's end: the heartbeat renews it like any lease.
        await wait_until(renewed_past_first, timeout=10, what="the lease renewed")
        release.set()
        await wait_until(lambda: _state_is(db, slow, "succeeded"), timeout=10,
                         what="the slow event's success")
    assert (await event_row(db, slow))["attempts"] == 1
    assert worker.stats.lost == 0


async def _state_is(url: str, event_id: int, state: str) -> bool:
    return (await event_row(url, event_id))["state"] == state


async def test_a_retry_written_by_a_window_spends_its_attempt(db: str) -> None:
    async def handle(event: Event) -> None:
        if event.attempt == 1:
            raise RuntimeError("first attempt fails")

    event_id = await enqueue(db, "win.retry")
    worker = Worker(db, _router("win.retry", handle), fast_config(claim_window=0.5))
    async with running(worker):
        await wait_all_in(db, {"succeeded"}, timeout=20)
    row = await event_row(db, event_id)
    assert row["attempts"] == 2
    assert [(e["attempt"], e["error"]) for e in row["errors"]] == [
        (1, "RuntimeError: first attempt fails")]


async def test_an_event_a_dead_window_held_is_counted_and_parked_at_its_last(db: str) -> None:
    calls: list[tuple[str, int]] = []

    async def handle(event: Event) -> None:
        calls.append((event.payload["name"], event.attempt))

    again = await enqueue(db, "win.crashed", {"name": "again"}, max_attempts=3)
    spent = await enqueue(db, "win.crashed", {"name": "spent"}, max_attempts=1)
    # A window that never committed held both: its worker died.
    await query(db, "INSERT INTO conveyor.claim_windows (worker, window_no, ids)"
                    " VALUES (%s, 1, %s)", (str(uuid.uuid4()), [again, spent]))
    worker = Worker(db, _router("win.crashed", handle), fast_config(claim_window=0.5))
    async with running(worker):
        await wait_all_in(db, {"succeeded", "failed"}, timeout=20)
    assert calls == [("again", 2)]
    row = await event_row(db, again)
    assert (row["state"], row["attempts"]) == ("succeeded", 2)
    assert [e["attempt"] for e in row["errors"]] == [1]
    row = await event_row(db, spent)
    assert (row["state"], row["attempts"]) == ("failed", 1)
    assert "its claim window never committed" in row["last_error"]


async def test_an_idle_worker_claims_on_its_fetch_connection_only(db: str) -> None:
    async def handle(event: Event) -> None:
        pass

    # Only the enqueues' wakes claim: a poll that claimed an event before its
    # NOTIFY came, or the listener's wake on connecting after a poll's claim,
    # claims at once on a second connection while the first window is open
    # (the design: a wake never waits), which a loaded machine once showed.
    worker = Worker(db, _router("win.idle", handle), fast_config(claim_window=0.2,
                                                                 poll_interval=60.0))
    windows = worker.claims.windows
    assert windows is not None

    async def closed() -> bool:
        return windows.open_windows == 0

    async with running(worker):
        await _idle_after_listening(worker)
        for _ in range(3):
            await enqueue(db, "win.idle")
            await wait_all_in(db, {"succeeded"}, timeout=10)
            # Its commit is seen before its window lets go of the connection.
            await wait_until(closed, timeout=10, what="the window closed")
        sessions = await query(db, "SELECT application_name AS name FROM pg_stat_activity"
                                   " WHERE datname = current_database()")
        names = {row["name"] for row in sessions}
        # The second claim connection is for a window claimed while another is open.
        assert {"conveyor-fetch", "conveyor-record"} <= names
        assert "conveyor-window" not in names


async def _idle_after_listening(worker: Worker) -> None:
    """Wait until the worker listens and a claim since has found nothing: the
    listener's wake on connecting (which claims at once, on a second
    connection if a window is open) has come and gone. The claim waited for
    is woken here: the listener's own may have ended before this looks."""
    await asyncio.wait_for(worker.listener.connected.wait(), 10)
    listening = time.monotonic()
    worker.claims.wake()

    async def idle_since_listening() -> bool:
        return worker.stats.last_empty_claim_at > listening
    await wait_until(idle_since_listening, timeout=10, what="an empty claim after LISTEN")


async def test_a_heartbeat_while_a_window_records_its_batch_abandons_nothing(db: str) -> None:
    # The slots of a held claim are taken before its record is written (a round
    # trip on another connection); a heartbeat in between read its events as
    # leased ones, found them pending and locked, and abandoned them as lost: a
    # loaded machine's SIGKILL storm ran 22 of them twice (the cancelled call,
    # then a new claim).
    calls: list[tuple[int, int]] = []

    async def handle(event: Event) -> None:
        calls.append((event.id, event.attempt))

    ids = {await enqueue(db, "win.race", {"n": n}) for n in range(3)}
    worker = Worker(db, _router("win.race", handle), fast_config(claim_window=0.5))
    async with await psycopg.AsyncConnection.connect(db) as blocker, \
            await psycopg.AsyncConnection.connect(db, autocommit=True) as beat:
        # The window's record waits behind this lock, its slots already taken.
        await blocker.execute("LOCK TABLE conveyor.claim_windows IN SHARE MODE")
        claim = asyncio.create_task(worker.run_once())
        try:
            await wait_until(lambda: _slots_taken(worker, 3), timeout=10,
                             what="the held claim's slots taken")
            await worker.maintenance.lease.run_once(beat)
            assert worker.stats.lost == 0
        finally:
            await blocker.rollback()
        assert await asyncio.wait_for(claim, 20) == 3
    await worker.close()
    assert sorted(calls) == sorted((event_id, 1) for event_id in ids)
    for event_id in ids:
        row = await event_row(db, event_id)
        assert (row["state"], row["attempts"]) == ("succeeded", 1)


async def _slots_taken(worker: Worker, n: int) -> bool:
    return len(worker.running) == n


async def test_an_outcome_that_comes_while_its_window_commits_is_written_after_it(db: str) -> None:
    # The window's commit leases its unfinished events; an outcome that came
    # while it was on its way went to the completer at once, whose write read
    # the row still pending (the commit not landed), matched nothing and was
    # dropped as stale: the lease then ran out and the event ran again.
    calls: list[int] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def handle(event: Event) -> None:
        calls.append(event.attempt)
        started.set()
        await release.wait()

    event_id = await enqueue(db, "win.late")
    worker = Worker(db, _router("win.late", handle), fast_config(claim_window=1.0, lease_ttl=3.0))
    async with running(worker), await psycopg.AsyncConnection.connect(db) as blocker:
        await asyncio.wait_for(started.wait(), 10)
        # The window's record is written (its handler runs); its commit, which
        # deletes the record, now waits behind this lock.
        await blocker.execute("LOCK TABLE conveyor.claim_windows IN SHARE MODE")
        await wait_until(lambda: _window_commit_waits(db), timeout=10,
                         what="the window's commit waiting for the lock")
        release.set()
        await wait_until(lambda: _acknowledgements_tried(worker), timeout=10,
                         what="the outcome taken")
        await blocker.rollback()
        await wait_until(lambda: _state_is(db, event_id, "succeeded"), timeout=20,
                         what="the event's success")
    assert calls == [1]
    row = await event_row(db, event_id)
    assert (row["state"], row["attempts"]) == ("succeeded", 1)
    assert worker.completer.stale == 0


async def _window_commit_waits(url: str) -> bool:
    rows = await query(url, "SELECT count(*) AS n FROM pg_stat_activity"
                            " WHERE wait_event_type = 'Lock'"
                            " AND application_name IN ('conveyor-fetch', 'conveyor-window')")
    return bool(rows[0]["n"])


async def _acknowledgements_tried(worker: Worker) -> bool:
    # The handler has returned, and its outcome is not (or no longer) on its
    # way through the completer.
    return (all(task.done() for task in worker.running.tasks())
            and not worker.completer.unacknowledged())


async def test_a_poll_while_a_window_is_open_waits_for_it(db: str) -> None:
    # A poll is a safety net: an idle worker whose poll came while its one
    # window was open claimed on a second connection, opened for it. The
    # window here is opened by a poll too.
    started, release = asyncio.Event(), asyncio.Event()

    async def handle(event: Event) -> None:
        started.set()
        await release.wait()

    config = fast_config(claim_window=10.0)
    worker = Worker(db, _router("win.poll", handle), config)
    async with running(worker):
        # Only the poll may claim the event (see _idle_after_listening).
        await _idle_after_listening(worker)
        # Written without a wake-up: a poll claims it, and a NOTIFY that came
        # after that claim would claim at once, on a second connection.
        async with await psycopg.AsyncConnection.connect(db) as conn:
            await conn.execute("SET LOCAL conveyor.notify = 'off'")
            await AsyncProducer().enqueue(conn, "win.poll", {})
            await conn.commit()
        await asyncio.wait_for(started.wait(), 10)
        held_since = time.monotonic()

        async def polls_passed() -> bool:
            return time.monotonic() - held_since > 3 * config.poll_interval
        await wait_until(polls_passed, timeout=10, what="three polls while the window is open")
        release.set()
        await wait_all_in(db, {"succeeded"}, timeout=10)
        sessions = await query(db, "SELECT application_name AS name FROM pg_stat_activity"
                                   " WHERE datname = current_database()")
    assert "conveyor-window" not in {row["name"] for row in sessions}
