"""Metrics of ``worker-multi``: every tenant database's worker in one exposition.

Each tenant's worker counters (:class:`WorkerCollector`) and its database's
queue gauges (:class:`DatabaseGauges`, one per tenant database, each behind
that database's own advisory lock) are exported under one metric name with a
``tenant`` label: a family named twice in one exposition would be refused by
Prometheus, so the samples of all tenants are merged into one family.

The gauges are read on a connection opened for the read and closed after it,
taken from its server's wake connections (:meth:`TenantWakeups.slot
<conveyor.tenancy.wakeups.TenantWakeups.slot>`): a connection held per tenant
would stand outside the server's connection budget, 200 of them for 200
tenants. The advisory lock is taken for each read, so one process at a time
reads a tenant's database; a process exports the gauges of the tenants whose
last read it made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import psycopg
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.db.connect_async import connect_async
from conveyor.errors import ConveyorError
from conveyor.metrics.collectors import REFRESH_INTERVAL_DEFAULT, DatabaseGauges, WorkerCollector
from conveyor.metrics.config import MetricsConfig
from conveyor.tenancy.budget import server_of

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
            elif state.last_worker is not None:   # parked: its counters, which run on
                for family in WorkerCollector(state.last_worker).counters():
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
        # Reads of tenants whose server is not served yet (before run()), a few at a time.
        self._unserved = asyncio.Semaphore(2)

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
        # All at once, each server's a few at a time (its wake connections): a server
        # that does not answer holds up only its own tenants' reads.
        await asyncio.gather(*(self._read(name, self.by_tenant[name]) for name in sorted(wanted)))

    async def _read(self, name: str, gauges: DatabaseGauges) -> None:
        try:
            await self._read_once(gauges)
        except (ConveyorError, psycopg.Error, OSError, TimeoutError) as exc:
            gauges.holds_lock = False
            log.warning("reading the database gauges of tenant %s failed: %s", name, exc,
                        extra={"action": "metrics_refresh_failed", "tenant": name})

    async def _read_once(self, gauges: DatabaseGauges) -> None:
        """One read of ``gauges`` on a connection of its own, within its server's budget."""
        server = self.multi.servers.get(server_of(gauges.conninfo))
        slot: Any = server.wakeups.slot() if server is not None else self._unserved
        async with slot, asyncio.timeout(gauges.statement_timeout * 2):
            conn = await connect_async(gauges.conninfo, autocommit=True,
                                       application_name="conveyor-metrics",
                                       connect_timeout=max(2, round(gauges.statement_timeout)))
            try:
                await conn.execute("SELECT set_config('statement_timeout', %s, false)",
                                   (str(int(gauges.statement_timeout * 1000)),))
                gauges.holds_lock = False      # the lock is taken again for each read
                await gauges.run_once(conn)
            finally:
                await conn.close()             # and let go of with the connection

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
