"""The ``email.send`` consumer against a real SMTP server on loopback.

aiosmtpd with STARTTLS (certificate from a CA made in the test), AUTH, and a
handler that keeps the raw DATA bytes, which are parsed back here.
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.consumers.email import EmailConsumer, SmtpConfig, TemplateSet, build_message, message_id
from conveyor.errors import ConfigError
from conveyor.outcomes import HandlerSignal, PermanentFailure
from conveyor.types import Event

from .conftest import SMTP_PASSWORD, SMTP_USER, Silent, SmtpServer, Tls

FROM = "Shop <no-reply@shop.test>"
_ids = itertools.count(1000)


def make_event(payload: Any, *, event_id: int | None = None, tenant: str | None = "acme") -> Event:
    return Event(id=next(_ids) if event_id is None else event_id, topic="email.send",
                 payload_text=json.dumps(payload), tenant=tenant)


def config_for(server: SmtpServer | Silent, tls: Tls | None, **overrides: Any) -> SmtpConfig:
    values: dict[str, Any] = dict(
        host=server.host, port=server.port, from_address=FROM, username=SMTP_USER,
        password=SMTP_PASSWORD, ca_file=tls.ca_file if tls else None, timeout=5.0)
    values.update(overrides)
    return SmtpConfig(**values)


def verification(to: Any = "ana@example.com", **data: Any) -> dict[str, Any]:
    return {"to": to, "template": "verification",
            "data": {"name": "Ana", "link": "https://shop.test/verify?t=abc", "product": "",
                     "expires_in": "", **data}}


def welcome(to: Any = "ana@example.com", **data: Any) -> dict[str, Any]:
    return {"to": to, "template": "welcome",
            "data": {"name": "Ana", "product": "Shop", "login_url": "https://shop.test/login", **data}}


async def send(consumer: EmailConsumer, event: Event) -> None:
    await asyncio.wait_for(consumer(event), timeout=consumer.config.timeout + 5)


def parse(raw: bytes) -> email.message.EmailMessage:
    return email.message_from_bytes(raw, policy=email.policy.default)  # type: ignore[return-value]


def header_names(msg: email.message.Message) -> list[str]:
    return [k.lower() for k in msg.keys()]  # noqa: SIM118 - Message is not a dict


def assert_crlf_only(raw: bytes) -> None:
    assert raw, "no DATA received"
    assert re.search(rb"(?<!\r)\n", raw) is None, "bare LF in DATA"
    assert re.search(rb"\r(?!\n)", raw) is None, "bare CR in DATA"


MULTIPART_HEADERS = {"from", "to", "subject", "message-id", "mime-version", "content-type"}


@pytest.fixture
async def consumer(smtp_server: SmtpServer, tls: Tls):  # type: ignore[no-untyped-def]
    c = EmailConsumer(config_for(smtp_server, tls))
    yield c
    await c.aclose()


# ------------------------------------------------------------------ delivery


async def test_delivers_multipart_over_starttls_with_auth(consumer: EmailConsumer,
                                                          smtp_server: SmtpServer) -> None:
    event = make_event(verification(name="Ana <script>alert(1)</script>"))
    await send(consumer, event)

    assert len(smtp_server.messages) == 1
    got = smtp_server.messages[0]
    assert smtp_server.auth_ok == 1 and smtp_server.auth_refused == 0
    assert smtp_server.tls_sessions >= 1
    assert got.mail_from == "no-reply@shop.test"
    assert got.rcpt_tos == ["ana@example.com"]
    assert_crlf_only(got.raw)

    msg = parse(got.raw)
    # Exactly the intended headers, each once (Date is checked on its own, below).
    names = header_names(msg)
    assert len(names) == len(set(names)), names
    assert set(names) - {"date"} == MULTIPART_HEADERS
    assert msg["From"] == FROM
    assert msg["To"] == "ana@example.com"
    assert msg["Subject"] == "Confirm your email address"
    assert msg["Message-ID"] == message_id(event, consumer.config)
    assert msg["Message-ID"] == f"<conveyor.acme.{event.id}@shop.test>"
    assert msg["MIME-Version"] == "1.0"
    assert msg.get_content_type() == "multipart/alternative"

    parts = list(msg.iter_parts())
    assert [p.get_content_type() for p in parts] == ["text/plain", "text/html"]
    text, html = parts[0].get_content(), parts[1].get_content()
    assert "https://shop.test/verify?t=abc" in text
    # HTML is autoescaped: the payload's markup is inert text.
    assert "<script>" not in html
    assert "Ana &lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert 'href="https://shop.test/verify?t=abc"' in html
    # The text part carries the data verbatim (it is not HTML).
    assert "Ana <script>alert(1)</script>" in text
    assert consumer.sent == 1


async def test_mail_has_a_date_header(consumer: EmailConsumer, smtp_server: SmtpServer) -> None:
    await send(consumer, make_event(verification()))
    assert parse(smtp_server.messages[0].raw)["Date"] is not None


async def test_reply_to_and_several_recipients(consumer: EmailConsumer, smtp_server: SmtpServer) -> None:
    payload = verification(to=["ana@example.com", "bo@example.org"]) | {"reply_to": "help@shop.test"}
    await send(consumer, make_event(payload))
    got = smtp_server.messages[0]
    assert sorted(got.rcpt_tos) == ["ana@example.com", "bo@example.org"]
    msg = parse(got.raw)
    assert set(header_names(msg)) - {"date"} == MULTIPART_HEADERS | {"reply-to"}
    assert msg["Reply-To"] == "help@shop.test"
    assert [a.addr_spec for a in msg["To"].addresses] == ["ana@example.com", "bo@example.org"]


async def test_builtin_welcome_template(consumer: EmailConsumer, smtp_server: SmtpServer) -> None:
    await send(consumer, make_event(welcome()))
    msg = parse(smtp_server.messages[0].raw)
    assert msg["Subject"] == "Welcome to Shop, Ana"
    text = msg.get_body(("plain",)).get_content()
    html = msg.get_body(("html",)).get_content()
    assert "welcome aboard Shop!" in text and "https://shop.test/login" in text
    assert 'href="https://shop.test/login"' in html


async def test_non_ascii_and_very_long_lines(consumer: EmailConsumer, smtp_server: SmtpServer) -> None:
    link = "https://shop.test/verify?t=" + "x" * 5000
    await send(consumer, make_event(welcome(name="José 🚀 Ñandú", login_url=link)))
    raw = smtp_server.messages[0].raw
    assert_crlf_only(raw)
    assert max(len(line) for line in raw.split(b"\r\n")) <= 998  # RFC 5322 2.1.1
    raw.decode("ascii")  # headers encoded (RFC 2047), bodies transfer-encoded: no SMTPUTF8 needed
    msg = parse(raw)
    assert msg["Subject"] == "Welcome to Shop, José 🚀 Ñandú"
    assert link in msg.get_body(("plain",)).get_content()
    assert link in msg.get_body(("html",)).get_content()


async def test_message_id_is_deterministic_on_redelivery(consumer: EmailConsumer,
                                                         smtp_server: SmtpServer) -> None:
    first = make_event(verification(), event_id=4242)
    redelivered = Event(id=4242, topic="email.send", payload_text=json.dumps(verification()),
                        tenant="acme", attempt=2)
    other = make_event(verification(), event_id=4243)
    for ev in (first, redelivered, other):
        await send(consumer, ev)
    ids = [parse(m.raw)["Message-ID"] for m in smtp_server.messages]
    assert ids[0] == ids[1] == message_id(first, consumer.config) == "<conveyor.acme.4242@shop.test>"
    assert ids[2] != ids[0]
    # Tenant-less events and a configured id domain.
    cfg = SmtpConfig(host="h", from_address=FROM, message_id_domain="mail.shop.test")
    assert message_id(make_event({}, event_id=7, tenant=None), cfg) == "<conveyor.default.7@mail.shop.test>"


async def test_app_templates_dir_overrides_and_adds(smtp_server: SmtpServer, tls: Tls,
                                                    templates_dir: Path) -> None:
    c = EmailConsumer(config_for(smtp_server, tls, templates_dir=str(templates_dir)))
    try:
        await send(c, make_event(welcome()))
        await send(c, make_event({"to": "ana@example.com", "template": "invoice",
                                  "data": {"number": "F-7", "amount": "12.50"}}))
        await send(c, make_event({"to": "ana@example.com", "template": "htmlonly",
                                  "data": {"name": "<b>Ana</b>"}}))
        # A built-in template the app folder does not override still works.
        await send(c, make_event(verification()))
    finally:
        await c.aclose()
    welcome_m, invoice, htmlonly, verif = (parse(m.raw) for m in smtp_server.messages)
    assert welcome_m["Subject"] == "App welcome for Ana"
    assert welcome_m.get_body(("plain",)).get_content().rstrip() == "Custom welcome, Ana."
    assert invoice["Subject"] == "Invoice F-7"
    assert invoice.get_content_type() == "multipart/alternative"
    assert "<b>F-7</b>" in invoice.get_body(("html",)).get_content()
    assert "Invoice F-7: 12.50 EUR" in invoice.get_body(("plain",)).get_content()
    assert htmlonly.get_content_type() == "text/html"
    assert set(header_names(htmlonly)) - {"date"} == MULTIPART_HEADERS | {"content-transfer-encoding"}
    assert "&lt;b&gt;Ana&lt;/b&gt;" in htmlonly.get_content()
    assert verif["Subject"] == "Confirm your email address"
    for m in smtp_server.messages:
        assert_crlf_only(m.raw)


def test_app_override_replaces_the_whole_builtin_template(templates_dir: Path) -> None:
    subject, text, html = TemplateSet(templates_dir).render("welcome", {"name": "Ana"})
    assert (subject, text, html) == ("App welcome for Ana", "Custom welcome, Ana.\n", None)


@pytest.mark.parametrize(("name", "data"), [
    ("verification", {"name": "Ana", "link": "https://shop.test/v"}),   # the documented payload
    ("verification", {"link": "https://shop.test/v"}),
    ("welcome", {"name": "Ana"}),
    ("welcome", {}),
])
def test_builtin_templates_render_without_optional_data(name: str, data: dict[str, Any]) -> None:
    subject, text, html = TemplateSet().render(name, data)
    assert subject and text and html


def test_clean_values_build_the_intended_headers() -> None:
    """The positive control for the fuzz test below: a clean value is accepted as is."""
    for field, value in [("subject", "Ana María"), ("to", "bo@example.org"), ("reply_to", "h@x.test")]:
        assert _field_check(field, value), (field, value)
    # Unicode line separators are refused too (by the email package's header policy).
    assert not _field_check("subject", "Ana\u2028Bcc: v@evil.test")


def test_templates_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        TemplateSet(tmp_path / "nope")


async def test_no_auth_when_no_user_is_set(smtp_server_noauth: SmtpServer, tls: Tls) -> None:
    c = EmailConsumer(config_for(smtp_server_noauth, tls, username=None, password=None))
    try:
        await send(c, make_event(verification()))
    finally:
        await c.aclose()
    assert len(smtp_server_noauth.messages) == 1
    assert smtp_server_noauth.tls_sessions >= 1


# ------------------------------------------------------ permanent, pre-SMTP


def _no_dialogue(server: SmtpServer) -> None:
    assert server.sessions == 0, "an SMTP connection was opened for a mail that was refused up front"
    assert server.messages == []


INJECTIONS = [
    "x\r\nBcc: victim@evil.test",
    "x\nBcc: victim@evil.test",
    "x\rBcc: victim@evil.test",
    "x\r\n\r\nINJECTED BODY",
    "x\x00y",
    "x\tBcc: y",
]


@pytest.mark.parametrize("bad", INJECTIONS)
async def test_header_injection_in_subject_via_template_data(consumer: EmailConsumer,
                                                             smtp_server: SmtpServer, bad: str) -> None:
    # welcome.subject.txt renders the name into the Subject.
    payload = welcome(name=bad)
    with pytest.raises(PermanentFailure):
        await send(consumer, make_event(payload))
    _no_dialogue(smtp_server)


@pytest.mark.parametrize("bad", [
    "ana@example.com\r\nBcc: victim@evil.test",
    "ana@example.com>\r\nRCPT TO:<victim@evil.test",
    "ana@example.com\n",
    "ana@example.com\x00",
    "Ana <ana@example.com>",           # display names are not accepted in the envelope
    "ana@example.com, victim@evil.test",
    "ana@example.com,victim@evil.test",
    "",
    "   ",
    "no-at-sign",
    "@example.com",
    "ana@",
    "ana@exa mple.com",
])
async def test_bad_recipient_is_permanent(consumer: EmailConsumer, smtp_server: SmtpServer,
                                          bad: str) -> None:
    with pytest.raises(PermanentFailure):
        await send(consumer, make_event(verification(to=bad)))
    with pytest.raises(PermanentFailure):
        await send(consumer, make_event(verification(to=["ok@example.com", bad])))
    _no_dialogue(smtp_server)


@pytest.mark.parametrize("bad", ["help@shop.test\r\nBcc: victim@evil.test", "help@shop.test\n",
                                 "", None, 7, "x y@shop.test"])
async def test_bad_reply_to_is_permanent(consumer: EmailConsumer, smtp_server: SmtpServer,
                                         bad: Any) -> None:
    with pytest.raises(PermanentFailure):
        await send(consumer, make_event(verification() | {"reply_to": bad}))
    _no_dialogue(smtp_server)


@pytest.mark.parametrize("payload", [
    [1, 2],
    "ana@example.com",
    None,
    42,
    {"template": "verification", "data": {"link": "x"}},             # no recipient
    {"to": [], "template": "verification", "data": {"link": "x"}},    # empty recipient list
    {"to": None, "template": "verification", "data": {"link": "x"}},
    {"to": {"a": 1}, "template": "verification", "data": {"link": "x"}},
    {"to": "ana@example.com", "template": "nope", "data": {}},         # unknown template
    {"to": "ana@example.com", "template": "../verification", "data": {"link": "x"}},
    {"to": "ana@example.com", "template": "Verification", "data": {"link": "x"}},
    {"to": "ana@example.com", "data": {"link": "x"}},                  # no template
    {"to": "ana@example.com", "template": "verification", "data": ["x"]},
    {"to": "ana@example.com", "template": "verification", "data": {}},  # link is required
], ids=lambda p: json.dumps(p)[:40])
async def test_malformed_payload_is_permanent(consumer: EmailConsumer, smtp_server: SmtpServer,
                                              payload: Any) -> None:
    with pytest.raises(PermanentFailure):
        await send(consumer, make_event(payload))
    _no_dialogue(smtp_server)


def test_config_refuses_header_injection_in_sender_settings() -> None:
    with pytest.raises(ConfigError):
        SmtpConfig(host="h", from_address="not an address")
    with pytest.raises(ConfigError):
        SmtpConfig(host="h", from_address=FROM, username="u")  # password missing


def test_config_refuses_control_characters_in_display_name_and_id_domain() -> None:
    with pytest.raises(ConfigError):  # parseaddr() silently cuts this down to the first line
        SmtpConfig(host="h", from_address="no-reply@shop.test\r\nBcc: victim@evil.test")
    with pytest.raises(ConfigError):
        SmtpConfig(host="h", from_address="Shop\r\nBcc: victim@evil.test <no-reply@shop.test>")
    with pytest.raises(ConfigError):
        SmtpConfig(host="h", from_address=FROM, message_id_domain="shop.test>\r\nBcc: v@evil.test")


# A fuzzed value goes into the subject (via template data), a recipient and Reply-To.
_PIECES = [*"aZ@.<>:;,\" \t\r\n\x00\x0b\x0c\x1b\x7f\x85\u2028\u2029=?é",
           "Bcc: v@evil.test", "\r\nBcc: v@evil.test", "=?utf-8?q?x?=", "ana@example.com"]
_nasty = st.lists(st.sampled_from(_PIECES), min_size=1, max_size=10).map("".join)


def _field_check(field: str, value: str) -> bool:
    """build_message either refuses the value permanently or produces exactly the intended headers."""
    templates = TemplateSet()
    cfg = SmtpConfig(host="127.0.0.1", from_address=FROM)
    payload: dict[str, Any] = welcome(product="")
    if field == "subject":
        payload["data"]["name"] = value
    elif field == "to":
        payload["to"] = ["ana@example.com", value]
    else:
        payload["reply_to"] = value
    try:
        msg = build_message(make_event(payload), cfg, templates)
    except PermanentFailure:
        return False
    # Only what ends up inside a header value counts: the rendered subject is stripped.
    inside = f"Welcome, {value}".strip() if field == "subject" else value
    assert not re.search(r"[\r\n\x00]", inside), f"{value!r} was accepted in {field}"
    raw = msg.as_bytes()
    assert_crlf_only(raw)
    parsed = parse(raw)
    expected = MULTIPART_HEADERS | {"date"} | ({"reply-to"} if field == "reply_to" else set())
    names = header_names(parsed)
    assert sorted(names) == sorted(expected), (value, names)
    if field == "subject" and "=?" not in value:  # encoded-words are decoded by the parser
        # Folding (and encoded-words for non-ASCII) can move whitespace when the
        # header is parsed back; the words themselves must come back unchanged.
        assert parsed["Subject"].split() == inside.split()
    return True


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["subject", "to", "reply_to"]), value=_nasty)
def test_fuzz_header_values_never_add_a_header(field: str, value: str) -> None:
    _field_check(field, value)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.lists(st.sampled_from([*"ab \r\n\x00\x85\u2028", "Bcc: v@evil.test"]),
                      min_size=1, max_size=8).map("".join)
       .filter(lambda v: bool(re.search(r"[\r\n\x00]", v))))
def test_fuzz_injection_over_real_smtp_starts_no_dialogue(smtp_server: SmtpServer, tls: Tls,
                                                         value: str) -> None:
    async def attempt() -> None:
        c = EmailConsumer(config_for(smtp_server, tls))
        try:
            for payload in (welcome(name=f"{value}!"), welcome(to=["ana@example.com", f"v{value}@evil.test"]),
                            welcome() | {"reply_to": f"a{value}@x.test"}):
                with pytest.raises(PermanentFailure):
                    await send(c, make_event(payload))
        finally:
            await c.aclose()

    asyncio.run(attempt())
    _no_dialogue(smtp_server)


# ------------------------------------------------------- SMTP-side failures


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, Exception) and not isinstance(exc, HandlerSignal)


async def test_server_down_is_retryable(closed_port: int, tls: Tls) -> None:
    # A 30 s timeout and a 10 s bound: the refusal, not the timeout, ended it, with
    # room for a loaded machine (the bound was the 3 s timeout itself).
    c = EmailConsumer(SmtpConfig(host="127.0.0.1", port=closed_port, from_address=FROM,
                                 ca_file=tls.ca_file, timeout=30))
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        await send(c, make_event(verification()))
    assert _is_retryable(info.value), repr(info.value)
    assert time.monotonic() - start < 10
    await c.aclose()


@pytest.mark.parametrize("where", ["rcpt", "data"])
async def test_4xx_is_retryable(consumer: EmailConsumer, smtp_server: SmtpServer, where: str) -> None:
    setattr(smtp_server, f"{where}_reply", "451 4.3.0 try later")
    with pytest.raises(Exception) as info:
        await send(consumer, make_event(verification()))
    assert _is_retryable(info.value), repr(info.value)
    assert smtp_server.messages == []
    # The server recovers: the next attempt goes through on a fresh connection.
    setattr(smtp_server, f"{where}_reply", None)
    await send(consumer, make_event(verification()))
    assert len(smtp_server.messages) == 1


@pytest.mark.parametrize(("where", "reply"), [("rcpt", "550 5.1.1 no such user"),
                                              ("data", "554 5.7.1 rejected as spam")])
async def test_5xx_is_permanent(consumer: EmailConsumer, smtp_server: SmtpServer, where: str,
                                reply: str) -> None:
    setattr(smtp_server, f"{where}_reply", reply)
    with pytest.raises(PermanentFailure):
        await send(consumer, make_event(verification()))
    assert smtp_server.messages == []


async def test_recipient_refusals(consumer: EmailConsumer, smtp_server: SmtpServer) -> None:
    smtp_server.rcpt_reply = "550 5.1.1 no such user"
    with pytest.raises(PermanentFailure):
        await send(consumer, make_event(verification(to=["a@example.com", "b@example.com"])))
    smtp_server.rcpt_reply = "452 4.2.2 mailbox full"
    with pytest.raises(Exception) as info:
        await send(consumer, make_event(verification(to=["a@example.com", "b@example.com"])))
    assert _is_retryable(info.value), repr(info.value)
    assert smtp_server.messages == []


async def test_wrong_password_is_refused_with_535(smtp_server: SmtpServer, tls: Tls) -> None:
    # Bounded far under the 30 s timeout: the 535 answer ended it, however loaded.
    c = EmailConsumer(config_for(smtp_server, tls, password="wrong", timeout=30.0))
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as info:
            await send(c, make_event(verification()))
    finally:
        await c.aclose()
    assert time.monotonic() - start < 10, "the server did not answer the refused AUTH"
    assert smtp_server.auth_refused >= 1 and smtp_server.auth_ok == 0 and smtp_server.messages == []
    assert "535" in str(info.value)


async def test_wrong_password_is_retryable_not_parked(smtp_server: SmtpServer, tls: Tls) -> None:
    c = EmailConsumer(config_for(smtp_server, tls, password="wrong"))
    try:
        with pytest.raises(Exception) as info:
            await send(c, make_event(verification()))
    finally:
        await c.aclose()
    assert _is_retryable(info.value), repr(info.value)


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
async def test_credentials_never_sent_without_tls(smtp_server_plaintext: SmtpServer) -> None:
    c = EmailConsumer(config_for(smtp_server_plaintext, None))
    try:
        with pytest.raises(Exception):  # noqa: B017 - any error, as long as nothing was sent
            await send(c, make_event(verification()))
    finally:
        await c.aclose()
    assert smtp_server_plaintext.auth_ok + smtp_server_plaintext.auth_refused == 0, "password sent in clear"
    assert smtp_server_plaintext.messages == []


async def test_tls_verification_is_on_by_default(smtp_server: SmtpServer) -> None:
    # no ca_file: the test CA is not trusted. The handshake's refusal ends it, far under
    # the 30 s timeout.
    c = EmailConsumer(config_for(smtp_server, None, timeout=30.0))
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as info:
            await send(c, make_event(verification()))
    finally:
        await c.aclose()
    assert not isinstance(info.value, HandlerSignal)
    assert "CERTIFICATE_VERIFY_FAILED" in repr(info.value) or "certificate" in repr(info.value).lower()
    assert time.monotonic() - start < 10
    assert smtp_server.auth_ok == 0 and smtp_server.messages == []


async def test_insecure_switch_accepts_the_untrusted_certificate(smtp_server: SmtpServer) -> None:
    c = EmailConsumer(config_for(smtp_server, None, insecure_skip_verify=True))
    try:
        await send(c, make_event(verification()))
    finally:
        await c.aclose()
    assert len(smtp_server.messages) == 1


async def test_whole_dialogue_timeout_against_a_silent_server(silent_server: Silent) -> None:
    timeout = 1.5
    c = EmailConsumer(config_for(silent_server, None, timeout=timeout))
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        await asyncio.wait_for(c(make_event(verification())), timeout=timeout + 10)
    elapsed = time.monotonic() - start
    assert _is_retryable(info.value), repr(info.value)
    # The consumer's own timeout ended it, well before the test's timeout + 10 s
    # (a loaded machine may add seconds; the margin was 1 s).
    assert elapsed < timeout + 5, f"took {elapsed:.2f}s"
    assert silent_server.accepted, "the client never connected"
    await c.aclose()


# ------------------------------------------------------- connection reuse


async def test_twenty_mails_reuse_connections(smtp_server: SmtpServer, tls: Tls) -> None:
    c = EmailConsumer(config_for(smtp_server, tls, max_connections=2))
    try:
        for _ in range(10):
            await send(c, make_event(verification()))
        await asyncio.wait_for(asyncio.gather(*(c(make_event(verification())) for _ in range(10))), 20)
    finally:
        await c.aclose()
    assert len(smtp_server.messages) == 20
    assert c.sent == 20
    assert 1 <= c.connections_opened <= 2
    assert smtp_server.sessions == c.connections_opened
    assert smtp_server.auth_ok == c.connections_opened


async def test_connection_closed_by_server_while_idle_is_replaced(smtp_server_short_idle: SmtpServer,
                                                                  tls: Tls) -> None:
    server = smtp_server_short_idle
    c = EmailConsumer(config_for(server, tls, max_connections=1))
    try:
        await send(c, make_event(verification()))
        await asyncio.sleep(1.2)  # the server's 0.5 s idle timeout closes the kept connection
        await send(c, make_event(verification()))
    finally:
        await c.aclose()
    assert len(server.messages) == 2
    assert c.connections_opened == 2 == server.sessions
