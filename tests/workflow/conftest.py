"""Fixtures for the workflow, webhook and multi-tenant tests: real servers on loopback.

The example workflow engine runs in a thread on a reserved loopback port; while
it is stopped, connections to that port are refused, exactly like an engine that
is down. Workers run in-process against real databases, with bounded waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conveyor import Admin, EventRecord, LinearBackoff, Worker, WorkerConfig
from conveyor.consumers.engine_client import AsyncEngineClient, EngineConfig

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.workflow_engine.app import WorkflowEngine, WorkflowEngineSettings, create_app  # noqa: E402
from examples.workflow_engine.server import ThreadedServer  # noqa: E402

JWT_SECRET = "workflow-test-secret-0123456789abcdef"
TENANT_DOMAIN = "workflow.test"
SMALL_BACKOFF = LinearBackoff(step=0.05, max_delay=0.2)


@dataclass
class EngineHandle:
    server: ThreadedServer
    engine: WorkflowEngine

    @property
    def url(self) -> str:
        return self.server.url

    def config(self, **overrides: Any) -> EngineConfig:
        return engine_config(self.url, **overrides)


def engine_config(url: str, **overrides: Any) -> EngineConfig:
    """How the tests' service authenticates to the example engine at ``url``."""
    options: dict[str, Any] = {"base_url": url, "tenant_domain": TENANT_DOMAIN,
                               "jwt_secret": JWT_SECRET, "role": "conveyor-workflow",
                               "audience": "workflow", "timeout": 2.0}
    options.update(overrides)
    return EngineConfig(**options)


@pytest.fixture
def workflow_engine(tmp_path: Path) -> Iterator[EngineHandle]:
    """The example engine, NOT yet started: call ``.server.start()``."""
    app = create_app(WorkflowEngineSettings(jwt_secret=JWT_SECRET, tenant_domain=TENANT_DOMAIN,
                                            state_file=str(tmp_path / "engine.json"),
                                            allow_control=True))
    server = ThreadedServer(app)
    yield EngineHandle(server, app.state.engine)
    server.close()


@pytest.fixture
def running_engine(workflow_engine: EngineHandle) -> EngineHandle:
    workflow_engine.server.start()
    return workflow_engine


@pytest.fixture
async def engine_client(workflow_engine: EngineHandle) -> AsyncIterator[AsyncEngineClient]:
    async with AsyncEngineClient(workflow_engine.config()) as client:
        yield client


def fast_config(**overrides: Any) -> WorkerConfig:
    options: dict[str, Any] = {"concurrency": 10, "batch_size": 10, "poll_interval": 0.2,
                               "lease_ttl": 2.0, "heartbeat_interval": 0.5,
                               "rescue_interval": 0.5, "shutdown_timeout": 2.0,
                               "reconnect_min": 0.05, "reconnect_max": 0.2,
                               "backoff": SMALL_BACKOFF}
    options.update(overrides)
    return WorkerConfig(**options)


@contextlib.asynccontextmanager
async def running(worker: Any) -> AsyncIterator[Any]:
    """Run ``worker`` (a Worker or MultiTenantWorker) in the background for a block."""
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(_started(worker, task), 30)
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)


async def _started(worker: Any, task: asyncio.Task[None]) -> None:
    while not worker.started.is_set():
        if task.done():
            task.result()
        await asyncio.sleep(0.01)


def show(url: str, event_id: int) -> EventRecord:
    with psycopg.connect(url, autocommit=True) as conn:
        return Admin().show(conn, event_id)


async def state_of(url: str, event_id: int) -> str:
    return (await asyncio.to_thread(show, url, event_id)).state.value


def new_worker(url: str, router: Any, **overrides: Any) -> Worker:
    return Worker(url, router, fast_config(**overrides))
