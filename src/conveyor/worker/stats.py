"""What a worker has done since it started."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WorkerStats:
    """Counters since the worker started."""

    claimed: int = 0              # events claimed
    claims: int = 0               # claim statements that returned events (claimed / claims: batch size)
    last_claim_at: float = 0.0    # time.monotonic() of the last claim round trip, with or without rows
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    handed_back: int = 0
    lost: int = 0
    rescued: int = 0
    loop_stalls: int = 0          # times a handler blocked the event loop (see LoopWatchdog)
    loop_stall_max_s: float = 0.0
