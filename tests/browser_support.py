"""Fixtures and helpers for tests that drive a real browser: Debian's chromium through Playwright.

The browser is the distribution's chromium (``scripts/test.sh`` installs it),
never one downloaded by ``playwright install``: that download is not reachable
everywhere the tests run. Without chromium the browser tests fail and say how
to install it; they never skip.

A test module takes the fixtures with
``from browser_support import browser, page, phone_page`` and lists them in
its ``__all__`` (imported fixtures are otherwise "unused" to ruff).

Playwright's sync API refuses to start inside a running event loop, and while
it is alive it marks its own loop as the thread's running loop, so an
``async def`` test would fail to start its loop. Browser tests are plain
``def`` tests, and ``browser`` lives for one module, so that the async tests of
other modules run after it has stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from playwright.sync_api import Browser, Page, ViewportSize, sync_playwright
from starlette.types import ASGIApp

DEBIAN_CHROMIUM = Path("/usr/bin/chromium")
DESKTOP_VIEWPORT = ViewportSize(width=1280, height=900)
PHONE_VIEWPORT = ViewportSize(width=390, height=844)
# Playwright waits 30 s by default; a page of a local test server that has not
# answered in 10 s will not, and the failure should come while it is fresh.
ACTION_TIMEOUT_MS = 10_000
SERVER_START_TIMEOUT = 10.0
REPO = Path(__file__).resolve().parent.parent


def chromium_path() -> str:
    """The Debian chromium executable: /usr/bin/chromium, else ``chromium`` on PATH.

    Raises FileNotFoundError naming what is missing and how to install it.
    """
    if os.access(DEBIAN_CHROMIUM, os.X_OK):
        return str(DEBIAN_CHROMIUM)
    found = shutil.which("chromium")
    if found is not None:
        return found
    raise FileNotFoundError(
        f"chromium is missing: no executable {DEBIAN_CHROMIUM} and no chromium on PATH; the browser "
        "tests drive Debian's chromium (install it: apt-get install --no-install-recommends chromium, "
        "as scripts/test.sh does when run as root)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """A headless chromium for the module's tests (see the module docstring for why not the session)."""
    try:
        executable = chromium_path()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    with sync_playwright() as playwright:
        # --no-sandbox: the tests run as root, where chromium's sandbox refuses to start.
        launched = playwright.chromium.launch(executable_path=executable, headless=True,
                                              args=["--no-sandbox"])
        yield launched
        launched.close()


@contextlib.contextmanager
def open_page(browser: Browser, viewport: ViewportSize = DESKTOP_VIEWPORT) -> Iterator[Page]:
    """A page in a context of its own (no cookies or storage shared with other tests), closed on exit."""
    context = browser.new_context(viewport=viewport)
    context.set_default_timeout(ACTION_TIMEOUT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh desktop-sized page (1280x900)."""
    with open_page(browser, DESKTOP_VIEWPORT) as opened:
        yield opened


@pytest.fixture
def phone_page(browser: Browser) -> Iterator[Page]:
    """A fresh phone-sized page (390x844, an iPhone 12 to 15's CSS pixels)."""
    with open_page(browser, PHONE_VIEWPORT) as opened:
        yield opened


def artifacts_dir() -> Path:
    """``$CONVEYOR_ARTIFACTS`` when set (CI collects it), else ``<repo>/.artifacts`` (git-ignored)."""
    configured = os.environ.get("CONVEYOR_ARTIFACTS")
    return Path(configured) if configured else REPO / ".artifacts"


def screenshot(page: Page, name: str, *, full_page: bool = True) -> Path:
    """Save a PNG of ``page`` as ``<artifacts>/screenshots/<name>.png`` and return its path.

    The name is reduced to letters, digits, ``.``, ``_`` and ``-`` so that a
    test id can serve as one; an existing file of that name is replaced.
    """
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name.removesuffix(".png")).strip("-.")
    if not stem:
        raise ValueError(f"expected a screenshot name with a letter or digit, got {name!r}")
    path = artifacts_dir() / "screenshots" / f"{stem}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=path, full_page=full_page)
    return path


@contextlib.contextmanager
def serve_asgi(app: ASGIApp) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 in a background thread; yield its base URL.

    ``with serve_asgi(app) as base_url: page.goto(base_url + "/")``. The socket
    is bound before the server starts, so the port is known and no other
    process can take it in between. The server stops on exit.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    # log_config=None: uvicorn's records go to the root logger, which pytest
    # captures and shows with a failing test, instead of replacing the logging setup.
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None,
                            access_log=False, lifespan="auto", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]},
                              name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        _wait_started(server, thread)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=SERVER_START_TIMEOUT)
        listener.close()
    if thread.is_alive():
        raise RuntimeError(f"the test server on port {port} did not stop within {SERVER_START_TIMEOUT} s")


def _wait_started(server: uvicorn.Server, thread: threading.Thread) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while not server.started:
        # uvicorn ends its thread with SystemExit when the app's startup fails.
        if not thread.is_alive():
            raise RuntimeError("the test server stopped before it started (its log is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test server did not start within {SERVER_START_TIMEOUT} s")
        time.sleep(0.01)
