"""The example workflow engine as a real process: persistence across restarts, and its checks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from examples.mail_module import registry
from examples.workflow_engine.app import WorkflowEngineSettings, create_app
from examples.workflow_engine.server import ThreadedServer

from conveyor.consumers.engine_client import AsyncEngineClient, mint_service_token
from conveyor.workflow import HttpWorkflowAdapter, workflow_idempotency_key

from .conftest import JWT_SECRET, ROOT, TENANT_DOMAIN, EngineHandle, engine_config

EVENT = {"source": "mail", "trigger": "mail.received",
         "fields": {"message_id": "m", "thread_id": "t", "mailbox": "inbox"}}
KEY = workflow_idempotency_key("mail", "acme", 1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EngineProcess:
    def __init__(self, state_file: Path) -> None:
        self.port = _free_port()
        self.state_file = state_file
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "examples.workflow_engine", "--port", str(self.port),
             "--state-file", str(self.state_file)],
            cwd=ROOT, env=dict(os.environ, WORKFLOW_ENGINE_JWT_SECRET=JWT_SECRET),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise AssertionError(f"engine did not start: {self.stop()}")

    def stop(self) -> str:
        if self.proc is None:
            return ""
        self.proc.terminate()
        output, _ = self.proc.communicate(timeout=20)
        self.proc = None
        return output


@pytest.fixture
def engine_process(tmp_path: Path) -> Iterator[EngineProcess]:
    process = EngineProcess(tmp_path / "state.json")
    yield process
    process.stop()


def _cli_register(url: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONVEYOR_WORKFLOW_ENGINE_URL=url, CONVEYOR_WORKFLOW_JWT_SECRET=JWT_SECRET)
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", "workflow", "register",
                           "--app", "examples.mail_module:registry"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


async def test_definitions_and_seen_keys_survive_a_restart(engine_process: EngineProcess) -> None:
    engine_process.start()
    assert _cli_register(engine_process.url).stdout.strip().endswith("created 5, updated 0, unchanged 0")
    async with AsyncEngineClient(engine_config(engine_process.url)) as client:
        adapter = HttpWorkflowAdapter(client)
        reply = await client.request("acme", "POST", "/api/workflow/events", json=EVENT,
                                     idempotency_key=KEY)
        assert (reply.status, reply.body["result"]) == (202, "accepted")
        engine_process.stop()
        engine_process.start()
        report = await registry.register_all(adapter)
        assert report.summary() == "created 0, updated 0, unchanged 5"
        again = await client.request("acme", "POST", "/api/workflow/events", json=EVENT,
                                     idempotency_key=KEY)
        assert (again.status, again.body["result"]) == (200, "duplicate")


def _post(url: str, headers: dict[str, str], body: bytes = b"{}") -> httpx.Response:
    return httpx.post(f"{url}/api/workflow/events", headers=headers, content=body, timeout=5)


def _token(handle: EngineHandle, tenant: str, **overrides: str) -> str:
    return mint_service_token(handle.config(**overrides), tenant)


def test_the_engine_checks_token_tenant_role_and_key(running_engine: EngineHandle) -> None:
    url, host = running_engine.url, f"acme.{TENANT_DOMAIN}"
    assert _post(url, {"host": host}).json() == {"error": "missing bearer token"}
    wrong_secret = _token(running_engine, "acme", jwt_secret="x" * 40)
    assert _post(url, {"host": host, "authorization": f"Bearer {wrong_secret}"}).status_code == 401
    other_tenant = _token(running_engine, "globex")
    answer = _post(url, {"host": host, "authorization": f"Bearer {other_tenant}"})
    assert (answer.status_code, answer.json()["error"]) == (403, "token is for another tenant")
    wrong_role = _token(running_engine, "acme", role="conveyor-service")
    answer = _post(url, {"host": host, "authorization": f"Bearer {wrong_role}"})
    assert answer.status_code == 403
    good = _token(running_engine, "acme")
    answer = _post(url, {"host": host, "authorization": f"Bearer {good}"})
    assert answer.status_code == 400 and "Idempotency-Key header is required" in answer.json()["error"]


def test_the_fault_knob_is_off_unless_allowed() -> None:
    server = ThreadedServer(create_app(WorkflowEngineSettings(jwt_secret=JWT_SECRET)))
    server.start()
    try:
        answer = httpx.post(f"{server.url}/_control/fail-next", json={"count": 3}, timeout=5)
    finally:
        server.close()
    assert answer.status_code == 404
