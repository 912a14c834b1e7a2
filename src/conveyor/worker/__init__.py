"""The worker: claims events, runs their handlers, acknowledges the results."""

from conveyor.worker.worker import Worker, WorkerStats

__all__ = ["Worker", "WorkerStats"]
