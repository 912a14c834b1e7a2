"""R1, R3, R6, R7 and R13 of the reliability plan, short enough for CI (about 3 minutes together).

Each test runs ``benchmarks/chaos.py`` (real ``conveyor worker`` processes, a
private embedded PostgreSQL in a temp dir, the ledger router) and checks its
report. The full-size runs and their figures are in ``docs/reliability.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from conveyor.worker.connection import PROBE_INTERVAL

from .conftest import assert_exactly_once_where_it_counts

# Each run has a private embedded PostgreSQL of its own. The draining ones are
# serial (worker processes draining up to 50,000 events load both cores); the
# restart and the horizon pins (two workers, a trickle of events, bounds of
# seconds) are light.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

Chaos = Callable[..., dict[str, Any]]


@pytest.mark.serial
def test_r1_short_exactly_once_without_faults(chaos: Chaos) -> None:
    report = chaos("--workers", "4", "--events", "2000", "--upfront", "--handler-ms", "0-20",
                   "--drain-timeout", "60")
    assert_exactly_once_where_it_counts(report)
    c = report["check"]
    # The whole check in the message: a failure in CI shows only its summary line.
    assert (c["duplicated"], c["retries"], c["unfinished"]) == (0, 0, 0), c
    assert report["states"] == {"succeeded": report["events"]}, report["states"]
    assert report["events"] >= 2000


LEASE_TTL, RESCUE = 3.0, 1.0


@pytest.mark.serial
def test_r3_short_sigkill_a_worker_every_two_seconds(chaos: Chaos) -> None:
    report = chaos("--workers", "4", "--events", "50000", "--duration", "20", "--faults", "kill:2s",
                   "--handler-ms", "50-500", "--lease-ttl", f"{LEASE_TTL:g}",
                   "--rescue-interval", f"{RESCUE:g}", "--backlog", "300",
                   "--drain-timeout", "60", "--seed", "3")
    assert_exactly_once_where_it_counts(report)
    c = report["check"]
    assert report["kills"] >= 8
    # Every duplicate is a re-run of an event whose previous execution was on a killed pid.
    assert c["duplicated"] == c["duplicates_after_kill"]
    assert c["duplicated"] <= report["kills"] * 16
    assert c["orphans_not_rerun"] == 0
    bound = LEASE_TTL + RESCUE
    # Back to pending within the documented bound (a 2 s margin for a loaded 2-core box)...
    assert report["orphan_rescued_s"]["count"] > 0
    assert report["orphan_rescued_s"]["max"] <= bound + 2.0
    # ...and running again after at most the queue ahead of it (backlog ~300-900 events).
    assert report["orphan_rerun_s"]["max"] <= bound + 10.0


@pytest.mark.serial
def test_r3_short_sigkill_storm_landing_inside_claim_windows(chaos: Chaos) -> None:
    # Windows as long as the handlers' slowest: every kill lands in an open one.
    report = chaos("--workers", "4", "--events", "50000", "--duration", "20", "--faults", "kill:2s",
                   "--handler-ms", "50-500", "--lease-ttl", f"{LEASE_TTL:g}",
                   "--rescue-interval", f"{RESCUE:g}", "--backlog", "300",
                   "--claim-window", "0.5", "--drain-timeout", "60", "--seed", "3")
    assert_exactly_once_where_it_counts(report)
    c = report["check"]
    assert report["kills"] >= 8
    # A killed window's events are pending again at once, run again by others:
    # every duplicate is still a re-run of an execution on a killed pid.
    assert c["duplicated"] == c["duplicates_after_kill"]
    assert c["duplicated"] <= report["kills"] * 16
    # The next claims of a killed window's events counted its attempts.
    assert report["window_crashes_counted"] > 0
    assert c["orphans_not_rerun"] == 0


@pytest.mark.serial
def test_r7_short_backend_kill_storm_inside_claim_windows(chaos: Chaos) -> None:
    report = chaos("--workers", "2", "--events", "50000", "--duration", "15",
                   "--faults", "terminate:1s", "--after", "5", "--handler-ms", "0-20",
                   "--backlog", "500", "--claim-window", "0.1", "--drain-timeout", "60")
    assert_exactly_once_where_it_counts(report)
    assert report["terminations"] >= 12
    assert report["throughput"]["after_faults_first_60s"] > 0


@pytest.mark.serial
def test_r7_short_backend_kill_storm(chaos: Chaos) -> None:
    report = chaos("--workers", "2", "--events", "50000", "--duration", "15",
                   "--faults", "terminate:1s", "--after", "5", "--handler-ms", "0-20",
                   "--backlog", "500", "--drain-timeout", "60")
    assert_exactly_once_where_it_counts(report)
    assert report["terminations"] >= 12
    assert report["terminated_sessions"] >= 12 * 2
    assert report["throughput"]["after_faults_first_60s"] > 0


@pytest.mark.light
def test_a_fleet_with_latency_rides_out_a_partition(chaos: Chaos) -> None:
    # Each worker on a "host" of its own (a network namespace), 2 ms of round trip
    # to the server, and one of them cut off for 5 s mid-flow (its link down,
    # both ends running): conveyor_tools/chaos/netsim.py, docs/scaling.md. The
    # feeder keeps 200 events pending until 4 s after the link comes back, so both
    # workers' slots stay full and there is work left for the healed one however
    # fast the other drains (an upfront 3,000 were sometimes gone before the heal
    # on a quiet machine).
    report = chaos("--netns", "--latency", "2ms", "--workers", "2", "--backlog", "200",
                   "--after", "8", "--duration", "4", "--faults", "partition:3s",
                   "--partition-down", "5", "--lease-ttl", f"{LEASE_TTL:g}",
                   "--rescue-interval", f"{RESCUE:g}", "--handler-ms", "0-20",
                   "--drain-timeout", "60")
    assert_exactly_once_where_it_counts(report)
    assert report["latency_by"] in ("tc netem", "delay proxy")
    [part] = report["partitions"]
    c = report["check"]
    # What ran twice is what the cut-off worker held: handlers it had finished
    # but could not acknowledge, or that ran on past their lease (zombies); every
    # one explained (above), and no more than its 16 slots and a claim in flight.
    assert c["duplicated"] <= 2 * 16, c
    assert c["partition_rerun_max"] is None or c["partition_rerun_max"] <= LEASE_TTL + RESCUE + 4.0
    # The worker itself lived through it and went back to work.
    assert part["ran_after_heal"] > 0, part


@pytest.mark.light
def test_r6_short_server_restart_mid_drain(chaos: Chaos) -> None:
    report = chaos("--workers", "2", "--events", "3000", "--upfront", "--duration", "3",
                   "--faults", "restart:1s", "--restart-down", "3", "--after", "12",
                   "--handler-ms", "0-20", "--poll-interval", "60", "--drain-timeout", "60")
    assert_exactly_once_where_it_counts(report)
    [restart] = report["restarts"]
    assert restart["workers_alive_while_down"] == 2 and restart["workers_alive"] == 2
    assert restart["reconnect_s"] is not None and restart["reconnect_s"] <= 10.0
    # With a 60 s poll, only a re-established LISTEN starts a new event this fast.
    # The prober's probes are timed only when one lands after the reconnect inside
    # this short window (not always, on a loaded machine); LISTEN after a restart
    # is proven deterministically by tests/acceptance/test_server_restart.py.
    # "Reconnected" is every worker's LISTEN session back; each of a worker's
    # other connections looks for the server once a second while it waits
    # (PROBE_INTERVAL), so its claims may resume up to a second after that, and
    # a probe waits that long: 2.04 s was seen beside three light tests
    # (2026-12-05) against a bound of 2 s. The bound is that second and 3 s of
    # a loaded machine, far from the 60 s poll; the full R6 run
    # (docs/reliability.md) holds the 1 s figure.
    if restart["first_probe_after_reconnect_s"] is not None:
        assert restart["probe_max_after_reconnect_s"] < PROBE_INTERVAL + 3.0


# R13: the vacuum horizon pinned while events arrive at a steady rate. The worker
# checks every min(30 s, threshold / 4), so its alert lands at most threshold +
# interval after the pin; the margin covers a loaded 2-core box and the log's
# one-second timestamps.
HORIZON_ALERT = 6.0
HORIZON_CHECK = min(30.0, HORIZON_ALERT / 4)
ALERT_MARGIN = 5.0
# The feed must stay well within what the two workers manage on a loaded machine,
# or the backlog never clears after the release, pin or no pin: at 200/s, with two
# CPU burners on the 2-core box, they worked about 125/s and R13b's backlog was
# still 451 events when the run ended (cleared_after_release_s None). At 50/s
# the pin still leaves its dead rows and xmin age, and the alert is the same.
R13_RATE = 50
# The phases, in seconds: a baseline to compare the pin's dead rows with; a pin
# long enough for the latest alert (HORIZON_ALERT + HORIZON_CHECK + ALERT_MARGIN,
# 12.5 s) with room to spare; after it, room for the release's record (at most
# HORIZON_CHECK + ALERT_MARGIN) and the backlog to clear. (R13a ran 10 + 40 + 15 s,
# then 5 + 25 + 10 with a 10 s threshold.)
R13_BASELINE, R13_PIN, R13_AFTER = 5, 18, 10


def assert_pin_reported(report: dict[str, Any], holder: str) -> None:
    assert_exactly_once_where_it_counts(report)
    c = report["check"]
    assert c["duplicated"] == 0 and c["retries"] == 0
    feed = report["feed"]
    assert feed["errors"] == 0 and feed["max_lag_s"] < 2.0
    pin = report["pin"]
    alert = pin["alert"]
    assert alert["first_after_pin_s"] is not None, alert["messages"]
    assert alert["first_after_pin_s"] <= HORIZON_ALERT + HORIZON_CHECK + ALERT_MARGIN
    # the worker measures the holder's age itself: never before the threshold
    assert alert["first_reported_age_s"] >= HORIZON_ALERT
    assert holder in alert["first_holder"]
    assert len(alert["workers_alerted"]) == alert["workers"]      # every worker checks
    assert alert["alerts_outside_pin"] == []                       # no false alarm
    assert alert["released_logged_after_s"] is not None
    assert alert["released_logged_after_s"] <= HORIZON_CHECK + ALERT_MARGIN
    pinned = report["phases"]["pinned"]
    assert pinned["xmin_age_max"] > 0
    assert pinned["dead_tuples_max"] > report["phases"]["baseline"]["dead_tuples_max"]
    assert pin["backlog"]["cleared_after_release_s"] is not None


@pytest.mark.light
def test_r13a_short_idle_in_transaction_pin_raises_the_worker_alert(chaos: Chaos) -> None:
    report = chaos("--workers", "2", "--rate", str(R13_RATE), "--baseline", str(R13_BASELINE),
                   "--duration", str(R13_PIN), "--faults", "idle_tx", "--after", str(R13_AFTER),
                   "--horizon-alert", f"{HORIZON_ALERT:g}s", "--handler-ms", "0-20",
                   "--drain-timeout", "60", timeout=200)
    assert_pin_reported(report, "chaos-idle-tx, idle in transaction")
    assert report["pin"]["held_s"] >= R13_PIN - 2
    assert report["feed"]["enqueued"] >= R13_RATE * (R13_BASELINE + R13_PIN + R13_AFTER) * 0.95


@pytest.mark.light
def test_r13b_short_repeatable_read_readers_raise_the_worker_alert(chaos: Chaos) -> None:
    report = chaos("--workers", "2", "--rate", str(R13_RATE), "--baseline", str(R13_BASELINE),
                   "--duration", str(R13_PIN), "--faults", "rr_readers", "--rr-readers", "4",
                   "--rr-stagger", "3", "--rr-interval", "2", "--after", str(R13_AFTER),
                   "--horizon-alert", f"{HORIZON_ALERT:g}s", "--handler-ms", "0-20",
                   "--drain-timeout", "60", timeout=200)
    assert_pin_reported(report, "chaos-rr-reader-0")     # the oldest snapshot is named
    rr = report["pin"]["rr"]
    assert rr["snapshots"] == 4 and rr["errors"] == []
