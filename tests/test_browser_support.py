"""The browser test infrastructure works for real: Debian's chromium loads and submits a served page."""

from __future__ import annotations

import html
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

import browser_support
from browser_support import browser, chromium_path, page, phone_page, screenshot, serve_asgi

__all__ = ["browser", "page", "phone_page"]  # shared fixtures

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

FORM_PAGE = """<!doctype html>
<html><head><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Echo</title></head>
<body><h1>Echo</h1>
<form method="post" action="/echo">
  <label>Message <input name="message" id="message"></label>
  <button type="submit">Send</button>
</form></body></html>"""


async def form(request: Request) -> HTMLResponse:
    return HTMLResponse(FORM_PAGE)


async def echo(request: Request) -> HTMLResponse:
    message = (await request.form()).get("message", "")
    assert isinstance(message, str)
    return HTMLResponse(f"<!doctype html><title>Result</title>"
                        f"<p id='result'>You said: {html.escape(message)}</p>")


def echo_app() -> Starlette:
    return Starlette(routes=[Route("/", form), Route("/echo", echo, methods=["POST"])])


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serve_asgi(echo_app()) as url:
        yield url


@pytest.mark.light   # scripts/test.sh installs chromium while the parallel tier runs
def test_chromium_path_is_an_executable() -> None:
    assert Path(chromium_path()).is_file()


def test_chromium_path_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(browser_support, "DEBIAN_CHROMIUM", tmp_path / "chromium")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"chromium is missing.*apt-get install"):
        chromium_path()


def test_serve_asgi_answers_over_http_and_stops_on_exit() -> None:
    with serve_asgi(echo_app()) as url:
        assert httpx.get(url + "/").text == FORM_PAGE
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/")


def test_submitted_form_shows_the_echo(page: Page, base_url: str) -> None:
    page.goto(base_url + "/")
    page.fill("#message", "hello <conveyor>")
    page.click("button[type=submit]")
    page.wait_for_url(base_url + "/echo")
    assert page.inner_text("#result") == "You said: hello <conveyor>"


def test_screenshot_writes_a_png_under_the_artifacts_dir(
        page: Page, base_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONVEYOR_ARTIFACTS", str(tmp_path))
    page.goto(base_url + "/")
    path = screenshot(page, "echo form")
    assert path == tmp_path / "screenshots" / "echo-form.png"
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    assert path.stat().st_size > 1000


def test_screenshot_defaults_to_the_repo_artifacts_dir(
        page: Page, base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_ARTIFACTS", raising=False)
    page.goto(base_url + "/")
    path = screenshot(page, "browser-support-echo-form")
    assert path == browser_support.REPO / ".artifacts" / "screenshots" / "browser-support-echo-form.png"
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_desktop_page_is_1280_wide(page: Page, base_url: str) -> None:
    page.goto(base_url + "/")
    assert page.evaluate("[window.innerWidth, window.innerHeight]") == [1280, 900]


def test_phone_page_is_390_wide(phone_page: Page, base_url: str) -> None:
    phone_page.goto(base_url + "/")
    assert phone_page.evaluate("window.innerWidth") == 390
    screenshot(phone_page, "browser-support-echo-form-phone")
