"""The paused claim is the plain claim plus one anti-join, kept so by this test."""

from __future__ import annotations

from conveyor.db.named_queries import raw_queries

PAUSE_FILTER = """      AND NOT EXISTS (
          SELECT 1 FROM {schema}.pauses AS p
          WHERE (p.pattern = '*' OR p.pattern = events.topic
                 OR (right(p.pattern, 2) = '.*' AND starts_with(events.topic, left(p.pattern, -1))))
            AND (p.tenant IS NULL OR p.tenant = events.tenant))
"""


def _statement(name: str) -> str:
    """The SQL of a named query without its leading comment lines."""
    return "\n".join(line for line in raw_queries()[name].splitlines()
                     if not line.startswith("--"))


def test_claim_unpaused_is_event_claim_plus_the_pause_filter() -> None:
    # A change to event_claim (a column, an ORDER BY) must be made to both:
    # a worker with a pause in force claims with the second.
    unpaused = _statement("event_claim_unpaused")
    assert PAUSE_FILTER.rstrip("\n") in unpaused
    assert unpaused.replace(PAUSE_FILTER, "") == _statement("event_claim")
