"""Topic patterns: an exact topic, ``prefix.*`` for every topic under a prefix, or ``*``.

One value type says what a pattern matches, whether two patterns share a
topic, and how the SQL statements test a topic against a set of patterns. The
router, the flow limits, the relay, pauses, webhooks and the operator API all
read patterns through it.

Example::

    pattern = TopicPattern.parse("email.*")
    pattern.matches("email.send")                      # True
    pattern.overlaps(TopicPattern.parse("email.bulk")) # True
    sql_params([pattern], prefix="limit_")             # the claim's topic test
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from conveyor.errors import InvalidInputError
from conveyor.validation import check_topic, show

__all__ = ["TopicPattern", "check_topic_pattern", "matches_any", "sql_params"]

ALL = "*"
_PREFIX_SUFFIX = ".*"


@dataclass(frozen=True, slots=True)
class TopicPattern:
    """A checked topic pattern; build one with :meth:`parse`.

    Attributes:
        text: the pattern as written (``"email.send"``, ``"email.*"``, ``"*"``).
    """

    text: str

    @classmethod
    def parse(cls, value: object) -> TopicPattern:
        """The pattern ``value`` spells; :class:`~conveyor.errors.InvalidInputError` when it
        is none (the message names the value)."""
        if isinstance(value, TopicPattern):
            return value
        if value == ALL:
            return cls(ALL)
        topic = value[:-2] if isinstance(value, str) and value.endswith(_PREFIX_SUFFIX) else value
        try:
            check_topic(topic)
        except InvalidInputError:
            raise InvalidInputError(
                f"malformed topic pattern {show(value)}: expected 'topic', 'prefix.*' or '*'"
            ) from None
        assert isinstance(value, str)  # check_topic refused anything else
        return cls(value)

    @property
    def is_all(self) -> bool:
        """Whether the pattern is ``*``: every topic."""
        return self.text == ALL

    @property
    def prefix(self) -> str | None:
        """For ``prefix.*``, the prefix with its dot (``"email."``); None otherwise."""
        return self.text[:-1] if self.text.endswith(_PREFIX_SUFFIX) else None

    @property
    def exact(self) -> str | None:
        """For an exact topic, that topic; None for ``prefix.*`` and ``*``."""
        return None if self.is_all or self.prefix is not None else self.text

    def matches(self, topic: str) -> bool:
        """Whether ``topic`` is one this pattern names."""
        prefix = self.prefix
        if prefix is not None:
            return topic.startswith(prefix)
        return self.is_all or topic == self.text

    def overlaps(self, other: TopicPattern) -> bool:
        """Whether some topic matches both patterns."""
        if self.is_all or other.is_all or self.text == other.text:
            return True
        mine, theirs = self.prefix, other.prefix
        if mine is not None and theirs is not None:
            return mine.startswith(theirs) or theirs.startswith(mine)
        if mine is not None:
            return other.text.startswith(mine)
        if theirs is not None:
            return self.text.startswith(theirs)
        return False

    def sql_params(self, prefix: str = "") -> dict[str, Any]:
        """:func:`sql_params` for this one pattern."""
        return sql_params([self], prefix)

    def topic_range(self) -> tuple[str | None, str | None, str | None]:
        """``(exact, low, high)`` for a listing's index range: the exact topic, or the
        ``[low, high)`` range of topics under a prefix; all None for ``*``.

        ``"email.*"`` gives ``(None, "email.", "email/")``: ``/`` follows ``.``
        in byte order, so the range holds exactly the topics under ``email.``.
        """
        prefix = self.prefix
        if prefix is None:
            return self.exact, None, None
        return None, prefix, prefix[:-1] + "/"

    def __str__(self) -> str:
        return self.text


def check_topic_pattern(pattern: object) -> str:
    """A routing pattern as text: an exact topic, ``prefix.*`` or ``*`` for everything."""
    return TopicPattern.parse(pattern).text


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def sql_params(patterns: Iterable[TopicPattern | str], prefix: str = "") -> dict[str, Any]:
    """``{<prefix>all_topics, <prefix>topics, <prefix>prefixes}``: how the SQL statements'
    topic test matches a topic against any of ``patterns``: every topic, one of the exact
    topics, or a LIKE of one of the prefixes.

    Text is read as written, unchecked: patterns are checked where they enter
    (:meth:`TopicPattern.parse`), and one stored by a worker is not input.
    """
    exact: list[str] = []
    prefixes: list[str] = []
    for pattern in patterns:
        read = _read(pattern)
        under = read.prefix
        if read.is_all:
            return {f"{prefix}all_topics": True, f"{prefix}topics": [], f"{prefix}prefixes": []}
        if under is None:
            exact.append(read.text)
        else:
            prefixes.append(_like_escape(under) + "%")
    return {f"{prefix}all_topics": False, f"{prefix}topics": exact, f"{prefix}prefixes": prefixes}


def matches_any(patterns: Iterable[TopicPattern | str], topic: str) -> bool:
    """Whether any of ``patterns`` (read as written, like :func:`sql_params`) matches ``topic``."""
    return any(_read(p).matches(topic) for p in patterns)


def _read(pattern: TopicPattern | str) -> TopicPattern:
    return pattern if isinstance(pattern, TopicPattern) else TopicPattern(pattern)
