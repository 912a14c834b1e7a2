"""What ``--metrics-port`` serves beside the worker's own metrics: the process, the
build, and the one log line that says where (newcomer review M4)."""

from __future__ import annotations

import logging
import platform
import urllib.request

import pytest

from conveyor import Event, Router, Worker, __version__
from conveyor.cli.metrics_serving import WorkerMetrics
from worker_support import fast_config


def _worker(db: str, metrics: WorkerMetrics) -> Worker:
    async def noop(event: Event) -> None:
        pass
    router = Router()
    router.add("metrics.noop", noop)
    return Worker(db, router, fast_config(), middleware=[metrics.middleware])


def test_the_port_serves_process_platform_gc_and_build_info(db: str) -> None:
    metrics = WorkerMetrics(db, "conveyor")
    metrics.serve(_worker(db, metrics), "127.0.0.1", 0)
    try:
        registry = metrics.registry
        assert registry.get_sample_value("conveyor_build_info", {
            "version": __version__, "python": platform.python_version()}) == 1
        assert (registry.get_sample_value("process_resident_memory_bytes") or 0) > 0
        assert registry.get_sample_value("process_cpu_seconds_total") is not None
        assert registry.get_sample_value("python_gc_collections_total",
                                         {"generation": "0"}) is not None
        info = [s for family in registry.collect() for s in family.samples
                if s.name == "python_info"]
        assert info and info[0].labels["version"] == platform.python_version()
    finally:
        metrics.stop()


def test_the_worker_logs_the_url_it_serves_metrics_on(db: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    metrics = WorkerMetrics(db, "conveyor")
    with caplog.at_level(logging.INFO, logger="conveyor.cli.metrics_serving"):
        metrics.serve(_worker(db, metrics), "127.0.0.1", 0)
    try:
        assert metrics._server is not None
        url = f"http://127.0.0.1:{metrics._server.port}/metrics"
        lines = [r for r in caplog.records if r.getMessage() == f"metrics on {url}"]
        assert [r.action for r in lines] == ["metrics_serving"]  # type: ignore[attr-defined]
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
    finally:
        metrics.stop()
