"""The parameters of the worker's claim statements, for tests that run them by hand."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from conveyor.patterns import sql_params


def claim_params(patterns: Sequence[str] = ("*",), *, tenants: Sequence[str] | None = None,
                 limit: int = 100, owner: str | None = None, lease_ttl: float = 30.0,
                 **more: Any) -> dict[str, Any]:
    """What a worker routing ``patterns`` for ``tenants`` (None: all) passes ``event_claim``
    and its variants: the topic test (:func:`conveyor.patterns.sql_params`), the tenant
    test, ``limit``, ``owner`` (a new one unless given) and ``lease_ttl``; ``more`` adds or
    overrides (a variant's own parameters, or a topic test written out)."""
    return {**sql_params(patterns), "all_tenants": tenants is None, "tenants": list(tenants or ()),
            "limit": limit, "owner": owner or str(uuid.uuid4()), "lease_ttl": lease_ttl, **more}
