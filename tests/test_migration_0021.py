"""0021: a claimed row's next version stays on its page (the drain's locality)."""

from __future__ import annotations

import psycopg

from conveyor import NewEvent, Producer
from conveyor.db.named_queries import queries_for
from conveyor.patterns import sql_params

Q = queries_for("conveyor")


def _page(ctid: str) -> int:
    return int(ctid.strip("()").split(",")[0])


def test_claimed_rows_new_versions_stay_on_their_pages(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        Producer().enqueue_bulk(conn, [NewEvent(topic="t.x", payload={"i": i})
                                       for i in range(2_000)])
        conn.commit()
        before = dict(conn.execute("SELECT id, ctid::text FROM conveyor.events").fetchall())
        params = {**sql_params(["*"]), "all_tenants": True, "tenants": [], "limit": 100,
                  "owner": "7f3c2a64-1d5e-4b8e-9c1a-3e2f4d5c6b7a", "lease_ttl": 30.0}
        claimed = [row[0] for row in conn.execute(Q["event_claim"], params).fetchall()]
        conn.commit()
        after = dict(conn.execute("SELECT id, ctid::text FROM conveyor.events WHERE id = ANY(%s)",
                                  (claimed,)).fetchall())
    assert len(claimed) == 100
    stayed = sum(_page(before[i]) == _page(after[i]) for i in claimed)
    # With pages filled to the brim (before 0021) none stayed: every new version
    # went to another page, and a worker at defaults drained at a third of the
    # rate. A page's room takes the first versions of its rows (15 of 100 here).
    assert stayed >= 10, stayed
