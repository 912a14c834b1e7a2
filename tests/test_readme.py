"""The README's quickstart runs as written: its shell lines and its files, in order.

The test reads the "Quickstart" section of README.md, writes each Python block
to the file its first line names (``# tasks.py``), and runs each shell line in
a fresh directory against a database of its own: ``conveyor migrate``, the
producer script, a real ``conveyor worker`` process stopped with Ctrl-C, and
``conveyor status``. Only the install lines are skipped (this interpreter is
the installed environment); any other line the test does not know fails it, so
the README cannot grow a step that is not run.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def quickstart_blocks() -> list[tuple[str, str]]:
    """(language, body) of each fenced block in the README's Quickstart section."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Quickstart\n")
    end = readme.index("\n## ", start + 1)
    return FENCE.findall(readme[start:end])


def test_the_quickstart_comes_right_after_the_introduction() -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), re.M)
    assert headings[0] == "Quickstart"
    languages = [language for language, _ in quickstart_blocks()]
    assert languages.count("python") == 2 and "sh" in languages


class _Writes:
    """A stdout that keeps each write apart."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_each_quickstart_handler_prints_its_line_in_one_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker runs the two handlers at once, one on the event loop and one in
    # a thread, into one pipe: a print of several arguments writes each apart,
    # and the other handler's words (or a log line) can land between them. The
    # quickstart test then missed "order.created {'order_id': 1}" once in about
    # twenty runs, though both events had succeeded.
    import asyncio
    import inspect
    import json

    from conveyor import Event

    [tasks] = [body for language, body in quickstart_blocks()
               if language == "python" and body.startswith("# tasks.py")]
    names: dict[str, object] = {}
    exec(compile(tasks, "tasks.py", "exec"), names)
    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    router = names["router"]
    for topic, payload, line in [
            ("email.send", {"to": "ana@example.com", "order_id": 1},
             "mail to ana@example.com for order 1"),
            ("order.created", {"order_id": 1}, "order.created {'order_id': 1}")]:
        route = router.resolve(topic)  # type: ignore[attr-defined]
        event = Event(id=1, topic=topic, payload_text=json.dumps(payload))
        out.writes.clear()
        result = route.handler(event)
        if inspect.iscoroutine(result):
            asyncio.run(result)
        assert line in out.writes, (topic, out.writes)


def _states(url: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT topic, state FROM conveyor.events ORDER BY id").fetchall()


def test_the_quickstart_runs_as_written(empty_db: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONUNBUFFERED"] = "1"
    conveyor = [sys.executable, "-m", "conveyor.cli.main"]
    outputs: list[str] = []

    def run(argv: list[str]) -> None:
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, f"{argv}: {result.stdout}{result.stderr}"
        outputs.append(result.stdout)

    def run_worker(args: list[str]) -> None:
        proc = subprocess.Popen([*conveyor, *args], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(lambda: _states(empty_db) and all(
                state == "succeeded" for _, state in _states(empty_db)), 60,
                "the worker to handle every event")
        finally:
            proc.send_signal(signal.SIGINT)  # Ctrl-C, as the README says
            output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        outputs.append(output)

    ran = []
    for language, body in quickstart_blocks():
        if language == "python":
            name = body.splitlines()[0].removeprefix("# ").strip()
            assert name.endswith(".py"), f"a Python block names its file first: {body[:40]!r}"
            (tmp_path / name).write_text(body)
            continue
        assert language == "sh"
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if not words or words[0] == "pip":  # the install: this interpreter has it
                continue
            if words[0] == "export":
                name, _, _ = words[1].partition("=")
                assert name == "CONVEYOR_DATABASE_URL", line
                env[name] = empty_db
                continue
            if words[0] == "python":
                run([sys.executable, *words[1:]])
            elif words[:2] == ["conveyor", "worker"]:
                run_worker(words[1:])
            elif words[0] == "conveyor":
                run([*conveyor, *words[1:]])
            else:
                pytest.fail(f"the test does not know how to run this README line: {line!r}")
            ran.append(words[:2])

    assert ran == [["conveyor", "migrate"], ["python", "shop.py"], ["conveyor", "worker"],
                   ["conveyor", "status"]]
    assert [topic for topic, _ in _states(empty_db)] == ["order.created", "email.send"]
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT customer FROM orders").fetchall() == [("ana",)]
    worker_output = outputs[2]
    assert "mail to ana@example.com for order 1" in worker_output
    assert "order.created {'order_id': 1}" in worker_output
    assert "succeeded" in outputs[3]
