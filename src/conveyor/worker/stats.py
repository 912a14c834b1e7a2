"""What a worker has done since it started."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class WorkerStats:
    """Counters since the worker started."""

    claimed: int = 0              # events claimed
    claims: int = 0               # claim statements that returned events (claimed / claims: batch size)
    last_claim_at: float = 0.0    # time.monotonic() of the last claim round trip, with or without rows
    last_empty_claim_at: float = 0.0  # the same, of the last one that found nothing to claim
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    handed_back: int = 0
    lost: int = 0
    rescued: int = 0
    loop_stalls: int = 0          # times a handler blocked the event loop (see LoopWatchdog)
    loop_stall_max_s: float = 0.0

    def carry(self, earlier: WorkerStats) -> None:
        """Start the counts from ``earlier``'s (a tenant's previous turn: its counters run on
        across turns); the times of the last claims stay this worker's own."""
        for name in ("claimed", "claims", "succeeded", "retried", "failed", "cancelled",
                     "handed_back", "lost", "rescued", "loop_stalls"):
            setattr(self, name, getattr(self, name) + getattr(earlier, name))
        self.loop_stall_max_s = max(self.loop_stall_max_s, earlier.loop_stall_max_s)

    def stalled(self, seconds: float) -> None:
        """Count a loop stall of ``seconds`` (the watchdog's report)."""
        self.loop_stalls += 1
        self.loop_stall_max_s = max(self.loop_stall_max_s, seconds)


# The order of each tally's counts, as event_counts_add takes them.
SUCCEEDED, RETRIED, FAILED, CANCELLED = range(4)


class OutcomeTally:
    """Outcomes written since the last flush, by (minute, topic): the rows the
    heartbeat adds to ``event_counts`` (migration 0008, the dashboard's charts).

    ``minute`` is an epoch second on the database's clock, a whole minute.
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[int, str], list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self._counts)

    def add(self, minute: int, topic: str, kind: int, n: int = 1) -> None:
        row = self._counts.get((minute, topic))
        if row is None:
            row = self._counts[minute, topic] = [0, 0, 0, 0]
        row[kind] += n

    def take(self) -> dict[tuple[int, str], list[int]]:
        """Everything tallied, sorted by (minute, topic); the tally starts again empty."""
        taken, self._counts = self._counts, {}
        return dict(sorted(taken.items()))

    def put_back(self, taken: dict[tuple[int, str], list[int]]) -> None:
        """Merge counts whose write failed back in, for the next flush."""
        for (minute, topic), row in taken.items():
            for kind, n in enumerate(row):
                if n:
                    self.add(minute, topic, kind, n)

    @staticmethod
    def params(taken: dict[tuple[int, str], list[int]]) -> dict[str, list[Any]]:
        """``event_counts_add``'s parameters for what :meth:`take` returned."""
        return {"minutes": [float(m) for m, _ in taken], "topics": [t for _, t in taken],
                "succeeded": [r[SUCCEEDED] for r in taken.values()],
                "retried": [r[RETRIED] for r in taken.values()],
                "failed": [r[FAILED] for r in taken.values()],
                "cancelled": [r[CANCELLED] for r in taken.values()]}
