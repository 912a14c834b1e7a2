"""Router: exact topics, ``prefix.*`` and ``*``; first match wins; the SQL claim filter."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from conveyor import ConfigError, Event, NewEvent, Producer, Router
from conveyor.db.named_queries import queries_for
from conveyor.patterns import matches_any


def handler(event: Event) -> None:
    return None


async def async_handler(event: Event) -> None:
    return None


class AsyncCallable:
    async def __call__(self, event: Event) -> None:
        return None


def _router(*patterns: str) -> Router:
    router = Router()
    for pattern in patterns:
        router.add(pattern, handler)
    return router


def test_exact_route_matches_only_its_topic() -> None:
    router = _router("email.send")
    assert router.handles("email.send")
    assert not router.handles("email.send.bulk")
    assert not router.handles("email")


def test_prefix_route_matches_topics_below_the_prefix() -> None:
    router = _router("email.*")
    assert router.handles("email.send") and router.handles("email.send.bulk")


def test_prefix_route_does_not_match_the_prefix_itself_or_look_alikes() -> None:
    router = _router("email.*")
    assert not router.handles("email")
    assert not router.handles("emails.send")


def test_star_route_matches_every_topic() -> None:
    assert _router("*").handles("anything.at.all")


def test_first_matching_route_wins() -> None:
    router = Router()

    def specific(event: Event) -> None: ...
    def general(event: Event) -> None: ...

    router.add("email.*", general)
    router.add("email.send", specific)
    resolved = router.resolve("email.send")
    assert resolved is not None and resolved.handler is general


def test_unrouted_topic_resolves_to_none() -> None:
    assert _router("a.b").resolve("c.d") is None


def test_route_added_after_resolve_is_seen() -> None:
    router = _router("a")
    assert router.resolve("b") is None
    router.add("b", handler)
    assert router.handles("b")


def test_decorator_registers_and_returns_the_handler() -> None:
    router = Router()

    @router.route("x.y", timeout=3)
    def work(event: Event) -> None: ...

    route = router.resolve("x.y")
    assert route is not None and route.handler is work and route.timeout == 3


def test_routes_and_patterns_keep_insertion_order() -> None:
    router = _router("b", "a.*", "c")
    assert router.patterns == ["b", "a.*", "c"]
    assert [r.pattern for r in router.routes] == ["b", "a.*", "c"]


def test_async_def_handler_is_marked_async() -> None:
    router = Router()
    assert router.add("a", async_handler).is_async


def test_async_callable_object_is_marked_async() -> None:
    router = Router()
    assert router.add("a", AsyncCallable()).is_async


def test_plain_handler_is_not_async_and_blocking_by_default() -> None:
    route = Router().add("a", handler)
    assert not route.is_async and route.blocking


def test_blocking_false_is_kept() -> None:
    assert not Router().add("a", handler, blocking=False).blocking


@pytest.mark.parametrize("pattern", ["email*", "*.send", "a b", "", "a..b", "a.*.b"])
def test_malformed_pattern_is_refused_with_config_error_naming_it(pattern: str) -> None:
    with pytest.raises(ConfigError, match="malformed topic pattern"):
        Router().add(pattern, handler)


def test_duplicate_pattern_is_refused() -> None:
    router = _router("a.*")
    with pytest.raises(ConfigError, match=r"'a\.\*' is already routed"):
        router.add("a.*", handler)


def test_non_callable_handler_is_refused() -> None:
    with pytest.raises(ConfigError, match="not callable"):
        Router().add("a", "not a function")  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [0, -1])
def test_non_positive_timeout_is_refused(timeout: float) -> None:
    with pytest.raises(ConfigError, match="expected timeout"):
        Router().add("a", handler, timeout=timeout)


def test_claim_filter_with_star_claims_all_topics() -> None:
    assert _router("a", "*").claim_filter() == {"all_topics": True, "topics": [],
                                                  "prefixes": []}


def test_claim_filter_splits_exact_topics_and_prefixes() -> None:
    assert _router("a.b", "c.*").claim_filter() == {
        "all_topics": False, "topics": ["a.b"], "prefixes": ["c.%"]}


def test_claim_filter_escapes_like_wildcards_in_prefixes() -> None:
    assert _router("a_b.*").claim_filter()["prefixes"] == ["a\\_b.%"]


@pytest.mark.parametrize(("patterns", "topic", "expected"), [
    (["*"], "x.y", True),
    (["x.y"], "x.y", True),
    (["x.*"], "x.y.z", True),
    (["x.*"], "x", False),
    (["x.*"], "xy.z", False),
    ([], "x", False),
])
def test_patterns_match_agrees_with_router(patterns: list[str], topic: str,
                                           expected: bool) -> None:
    assert matches_any(patterns, topic) is expected
    assert _router(*patterns).handles(topic) is expected


def _claimed_topics(conn: psycopg.Connection[Any], router: Router) -> set[str]:
    rows = conn.execute(queries_for("conveyor")["event_claim"], {
        **router.claim_filter(), "all_tenants": True, "tenants": [], "limit": 1000,
        "owner": str(uuid.uuid4()), "lease_ttl": 30,
    }).fetchall()
    return {r[2] for r in rows}


TOPICS = ["email.send", "email.send.bulk", "emails.x", "email", "a_b.c", "aXb.c", "sms.send"]


@pytest.mark.parametrize("patterns", [
    ["email.*"], ["email.send", "sms.*"], ["a_b.*"], ["*"], ["email"], ["nothing.here"],
])
def test_sql_claim_filter_claims_exactly_what_the_router_handles(
    conn: psycopg.Connection[Any], patterns: list[str],
) -> None:
    Producer().enqueue_many(conn, [NewEvent(topic=t) for t in TOPICS])
    router = _router(*patterns)
    assert _claimed_topics(conn, router) == {t for t in TOPICS if router.handles(t)}


def test_route_keeps_its_own_backoff_policy() -> None:
    from conveyor import LinearBackoff

    policy = LinearBackoff(step=3)
    router = Router()

    @router.route("a", backoff=policy)
    def work(event: Event) -> None: ...

    route = router.resolve("a")
    assert route is not None and route.backoff is policy


def test_route_without_backoff_defers_to_the_worker() -> None:
    assert Router().add("a", handler).backoff is None
