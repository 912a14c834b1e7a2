"""A web dashboard for Conveyor (extra ``conveyor[dashboard]``): see docs/dashboard.md.

Mount :func:`dashboard_app` in your ASGI app, or run ``conveyor dashboard``.
"""

from conveyor.dashboard.app import DashboardConfig, dashboard_app
from conveyor.dashboard.security import Action, Unauthenticated, allow_all, basic_auth, read_only

__all__ = ["Action", "DashboardConfig", "Unauthenticated", "allow_all", "basic_auth", "dashboard_app",
           "read_only"]
