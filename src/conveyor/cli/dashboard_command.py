"""``conveyor dashboard``: the web dashboard, served standalone by uvicorn.

Safe by default: it refuses to start unless told who may do what
(``--basic-auth``, ``--read-only``, or ``--insecure-local`` on the loopback
interface only).
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
from typing import Any

from conveyor.cli.context import Context, duration, positive_int
from conveyor.cli.options import add_command, boolean, option
from conveyor.cli.output import note
from conveyor.errors import ConfigError, MissingExtraError

Sub = Any  # argparse's private _SubParsersAction

LOOPBACK_NAMES = ("localhost",)


def register_dashboard(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "dashboard", "serve the web dashboard (extra 'dashboard')",
        "Serve the dashboard: counts by state and topic, live workers, pauses, the\n"
        "events with filters, one event with its errors and tracebacks, and the\n"
        "actions (retry, cancel, run now, pause, resume, bulk retry or cancel of\n"
        "everything a filter matches, confirmed with its count).\n\n"
        "It refuses to start without saying who may do what: --basic-auth USER:PASSWORD\n"
        "(every page and action behind one login; with --read-only, pages only),\n"
        "--read-only alone (pages for anyone who reaches the port, no action), or\n"
        "--insecure-local (everything, no login; only on 127.0.0.1 / ::1).\n"
        "Every query runs under --statement-timeout; a page whose query was cut says so.\n"
        "Requests naming a Host other than an IP address, localhost, --host or the\n"
        "--public-url host get 400 (DNS rebinding): add names with --allowed-host.",
        run_dashboard,
        examples=[("conveyor dashboard --read-only --host 0.0.0.0", "look, never touch"),
                  ("CONVEYOR_DASHBOARD_BASIC_AUTH=ops:s3cret conveyor dashboard --host 0.0.0.0",
                   "one login for pages and actions"),
                  ("conveyor dashboard --insecure-local", "on your own machine only"),
                  ("conveyor dashboard --insecure-local --public-url https://ops.example.com/queue",
                   "behind a proxy that asks for the login (docs/dashboard.md)")])
    option(p, "--host", env="DASHBOARD_HOST", default="127.0.0.1", help="interface to listen on")
    option(p, "--port", env="DASHBOARD_PORT", type=positive_int, default=8080, help="port to listen on")
    option(p, "--basic-auth", env="DASHBOARD_BASIC_AUTH", metavar="USER:PASSWORD", secret=True,
           shown="none", help="require this login (prefer the variable: arguments show in ps)")
    option(p, "--read-only", env="DASHBOARD_READ_ONLY", action="store_true", default=False,
           env_type=boolean, help="pages only, no action")
    option(p, "--insecure-local", action="store_true", default=False,
           help="no login and every action; refused unless --host is a loopback address")
    option(p, "--hide-payloads", env="DASHBOARD_HIDE_PAYLOADS", action="store_true", default=False,
           env_type=boolean, help="never show event payloads (their size only)")
    option(p, "--statement-timeout", env="DASHBOARD_STATEMENT_TIMEOUT", type=duration, unit="s",
           default=5.0, help="longest a page's query may run")
    option(p, "--live-refresh", env="DASHBOARD_LIVE_REFRESH", type=duration, unit="s",
           default=10.0, help="how often the overview, limits, cron and audit pages re-read "
                              "themselves in the browser (0: never)")
    option(p, "--public-url", env="DASHBOARD_PUBLIC_URL", metavar="URL",
           help="the address browsers use behind a reverse proxy, e.g. https://ops.example.com: "
                "a POST's Origin must match it, https marks the cookie Secure, its path "
                "prefixes every link")
    p.add_argument("--allowed-host", action="append", dest="allowed_hosts", default=[],
                   metavar="NAME[:PORT]",
                   help="a Host name the dashboard answers besides IP addresses, localhost and "
                        "the --public-url host (repeatable; '*' for any); any other Host gets "
                        "400, so a page that rebinds its DNS name here cannot use it")


def _loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def access(args: argparse.Namespace) -> Any:
    """The ``authorize`` callable the flags ask for; ConfigError when they ask for none."""
    from conveyor.dashboard import allow_all, basic_auth, read_only

    if args.insecure_local:
        if args.basic_auth or args.read_only:
            raise ConfigError("--insecure-local cannot be combined with --basic-auth or --read-only")
        if not _loopback(args.host):
            raise ConfigError(f"--insecure-local serves every action without a login: refused on "
                              f"--host {args.host!r} (use 127.0.0.1, or --basic-auth)")
        return allow_all
    if args.basic_auth:
        return basic_auth(args.basic_auth, actions=not args.read_only)
    if args.read_only:
        return read_only
    raise ConfigError("the dashboard needs --basic-auth USER:PASSWORD, --read-only, or "
                      "--insecure-local (on 127.0.0.1): it will not serve actions to anyone "
                      "who reaches the port")


def run_dashboard(ctx: Context, args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from conveyor.dashboard import dashboard_app
    except ImportError as exc:
        raise MissingExtraError("conveyor dashboard", "dashboard", module=exc.name) from None
    authorize = access(args)
    config = dashboard_config(args, ctx.schema)
    ctx.connect()   # fail now, with the usual message, when the database or schema is wrong
    app = dashboard_app(ctx.url(), config, authorize=authorize)
    mode = ("read-only" if args.read_only else "") if not args.insecure_local else "no login"
    if args.basic_auth:
        mode = "basic auth" + (", read-only" if args.read_only else "")
    note(f"dashboard on http://{args.host}:{args.port}/ ({mode})"
         + (f", public address {config.public_url}" if config.public_url else ""))
    # uvicorn stops gracefully on SIGTERM, then raises the signal again for
    # the handler it found: the default one would end the process by the
    # signal (exit -15). A stop asked for is a clean exit: 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def dashboard_config(args: argparse.Namespace, schema: str) -> Any:
    """The DashboardConfig the flags ask for; standalone, the Host is always checked
    (a name given as --host is one the dashboard answers)."""
    from conveyor.dashboard import DashboardConfig

    hosts = list(args.allowed_hosts or ())
    if not _is_address(args.host):
        hosts.append(args.host)
    return DashboardConfig(schema=schema, hide_payloads=args.hide_payloads,
                           statement_timeout=args.statement_timeout, public_url=args.public_url,
                           allowed_hosts=tuple(hosts), live_refresh=args.live_refresh)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
