"""``conveyor dashboard`` as a real process: it serves, and a SIGTERM is a clean stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    return env


def _status(url: str, host: str | None = None) -> int | None:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def test_the_dashboard_serves_then_exits_0_on_sigterm(fresh_db: str) -> None:
    port = _free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli.main", "--database-url", fresh_db, "dashboard",
             "--read-only", "--port", str(port)],
            cwd=REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: _status(base + "/") == 200 or proc.poll() is not None, 90,
                     "the dashboard to answer")
            assert proc.poll() is None, "the dashboard exited early"
            # The Host check is on in the standalone server: a rebound name is refused.
            assert _status(base + "/", host=f"evil.example:{port}") == 400
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        output = log.read()
    assert code == 0, f"exit {code}; output:\n{output}"
    assert f"dashboard on http://127.0.0.1:{port}/ (read-only)" in output
