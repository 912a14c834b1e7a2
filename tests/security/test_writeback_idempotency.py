"""S9: every retry of one write-back carries the same Idempotency-Key, and a
server that deduplicates on it sees at most one effect per event, through
5xx answers, timeouts after the effect was applied, and a redelivery of an
event that already succeeded."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from conveyor import AsyncCommittingProducer, BackoffPolicy, Router, Worker, WorkerConfig
from conveyor.consumers.engine_client import AsyncEngineClient, EngineConfig
from conveyor.consumers.writeback import WritebackConsumer

SECRET = "writeback-secret-0123456789-abcdefghij"
DOMAIN = "app.test"


@dataclass
class Fake:
    """Applies a PATCH once per key; misbehaves on the first tries of each row."""

    requests: list[tuple[str, str | None, str]] = field(default_factory=list)   # (path, key, host)
    effects: Counter[str] = field(default_factory=Counter)                     # per key
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    tries: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    lock: threading.Lock = field(default_factory=threading.Lock)


def _app(fake: Fake) -> Starlette:
    async def patch(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        path = request.url.path
        with fake.lock:
            fake.requests.append((path, key, request.headers.get("host", "")))
            fake.tries[path] += 1
            n = fake.tries[path]
        mode = path.rsplit("/", 1)[1].split("-")[0]     # /api/jobs/<mode>-<n>
        if mode == "503" and n <= 2:
            return JSONResponse({"error": "busy"}, status_code=503)    # before any effect
        if key is None:
            return JSONResponse({"error": "no key"}, status_code=400)
        with fake.lock:
            if key not in fake.answers:
                fake.effects[key] += 1
                fake.answers[key] = {"applied": path}
            answer = fake.answers[key]
        if mode == "500after" and n <= 2:
            return JSONResponse({"error": "lost the answer"}, status_code=500)  # after the effect
        if mode == "slow" and n <= 2:
            await asyncio.sleep(2.0)                     # after the effect; the client gave up
        return JSONResponse(answer)

    return Starlette(routes=[Route("/api/{path:path}", patch, methods=["PATCH"])])


@pytest.fixture
def fake_engine() -> Iterator[tuple[str, Fake]]:
    fake = Fake()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app(fake), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", fake
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


async def test_every_retry_carries_one_key_and_the_effect_happens_once(
        fresh_db: str, fake_engine: tuple[str, Fake]) -> None:
    url, fake = fake_engine
    client = AsyncEngineClient(EngineConfig(base_url=url, tenant_domain=DOMAIN, jwt_secret=SECRET,
                                            role="svc-writeback", timeout=0.5))
    router = Router()
    router.add("jobs.created", WritebackConsumer(client))
    config = WorkerConfig(concurrency=10, batch_size=10, poll_interval=0.2, lease_ttl=5.0,
                          heartbeat_interval=1.0, rescue_interval=1.0, shutdown_timeout=3.0,
                          backoff=BackoffPolicy(base_delay=0.05, max_delay=0.1, jitter=0.0))
    rows = [f"{mode}-{i}" for mode in ("ok", "503", "500after", "slow") for i in range(3)]
    async with AsyncCommittingProducer(fresh_db) as producer:
        ids = {row: await producer.enqueue("jobs.created", {"id": row}, tenant="acme", max_attempts=5)
               for row in rows}
    worker = Worker(fresh_db, router, config)
    task = asyncio.create_task(worker.run())

    async def states() -> dict[str, int]:
        async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
            got = await (await conn.execute(
                "SELECT state, count(*) FROM conveyor.events GROUP BY state")).fetchall()
        return dict(got)

    try:
        await asyncio.wait_for(worker.started.wait(), 10)
        for _ in range(200):
            if await states() == {"succeeded": len(rows)}:
                break
            await asyncio.sleep(0.1)
        # Redeliver one of each kind, as after a lost acknowledgement.
        async with await psycopg.AsyncConnection.connect(fresh_db, autocommit=True) as conn:
            # done = NULL: out of the history, where the successes went (0025).
            await conn.execute("UPDATE conveyor.events SET state = 'pending', run_at = now(), "
                               "finished_at = NULL, done = NULL"
                               " WHERE payload->>'id' LIKE '%%-0'")
            await conn.execute("NOTIFY \"conveyor.events\", '*'")
        for _ in range(100):
            if await states() == {"succeeded": len(rows)}:
                break
            await asyncio.sleep(0.1)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)
        await worker.close()
        await client.aclose()
    assert await states() == {"succeeded": len(rows)}
    keys_by_row: dict[str, set[str | None]] = defaultdict(set)
    for path, key, host in fake.requests:
        keys_by_row[path.rsplit("/", 1)[1]].add(key)
        assert host == f"acme.{DOMAIN}"
    tries = Counter(path.rsplit("/", 1)[1] for path, _, _ in fake.requests)
    print(f"\nS9: {len(fake.requests)} PATCHes for {len(rows)} events "
          f"(max {max(tries.values())} per event); effects per key: {sorted(set(fake.effects.values()))}")
    for row in rows:
        assert keys_by_row[row] == {f"conveyor-event-acme-{ids[row]}"}, row
    assert all(n == 1 for n in fake.effects.values()) and len(fake.effects) == len(rows)
    assert all(tries[f"{m}-1"] >= 3 for m in ("503", "500after", "slow"))
    assert all(tries[f"{m}-0"] >= 2 for m in ("ok",)), "the redelivery called again, with the same key"
