"""S6 addition: SMTP smuggling through the body. tests/consumers/test_email.py
fuzzes headers; here body text with end-of-data look-alikes (``\\n.\\r\\n``,
``\\r\\n.\\r``, lone CR/LF, a leading dot) is sent to a raw SMTP sink that keeps
the wire bytes before any dot-unstuffing: the only end-of-data sequence on the
wire must be the real one, and no bare CR or LF may appear."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conveyor.consumers.email import EmailConsumer, SmtpConfig, TemplateSet
from conveyor.types import Event

SMUGGLES = [
    "a\n.\r\nMAIL FROM:<evil@x.test>\r\nRCPT TO:<v@x.test>\r\nDATA\r\nowned\r\n",
    "a\r\n.\rMAIL FROM:<evil@x.test>",
    "a\r.\r\nMAIL FROM:<evil@x.test>",
    "a\n.\nMAIL FROM:<evil@x.test>",
    ".\r\nQUIT\r\n",
    "lone\rcr and lone\nlf",
    "x\u2028.\u2028y",
    "." * 1000 + "\n" + "y" * 2000,
]


class RawSink:
    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.commands_after_data: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 sink ESMTP\r\n")
        try:
            while True:
                line = await asyncio.wait_for(reader.readline(), 10)
                if not line:
                    return
                verb = line[:4].upper()
                if verb in (b"EHLO", b"HELO"):
                    writer.write(b"250-sink\r\n250 8BITMIME\r\n")
                elif verb == b"DATA":
                    writer.write(b"354 go\r\n")
                    await writer.drain()
                    raw = await asyncio.wait_for(reader.readuntil(b"\r\n.\r\n"), 10)
                    self.data.append(raw)
                    writer.write(b"250 queued\r\n")
                elif verb == b"QUIT":
                    writer.write(b"221 bye\r\n")
                    await writer.drain()
                    return
                else:
                    if self.data:
                        self.commands_after_data.append(line)
                    writer.write(b"250 ok\r\n")
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


@pytest.fixture
async def sink() -> AsyncIterator[RawSink]:
    s = RawSink()
    s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    s.port = s.server.sockets[0].getsockname()[1]
    try:
        yield s
    finally:
        s.server.close()
        await asyncio.wait_for(s.server.wait_closed(), 5)


@pytest.mark.parametrize("body", SMUGGLES)
async def test_body_cannot_end_data_early_or_carry_bare_cr_lf(sink: RawSink, tmp_path: Path,
                                                             body: str) -> None:
    (tmp_path / "note.subject.txt").write_text("Note\n")
    (tmp_path / "note.txt").write_text("{{ body }}\n")
    config = SmtpConfig(host="127.0.0.1", port=sink.port, from_address="Shop <no-reply@shop.test>",
                        starttls=False, timeout=5)
    consumer = EmailConsumer(config, TemplateSet(tmp_path))
    event = Event(id=1, topic="email.send", tenant="acme", payload_text=json.dumps(
        {"to": "ana@example.com", "template": "note", "data": {"body": body}}))
    try:
        await asyncio.wait_for(consumer(event), 10)
    finally:
        await consumer.aclose()
    assert len(sink.data) == 1
    raw = sink.data[0]
    assert raw.endswith(b"\r\n.\r\n") and raw.count(b"\r\n.\r\n") == 1
    assert re.search(rb"(?<!\r)\n", raw) is None, "bare LF on the wire"
    assert re.search(rb"\r(?!\n)", raw) is None, "bare CR on the wire"
    assert sink.commands_after_data == [], "a smuggled command reached the server"
