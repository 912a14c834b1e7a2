"""Stored results: a store_result route keeps what its handler returns; Admin.result / wait read it."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest

from conveyor import (
    Admin,
    AsyncAdmin,
    ConfigError,
    Event,
    EventNotFoundError,
    EventState,
    InvalidInputError,
    PermanentFailure,
    Router,
    WaitTimeoutError,
    Worker,
)
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, running

# Admin.wait re-reads the event every WAIT_RECHECK seconds (5). The tests below stretch
# that to NO_RECHECK, so that a wait ending well within it can only have been woken by
# the announcement, however long a loaded machine takes to get there.
NO_RECHECK = 120.0
WOKEN_WITHIN = 30.0


@pytest.fixture
def no_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("conveyor.admin_results_async.WAIT_RECHECK", NO_RECHECK)
    monkeypatch.setattr("conveyor.admin_results.WAIT_RECHECK", NO_RECHECK)


async def _work_all(url: str, router: Router, **config: Any) -> Worker:
    worker = Worker(url, router, fast_config(**config))
    try:
        while await worker.run_once():
            pass
    finally:
        await worker.close()
    return worker


async def test_each_kind_of_handler_stores_its_return_value(db: str) -> None:
    router = Router()

    @router.route("calc.async", store_result=True)
    async def add(event: Event) -> dict[str, Any]:
        return {"sum": event.payload["a"] + event.payload["b"], "items": [1, 2.5, None, "é"]}

    router.add("calc.thread", lambda event: event.payload["a"] * 10, store_result=True)
    router.add("calc.inline", lambda event: "inline", store_result=True, blocking=False)
    router.add("calc.none", lambda event: None, store_result=True)
    router.add("calc.unstored", lambda event: {"kept": False})

    ids = {topic: await enqueue(db, topic, {"a": 2, "b": 3})
           for topic in ("calc.async", "calc.thread", "calc.inline", "calc.none", "calc.unstored")}
    await _work_all(db, router)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        results = {topic: await AsyncAdmin().result(conn, event_id) for topic, event_id in ids.items()}
        shown = await AsyncAdmin().show(conn, ids["calc.async"])
    assert {t: (r.state, r.value, r.finished) for t, r in results.items()} == {
        "calc.async": (EventState.SUCCEEDED, {"sum": 5, "items": [1, 2.5, None, "é"]}, True),
        "calc.thread": (EventState.SUCCEEDED, 20, True),
        "calc.inline": (EventState.SUCCEEDED, "inline", True),
        "calc.none": (EventState.SUCCEEDED, None, True),
        "calc.unstored": (EventState.SUCCEEDED, None, True),
    }
    assert shown.result == {"sum": 5, "items": [1, 2.5, None, "é"]}
    assert results["calc.async"].error is None and results["calc.async"].finished_at is not None


async def test_a_typed_task_stores_what_the_function_returns(db: str) -> None:
    router = Router()

    @router.task("report.total", store_result=True)
    def total(year: int, amounts: list[int]) -> dict[str, int]:
        return {"year": year, "total": sum(amounts)}

    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        event_id = await total.aenqueue(conn, 2026, [1, 2, 39])
    await _work_all(db, router)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        assert (await AsyncAdmin().result(conn, event_id)).value == {"year": 2026, "total": 42}


async def test_retention_zero_keeps_the_rows_whose_results_were_stored(db: str) -> None:
    router = Router()
    router.add("kept", lambda event: "answer", store_result=True)
    router.add("gone", lambda event: "ignored")
    kept, gone = await enqueue(db, "kept"), await enqueue(db, "gone")
    await _work_all(db, router, retention=0.0)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        assert (await AsyncAdmin().result(conn, kept)).value == "answer"
        with pytest.raises(EventNotFoundError, match=f"event {gone} not found"):
            await AsyncAdmin().result(conn, gone)


@pytest.mark.parametrize(("returned", "message"), [
    ({1, 2}, "the result is not JSON-serialisable: Object of type set"),
    ("x" * 200, "the result is 202 bytes of JSON, the limit is 100 bytes"),
    ({"text": "nul\x00here"}, "the result contains a NUL character"),
    (float("nan"), "the result is not JSON: it contains NaN"),
])
async def test_a_result_that_cannot_be_stored_parks_the_event_with_the_reason(
        db: str, returned: object, message: str) -> None:
    calls: list[int] = []

    def handle(event: Event) -> object:
        calls.append(event.attempt)
        return returned

    router = Router()
    router.add("odd.result", handle, store_result=True, result_limit=100)
    event_id = await enqueue(db, "odd.result", max_attempts=3)
    await _work_all(db, router)
    row = await event_row(db, event_id)
    # Parked after one call: running the handler again would not make its value storable.
    assert (row["state"], calls, row["result"]) == ("failed", [1], None)
    assert row["last_error"].startswith("handler of odd.result succeeded but its result could not"
                                        " be stored: ")
    assert message in row["last_error"]


def test_routes_refuse_a_result_limit_outside_one_byte_to_one_mib() -> None:
    router = Router()
    for bad in (0, -1, 1024 * 1024 + 1, 2.5, True, "64k"):
        with pytest.raises(ConfigError, match=r"expected result_limit for 'a' to be an int from 1 "
                                              r"to 1048576, got "):
            router.add("a", print, store_result=True, result_limit=bad)  # type: ignore[arg-type]
    assert router.add("a", print, store_result=True, result_limit=1024 * 1024).result_limit == 1048576


async def test_wait_returns_as_soon_as_the_worker_announces_the_end(db: str, no_recheck: None) -> None:
    release = asyncio.Event()

    async def slow(event: Event) -> str:
        await release.wait()
        return f"done {event.payload}"

    router = Router()
    router.add("slow.job", slow, store_result=True)
    event_id = await enqueue(db, "slow.job", 7)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        async with running(Worker(db, router, fast_config())):
            waiting = asyncio.create_task(AsyncAdmin().wait(conn, event_id, timeout=60))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            released = time.monotonic()
            release.set()
            found = await asyncio.wait_for(waiting, 90)
            took = time.monotonic() - released
        assert (found.state, found.value) == (EventState.SUCCEEDED, "done 7")
        # Well under the (stretched) re-read and the wait's timeout: the notification woke it.
        assert took < WOKEN_WITHIN, took
        # The connection is left as it was: listening to nothing.
        assert await (await conn.execute("SELECT count(*) FROM pg_listening_channels()")).fetchone() \
            == (0,)


async def test_wait_wakes_for_a_parked_failure_and_for_a_cancel(db: str, no_recheck: None) -> None:
    release = asyncio.Event()

    async def refuse(event: Event) -> None:
        await release.wait()
        raise PermanentFailure("no such customer")

    router = Router()
    router.add("bad.job", refuse, store_result=True)
    failing = await enqueue(db, "bad.job")
    later = await enqueue(db, "later.job", delay=3600)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        async with running(Worker(db, router, fast_config())):
            waiting = asyncio.create_task(AsyncAdmin().wait(conn, failing, timeout=60))
            await asyncio.sleep(0.5)
            released = time.monotonic()
            release.set()
            failed = await asyncio.wait_for(waiting, 90)
            took_failing = time.monotonic() - released
        waiting = asyncio.create_task(AsyncAdmin().wait(conn, later, timeout=60))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        async with await psycopg.AsyncConnection.connect(db) as other:
            await AsyncAdmin().cancel(other, later)
            await asyncio.sleep(0.2)
            assert not waiting.done()       # announced at commit, not before
            await other.commit()
        cancelled = await asyncio.wait_for(waiting, 90)
        took = time.monotonic() - started
    assert (failed.state, failed.value, failed.error) == (EventState.FAILED, None, "no such customer")
    assert took_failing < WOKEN_WITHIN, took_failing
    assert cancelled.state is EventState.CANCELLED and took < WOKEN_WITHIN, took


async def test_wait_gives_up_after_its_timeout_naming_the_state(db: str, no_recheck: None) -> None:
    event_id = await enqueue(db, "nobody.handles")
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        started = time.monotonic()
        with pytest.raises(WaitTimeoutError, match=f"event {event_id} did not finish within 0.4s; "
                                                   "it is pending"):
            await AsyncAdmin().wait(conn, event_id, timeout=0.4)
        # Under the stretched re-read: the wait's own timeout ended it.
        assert 0.35 < time.monotonic() - started < WOKEN_WITHIN
        with pytest.raises(EventNotFoundError, match="event 999999 not found"):
            await AsyncAdmin().wait(conn, 999_999, timeout=1)
        for bad in (0, -1, float("nan"), float("inf"), "5", True):
            with pytest.raises(InvalidInputError, match="expected timeout to be seconds above 0"):
                await AsyncAdmin().wait(conn, event_id, timeout=bad)  # type: ignore[arg-type]
    async with await psycopg.AsyncConnection.connect(db) as conn:
        with pytest.raises(InvalidInputError, match="autocommit mode"):
            await AsyncAdmin().wait(conn, event_id, timeout=1)


def test_sync_wait_and_result_see_a_worker_in_another_thread(db: str) -> None:
    router = Router()
    router.add("sync.job", lambda event: {"echo": event.payload}, store_result=True)
    with psycopg.connect(db, autocommit=True) as conn:
        event_id = conn.execute("INSERT INTO conveyor.events (topic, payload) VALUES "
                                "('sync.job', '[1, 2]') RETURNING id").fetchone()[0]
        pending = Admin().result(conn, event_id)
        worked = threading.Thread(target=lambda: asyncio.run(_work_all(db, router)))
        worked.start()
        found = Admin().wait(conn, event_id, timeout=20)
        worked.join(20)
    assert (pending.state, pending.finished, pending.value) == (EventState.PENDING, False, None)
    assert (found.state, found.value) == (EventState.SUCCEEDED, {"echo": [1, 2]})


class _LazyMapping(dict[str, Any]):
    """A mapping whose items come from somewhere that is gone (a closed session)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(a=1)
        self.error = error

    def items(self) -> Any:
        raise self.error


@pytest.mark.parametrize("kind", ["async", "thread", "inline"])
@pytest.mark.parametrize("error", [RuntimeError("session is closed"), MemoryError(),
                                   KeyboardInterrupt()], ids=["runtime", "memory", "interrupt"])
async def test_a_result_whose_encoding_raises_anything_is_a_failed_attempt_and_the_worker_lives(
        db: str, kind: str, error: BaseException) -> None:
    # Adversary finding N2: encoding the result ran outside every try. The
    # event stayed `running` for good (async, thread), or the worker died with
    # it and every worker after it (inline), its batch-mates never run.
    router = Router()
    if kind == "async":
        async def lazy_async(event: Event) -> object:
            return _LazyMapping(error)
        router.add("lazy", lazy_async, store_result=True)
    else:
        router.add("lazy", lambda event: _LazyMapping(error), store_result=True,
                   blocking=kind == "thread")
    router.add("fine", lambda event: event.payload, store_result=True,
               blocking=kind == "thread")
    bad = await enqueue(db, "lazy", max_attempts=3)
    mates = [await enqueue(db, "fine", n) for n in range(4)]
    async with running(Worker(db, router, fast_config())) as task:
        async def settled() -> bool:
            rows = [await event_row(db, i) for i in (bad, *mates)]
            return all(r["state"] in ("failed", "succeeded") for r in rows)
        await wait_until(settled, timeout=10, what=f"the {kind} events to finish")
        assert not task.done(), "the worker must keep running"
    row = await event_row(db, bad)
    # Parked at once, as for any result that cannot be stored.
    assert (row["state"], row["attempts"], row["result"]) == ("failed", 1, None)
    assert row["last_error"] == ("handler of lazy succeeded but its result could not be stored: "
                                 f"{type(error).__name__}" + (f": {error}" if str(error) else ""))
    assert "in items" in row["errors"][0]["traceback"]
    for n, mate in enumerate(mates):
        assert (await event_row(db, mate))["result"] == n
