"""``--metrics-port``: a worker's (or every tenant's) metrics, health and database gauges on a port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from conveyor.metrics import (
    DatabaseGauges,
    MetricsConfig,
    MetricsMiddleware,
    MetricsServer,
    WorkerCollector,
)
from conveyor.metrics.collectors import register_process_collectors
from conveyor.multitenant import MultiTenantWorker
from conveyor.worker import Worker

Refresher = Callable[[asyncio.Event], Coroutine[Any, Any, None]]

log = logging.getLogger(__name__)


class _Served:
    """A registry on a port, and a gauges refresher that runs as long as the worker does
    (a worker given the refresher as one of its services runs it itself)."""

    def __init__(self, config: MetricsConfig | None = None) -> None:
        self.config = config or MetricsConfig()
        self.registry = CollectorRegistry()
        register_process_collectors(self.registry)
        self._server: MetricsServer | None = None
        self._refresh: Refresher | None = None

    def _start(self, target: Worker | MultiTenantWorker, refresh: Refresher | None, host: str,
               port: int) -> None:
        self._refresh = refresh
        self._server = MetricsServer(target, self.registry, port=port, host=host,
                                     config=self.config).start()
        # The one line that tells an operator where to point the scraper.
        log.info("metrics on %s", self._server.url,
                 extra={"action": "metrics_serving", "url": self._server.url})

    async def run_beside(self, target: Worker | MultiTenantWorker) -> None:
        """Run ``target``, refreshing the gauges until it ends."""
        assert self._server is not None, "serve() first"
        if self._refresh is None:
            await target.run()
            return
        done = asyncio.Event()
        refresher = asyncio.create_task(self._refresh(done), name="conveyor-metrics")
        try:
            await target.run()
        finally:
            done.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(refresher, 5)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class WorkerMetrics(_Served):
    """One registry per worker process; the gauges refresher is one of the worker's
    services (``Worker(services=[metrics.gauges])``), or runs beside a worker not given it."""

    def __init__(self, url: str, schema: str, *, labels: Mapping[str, str] | None = None,
                 tenant_label: bool = False, config: MetricsConfig | None = None) -> None:
        super().__init__(config)
        self.labels = dict(labels or {})
        self.middleware = MetricsMiddleware(registry=self.registry, tenant_label=tenant_label,
                                            config=self.config)
        self.gauges = DatabaseGauges(url, schema, config=self.config)
        self.registry.register(self.gauges)

    def serve(self, worker: Worker, host: str, port: int) -> None:
        """Register the worker's collector and start answering on ``host:port``."""
        self.registry.register(WorkerCollector(worker, labels=self.labels))
        given = any(service is self.gauges for service in worker.services)
        self._start(worker, None if given else self.gauges.run, host, port)


class TenantsMetrics(_Served):
    """``worker-multi --metrics-port``: one registry for every tenant database's worker.

    Handler outcomes (the middleware) are counted by topic over all tenants;
    each tenant's worker counters and queue gauges carry a ``tenant`` label;
    ``/healthz`` and ``/readyz`` answer 200 only while every tenant's worker does.
    """

    def __init__(self, schema: str, *, config: MetricsConfig | None = None) -> None:
        super().__init__(config)
        self.middleware = MetricsMiddleware(registry=self.registry, config=self.config)
        self.schema = schema

    def serve(self, multi: MultiTenantWorker, host: str, port: int) -> None:
        from conveyor.metrics.tenants import TenantGauges, TenantsCollector

        gauges = TenantGauges(multi, self.schema, config=self.config)
        self.registry.register(TenantsCollector(multi, gauges.by_tenant))
        self._start(multi, gauges.run, host, port)
