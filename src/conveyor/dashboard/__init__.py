"""A web dashboard for Conveyor (extra ``conveyor[dashboard]``): see docs/dashboard.md.

Mount :func:`dashboard_app` in your ASGI app, or run ``conveyor dashboard``.
"""

from conveyor.errors import MissingExtraError

try:
    import jinja2  # noqa: F401 - probed here so a missing one names the extra
    import psycopg_pool  # noqa: F401
    import python_multipart  # noqa: F401 - Starlette's form parser
    import starlette  # noqa: F401
except ImportError as exc:
    raise MissingExtraError("the dashboard", "dashboard", module=exc.name) from exc

from conveyor.dashboard.app import dashboard_app
from conveyor.dashboard.config import DashboardConfig
from conveyor.dashboard.security import Action, Unauthenticated, allow_all, basic_auth, read_only

__all__ = ["Action", "DashboardConfig", "Unauthenticated", "allow_all", "basic_auth", "dashboard_app",
           "read_only"]
