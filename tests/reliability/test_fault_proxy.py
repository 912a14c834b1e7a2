"""The R8 fault proxy itself: it names each connection by its backend pid, over
TCP and over the embedded server's Unix socket alike, and a hole cuts only that one."""

from __future__ import annotations

import asyncio
import struct

import psycopg
import pytest

from .helpers import BlackHoleProxy, _BackendKeySniffer, via


def _message(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack("!i", 4 + len(payload)) + payload


STARTUP_REPLY = (
    b"N"                                                    # SSLRequest refused
    + _message(b"R", struct.pack("!i", 0))                  # AuthenticationOk
    + _message(b"S", b"server_version\x0018.0\x00")
    + _message(b"K", struct.pack("!i", 4242) + b"\x01\x02\x03\x04")
    + _message(b"Z", b"I")
)


def test_sniffer_reads_the_pid_however_the_stream_is_split() -> None:
    for cut in range(len(STARTUP_REPLY) + 1):
        sniffer = _BackendKeySniffer()
        sniffer.feed(STARTUP_REPLY[:cut])
        sniffer.feed(STARTUP_REPLY[cut:])
        assert (sniffer.pid, sniffer.encrypted) == (4242, False), cut


def test_sniffer_reads_the_pid_fed_one_byte_at_a_time() -> None:
    sniffer = _BackendKeySniffer()
    for i in range(len(STARTUP_REPLY)):
        sniffer.feed(STARTUP_REPLY[i:i + 1])
    assert sniffer.pid == 4242 and sniffer.done


def test_sniffer_gives_up_on_an_encrypted_stream() -> None:
    sniffer = _BackendKeySniffer()
    sniffer.feed(b"S\x16\x03\x01" + bytes(100))
    assert (sniffer.pid, sniffer.encrypted, sniffer.done) == (None, True, True)


def test_sniffer_stops_at_a_startup_error() -> None:
    sniffer = _BackendKeySniffer()
    sniffer.feed(_message(b"E", b"SFATAL\x00\x00") + _message(b"K", struct.pack("!ii", 7, 7)))
    assert (sniffer.pid, sniffer.done) == (None, True)


async def test_proxy_names_each_connection_by_its_backend_pid(
        fresh_db: str, proxy: BlackHoleProxy) -> None:
    url = via(fresh_db, proxy)
    first = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)
    second = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)
    try:
        pids = [conn.info.backend_pid for conn in (first, second)]
        assert sorted(p.backend_pid for p in proxy.pipes) == sorted(pids)
        pipe = proxy.hole(pids[0])
        # The holed connection hears nothing back; the other one is untouched.
        stuck = asyncio.create_task(first.execute("SELECT 1"))
        await asyncio.sleep(1.0)
        assert not stuck.done()
        assert proxy.dropped_bytes > 0
        assert await (await second.execute("SELECT 1")).fetchone() == (1,)
        # Closing the pipe ends the wait (a cancelled task would wait out psycopg's cancel grace).
        pipe.close()
        with pytest.raises(psycopg.OperationalError):
            await asyncio.wait_for(stuck, 10)
    finally:
        proxy.heal()
        await second.close()
        await first.close()
