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

from collections.abc import Iterable, Sequence
from typing import Any

from conveyor.errors import ConfigError, InvalidInputError
from conveyor.workflow.errors import WorkflowConflictError
from conveyor.workflow.types import (
    Field,
    ObjectType,
    RegistrationOutcome,
    RegistrationReport,
    Trigger,
    WorkflowAdapter,
    _as_field,
    _check_name,
)


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


    async def register_all(self, adapter: WorkflowAdapter) -> RegistrationReport:
        """Register every object type, then every trigger; idempotent.

        Returns the report; raises :class:`WorkflowConflictError` listing every
        conflicting definition (with ``report`` attached) after trying them all.
        """
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
