"""Metrics of ``worker-multi``: every tenant database's worker in one exposition.

Each tenant's worker counters (:class:`WorkerCollector`) and its database's
queue gauges (:class:`DatabaseGauges`, one per tenant database, each behind
that database's own advisory lock) are exported under one metric name with a
``tenant`` label: a family named twice in one exposition would be refused by
Prometheus, so the samples of all tenants are merged into one family.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import psycopg
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.metrics.collectors import REFRESH_INTERVAL_DEFAULT, DatabaseGauges, WorkerCollector
from conveyor.metrics.config import MetricsConfig

if TYPE_CHECKING:
    from conveyor.multitenant import MultiTenantWorker

log = logging.getLogger(__name__)


def merge(families: Iterable[tuple[str, Metric]]) -> Iterator[Metric]:
    """One family per name, holding every tenant's samples with its ``tenant`` label."""
    merged: dict[str, Metric] = {}
    for tenant, family in families:
        target = merged.get(family.name)
        if target is None:
            target = merged[family.name] = Metric(family.name, family.documentation, family.type)
        for sample in family.samples:
            target.samples.append(sample._replace(labels={"tenant": tenant, **sample.labels}))
    yield from merged.values()


class TenantsCollector(Collector):
    """The counters and gauges of every tenant of ``multi``, read at scrape time.

    ``gauges``: tenant name -> its database's gauges (kept by :class:`TenantGauges`).
    """

    def __init__(self, multi: MultiTenantWorker, gauges: dict[str, DatabaseGauges]) -> None:
        self.multi = multi
        self.gauges = gauges

    def _families(self) -> Iterator[tuple[str, Metric]]:
        for name, state in sorted(self.multi.tenants.items()):
            if state.worker is not None:
                for family in WorkerCollector(state.worker).collect():
                    yield name, family
            gauges = self.gauges.get(name)
            if gauges is not None:
                for family in gauges.collect():
                    yield name, family

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("conveyor_tenant_worker_up",
                               "1 while the tenant is served (its worker runs, or it is parked "
                               "with nothing to do), 0 while its worker or database fails.",
                               labels=["tenant"])
        for name, state in sorted(self.multi.tenants.items()):
            up.add_metric([name], 1.0 if state.running or state.error is None else 0.0)
        yield up
        yield from merge(self._families())


class TenantGauges:
    """The database gauges of every tenant database, refreshed on one timer.

    Follows the tenants of ``multi`` as they come and go: a new tenant gets its
    gauges at the next round, a removed one's connection is closed.
    """

    def __init__(self, multi: MultiTenantWorker, schema: str, *,
                 interval: float = REFRESH_INTERVAL_DEFAULT,
                 config: MetricsConfig | None = None) -> None:
        self.multi = multi
        self.schema = schema
        self.interval = interval
        self.config = config or MetricsConfig()
        self.by_tenant: dict[str, DatabaseGauges] = {}

    async def refresh_once(self) -> None:
        wanted = {name: state.tenant for name, state in self.multi.tenants.items()}
        for name in [n for n in self.by_tenant if n not in wanted]:
            await self.by_tenant.pop(name).close()
        for name, tenant in sorted(wanted.items()):
            gauges = self.by_tenant.get(name)
            if gauges is None or gauges.conninfo != tenant.conninfo:
                if gauges is not None:
                    await gauges.close()
                gauges = self.by_tenant[name] = DatabaseGauges(tenant.conninfo, self.schema,
                                                              config=self.config)
            try:
                await gauges.refresh_once()
            except (psycopg.Error, OSError) as exc:
                log.warning("reading the database gauges of tenant %s failed: %s", name, exc,
                            extra={"action": "metrics_refresh_failed", "tenant": name})
                await gauges.close()

    async def run(self, stopping: asyncio.Event) -> None:
        """Refresh every ``interval`` until ``stopping`` is set; then close every connection."""
        try:
            while not stopping.is_set():
                await self.refresh_once()
                try:
                    await asyncio.wait_for(stopping.wait(), self.interval)
                except TimeoutError:
                    pass
        finally:
            for gauges in self.by_tenant.values():
                await gauges.close()
            self.by_tenant.clear()
