"""``conveyor worker --tracing`` (and ``worker-multi``): a real worker process exports its
``process`` spans through the tracer provider its app set up; without the extra, one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conveyor import Producer

SRC = Path(__file__).resolve().parents[1] / "src"

# The app sets up the OpenTelemetry SDK as a user's app (or opentelemetry-instrument)
# would, exporting every finished span as one JSON line to a file the test reads.
APP = '''
import json, os
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from conveyor import Router


class FileExporter(SpanExporter):
    def export(self, spans):
        with open(os.environ["SPANS_FILE"], "a") as out:
            for span in spans:
                out.write(json.dumps({
                    "name": span.name, "trace_id": span.context.trace_id,
                    "parent": span.parent.span_id if span.parent else None,
                    "links": [link.context.span_id for link in span.links],
                    "attributes": dict(span.attributes or {})}) + "\\n")
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
trace.set_tracer_provider(provider)


async def handle(event):
    pass


router = Router()
router.add("traced.*", handle)
'''


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "traced_app.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join((str(SRC), str(tmp_path)))
    env["SPANS_FILE"] = str(tmp_path / "spans.jsonl")
    return env


def _conveyor(*args: str) -> list[str]:
    return [sys.executable, "-c", "from conveyor.cli.main import main; raise SystemExit(main())",
            *args]


def _spans(path: Path, name: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            found = [json.loads(line) for line in path.read_text().splitlines()]
            if any(s["name"] == name for s in found):
                return [s for s in found if s["name"] == name]
        time.sleep(0.1)
    raise AssertionError(f"no {name!r} span exported within {timeout}s")


def _send_span() -> tuple[InMemorySpanExporter, trace.Tracer]:
    """An exporter on the global tracer provider (the producer's), an SDK one set once."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, trace.get_tracer("tests.cli_tracing")


def test_worker_tracing_exports_a_process_span_linked_to_the_send_span(
        fresh_db: str, tmp_path: Path) -> None:
    exporter, tracer = _send_span()
    with psycopg.connect(fresh_db) as conn:
        with tracer.start_as_current_span("request"):
            event_id = Producer(tracing=True).enqueue(conn, "traced.order", {"n": 1})
        conn.commit()
    send = next(s for s in exporter.get_finished_spans() if s.name == "send traced.order")
    proc = subprocess.Popen(_conveyor("--database-url", fresh_db, "worker", "--app",
                                      "traced_app:router", "--tracing"),
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        (process,) = _spans(tmp_path / "spans.jsonl", "process traced.order")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert process["trace_id"] == send.context.trace_id
    assert process["parent"] == send.context.span_id
    assert process["links"] == [send.context.span_id]
    assert process["attributes"]["messaging.message.id"] == str(event_id)
    assert process["attributes"]["conveyor.outcome"] == "succeeded"


def test_without_tracing_the_worker_exports_no_process_span(fresh_db: str, tmp_path: Path) -> None:
    with psycopg.connect(fresh_db) as conn:
        event_id = Producer(tracing=False).enqueue(conn, "traced.plain", {})
        conn.commit()
    env = _env(tmp_path)
    proc = subprocess.Popen(_conveyor("--database-url", fresh_db, "worker", "--app",
                                      "traced_app:router"),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        with psycopg.connect(fresh_db, autocommit=True) as conn:
            while conn.execute("SELECT state FROM conveyor.events WHERE id = %s",
                               (event_id,)).fetchone() != ("succeeded",):
                assert time.monotonic() < deadline, "the event did not run"
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert not (tmp_path / "spans.jsonl").exists()


def test_tracing_without_the_extra_is_refused_in_one_line_before_the_app_is_imported(
        tmp_path: Path) -> None:
    for command in (["worker", "--app", "nowhere:router"],
                    ["worker-multi", "--app", "nowhere:router",
                     "--dsn", "t1=postgresql://127.0.0.1/none"]):
        code = ("import sys\nsys.modules['opentelemetry'] = None\n"
                "from conveyor.cli.main import main\nraise SystemExit(main())")
        result = subprocess.run(
            [sys.executable, "-c", code, "--database-url", "postgresql://127.0.0.1/none",
             *command, "--tracing"],
            env=_env(tmp_path), capture_output=True, text=True, timeout=60)
        assert result.returncode != 0, command
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert "--tracing" in lines[0] and "pip install 'conveyor[otel]'" in lines[0], lines[0]
