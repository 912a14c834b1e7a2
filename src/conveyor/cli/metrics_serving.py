"""``--metrics-port``: a worker's (or every tenant's) metrics, health and database gauges on a port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from conveyor.metrics import DatabaseGauges, MetricsMiddleware, MetricsServer, WorkerCollector
from conveyor.multitenant import MultiTenantWorker
from conveyor.worker import Worker


class WorkerMetrics:
    """One registry per worker process; the gauges refresher runs beside the worker."""

    def __init__(self, url: str, schema: str, *, labels: Mapping[str, str] | None = None,
                 tenant_label: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.labels = dict(labels or {})
        self.middleware = MetricsMiddleware(registry=self.registry, tenant_label=tenant_label)
        self.gauges = DatabaseGauges(url, schema)
        self.registry.register(self.gauges)
        self._server: MetricsServer | None = None

    def serve(self, worker: Worker, host: str, port: int) -> None:
        """Register the worker's collector and start answering on ``host:port``."""
        self.registry.register(WorkerCollector(worker, labels=self.labels))
        self._server = MetricsServer(worker, self.registry, port=port, host=host).start()

    async def run_beside(self, worker: Worker) -> None:
        """Run the worker, refreshing the gauges until it ends."""
        done = asyncio.Event()
        refresher = asyncio.create_task(self.gauges.run(done), name="conveyor-metrics")
        try:
            await worker.run()
        finally:
            done.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(refresher, 5)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class TenantsMetrics:
    """``worker-multi --metrics-port``: one registry for every tenant database's worker.

    Handler outcomes (the middleware) are counted by topic over all tenants;
    each tenant's worker counters and queue gauges carry a ``tenant`` label;
    ``/healthz`` and ``/readyz`` answer 200 only while every tenant's worker does.
    """

    def __init__(self, schema: str) -> None:
        from conveyor.metrics.tenants import TenantGauges

        self.registry = CollectorRegistry()
        self.middleware = MetricsMiddleware(registry=self.registry)
        self.schema = schema
        self._gauges: TenantGauges | None = None
        self._make_gauges = TenantGauges
        self._server: MetricsServer | None = None

    def serve(self, multi: MultiTenantWorker, host: str, port: int) -> None:
        from conveyor.metrics.tenants import TenantsCollector

        self._gauges = self._make_gauges(multi, self.schema)
        self.registry.register(TenantsCollector(multi, self._gauges.by_tenant))
        self._server = MetricsServer(multi, self.registry, port=port, host=host).start()

    async def run_beside(self, multi: MultiTenantWorker) -> None:
        """Run the multi-tenant worker, refreshing every tenant's gauges until it ends."""
        assert self._gauges is not None, "serve() first"
        done = asyncio.Event()
        refresher = asyncio.create_task(self._gauges.run(done), name="conveyor-metrics")
        try:
            await multi.run()
        finally:
            done.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(refresher, 5)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
