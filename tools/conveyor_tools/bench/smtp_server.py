"""A local SMTP sink for the email benchmark, in its own process (its own GIL).

Run as a script::

    python .../bench/smtp_server.py plain|starttls

It starts an aiosmtpd ``Controller`` on 127.0.0.1 (a free port) and prints one
JSON line: ``{"port": ..., "ca_file": ..., "user": ..., "password": ...}``.

* ``plain``: no TLS, no AUTH.
* ``starttls``: STARTTLS required (a certificate for 127.0.0.1 issued by a
  throwaway trustme CA, whose PEM is ``ca_file``) and AUTH required after TLS,
  with an authenticator that refuses wrong passwords with a proper 535.

Then it reads commands from stdin: ``count`` prints the number of messages
accepted so far (and their total bytes) as a JSON line; end of input stops
the server and exits.

Needs aiosmtpd (and trustme for ``starttls``): test extras of Conveyor.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.path and sys.path[0].endswith("bench"):
    del sys.path[0]  # never import a sibling of this file as a top-level module

import json
import os
import socket
import ssl
import tempfile
import threading
from typing import Any

USER = "bench"
PASSWORD = "bench-password-not-a-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Sink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages = 0
        self.bytes = 0

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        with self.lock:
            self.messages += 1
            self.bytes += len(envelope.original_content or b"")
        return "250 Message accepted for delivery"


def _authenticate(server: Any, session: Any, envelope: Any, mechanism: str,
                  auth_data: Any) -> Any:
    from aiosmtpd.smtp import AuthResult, LoginPassword  # type: ignore[import-not-found,unused-ignore]

    if (isinstance(auth_data, LoginPassword) and auth_data.login == USER.encode()
            and auth_data.password == PASSWORD.encode()):
        return AuthResult(success=True)
    return AuthResult(success=False, handled=False)  # a 535, not silence


def main(argv: list[str]) -> int:
    from aiosmtpd.controller import Controller  # type: ignore[import-not-found,unused-ignore]

    mode = argv[1] if len(argv) > 1 else "plain"
    sink = _Sink()
    port = _free_port()
    kwargs: dict[str, Any] = {"hostname": "127.0.0.1", "port": port, "ready_timeout": 10.0}
    info: dict[str, Any] = {"port": port, "ca_file": None, "user": None, "password": None}
    tmpdir = tempfile.mkdtemp(prefix="conveyor-bench-smtp-")
    try:
        if mode == "starttls":
            import trustme  # type: ignore[import-not-found,unused-ignore]

            ca = trustme.CA()
            cert = ca.issue_cert("127.0.0.1", "localhost")
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            cert.configure_cert(context)
            ca_file = os.path.join(tmpdir, "ca.pem")
            ca.cert_pem.write_to_path(ca_file)
            kwargs.update(tls_context=context, require_starttls=True, auth_required=True,
                          auth_require_tls=True, authenticator=_authenticate)
            info.update(ca_file=ca_file, user=USER, password=PASSWORD)
        controller = Controller(sink, **kwargs)
        controller.start()
        try:
            print(json.dumps(info), flush=True)
            for line in sys.stdin:
                if line.strip() == "count":
                    with sink.lock:
                        print(json.dumps({"messages": sink.messages, "bytes": sink.bytes}),
                              flush=True)
        finally:
            controller.stop()
    finally:
        for name in os.listdir(tmpdir):
            os.unlink(os.path.join(tmpdir, name))
        os.rmdir(tmpdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
