"""The dashboard's configuration: :class:`DashboardConfig` and its checks.

Kept apart from the app so the CLI (``conveyor dashboard``) and a host
application can build and validate a configuration, and read its defaults,
without loading the pages, the templates or the pool.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from conveyor.dashboard.security import origin_of
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.validation import check_schema_name

STATEMENT_TIMEOUT_DEFAULT = 5.0
PAGE_SIZE_DEFAULT = 50
POOL_SIZE_DEFAULT = 4
SEARCH_ROWS_DEFAULT = 100_000
LIVE_REFRESH_DEFAULT = 10.0
ALLOWED_HOST = re.compile(r"\*|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?(:[0-9]{1,5})?")


@dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    """How the dashboard reads and shows the queue.

    Attributes:
        schema: PostgreSQL schema holding Conveyor's tables. Defaults to ``"conveyor"``.
        statement_timeout: seconds any one query of a page may run before the
            database cuts it (the page then says so). Defaults to 5.0.
        hide_payloads: never show an event's payload (it may hold personal
            data); its size is shown instead. Defaults to False.
        page_size: events per page of the list, 1 to 500. Defaults to 50.
        pool_size: most database connections the dashboard holds. Defaults to 4.
        search_rows: an error-text or payload search of the events list looks
            at the newest this many events only (by id), so a search that
            matches nothing never reads the whole table; the page says so.
            Defaults to 100,000.
        public_url: the address browsers use, when it is not the one the
            dashboard is served on (behind a reverse proxy), e.g.
            ``"https://ops.example.com/queue"``. A POST's ``Origin`` must be
            its origin; ``https`` marks the CSRF cookie ``Secure``; its path
            prefixes every link. Defaults to None (the request's own ``Host``).
        allowed_hosts: the host names (``name`` or ``name:port``; ``"*"``: any)
            the dashboard answers besides IP addresses, ``localhost`` and the
            public URL's host; any other ``Host`` is answered 400 (a page that
            rebinds its DNS name to this address sends its own name). Defaults
            to None: no check, the host application's (Django's
            ``ALLOWED_HOSTS``, Starlette's ``TrustedHostMiddleware``);
            ``conveyor dashboard`` always checks.
        live_refresh: seconds between two refreshes of a live page (the
            overview, limits, cron and audit pages), done by a small script
            that re-reads the page while it is visible and no form on it is
            being filled in; 0 turns it off. Without JavaScript the pages
            are plain documents. Defaults to 10.0.
    """

    schema: str = "conveyor"
    statement_timeout: float = STATEMENT_TIMEOUT_DEFAULT
    hide_payloads: bool = False
    page_size: int = PAGE_SIZE_DEFAULT
    pool_size: int = POOL_SIZE_DEFAULT
    search_rows: int = SEARCH_ROWS_DEFAULT
    public_url: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    live_refresh: float = LIVE_REFRESH_DEFAULT

    def __post_init__(self) -> None:
        try:
            check_schema_name(self.schema)
        except InvalidInputError as exc:
            raise ConfigError(str(exc)) from None
        timeout = self.statement_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
                or not math.isfinite(timeout) or not 0.01 <= timeout <= 3600:
            raise ConfigError(f"expected statement_timeout to be 0.01-3600 seconds, got {timeout!r}")
        live = self.live_refresh
        if isinstance(live, bool) or not isinstance(live, int | float) \
                or not math.isfinite(live) or not (live == 0 or 1 <= live <= 3600):
            raise ConfigError(f"expected live_refresh to be 0 (off) or 1-3600 seconds, "
                              f"got {live!r}")
        for name, low, high in (("page_size", 1, 500), ("pool_size", 1, 100),
                                ("search_rows", 1, 100_000_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"expected {name} to be an integer {low}-{high}, got {value!r}")
        if self.public_url is not None:
            _check_public_url(self.public_url)
        if self.allowed_hosts is not None:
            if isinstance(self.allowed_hosts, str):
                raise ConfigError(f"expected allowed_hosts to be a tuple of host names, "
                                  f"got the string {self.allowed_hosts!r}")
            object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
            for host in self.allowed_hosts:
                if not isinstance(host, str) or not ALLOWED_HOST.fullmatch(host):
                    raise ConfigError(f"expected each allowed host to be a name or name:port "
                                      f"(or *), got {host!r}")

    @property
    def public_origin(self) -> str | None:
        """``scheme://host[:port]`` of ``public_url``, or None."""
        return origin_of(self.public_url) if self.public_url else None

    @property
    def public_path(self) -> str:
        """The path ``public_url`` puts before every link, without its last slash."""
        return urlsplit(self.public_url).path.rstrip("/") if self.public_url else ""


def _check_public_url(url: object) -> None:
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"expected public_url to be an http(s) address such as "
                          f"https://ops.example.com or https://example.com/queue, got {url!r}")
