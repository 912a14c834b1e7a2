"""The worker: claims events, runs their handlers, acknowledges the results."""

from conveyor.worker.stats import WorkerStats
from conveyor.worker.worker import Worker

__all__ = ["Worker", "WorkerStats"]
