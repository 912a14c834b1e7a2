"""TopicPattern: parse, match, overlap, and the SQL parameters of a set of patterns."""

from __future__ import annotations

import pytest

from conveyor.errors import InvalidInputError
from conveyor.patterns import TopicPattern, check_topic_pattern, matches_any, sql_params


def p(text: str) -> TopicPattern:
    return TopicPattern.parse(text)


@pytest.mark.parametrize("text", ["*", "email.*", "email.send", "a.b.*", "a-1.b_2"])
def test_parse_keeps_the_text_of_a_good_pattern(text: str) -> None:
    assert p(text).text == text
    assert str(p(text)) == text


@pytest.mark.parametrize("bad", ["email*", "*.send", ".*", "email.**", "a.*.b", "", "a..b",
                                 "email.", " email", "e" * 101 + ".*", None, 3, b"email",
                                 ["email"]])
def test_a_bad_pattern_gets_one_line_naming_the_value(bad: object) -> None:
    with pytest.raises(InvalidInputError) as caught:
        TopicPattern.parse(bad)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("malformed topic pattern ")
    assert repr(bad)[:20] in message
    assert "expected 'topic', 'prefix.*' or '*'" in message


def test_parse_returns_a_pattern_as_is() -> None:
    pattern = p("email.*")
    assert TopicPattern.parse(pattern) is pattern


def test_the_kinds() -> None:
    assert (p("*").is_all, p("*").prefix, p("*").exact) == (True, None, None)
    assert (p("a.*").is_all, p("a.*").prefix, p("a.*").exact) == (False, "a.", None)
    assert (p("a.b").is_all, p("a.b").prefix, p("a.b").exact) == (False, None, "a.b")


@pytest.mark.parametrize(("pattern", "topic", "expected"), [
    ("*", "anything.at.all", True),
    ("email.send", "email.send", True),
    ("email.send", "email.sent", False),
    ("email.*", "email.send", True),
    ("email.*", "email.bulk.daily", True),
    ("email.*", "email", False),          # the prefix alone is not under itself
    ("email.*", "emails.send", False),    # the dot is part of the prefix
])
def test_matches(pattern: str, topic: str, expected: bool) -> None:
    assert p(pattern).matches(topic) is expected


@pytest.mark.parametrize(("a", "b", "expected"), [
    ("*", "x.y", True),
    ("x.y", "x.y", True),
    ("x.y", "x.z", False),
    ("x.*", "x.y", True),
    ("x.*", "x.y.*", True),
    ("x.y.*", "x.z.*", False),
    ("x.*", "xy.z", False),
    ("x.*", "x", False),
])
def test_overlaps_is_symmetric_and_true_when_a_topic_matches_both(a: str, b: str,
                                                                 expected: bool) -> None:
    assert p(a).overlaps(p(b)) is expected
    assert p(b).overlaps(p(a)) is expected


@pytest.mark.parametrize("topic", ["x", "x.y", "x.y.z", "xy.z", "q"])
@pytest.mark.parametrize(("a", "b"), [("x.*", "x.y.*"), ("x.y", "x.*"), ("*", "q"), ("x.y", "q")])
def test_overlapping_patterns_share_a_matching_topic(a: str, b: str, topic: str) -> None:
    if p(a).matches(topic) and p(b).matches(topic):
        assert p(a).overlaps(p(b))


def test_sql_params_of_exact_and_prefix_patterns() -> None:
    assert sql_params(["a.b", "c.*", p("d_e.*")], prefix="limit_") == {
        "limit_all_topics": False, "limit_topics": ["a.b"],
        "limit_prefixes": ["c.%", "d\\_e.%"]}      # LIKE's wildcards escaped


def test_sql_params_of_star_match_every_topic() -> None:
    assert sql_params(["a.b", "*"]) == {"all_topics": True, "topics": [], "prefixes": []}
    assert p("x.*").sql_params("fifo_") == sql_params(["x.*"], "fifo_")


def test_sql_params_of_no_pattern_match_no_topic() -> None:
    assert sql_params([]) == {"all_topics": False, "topics": [], "prefixes": []}


@pytest.mark.parametrize(("pattern", "expected"), [
    ("*", (None, None, None)),
    ("email.send", ("email.send", None, None)),
    ("email.*", (None, "email.", "email/")),
])
def test_topic_range(pattern: str, expected: tuple[str | None, ...]) -> None:
    assert p(pattern).topic_range() == expected


def test_matches_any_is_the_patterns_matches() -> None:
    patterns = ["a.*", "b.c"]
    for topic in ("a.z", "b.c", "b.d", "a"):
        assert matches_any(patterns, topic) is any(p(x).matches(topic) for x in patterns)
    assert check_topic_pattern("a.*") == "a.*"


def test_stored_patterns_are_read_as_written() -> None:
    # A worker's registry row is not input: matching it never raises.
    assert matches_any(["not a pattern", "a.*"], "a.b")
    assert not matches_any(["not a pattern"], "a.b")
