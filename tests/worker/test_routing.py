"""A worker claims only the topics its router handles, and matches them exactly."""

from __future__ import annotations

import asyncio

from conveyor import Event, Router, Worker
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, query, running


async def _drain(worker: Worker) -> None:
    for _ in range(20):
        if await worker.run_once() == 0:
            return
    raise AssertionError("run_once kept finding events")


async def _untouched(url: str, event_id: int) -> None:
    row = await event_row(url, event_id)
    assert row["state"] == "pending"
    assert row["attempts"] == 0
    assert row["attempted_at"] is None and row["lease_owner"] is None


async def test_worker_never_claims_topics_outside_its_router(db: str) -> None:
    handled: list[str] = []

    async def handle(event: Event) -> None:
        handled.append(event.topic)

    router = Router()
    router.add("email.*", handle)
    billing = await enqueue(db, "billing.x")
    worker = Worker(db, router, fast_config())
    async with running(worker):
        email = await enqueue(db, "email.send")

        async def email_done() -> bool:
            return (await event_row(db, email))["state"] == "succeeded"
        await wait_until(email_done, timeout=5, what="email.send to succeed")
        await asyncio.sleep(0.5)   # a few more polls: billing.x must stay put
    assert handled == ["email.send"]
    await _untouched(db, billing)
    assert worker.stats.claimed == 1


async def test_prefix_pattern_matches_whole_segments_only(db: str) -> None:
    handled: list[str] = []

    async def handle(event: Event) -> None:
        handled.append(event.topic)

    router = Router()
    router.add("a.*", handle)
    router.add("x.y", handle)
    ids = {t: await enqueue(db, t) for t in
           ("a.b", "a.b.c", "ab.c", "a", "x.y", "x.y.z", "x.yz")}
    worker = Worker(db, router, fast_config())
    try:
        await _drain(worker)
    finally:
        await worker.close()
    assert sorted(handled) == ["a.b", "a.b.c", "x.y"]
    for topic in ("ab.c", "a", "x.y.z", "x.yz"):
        await _untouched(db, ids[topic])
    for topic in ("a.b", "a.b.c", "x.y"):
        assert (await event_row(db, ids[topic]))["state"] == "succeeded"


async def test_underscore_in_a_pattern_is_not_a_like_wildcard(db: str) -> None:
    handled: list[str] = []

    async def handle(event: Event) -> None:
        handled.append(event.topic)

    router = Router()
    router.add("a_b.*", handle)
    router.add("c_d", handle)
    ids = {t: await enqueue(db, t) for t in ("a_b.x", "aXb.x", "a-b.x", "c_d", "cXd")}
    worker = Worker(db, router, fast_config())
    try:
        await _drain(worker)
    finally:
        await worker.close()
    assert sorted(handled) == ["a_b.x", "c_d"]
    for topic in ("aXb.x", "a-b.x", "cXd"):
        await _untouched(db, ids[topic])
    assert worker.stats.handed_back == 0


async def test_percent_in_a_stored_topic_is_not_matched_by_a_prefix(db: str) -> None:
    # Producers refuse '%' in topics; a row written by other means must still
    # not be claimed through a LIKE wildcard.
    handled: list[str] = []

    async def handle(event: Event) -> None:
        handled.append(event.topic)

    router = Router()
    router.add("p.*", handle)

    rows = await query(db, "INSERT INTO conveyor.events (topic, payload) "
                                 "VALUES ('p%q', '{}'), ('p_.x', '{}') RETURNING id")
    worker = Worker(db, router, fast_config())
    try:
        await _drain(worker)
    finally:
        await worker.close()
    assert handled == []
    for row in rows:
        await _untouched(db, row["id"])


async def test_catch_all_route_claims_every_topic(db: str) -> None:
    handled: list[str] = []

    async def handle(event: Event) -> None:
        handled.append(event.topic)

    router = Router()
    router.add("*", handle)
    for topic in ("a.b", "zz", "q_r.s"):
        await enqueue(db, topic)
    worker = Worker(db, router, fast_config())
    try:
        await _drain(worker)
    finally:
        await worker.close()
    assert sorted(handled) == ["a.b", "q_r.s", "zz"]


async def test_tenant_limited_worker_claims_only_its_tenants(db: str) -> None:
    handled: list[str | None] = []

    async def handle(event: Event) -> None:
        handled.append(event.tenant)

    router = Router()
    router.add("t.*", handle)
    ids = {tenant: await enqueue(db, "t.job", tenant=tenant)
           for tenant in ("acme", "globex", "acme-eu", None)}
    worker = Worker(db, router, fast_config(tenants=("acme", "initech")))
    try:
        await _drain(worker)
    finally:
        await worker.close()
    assert handled == ["acme"]
    for tenant in ("globex", "acme-eu", None):
        await _untouched(db, ids[tenant])
