"""The ``email.send`` consumer: renders a named template and sends it over SMTP.

Payload::

    {"to": "ana@example.com" | ["ana@example.com", ...],
     "template": "verification",          # built-in: verification, welcome
     "data": {"name": "Ana", "link": "https://..."},
     "reply_to": "support@example.com"}   # optional

Each template is up to three files: ``<name>.subject.txt`` (required),
``<name>.html`` (autoescaped) and ``<name>.txt``; with both bodies the mail is
multipart/alternative. An application's own folder is searched before the
built-in one, so it can add templates or override ours.

Failure policy (at-least-once delivery, so redelivery must be harmless):

* malformed payload, unknown template, missing template data, empty or
  invalid recipient, CR/LF in any header value: **permanent** (parked at once,
  no SMTP dialogue started);
* connection failure, timeout, 4xx reply: retried with backoff;
* 5xx reply: **permanent**.

The Message-ID is derived from the event id, so a redelivered mail carries the
same id and a downstream system can drop the duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.message import EmailMessage
from email.policy import SMTP as SMTP_POLICY
from email.utils import format_datetime, parseaddr
from pathlib import Path
from typing import Any

from conveyor.errors import ConfigError, MissingExtraError

try:
    import aiosmtplib
    import jinja2
except ImportError as exc:
    raise MissingExtraError("the email consumer", "email", module=exc.name) from exc
from conveyor.outcomes import PermanentFailure
from conveyor.types import Event

log = logging.getLogger(__name__)

TIMEOUT_DEFAULT = 15.0
_ADDRESS_RE = re.compile(r"[^@\s<>()\[\]\\,;:\"]+@[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_DOMAIN_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*")
BUILTIN_TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True, kw_only=True, slots=True)
class SmtpConfig:
    """The SMTP provider and the sender identity.

    Attributes:
        host: SMTP server host name.
        port: SMTP port. Defaults to 587.
        from_address: the From address of every mail, e.g. ``"App <no-reply@app.test>"``.
        username: AUTH user; AUTH is attempted only when set. Defaults to ``None``.
        password: AUTH password. Defaults to ``None``.
        implicit_tls: TLS from the first byte (port 465 style) instead of STARTTLS.
            Defaults to False.
        starttls: upgrade with STARTTLS when the server offers it. Defaults to True.
        ca_file: extra CA bundle to trust (e.g. a private relay's CA). Defaults to ``None``.
        insecure_skip_verify: TEST ONLY: accept any certificate. Defaults to False.
        timeout: seconds one whole SMTP dialogue may take. Defaults to 15.
        message_id_domain: right-hand side of Message-IDs. Defaults to the From domain.
        max_connections: connections kept open and reused across mails. Defaults to 2.
        templates_dir: the application's own template folder, searched first.
            Defaults to ``None`` (built-in templates only).
    """

    host: str
    port: int = 587
    from_address: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    implicit_tls: bool = False
    starttls: bool = True
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    timeout: float = TIMEOUT_DEFAULT
    message_id_domain: str | None = None
    max_connections: int = 2
    templates_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.host or _CONTROL_RE.search(self.host):
            raise ConfigError(f"expected host to be a host name, got {self.host!r}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"expected port to be 1..65535, got {self.port!r}")
        if not self.timeout > 0:
            raise ConfigError(f"expected timeout to be > 0, got {self.timeout!r}")
        if self.max_connections < 1:
            raise ConfigError(f"expected max_connections to be >= 1, got {self.max_connections!r}")
        if _CONTROL_RE.search(self.from_address):
            raise ConfigError(f"from_address contains control characters: {self.from_address!r:.80}")
        try:
            _address(parseaddr(self.from_address)[1], "from_address")
        except PermanentFailure as exc:
            raise ConfigError(str(exc)) from None
        if self.message_id_domain is not None and not _DOMAIN_RE.fullmatch(self.message_id_domain):
            raise ConfigError(
                f"expected message_id_domain to be a domain name, got {self.message_id_domain!r:.80}")
        if (self.username is None) != (self.password is None):
            raise ConfigError("username and password must be set together")

    @property
    def id_domain(self) -> str:
        return self.message_id_domain or parseaddr(self.from_address)[1].rpartition("@")[2]


def _address(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise PermanentFailure(f"{what} must be a non-empty email address, got {value!r:.80}")
    if _CONTROL_RE.search(value):
        raise PermanentFailure(f"{what} contains control characters (CR/LF): {value!r:.80}")
    if len(value) > 254 or parseaddr(value)[1] != value or not _ADDRESS_RE.fullmatch(value):
        raise PermanentFailure(f"{what} is not a valid email address: {value!r:.80}")
    return value


def _header_text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise PermanentFailure(f"{what} must be a string, got {value!r:.80}")
    if _CONTROL_RE.search(value):
        raise PermanentFailure(f"{what} contains control characters (CR/LF): {value!r:.80}")
    return value


class TemplateSet:
    """Named mail templates from an application folder and the built-in ones."""

    def __init__(self, app_dir: str | Path | None = None) -> None:
        folders: list[Path] = []
        if app_dir is not None:
            if not Path(app_dir).is_dir():
                raise ConfigError(f"templates_dir {str(app_dir)!r} is not a directory")
            folders.append(Path(app_dir))
        folders.append(BUILTIN_TEMPLATES)
        # One environment per folder: a template is taken whole from the first
        # folder that has its subject, never mixed part by part across folders.
        self._envs = [jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(folder)),
            autoescape=jinja2.select_autoescape(["html"]),
            undefined=jinja2.StrictUndefined,
            keep_trailing_newline=True,
        ) for folder in folders]

    @staticmethod
    def _optional(env: jinja2.Environment, name: str) -> jinja2.Template | None:
        try:
            return env.get_template(name)
        except jinja2.TemplateNotFound:
            return None

    def render(self, name: object, data: dict[str, Any]) -> tuple[str, str | None, str | None]:
        """(subject, text body, html body) of template ``name``; bodies may be ``None``."""
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", name):
            raise PermanentFailure(f"invalid template name {name!r:.80}")
        for env in self._envs:
            subject_t = self._optional(env, f"{name}.subject.txt")
            if subject_t is not None:
                text_t = self._optional(env, f"{name}.txt")
                html_t = self._optional(env, f"{name}.html")
                break
        else:
            raise PermanentFailure(f"unknown email template {name!r}")
        if text_t is None and html_t is None:
            raise PermanentFailure(f"email template {name!r} has neither a .txt nor an .html body")
        try:
            subject = subject_t.render(data).strip()
            text = text_t.render(data) if text_t else None
            html = html_t.render(data) if html_t else None
        except jinja2.UndefinedError as exc:
            raise PermanentFailure(f"template {name!r} needs data it was not given: {exc}") from None
        except jinja2.TemplateError as exc:
            raise PermanentFailure(f"template {name!r} failed to render: {exc}") from None
        return subject, text, html


def build_message(event: Event, config: SmtpConfig, templates: TemplateSet) -> EmailMessage:
    """Validate the payload and build the MIME message; raises PermanentFailure on bad input."""
    payload = event.payload
    if not isinstance(payload, dict):
        raise PermanentFailure("email payload must be a JSON object")
    to_raw = payload.get("to")
    recipients = to_raw if isinstance(to_raw, list) else [to_raw]
    if not recipients:
        raise PermanentFailure("email payload has no recipient")
    to = [_address(r, "recipient") for r in recipients]
    data = payload.get("data", {})
    if not isinstance(data, dict):
        raise PermanentFailure("email payload 'data' must be a JSON object")
    subject, text, html = templates.render(payload.get("template"), data)
    msg = EmailMessage(policy=SMTP_POLICY)
    try:
        msg["From"] = config.from_address
        msg["To"] = ", ".join(to)
        msg["Subject"] = _header_text(subject, "subject")
        if "reply_to" in payload:
            msg["Reply-To"] = _address(payload["reply_to"], "reply_to")
        msg["Message-ID"] = message_id(event, config)
        msg["Date"] = format_datetime(datetime.now(UTC))
        if text is not None:
            msg.set_content(text)
            if html is not None:
                msg.add_alternative(html, subtype="html")
        else:
            msg.set_content(html or "", subtype="html")
    except ValueError as exc:  # the email package refuses CR/LF in headers
        raise PermanentFailure(f"invalid header value: {exc}") from None
    return msg


def message_id(event: Event, config: SmtpConfig) -> str:
    """Deterministic per event, so every redelivery of one event has the same Message-ID."""
    tenant = event.tenant or "default"
    return f"<conveyor.{tenant}.{event.id}@{config.id_domain}>"


def _tls_context(config: SmtpConfig) -> ssl.SSLContext:
    if config.insecure_skip_verify:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=config.ca_file)


class SmtpUnavailableError(ConnectionError):
    """Connecting or logging in to the SMTP server failed; the mail will be retried."""


class EmailConsumer:
    """Handler for ``email.send``; route it with ``router.add("email.send", consumer)``.

    Keeps up to ``max_connections`` authenticated SMTP connections and reuses
    them; a connection that saw any error is dropped, never reused.
    """

    def __init__(self, config: SmtpConfig, templates: TemplateSet | None = None) -> None:
        self.config = config
        self.templates = templates or TemplateSet(config.templates_dir)
        self._idle: list[aiosmtplib.SMTP] = []
        self._slots = asyncio.Semaphore(config.max_connections)
        # Built once: loading the system trust store is costly (measured:
        # docs/benchmarks-consumers.md), and every new connection would pay it.
        self._tls_context = (_tls_context(config) if config.implicit_tls or config.starttls
                             else None)
        self.sent = 0
        self.connections_opened = 0

    async def __call__(self, event: Event) -> None:
        message = build_message(event, self.config, self.templates)
        async with self._slots:
            client = self._idle.pop() if self._idle else None
            try:
                async with asyncio.timeout(self.config.timeout):
                    if client is None or not client.is_connected:
                        client = await self._open()
                    await client.send_message(message)
            except aiosmtplib.SMTPAuthenticationError:
                # A refused login says nothing about this mail (a rotated password,
                # a relay hiccup): retry, never park.
                await self._discard(client)
                raise
            except aiosmtplib.SMTPRecipientsRefused as exc:
                await self._discard(client)
                codes = [getattr(e, "code", 0) for e in exc.recipients]
                if codes and all(c >= 500 for c in codes):
                    raise PermanentFailure(f"all recipients refused: {exc.recipients[0]}") from None
                raise
            except aiosmtplib.SMTPResponseException as exc:
                await self._discard(client)
                if exc.code >= 500:
                    raise PermanentFailure(f"SMTP server refused the mail: {exc.code} {exc.message}") \
                        from None
                raise
            except BaseException:
                await self._discard(client)
                raise
            self._idle.append(client)
            self.sent += 1

    async def _open(self) -> aiosmtplib.SMTP:
        """Connect and log in; any failure here is about the server, so it is retryable."""
        try:
            return await self._connect()
        except aiosmtplib.SMTPException as exc:
            raise SmtpUnavailableError(f"SMTP server {self.config.host}:{self.config.port} "
                                       f"unavailable: {exc}") from exc

    async def _connect(self) -> aiosmtplib.SMTP:
        c = self.config
        client = aiosmtplib.SMTP(
            hostname=c.host, port=c.port, timeout=c.timeout, use_tls=c.implicit_tls,
            # With credentials, STARTTLS is required, never merely attempted: a server
            # (or a man in the middle) not offering it must not get the password.
            start_tls=(False if c.implicit_tls or not c.starttls
                       else True if c.username is not None else None),
            tls_context=self._tls_context,
            validate_certs=not c.insecure_skip_verify)
        await client.connect()
        self.connections_opened += 1
        if c.username is not None and c.password is not None:
            try:
                await client.login(c.username, c.password)
            except BaseException:
                client.close()
                raise
        return client

    async def _discard(self, client: aiosmtplib.SMTP | None) -> None:
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - it is being thrown away
                pass

    async def aclose(self) -> None:
        while self._idle:
            client = self._idle.pop()
            try:
                await asyncio.wait_for(client.quit(), timeout=2)
            except Exception:  # noqa: BLE001 - closing is best effort
                client.close()
