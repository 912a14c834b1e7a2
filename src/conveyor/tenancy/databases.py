"""What a tenant is, and where the list of tenants comes from.

A tenant is a name and the database that holds its Conveyor schema
(:class:`TenantDatabase`); a :class:`TenantSource` says which tenants exist
now, from a fixed list (:class:`StaticTenants`) or a directory of ``.dsn``
files read at every scan (:class:`DirectoryTenants`). Kept apart from the
supervisor that serves them, which only ever asks a source to ``scan``, so
a source of one's own needs nothing else from this package.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, cast

from psycopg.conninfo import conninfo_to_dict

from conveyor.db.connect import UNPARSEABLE, describe
from conveyor.errors import ConfigError

log = logging.getLogger(__name__)

DSN_SUFFIX = ".dsn"
_TENANT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


def _check_tenant_name(name: str) -> str:
    if not _TENANT_NAME_RE.fullmatch(name):
        raise ConfigError(f"invalid tenant name {name!r}: expected 1-63 letters, digits, "
                          "'-' or '_'")
    return name


@dataclass(frozen=True, slots=True)
class TenantDatabase:
    """One tenant and its database.

    Attributes:
        name: the tenant, e.g. ``"acme"``.
        conninfo: libpq URL or conninfo of its database (never logged).
    """

    name: str
    conninfo: str = field(repr=False)

    def __post_init__(self) -> None:
        _check_tenant_name(self.name)
        if not self.conninfo.strip():
            raise ConfigError(f"tenant {self.name!r} has an empty database url")

    @classmethod
    def parse(cls, spec: str) -> TenantDatabase:
        """``"acme=postgresql://..."``, or a bare URL whose database name is the tenant.

        Example::

            TenantDatabase.parse("acme=postgresql://app@db/acme").name      # "acme"
            TenantDatabase.parse("postgresql://app@db/globex").name         # "globex"
        """
        name, sep, url = spec.partition("=")
        if sep and _TENANT_NAME_RE.fullmatch(name) and _parses(url):
            return cls(name, url)
        # The spec is never quoted: what fails to parse is often the password. An
        # ambiguous URL "parses", but its database name may be a piece of it too.
        if describe(spec) == UNPARSEABLE:
            raise ConfigError("cannot parse a tenant database (could not parse it; check quoting "
                              "and percent-encoding): expected 'TENANT=URL' or a URL naming "
                              "its database")
        dbname = conninfo_to_dict(spec).get("dbname")
        if not dbname:
            raise ConfigError(f"tenant database {describe(spec)!r} names no database; "
                              "write it as 'TENANT=URL'")
        return cls(str(dbname), spec)


def _parses(conninfo: str) -> bool:
    if "://" in conninfo:
        return True
    try:
        return bool(conninfo.strip()) and bool(conninfo_to_dict(conninfo))
    except Exception:  # noqa: BLE001 - psycopg raises several kinds for bad conninfo
        return False


class TenantSource(Protocol):
    """Where the tenants come from; ``scan`` is called at start-up and every rescan."""

    def scan(self) -> dict[str, TenantDatabase]: ...


class StaticTenants:
    """A fixed list of tenant databases (``TenantDatabase`` or ``"TENANT=URL"`` strings)."""

    def __init__(self, tenants: Iterable[TenantDatabase | str]) -> None:
        self._tenants: dict[str, TenantDatabase] = {}
        for item in tenants:
            tenant = item if isinstance(item, TenantDatabase) else TenantDatabase.parse(item)
            if tenant.name in self._tenants:
                raise ConfigError(f"tenant {tenant.name!r} is listed twice")
            self._tenants[tenant.name] = tenant

    def scan(self) -> dict[str, TenantDatabase]:
        return dict(self._tenants)


class DirectoryTenants:
    """Every ``<tenant>.dsn`` file in ``path``: the file's first non-comment line is the URL.

    Files are read at every scan, so adding, deleting or editing one adds, removes
    or re-points that tenant. Unreadable or malformed files are skipped with a
    warning; they never stop the other tenants.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def scan(self) -> dict[str, TenantDatabase]:
        if not self.path.is_dir():
            raise ConfigError(f"tenants directory {str(self.path)!r} does not exist")
        found: dict[str, TenantDatabase] = {}
        for entry in sorted(self.path.glob(f"*{DSN_SUFFIX}")):
            try:
                lines = entry.read_text("utf-8").splitlines()
                url = next((s.strip() for s in lines if s.strip() and not s.startswith("#")), "")
                found[entry.stem] = TenantDatabase(entry.stem, url)
            except (OSError, UnicodeDecodeError, ConfigError) as exc:
                log.warning("skipping tenant file %s: %s", entry.name, exc,
                            extra={"action": "tenant_file_skipped"})
        return found


def as_source(tenants: TenantSource | Iterable[TenantDatabase | str]) -> TenantSource:
    """``tenants`` as a source: itself when it has a ``scan``, else a fixed list of them."""
    if callable(getattr(tenants, "scan", None)):
        return cast(TenantSource, tenants)
    return StaticTenants(cast(Iterable[TenantDatabase | str], tenants))
