"""Errors of the workflow capability, rooted in :class:`~conveyor.errors.ConveyorError`::

    ConveyorError
    └── WorkflowError               the workflow engine refused or misunderstood a call
        └── WorkflowConflictError   a definition clashes with what the engine already has
"""

from __future__ import annotations

from conveyor.errors import ConveyorError
from conveyor.workflow.types import RegistrationReport


class WorkflowError(ConveyorError):
    """The workflow engine refused a registration or answered something unexpected."""


class WorkflowConflictError(WorkflowError):
    """One or more definitions conflict with the engine's; ``report`` holds what did succeed."""

    def __init__(self, message: str, *, conflicts: list[str] | None = None,
                 report: RegistrationReport | None = None) -> None:
        super().__init__(message)
        self.conflicts = conflicts or [message]
        self.report = report
