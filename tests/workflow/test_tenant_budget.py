"""The arithmetic of conveyor.tenancy.budget: servers, the budget's plan, the rotation,
which turns end for waiting tenants, the ledger, and the config's checks. No database."""

from __future__ import annotations

import threading

import pytest

from conveyor import Router
from conveyor.errors import ConfigError
from conveyor.multitenant import MultiTenantConfig
from conveyor.tenancy.budget import (
    MIN_CONNECTIONS,
    WAKE_CONNECTIONS,
    ConnectionLedger,
    Rotation,
    ServerPlan,
    TurnView,
    server_of,
    to_park,
    turn_connections,
    wait_bound,
    wake_connections,
)


def test_a_server_is_the_host_and_port_of_a_url() -> None:
    assert server_of("postgresql://app@db1:5433/acme") == "db1:5433"
    assert server_of("postgresql://app@db1/globex") == "db1:5432"
    assert server_of("host=/run/pg dbname=x") == "/run/pg:5432"
    assert server_of("postgresql://a@db1/x") == server_of("postgresql://b:pw@db1:5432/y")


def test_a_turn_reserves_three_connections_and_one_more_for_cron() -> None:
    router = Router()
    router.add("a.*", lambda event: None)
    assert turn_connections(router) == 3
    router.cron("* * * * *", "a.tick")
    assert turn_connections(router) == 4


def test_the_plan_listens_while_every_tenant_fits_in_half_the_budget() -> None:
    assert ServerPlan.plan(50, 10, 3) == ServerPlan(50, 5, True, 10, (50 - 5 - 10) // 3)
    assert ServerPlan.plan(50, 22, 3).listen
    polled = ServerPlan.plan(50, 23, 3)
    assert (polled.listen, polled.listeners, polled.turn_slots) == (False, 0, 15)
    assert ServerPlan.plan(40, 200, 3) == ServerPlan(40, 4, False, 0, 12)
    assert ServerPlan.plan(12, 30, 3).wake == 2
    assert ServerPlan.plan(MIN_CONNECTIONS, 1, 4).turn_slots >= 1


def test_the_rotation_is_first_come_first_served_and_keeps_a_waiters_place() -> None:
    rotation = Rotation()
    for name in ("b", "a", "c", "a"):
        rotation.add(name)
    assert rotation.names() == ["b", "a", "c"] and "a" in rotation and len(rotation) == 3
    rotation.discard("a")
    assert [rotation.pop(), rotation.pop()] == ["b", "c"] and not rotation


def test_idle_turns_end_first_then_busy_ones_past_their_length_never_others() -> None:
    turns = [TurnView("busy-new", started_at=9.5, idle_since=None),
             TurnView("busy-old", started_at=1.0, idle_since=None),
             TurnView("idle-late", started_at=8.0, idle_since=9.0),
             TurnView("idle-early", started_at=2.0, idle_since=3.0),
             TurnView("ending", started_at=0.0, idle_since=1.0, ending=True)]
    assert to_park(turns, now=10.0, turn_length=5.0, wanted=1) == ["idle-early"]
    assert to_park(turns, now=10.0, turn_length=5.0, wanted=9) == [
        "idle-early", "idle-late", "busy-old"]
    assert to_park(turns, now=10.0, turn_length=5.0, wanted=0) == []


def test_the_wait_bound_counts_the_turns_ahead_in_rounds_of_the_slots() -> None:
    assert wait_bound(200, 12, 1.0) == 17.0       # 199 ahead, 12 at a time
    assert wait_bound(1, 12, 1.0) == 0.0
    assert wait_bound(13, 12, 2.0) == 2.0


def test_the_ledger_never_admits_past_its_limit_from_any_thread() -> None:
    ledger = ConnectionLedger(limit=10)
    admitted: list[bool] = []

    def grab() -> None:
        for _ in range(100):
            admitted.append(ledger.try_acquire())

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admitted.count(True) == 10 == ledger.in_use == ledger.peak
    assert not ledger.take(1)
    ledger.release()
    assert ledger.take(1)


def test_the_budget_and_the_turn_length_are_checked() -> None:
    assert MultiTenantConfig().connections_per_server == 50
    assert MultiTenantConfig().turn_length == 5.0
    for bad in (3, 300_000, 40.0, True):
        with pytest.raises(ConfigError, match=rf"^expected connections_per_server to be an "
                                              rf"integer between 8 and 262143, got {bad!r}$"):
            MultiTenantConfig(connections_per_server=bad)
    for bad_length in (0, float("nan"), float("inf"), "5"):
        with pytest.raises(ConfigError, match=r"^expected turn_length to be between 0.01s "
                                              r"and 1d, got "):
            MultiTenantConfig(turn_length=bad_length)
    assert MIN_CONNECTIONS > WAKE_CONNECTIONS == wake_connections(MIN_CONNECTIONS)
