"""The workflow package's shared vocabulary: what a module declares and what an engine answers.

Every other module of :mod:`conveyor.workflow` imports from here and this one
from none of them, so the package's imports form a tree (River's ``rivertype``):

* declarations: :class:`Field`, :class:`ObjectType`, :class:`Trigger`;
* registration: :class:`RegistrationOutcome` per definition, :class:`RegistrationReport` per run;
* the engine seam: :class:`WorkflowAdapter` and the :class:`WorkflowDelivery` it receives.

All of them are importable from :mod:`conveyor.workflow`.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from conveyor.errors import ConfigError, InvalidInputError
from conveyor.validation import check_topic

_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,62}")
_TRIGGER_RE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
# Keyword arguments of the publish methods; a payload field cannot share a name with one.
RESERVED_FIELD_NAMES = frozenset({"conn", "trigger", "tenant", "idempotency_key", "delay",
                                  "priority", "max_attempts", "self"})
PUBLISH_PREFIX = "publish_"


def _check_name(kind: str, name: object, pattern: re.Pattern[str] = _NAME_RE) -> str:
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise ConfigError(f"invalid {kind} name {name!r}: expected lowercase letters, digits "
                          "and underscores" + (", dot-separated" if pattern is _TRIGGER_RE else ""))
    return name


@dataclass(frozen=True, kw_only=True, slots=True)
class Field:
    """One payload field a trigger carries.

    Attributes:
        name: the key in the payload, e.g. ``"message_id"``.
        description: what the value means, shown by the engine. Defaults to ``""``.
        required: whether every event must carry it. Defaults to ``True``.
    """

    name: str
    description: str = ""
    required: bool = True

    def __post_init__(self) -> None:
        _check_name("field", self.name)
        if self.name in RESERVED_FIELD_NAMES:
            raise ConfigError(f"field name {self.name!r} is reserved by the publish methods")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "required": self.required}


def _as_field(item: str | Field) -> Field:
    return item if isinstance(item, Field) else Field(name=item)


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectType:
    """A kind of object workflows can be attached to, e.g. ``message``.

    Attributes:
        name: lowercase identifier, e.g. ``"message"``.
        description: shown by the engine. Defaults to ``""``.
        id_field: the payload field carrying the object's id; every trigger of
            this type carries it. Defaults to ``"<name>_id"``.
    """

    name: str
    description: str = ""
    id_field: str = ""

    def __post_init__(self) -> None:
        _check_name("object type", self.name)
        if not self.id_field:
            object.__setattr__(self, "id_field", f"{self.name}_id")
        _check_name("id field", self.id_field)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "id_field": self.id_field}


@dataclass(frozen=True, kw_only=True, slots=True)
class Trigger:
    """An event on an object type that can start or advance a workflow.

    Attributes:
        name: dot-separated, e.g. ``"mail.received"``.
        object_type: name of the :class:`ObjectType` it fires on.
        description: shown by the engine. Defaults to ``""``.
        fields: payload fields (plain names are accepted as ``Field(name=...)``); the object type's
            ``id_field`` is added first when missing. Defaults to ``()``.
        method: name of the publisher method. Defaults to ``"publish_"`` plus the
            last segment of ``name`` (``publish_received``).
    """

    name: str
    object_type: str
    description: str = ""
    fields: tuple[Field, ...] = ()
    method: str = ""

    def __post_init__(self) -> None:
        _check_name("trigger", self.name, _TRIGGER_RE)
        check_topic(self.name)
        _check_name("object type", self.object_type)
        fields = tuple(_as_field(f) for f in self.fields)
        names = [f.name for f in fields]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"trigger {self.name!r} declares field {duplicates[0]!r} twice")
        object.__setattr__(self, "fields", fields)
        if not self.method:
            object.__setattr__(self, "method", PUBLISH_PREFIX + self.name.rsplit(".", 1)[-1])
        if not self.method.isidentifier() or keyword.iskeyword(self.method) \
                or not self.method.startswith(PUBLISH_PREFIX):
            raise ConfigError(f"invalid publish method name {self.method!r} for trigger "
                              f"{self.name!r}: expected an identifier starting with 'publish_'")

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def required_fields(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields if f.required)

    def check_payload(self, fields: dict[str, Any]) -> None:
        """Refuse a payload lacking a required field or carrying an undeclared one."""
        missing = [n for n in self.required_fields if fields.get(n) is None]
        if missing:
            raise InvalidInputError(
                f"trigger {self.name!r} payload lacks declared field(s): {', '.join(missing)}")
        unknown = sorted(set(fields) - set(self.field_names))
        if unknown:
            raise InvalidInputError(
                f"trigger {self.name!r} does not declare field(s): {', '.join(unknown)}; "
                f"declared: {', '.join(self.field_names)}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "object_type": self.object_type,
                "description": self.description, "fields": [f.to_json() for f in self.fields]}


class RegistrationOutcome(StrEnum):
    """What registering one definition did."""

    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


@dataclass(slots=True)
class RegistrationReport:
    """What :meth:`~conveyor.workflow.registry.WorkflowRegistry.register_all` did.

    Each entry names one definition, e.g. ``"object_type:message"``.

    Attributes:
        created: definitions the engine did not have.
        updated: definitions whose compatible details (descriptions, new fields) changed.
        unchanged: definitions the engine already had exactly.
        conflicts: definitions the engine refused, with its reason.
    """

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated)

    def summary(self) -> str:
        text = (f"created {len(self.created)}, updated {len(self.updated)}, "
                f"unchanged {len(self.unchanged)}")
        return text + (f", conflicts {len(self.conflicts)}" if self.conflicts else "")

    def to_json(self) -> dict[str, list[str]]:
        return {"created": list(self.created), "updated": list(self.updated),
                "unchanged": list(self.unchanged), "conflicts": list(self.conflicts)}


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkflowDelivery:
    """One event as the engine receives it.

    Attributes:
        tenant: whose event it is.
        source: the declaring module, e.g. ``"mail"``.
        trigger: e.g. ``"mail.received"``.
        object_type: e.g. ``"message"``.
        object_id: the object's id, from the object type's ``id_field``.
        fields: the payload fields.
        event_id: the Conveyor event id in the source database.
        idempotency_key: identical on every redelivery of this event.
        attempt: 1-based delivery attempt.
        occurred_at: when the event was published (ISO 8601), or ``None``.
    """

    tenant: str
    source: str
    trigger: str
    object_type: str
    object_id: Any
    fields: dict[str, Any] = field(default_factory=dict)
    event_id: int
    idempotency_key: str
    attempt: int = 1
    occurred_at: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "trigger": self.trigger, "object_type": self.object_type,
                "object_id": self.object_id, "fields": dict(self.fields),
                "event_id": self.event_id, "attempt": self.attempt,
                "occurred_at": self.occurred_at}


class WorkflowAdapter(Protocol):
    """What Conveyor needs from a workflow engine. Implement it for engines without HTTP.

    ``register_*`` return what they did and raise
    :class:`~conveyor.workflow.errors.WorkflowConflictError` for a definition the
    engine cannot accept. ``deliver`` returns on acceptance (including a
    recognised redelivery) and raises on anything else; an exception with a
    false ``retryable`` attribute makes the dispatcher stop retrying.
    """

    async def register_object_type(self, source: str, object_type: ObjectType) -> RegistrationOutcome:
        ...

    async def register_trigger(self, source: str, trigger: Trigger) -> RegistrationOutcome:
        ...

    async def deliver(self, delivery: WorkflowDelivery) -> None:
        ...
