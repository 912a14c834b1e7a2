"""The worker side of the example engine: email, XLSX and write-back behind one router.

``conveyor worker --app examples.engine.worker_app:build_router`` reads its
settings from the environment (an application may; Conveyor itself never does):

    ENGINE_URL, ENGINE_TENANT_DOMAIN, ENGINE_JWT_SECRET  the engine and its secret
    ENGINE_FILES_DIR                                     the uploads: one directory per
                                                         tenant, ENGINE_FILES_DIR/<tenant>
    SMTP_HOST, SMTP_PORT, SMTP_FROM                      the mail provider
    SMTP_USER, SMTP_PASSWORD, SMTP_CA_FILE, SMTP_STARTTLS (optional)
"""

from __future__ import annotations

import os

from conveyor import Router
from conveyor.consumers.email import EmailConsumer, SmtpConfig
from conveyor.consumers.engine_client import AsyncEngineClient, EngineConfig
from conveyor.consumers.filestore import TenantDirectories
from conveyor.consumers.writeback import WritebackConsumer
from conveyor.consumers.xlsx import XlsxConsumer


def build_router() -> Router:
    env = os.environ
    engine = AsyncEngineClient(EngineConfig(
        base_url=env["ENGINE_URL"], tenant_domain=env.get("ENGINE_TENANT_DOMAIN", "app.test"),
        jwt_secret=env["ENGINE_JWT_SECRET"], role="conveyor-service"))
    smtp = SmtpConfig(
        host=env.get("SMTP_HOST", "127.0.0.1"), port=int(env.get("SMTP_PORT", "25")),
        from_address=env.get("SMTP_FROM", "Example <no-reply@app.test>"),
        username=env.get("SMTP_USER"), password=env.get("SMTP_PASSWORD"),
        ca_file=env.get("SMTP_CA_FILE"), starttls=env.get("SMTP_STARTTLS", "1") == "1")
    router = Router()
    router.add("email.send", EmailConsumer(smtp), timeout=30)
    # Each tenant's jobs read only that tenant's directory: a job's file name is
    # chosen by a user, and must never reach another tenant's uploads.
    router.add("filejobs.created", XlsxConsumer(engine, TenantDirectories(env["ENGINE_FILES_DIR"])),
               timeout=600)
    # Tasks need no processing: the write-back consumer marks them done.
    router.add("tasks.created", WritebackConsumer(engine))
    return router
