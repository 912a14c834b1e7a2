"""Workflows: steps that wait for other steps (chains, groups, callbacks).

A workflow is built from steps, each one event, and written in one call in
the caller's transaction (:meth:`Producer.enqueue_workflow
<conveyor.Producer.enqueue_workflow>`): the steps that wait for others are
written ``waiting`` and become due only when every step they wait for has
succeeded (docs/workflows.md)::

    from conveyor import chain, group, step

    flow = chain(
        step("order.reserve", {"order": 7}),
        group(step("mail.confirm", {"order": 7}), step("invoice.create", {"order": 7})),
        step("order.close", {"order": 7}),
    )
    ids = producer.enqueue_workflow(conn, flow)

``chain(a, b, c)`` runs its parts one after another: each waits for every
last step of the one before. ``group(a, b, c)`` runs its parts side by side;
``group(...).then(c)`` (a chord) runs ``c`` once, after all of them. A step
object used twice is one event with both places' dependencies, which builds
any acyclic graph. Typed tasks make steps too: ``send_email.step(to, subject)``.

When a dependency fails for good or is cancelled, a step's ``on_failure``
decides: ``"park"`` (the default) fails it with the reason, without
running it, so an operator can retry it; ``"cancel"`` cancels it;
``"ignore"`` counts the dependency as done. Either way what waits for that
step follows its own rule in turn. A step reads what its dependencies
returned (``store_result`` routes) with :meth:`conveyor.Admin.dependencies`.

This module only describes a workflow; nothing here touches a database.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, get_args

from conveyor.errors import InvalidInputError
from conveyor.records import WorkflowStep
from conveyor.types import NewEvent

OnFailure = Literal["park", "cancel", "ignore"]
ON_FAILURE: tuple[str, ...] = get_args(OnFailure)

# Steps one workflow may hold: a 10,000-member chord is one statement's
# arrays; far larger graphs belong in several workflows (or a bulk enqueue).
MAX_STEPS = 100_000


class Step:
    """One event of a workflow, and what it does when a dependency fails.

    Build one with :func:`step` or a typed task's ``step()``. Compared by
    identity: the same object in two places of a workflow is one event.
    """

    __slots__ = ("event", "on_failure")

    def __init__(self, event: NewEvent, *, on_failure: OnFailure = "park") -> None:
        if not isinstance(event, NewEvent):
            raise InvalidInputError(f"a step holds a NewEvent, not {type(event).__name__}")
        if on_failure not in ON_FAILURE:
            raise InvalidInputError(
                f"on_failure must be one of {', '.join(ON_FAILURE)}, not {on_failure!r}")
        if event.idempotency_key is not None:
            raise InvalidInputError(
                f"step {event.topic!r}: a workflow's steps take no idempotency key "
                f"({event.idempotency_key!r}); a step skipped for it would leave the "
                "steps after it waiting for nothing")
        self.event = event
        self.on_failure = on_failure

    def __repr__(self) -> str:
        return f"step({self.event.topic!r})"

    def then(self, *parts: Part) -> Chain:
        """This step, then ``parts`` one after another."""
        return Chain((self, *parts))

    def _firsts(self) -> list[Step]:
        return [self]

    def _lasts(self) -> list[Step]:
        return [self]

    def _edges(self) -> Iterator[tuple[Step, Step]]:
        return iter(())


def step(topic: str, payload: Any = None, *, tenant: str | None = None, delay: float = 0.0,
         priority: int = 0, max_attempts: int | None = None, run_at: datetime | None = None,
         on_failure: OnFailure = "park") -> Step:
    """One step on ``topic``; the options are :meth:`Producer.enqueue
    <conveyor.Producer.enqueue>`'s (no idempotency key: see :class:`Step`)."""
    return Step(NewEvent(topic=topic, payload=payload, tenant=tenant, delay=delay,
                         priority=priority, max_attempts=max_attempts, run_at=run_at),
                on_failure=on_failure)


class Chain:
    """Parts one after another: each part's first steps wait for every last step
    of the part before it."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = _parts("chain", parts)

    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.parts))})"

    def then(self, *parts: Part) -> Chain:
        """This chain, then ``parts`` one after another."""
        return Chain((*self.parts, *parts))

    def _firsts(self) -> list[Step]:
        return self.parts[0]._firsts()

    def _lasts(self) -> list[Step]:
        return self.parts[-1]._lasts()

    def _edges(self) -> Iterator[tuple[Step, Step]]:
        for part in self.parts:
            yield from part._edges()
        for before, after in zip(self.parts, self.parts[1:], strict=False):
            for later in after._firsts():
                for earlier in before._lasts():
                    yield later, earlier


class Group:
    """Parts side by side; :meth:`then` adds a callback run once after all of them."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = _parts("group", parts)

    def __repr__(self) -> str:
        return f"group({', '.join(map(repr, self.parts))})"

    def then(self, *parts: Part) -> Chain:
        """This group, then ``parts`` one after another (with one step: a chord)."""
        return Chain((self, *parts))

    def _firsts(self) -> list[Step]:
        return [s for part in self.parts for s in part._firsts()]

    def _lasts(self) -> list[Step]:
        return [s for part in self.parts for s in part._lasts()]

    def _edges(self) -> Iterator[tuple[Step, Step]]:
        for part in self.parts:
            yield from part._edges()


Part = Step | Chain | Group


def chain(*parts: Part) -> Chain:
    """``parts`` one after another (see :class:`Chain`)."""
    return Chain(parts)


def group(*parts: Part) -> Group:
    """``parts`` side by side (see :class:`Group`)."""
    return Group(parts)


def _parts(kind: str, parts: Sequence[Part] | Iterable[Part]) -> tuple[Part, ...]:
    found = tuple(parts)
    if not found:
        raise InvalidInputError(f"a {kind} needs at least one step")
    for i, part in enumerate(found):
        if not isinstance(part, Step | Chain | Group):
            raise InvalidInputError(
                f"{kind} part #{i} is {type(part).__name__}, not a step, chain or group")
    return found


@dataclass(frozen=True, slots=True)
class Plan:
    """A workflow flattened: its steps in a stable order, and who waits for whom.

    ``edges`` are ``(step index, dependency index)``; ``firsts`` the indexes
    of the steps that wait for no other step of the workflow.
    """

    steps: tuple[Step, ...]
    edges: tuple[tuple[int, int], ...]
    firsts: tuple[int, ...]


def plan(workflow: Part) -> Plan:
    """Flatten ``workflow``; a cycle or an oversized graph is refused, naming a step."""
    if not isinstance(workflow, Step | Chain | Group):
        raise InvalidInputError(
            f"a workflow is a step, chain or group, not {type(workflow).__name__}")
    index: dict[int, int] = {}
    steps: list[Step] = []

    def number(s: Step) -> int:
        i = index.get(id(s))
        if i is None:
            if len(steps) >= MAX_STEPS:
                raise InvalidInputError(f"a workflow holds at most {MAX_STEPS:,} steps")
            i = index[id(s)] = len(steps)
            steps.append(s)
        return i

    for s in _all_steps(workflow):   # in writing order: ids ascend as the steps are read
        number(s)
    edges: dict[tuple[int, int], None] = {}
    for later, earlier in workflow._edges():
        edges[(index[id(later)], index[id(earlier)])] = None
    _refuse_cycles(steps, edges)
    waiting = {later for later, _ in edges}
    return Plan(tuple(steps), tuple(edges),
                tuple(i for i in range(len(steps)) if i not in waiting))


def _all_steps(part: Part) -> Iterator[Step]:
    if isinstance(part, Step):
        yield part
        return
    for p in part.parts:
        yield from _all_steps(p)


def _refuse_cycles(steps: Sequence[Step], edges: Mapping[tuple[int, int], None]) -> None:
    after: dict[int, list[int]] = {}
    for later, earlier in edges:
        if later == earlier:
            raise InvalidInputError(f"{steps[later]!r} waits for itself")
        after.setdefault(earlier, []).append(later)
    # Kahn's order: a step never reached is on a cycle.
    waits = {i: 0 for i in range(len(steps))}
    for later, _ in edges:
        waits[later] += 1
    ready = [i for i, n in waits.items() if n == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for later in after.get(i, ()):
            waits[later] -= 1
            if waits[later] == 0:
                ready.append(later)
    if seen < len(steps):
        stuck = min(i for i, n in waits.items() if n > 0)
        raise InvalidInputError(f"the workflow has a cycle through {steps[stuck]!r}")


class WorkflowIds(Sequence[int]):
    """The event ids of an enqueued workflow, in :class:`Plan` order; ``ids[step]``
    is one step's, ``last`` those of the steps nothing in it waits for."""

    __slots__ = ("_by_step", "_ids", "last")

    def __init__(self, p: Plan, ids: Sequence[int]) -> None:
        self._ids = tuple(ids)
        self._by_step = {id(s): i for s, i in zip(p.steps, self._ids, strict=True)}
        depended = {earlier for _, earlier in p.edges}
        self.last = tuple(self._ids[i] for i in range(len(p.steps)) if i not in depended)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, Step):
            try:
                return self._by_step[id(key)]
            except KeyError:
                raise KeyError(f"{key!r} is not a step of this workflow") from None
        return self._ids[key]

    def __repr__(self) -> str:
        return f"WorkflowIds({list(self._ids)!r})"


def levels(steps: Sequence[WorkflowStep]) -> list[list[WorkflowStep]]:
    """A workflow's steps (:meth:`conveyor.Admin.workflow`) by level: a step's is one
    more than its deepest dependency's among ``steps``; each level in id order.

    Ids ascend in writing order and a step is written after what it waits
    for, so one pass in id order sees every dependency's level first.
    """
    level: dict[int, int] = {}
    for s in sorted(steps, key=lambda s: s.id):
        level[s.id] = 1 + max((level[d] for d in s.depends_on if d in level), default=-1)
    found: list[list[WorkflowStep]] = [[] for _ in range(1 + max(level.values(), default=-1))]
    for s in sorted(steps, key=lambda s: s.id):
        found[level[s.id]].append(s)
    return found
