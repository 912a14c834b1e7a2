"""Workflow events: declare object types and triggers, publish in the transaction, deliver later.

* :mod:`~conveyor.workflow.types` -- the shared vocabulary: declarations, outcomes, the engine seam.
* :mod:`~conveyor.workflow.registry` -- what a module declares, and registration.
* :mod:`~conveyor.workflow.adapters` -- the engine seam's HTTP implementation.
* :mod:`~conveyor.workflow.publisher` -- ``publish_<trigger>(conn, ...)``: an insert only.
* :mod:`~conveyor.workflow.dispatcher` -- the consumer that delivers, with retries.

See ``docs/workflow.md``.
"""

from conveyor.workflow.adapters import HttpWorkflowAdapter
from conveyor.workflow.dispatcher import (
    BACKOFF_DEFAULT,
    WorkflowDispatcher,
    workflow_idempotency_key,
)
from conveyor.workflow.errors import WorkflowConflictError, WorkflowError
from conveyor.workflow.publisher import (
    MAX_ATTEMPTS_DEFAULT,
    TOPIC_PREFIX_DEFAULT,
    AsyncWorkflowPublisher,
    WorkflowEventStatus,
    WorkflowPublisher,
)
from conveyor.workflow.registry import WorkflowRegistry
from conveyor.workflow.types import (
    Field,
    ObjectType,
    RegistrationOutcome,
    RegistrationReport,
    Trigger,
    WorkflowAdapter,
    WorkflowDelivery,
)

__all__ = [
    "BACKOFF_DEFAULT",
    "MAX_ATTEMPTS_DEFAULT",
    "TOPIC_PREFIX_DEFAULT",
    "AsyncWorkflowPublisher",
    "Field",
    "HttpWorkflowAdapter",
    "ObjectType",
    "RegistrationOutcome",
    "RegistrationReport",
    "Trigger",
    "WorkflowAdapter",
    "WorkflowConflictError",
    "WorkflowDelivery",
    "WorkflowDispatcher",
    "WorkflowError",
    "WorkflowEventStatus",
    "WorkflowPublisher",
    "WorkflowRegistry",
    "workflow_idempotency_key",
]
