"""S1/S8 for files: the XLSX consumer never reads another tenant's file (finding F3).

A job's ``file`` is chosen by a user of the job's tenant. With one shared upload
root, acme could create a job naming ``globex/q3.xlsx`` and get globex's
aggregates written into its own job. Each tenant now has its own store
(``TenantDirectories(root)``: tenant T reads ``root/T`` only), chosen by the
event's tenant. Every attempt below must fail the job with a clear reason and
open nothing of globex's: an audit hook records every file the process opens.

The engine is a transport stand-in (GET serves the job of the Host's tenant,
PATCH records the update); no database is involved in this consumer's decision.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import xlsxwriter  # type: ignore[import-untyped]

from conveyor.consumers.engine_client import AsyncEngineClient, EngineConfig
from conveyor.consumers.filestore import FileStoreError, LocalDirectoryStore, TenantDirectories
from conveyor.consumers.xlsx import XlsxConsumer
from conveyor.errors import ConfigError
from conveyor.outcomes import PermanentFailure
from conveyor.types import Event

SECRET = "tenant-files-secret-0123456789-abcdefghijkl"
DOMAIN = "app.test"


# ------------------------------------------------------------ who opens what

_OPENED: list[str] = []
_RECORDING = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _RECORDING[0] and event == "open" and isinstance(args[0], str | bytes | Path):
        _OPENED.append(str(args[0] if not isinstance(args[0], bytes) else args[0].decode()))


sys.addaudithook(_audit)


@pytest.fixture
def opened() -> Iterator[list[str]]:
    _OPENED.clear()
    _RECORDING[0] = True
    try:
        yield _OPENED
    finally:
        _RECORDING[0] = False


# ------------------------------------------------------------------ the engine

@dataclass
class Engine:
    jobs: dict[tuple[str, int], dict[str, Any]]
    patches: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    requests: int = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        tenant = request.headers["host"].split(".")[0]
        job_id = int(request.url.path.rsplit("/", 1)[1])
        job = self.jobs.get((tenant, job_id))
        if job is None:
            return httpx.Response(404, json={"error": "no such filejobs row"})
        if request.method == "PATCH":
            update = json.loads(request.content)
            self.patches.append((tenant, job_id, update))
            job.update(update)
        return httpx.Response(200, json=job)


def write_book(path: Path, rows: list[tuple[str, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    book = xlsxwriter.Workbook(str(path))
    sheet = book.add_worksheet()
    sheet.write_row(0, 0, ["tipo", "monto"])
    for i, row in enumerate(rows, 1):
        sheet.write_row(i, 0, list(row))
    book.close()


@pytest.fixture
def uploads(tmp_path: Path) -> Path:
    root = tmp_path / "uploads"
    write_book(root / "acme" / "mine.xlsx", [("venta", 1.0), ("venta", 2.0)])
    write_book(root / "globex" / "q3.xlsx", [("secreto", 1000.0), ("secreto", 337.0)])
    write_book(root / "globex" / "globex" / "q3.xlsx", [("secreto", 5.0)])
    write_book(root / "q3.xlsx", [("compartido", 9.0)])     # at the root: no tenant's
    return root


def run(uploads: Path, tenant: str, file: str, **kwargs: Any) -> tuple[Engine, dict[str, Any]]:
    """One ``filejobs.created`` event of ``tenant`` whose job names ``file``."""
    engine = Engine({(tenant, 1): {"id": 1, "tenant": tenant, "file": file, "status": "pending"}})
    client = AsyncEngineClient(
        EngineConfig(base_url="http://engine.invalid", tenant_domain=DOMAIN, jwt_secret=SECRET,
                     role="conveyor-service"),
        transport=httpx.MockTransport(engine.handle))
    consumer = XlsxConsumer(client, kwargs.get("stores") or TenantDirectories(uploads))
    event = Event(id=10, topic="filejobs.created", tenant=tenant, payload_text='{"id": 1}')

    async def go() -> None:
        try:
            await consumer(event)
        finally:
            await client.aclose()

    asyncio.run(go())
    ((_, _, update),) = engine.patches
    return engine, update


def globex_files(opened: list[str], uploads: Path) -> list[str]:
    """Opened paths that exist and really lie in the uploads but outside acme's directory."""
    acme = (uploads / "acme").resolve()
    real = [Path(os.path.realpath(p)) for p in opened if os.path.exists(p)]
    return [str(p) for p in real if uploads.resolve() in p.parents and acme not in p.parents]


def test_a_tenants_own_file_is_aggregated(uploads: Path, opened: list[str]) -> None:
    _, update = run(uploads, "acme", "mine.xlsx")
    assert update["status"] == "done"
    assert update["result"]["rows"] == 2 and update["result"]["total"] == 3
    assert globex_files(opened, uploads) == []


def test_globex_reads_its_own_q3(uploads: Path) -> None:
    _, update = run(uploads, "globex", "q3.xlsx")
    assert update["status"] == "done" and update["result"]["total"] == 1337


@pytest.mark.parametrize("name", [
    "globex/q3.xlsx",            # the shared-root attack of the finding
    "q3.xlsx",                   # globex's file by its bare name
    "../globex/q3.xlsx", "..\\globex\\q3.xlsx", "../q3.xlsx", "./../globex/q3.xlsx",
    "%2e%2e/globex/q3.xlsx",
])
def test_acme_naming_globex_files_fails_with_a_reason_and_reads_nothing(
        uploads: Path, opened: list[str], name: str) -> None:
    _, update = run(uploads, "acme", name)
    assert update["status"] == "failed", update
    assert "result" not in update
    assert update["error"].startswith(("file not found in store", "file name must not contain")), \
        update["error"]
    assert globex_files(opened, uploads) == [], opened


def test_an_absolute_path_to_globex_is_refused(uploads: Path, opened: list[str]) -> None:
    _, update = run(uploads, "acme", str(uploads / "globex" / "q3.xlsx"))
    assert update["status"] == "failed"
    assert update["error"].startswith("file name must be relative to the store"), update["error"]
    assert globex_files(opened, uploads) == []


def test_a_symlink_in_acmes_directory_to_globex_is_refused(uploads: Path, opened: list[str]) -> None:
    (uploads / "acme" / "innocent.xlsx").symlink_to(uploads / "globex" / "q3.xlsx")
    (uploads / "acme" / "dir").symlink_to(uploads / "globex", target_is_directory=True)
    for name in ("innocent.xlsx", "dir/q3.xlsx"):
        _, update = run(uploads, "acme", name)
        assert update["status"] == "failed"
        assert update["error"].startswith("file name leads outside the store"), update["error"]
    assert globex_files(opened, uploads) == []


def test_a_tenant_directory_that_is_a_symlink_is_refused(uploads: Path, opened: list[str]) -> None:
    (uploads / "initech").symlink_to(uploads / "globex", target_is_directory=True)
    _, update = run(uploads, "initech", "q3.xlsx")
    assert update == {"status": "failed", "error": "file directory of tenant 'initech' is not a "
                                                   "directory (symlinks are refused)"}
    assert globex_files(opened, uploads) == []


def test_a_tenant_without_a_directory_fails_its_job_clearly(uploads: Path) -> None:
    _, update = run(uploads, "umbrella", "q3.xlsx")
    assert update == {"status": "failed", "error": "no file directory for tenant 'umbrella'"}


def test_an_event_without_a_tenant_is_parked_before_any_request(uploads: Path) -> None:
    engine = Engine({})
    client = AsyncEngineClient(
        EngineConfig(base_url="http://engine.invalid", tenant_domain=DOMAIN, jwt_secret=SECRET,
                     role="conveyor-service"), transport=httpx.MockTransport(engine.handle))
    consumer = XlsxConsumer(client, TenantDirectories(uploads))
    event = Event(id=11, topic="filejobs.created", tenant=None, payload_text='{"id": 1}')
    with pytest.raises(PermanentFailure, match="no tenant"):
        asyncio.run(consumer(event))
    assert engine.requests == 0


def test_one_store_shared_by_every_tenant_is_refused(uploads: Path) -> None:
    client = AsyncEngineClient(EngineConfig(base_url="http://engine.invalid", tenant_domain=DOMAIN,
                                            jwt_secret=SECRET, role="conveyor-service"))
    with pytest.raises(ConfigError, match="TenantDirectories"):
        XlsxConsumer(client, LocalDirectoryStore(uploads))  # type: ignore[arg-type]


@pytest.mark.parametrize("tenant", ["", ".", "..", "a/b", "a\\b", "\x00", "acme\n", "a" * 64, "-x"])
def test_tenant_names_that_are_not_one_plain_segment_are_refused(uploads: Path, tenant: str) -> None:
    with pytest.raises(FileStoreError, match="invalid tenant"):
        TenantDirectories(uploads)(tenant)


def test_a_missing_root_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileStoreError, match="does not exist"):
        TenantDirectories(tmp_path / "nowhere")
    with pytest.raises(FileStoreError, match="does not exist"):
        LocalDirectoryStore(tmp_path / "nowhere")
