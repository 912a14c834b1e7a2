"""Apps the multi-tenant CLI test serves in a real subprocess."""

from __future__ import annotations

import psycopg

from conveyor import Router
from conveyor.multitenant import current_tenant
from conveyor.types import Event

router = Router()


@router.route("visit.*")
def record_visit(event: Event) -> None:
    """Write which tenant ran the event into that tenant's own database."""
    tenant = current_tenant()
    assert tenant is not None
    with psycopg.connect(tenant.conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS visits (tenant text, event_id bigint)")
        conn.execute("INSERT INTO visits VALUES (%s, %s)", (tenant.name, event.id))
