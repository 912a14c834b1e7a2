"""Fixtures for the consumer tests: real peers on loopback, never mocks.

* ``smtp_server``: an aiosmtpd server on 127.0.0.1 (random free port) with
  STARTTLS (a certificate issued here by a trustme CA), ``require_starttls``,
  and AUTH through an authenticator that refuses wrong passwords correctly
  (``AuthResult(success=False, handled=False)``, so the client gets a 535).
  It stores every received DATA as raw bytes and counts sessions.
* ``silent_server``: a socket that accepts connections and never says a word.
* ``closed_port``: a port nobody listens on.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword

SMTP_USER = "mailer"
SMTP_PASSWORD = "correct horse battery staple"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------- TLS


@dataclass
class Tls:
    ca: trustme.CA
    ca_file: str
    server_context: Any


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    """A private CA and a server certificate for 127.0.0.1 and localhost."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    import ssl

    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_context)
    ca_file = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return Tls(ca=ca, ca_file=str(ca_file), server_context=server_context)


# --------------------------------------------------------------------- SMTP


@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    raw: bytes


@dataclass
class SmtpServer:
    """A running aiosmtpd server and everything it saw."""

    host: str
    port: int
    messages: list[Received] = field(default_factory=list)
    sessions: int = 0            # TCP connections accepted (after start-up)
    auth_ok: int = 0
    auth_refused: int = 0
    tls_sessions: int = 0
    rcpt_reply: str | None = None   # e.g. "550 no such user"; None accepts
    data_reply: str | None = None   # e.g. "451 try later"; None accepts
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset_counters(self) -> None:
        with self.lock:
            self.sessions = 0


class _Handler:
    def __init__(self, server: SmtpServer) -> None:
        self.server = server

    async def handle_EHLO(self, server: Any, session: Any, envelope: Any, hostname: str,
                          responses: list[str]) -> list[str]:
        session.host_name = hostname
        if server._tls_protocol is not None:
            with self.server.lock:
                self.server.tls_sessions += 1
        return responses

    async def handle_RCPT(self, server: Any, session: Any, envelope: Any, address: str,
                          rcpt_options: list[str]) -> str:
        if self.server.rcpt_reply is not None:
            return self.server.rcpt_reply
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        if self.server.data_reply is not None:
            return self.server.data_reply
        with self.server.lock:
            self.server.messages.append(
                Received(envelope.mail_from, list(envelope.rcpt_tos), bytes(envelope.original_content)))
        return "250 Message accepted for delivery"


def _authenticator(state: SmtpServer):  # type: ignore[no-untyped-def]
    def authenticate(server: Any, session: Any, envelope: Any, mechanism: str,
                     auth_data: Any) -> AuthResult:
        if (isinstance(auth_data, LoginPassword) and auth_data.login == SMTP_USER.encode()
                and auth_data.password == SMTP_PASSWORD.encode()):
            with state.lock:
                state.auth_ok += 1
            return AuthResult(success=True)
        with state.lock:
            state.auth_refused += 1
        # handled=False makes aiosmtpd answer 535; the default would answer nothing.
        return AuthResult(success=False, handled=False)

    return authenticate


class _CountingController(Controller):
    def __init__(self, state: SmtpServer, **kwargs: Any) -> None:
        self.state = state
        self.counting = False
        super().__init__(_Handler(state), **kwargs)

    def factory(self) -> SMTP:
        smtp = super().factory()
        if self.counting:
            with self.state.lock:
                self.state.sessions += 1
        return smtp


def _start_smtp(tls: Tls | None, *, auth: bool, **extra: Any) -> tuple[_CountingController, SmtpServer]:
    port = free_port()
    state = SmtpServer(host="127.0.0.1", port=port)
    kwargs: dict[str, Any] = dict(hostname="127.0.0.1", port=port, ready_timeout=5.0, **extra)
    if tls is not None:
        kwargs.update(tls_context=tls.server_context, require_starttls=True)
    if auth:
        kwargs.update(auth_required=True, auth_require_tls=tls is not None,
                      authenticator=_authenticator(state))
    controller = _CountingController(state, **kwargs)
    controller.start()
    controller.counting = True  # start() made one probe connection of its own
    return controller, state


@pytest.fixture
def smtp_server(tls: Tls) -> Iterator[SmtpServer]:
    """STARTTLS required, AUTH required (user ``mailer``)."""
    controller, state = _start_smtp(tls, auth=True)
    try:
        yield state
    finally:
        controller.stop()


@pytest.fixture
def smtp_server_noauth(tls: Tls) -> Iterator[SmtpServer]:
    """STARTTLS required, no AUTH offered."""
    controller, state = _start_smtp(tls, auth=False)
    try:
        yield state
    finally:
        controller.stop()


@pytest.fixture
def smtp_server_short_idle(tls: Tls) -> Iterator[SmtpServer]:
    """Like ``smtp_server`` but closes a connection idle for 0.5 s (421, then close)."""
    controller, state = _start_smtp(tls, auth=True, timeout=0.5)
    try:
        yield state
    finally:
        controller.stop()


@pytest.fixture
def smtp_server_plaintext() -> Iterator[SmtpServer]:
    """No STARTTLS offered (as after a downgrade by a man in the middle), AUTH accepted in clear."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # aiosmtpd warns about AUTH without TLS: that is the point
        controller, state = _start_smtp(None, auth=True)
    try:
        yield state
    finally:
        controller.stop()


# ------------------------------------------------------------- odd servers


@dataclass
class Silent:
    host: str
    port: int
    accepted: list[socket.socket]


@pytest.fixture
def silent_server() -> Iterator[Silent]:
    """Accepts TCP connections and never sends a byte."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    state = Silent("127.0.0.1", listener.getsockname()[1], [])
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            state.accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        stop.set()
        thread.join(timeout=2)
        for conn in state.accepted:
            conn.close()
        listener.close()


@pytest.fixture
def closed_port() -> int:
    """A loopback port with no listener (connections are refused)."""
    return free_port()


@pytest.fixture
def templates_dir(tmp_path: Path) -> Path:
    """An application template folder: overrides ``welcome``, adds ``invoice`` and ``htmlonly``."""
    d = tmp_path / "mail-templates"
    d.mkdir()
    (d / "welcome.subject.txt").write_text("App welcome for {{ name }}\n")
    (d / "welcome.txt").write_text("Custom welcome, {{ name }}.\n")
    (d / "invoice.subject.txt").write_text("Invoice {{ number }}\n")
    (d / "invoice.txt").write_text("Invoice {{ number }}: {{ amount }} EUR\n")
    (d / "invoice.html").write_text("<p>Invoice <b>{{ number }}</b>: {{ amount }} EUR</p>\n")
    (d / "htmlonly.subject.txt").write_text("Only HTML\n")
    (d / "htmlonly.html").write_text("<p>Hi {{ name }}</p>\n")
    return d
