"""Object types and their triggers, declared in code and registered with a workflow engine.

A module declares what it can tell a workflow engine about: its *object types*
(``message``, ``thread``) and, per type, the *triggers* that fire on them
(``mail.received``) with the payload fields each trigger carries. The same
declaration drives three things: registration with the engine
(:meth:`WorkflowRegistry.register_all`), the publisher's methods and payload
checks (:mod:`conveyor.workflow.publisher`), and the dispatcher's validation.

Example::

    registry = WorkflowRegistry(source="mail")
    registry.object_type("message", description="One e-mail message")
    registry.trigger("mail.received", object_type="message",
                     description="A message arrived in a mailbox",
                     fields=["message_id", "thread_id", Field(name="mailbox", required=False)])

    report = await registry.register_all(HttpWorkflowAdapter(engine))
    print(report.summary())      # "created 2, updated 0, unchanged 0"

Registration is idempotent: a second run with the same declarations reports
everything ``unchanged``. A definition the engine cannot accept (the name
belongs to another module, a trigger moves to another object type, a field
disappears) raises :class:`~conveyor.workflow.errors.WorkflowConflictError`
naming every conflicting definition, after the rest were registered.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConfigError, InvalidInputError
from conveyor.validation import check_topic
from conveyor.workflow.errors import WorkflowConflictError

if TYPE_CHECKING:
    from conveyor.workflow.adapters import WorkflowAdapter

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


@dataclass(slots=True)
class RegistrationReport:
    """What :meth:`WorkflowRegistry.register_all` did, as ``"object_type:message"`` entries.

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


class WorkflowRegistry:
    """The object types and triggers one module declares.

    Args:
        source: the declaring module's name, e.g. ``"mail"``; the engine uses it
            to tell one module's definitions from another's, and the dispatcher
            puts it in every idempotency key.

    Example::

        registry = WorkflowRegistry(source="mail")
        registry.object_type("thread", description="A conversation")
        registry.trigger("mail.deadline_reached", object_type="thread",
                         fields=["deadline"])        # thread_id is added first
    """

    def __init__(self, source: str) -> None:
        self.source = _check_name("source", source)
        self._types: dict[str, ObjectType] = {}
        self._triggers: dict[str, Trigger] = {}
        self._methods: dict[str, Trigger] = {}

    # ----------------------------------------------------------- declaring

    def object_type(self, name: str, *, description: str = "", id_field: str = "") -> ObjectType:
        """Declare an object type; returns it."""
        return self.add_object_type(ObjectType(name=name, description=description, id_field=id_field))

    def add_object_type(self, definition: ObjectType) -> ObjectType:
        if definition.name in self._types:
            raise ConfigError(f"object type {definition.name!r} is already declared")
        self._types[definition.name] = definition
        return definition

    def trigger(self, name: str, *, object_type: str, description: str = "",
                fields: Iterable[str | Field] = (), method: str = "") -> Trigger:
        """Declare a trigger on a declared object type; returns it."""
        return self.add_trigger(Trigger(name=name, object_type=object_type,
                                        description=description,
                                        fields=tuple(_as_field(f) for f in fields),
                                        method=method))

    def add_trigger(self, definition: Trigger) -> Trigger:
        owner = self._types.get(definition.object_type)
        if owner is None:
            raise ConfigError(f"trigger {definition.name!r} names undeclared object type "
                              f"{definition.object_type!r}")
        if definition.name in self._triggers:
            raise ConfigError(f"trigger {definition.name!r} is already declared")
        if owner.id_field not in definition.field_names:
            definition = Trigger(name=definition.name, object_type=definition.object_type,
                                 description=definition.description, method=definition.method,
                                 fields=(Field(name=owner.id_field,
                                               description=f"id of the {owner.name}"),
                                         *definition.fields))
        clash = self._methods.get(definition.method)
        if clash is not None:
            raise ConfigError(f"triggers {clash.name!r} and {definition.name!r} would both publish "
                              f"as {definition.method!r}; pass method= to one of them")
        self._triggers[definition.name] = definition
        self._methods[definition.method] = definition
        return definition

    # ------------------------------------------------------------- reading

    @property
    def object_types(self) -> tuple[ObjectType, ...]:
        return tuple(self._types.values())

    @property
    def triggers(self) -> tuple[Trigger, ...]:
        return tuple(self._triggers.values())

    def get_object_type(self, name: str) -> ObjectType:
        try:
            return self._types[name]
        except KeyError:
            raise InvalidInputError(f"unknown object type {name!r}") from None

    def get_trigger(self, name: str) -> Trigger:
        """The declared trigger ``name``; InvalidInputError naming it when it is not declared."""
        try:
            return self._triggers[name]
        except (KeyError, TypeError):
            known = ", ".join(self._triggers) or "none"
            raise InvalidInputError(
                f"trigger {name!r} is not registered in {self.source!r} (known: {known})") from None

    def trigger_for_method(self, method: str) -> Trigger | None:
        return self._methods.get(method)

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self._methods)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source,
                "object_types": [t.to_json() for t in self.object_types],
                "triggers": [t.to_json() for t in self.triggers]}

    # --------------------------------------------------------- registering

    async def register_all(self, adapter: WorkflowAdapter) -> RegistrationReport:
        """Register every object type, then every trigger; idempotent.

        Returns the report; raises :class:`WorkflowConflictError` listing every
        conflicting definition (with ``report`` attached) after trying them all.
        """
        from conveyor.workflow.adapters import RegistrationOutcome

        report = RegistrationReport()
        definitions: Sequence[ObjectType | Trigger] = (*self.object_types, *self.triggers)
        for definition in definitions:
            label = _label(definition)
            try:
                if isinstance(definition, ObjectType):
                    outcome = await adapter.register_object_type(self.source, definition)
                else:
                    outcome = await adapter.register_trigger(self.source, definition)
            except WorkflowConflictError as exc:
                report.conflicts.append(f"{label}: {exc}")
                continue
            {RegistrationOutcome.CREATED: report.created,
             RegistrationOutcome.UPDATED: report.updated,
             RegistrationOutcome.UNCHANGED: report.unchanged}[outcome].append(label)
        if report.conflicts:
            raise WorkflowConflictError(
                f"{len(report.conflicts)} workflow definition(s) of {self.source!r} conflict "
                f"with the engine: " + "; ".join(report.conflicts),
                conflicts=list(report.conflicts), report=report)
        return report


def _label(definition: ObjectType | Trigger) -> str:
    kind = "object_type" if isinstance(definition, ObjectType) else "trigger"
    return f"{kind}:{definition.name}"
