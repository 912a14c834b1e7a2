"""Input checks that run before any SQL (conveyor.validation).

Every refusal is an InvalidInputError whose message names the offending value.
Hypothesis fuzzes the identifier checks: whatever they accept matches the
strict pattern, whatever else they see they refuse, and never with any other
exception type.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.errors import InvalidInputError, PayloadTooLargeError
from conveyor.patterns import check_topic_pattern
from conveyor.validation import (
    IDEMPOTENCY_KEY_MAX_LENGTH,
    TOPIC_MAX_LENGTH,
    check_delay,
    check_event_id,
    check_idempotency_key,
    check_max_attempts,
    check_priority,
    check_schema_name,
    check_tenant,
    check_topic,
    encode_payload,
)

# The patterns the checks promise, written out independently of the module so a
# loosened regex there fails here.
TOPIC_PATTERN = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9][A-Za-z0-9_-]*)*\Z")
TENANT_PATTERN = re.compile(r"\A[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")
SCHEMA_PATTERN = re.compile(r"\A[a-z_][a-z0-9_]{0,39}\Z")

LIMITS = {"max_bytes": 256 * 1024, "max_depth": 64}

# Characters a hostile or careless caller might feed an identifier: SQL
# metacharacters, quotes, whitespace, control characters, non-ASCII look-alikes.
NASTY = "abcxyzABC019_-.*; '\"\\/\n\r\t\x00\x7f%$(){}[]éİıK\u200b\ufeff"  # noqa: RUF001
nasty_text = st.text(alphabet=NASTY, max_size=80) | st.text(max_size=80)

# 4 identifier checks x 2,500 = 10,000 random identifiers per run.
FUZZ = settings(max_examples=2_500, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _refused_naming(check: Any, value: Any, shown: str | None = None) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as info:
        check(value)
    assert (shown if shown is not None else repr(value)[:40]) in str(info.value)
    return info.value


# ------------------------------------------------------------------- topics

@pytest.mark.parametrize("topic", ["email", "email.send", "a.b-c.d_e", "X1.y2", "a" * 100])
def test_topic_accepts_dotted_segments(topic: str) -> None:
    assert check_topic(topic) == topic


@pytest.mark.parametrize("topic", [
    "email.", ".email", "email..send", "email.*", "*", "email send", "email;drop",
    "-email", "email.-x", "é.send", "email\n", "email\x00",
])
def test_topic_refuses_malformed_and_names_it(topic: str) -> None:
    _refused_naming(check_topic, topic)


def test_topic_refuses_empty() -> None:
    with pytest.raises(InvalidInputError, match="topic must not be empty"):
        check_topic("")


def test_topic_refuses_non_string_and_names_it() -> None:
    _refused_naming(check_topic, 42)


def test_topic_refuses_over_limit_and_names_length() -> None:
    error = _refused_naming(check_topic, "a" * (TOPIC_MAX_LENGTH + 1), "'aaaa")
    assert str(TOPIC_MAX_LENGTH + 1) in str(error)


@given(nasty_text)
@FUZZ
def test_topic_fuzz_accepts_only_the_strict_pattern(text: str) -> None:
    try:
        accepted = check_topic(text)
    except InvalidInputError:
        assert not (TOPIC_PATTERN.match(text) and len(text) <= TOPIC_MAX_LENGTH)
    else:
        assert accepted == text
        assert TOPIC_PATTERN.match(text) and len(text) <= TOPIC_MAX_LENGTH


@pytest.mark.parametrize("pattern", ["*", "email.*", "email.send", "a.b.*"])
def test_topic_pattern_accepts_exact_prefix_and_star(pattern: str) -> None:
    assert check_topic_pattern(pattern) == pattern


@pytest.mark.parametrize("pattern", ["email*", "*.send", ".*", "email.**", "a.*.b", ""])
def test_topic_pattern_refuses_other_wildcards_and_names_it(pattern: str) -> None:
    _refused_naming(check_topic_pattern, pattern)


# ------------------------------------------------------------------ tenants

@pytest.mark.parametrize("tenant", ["acme", "a", "a-b", "0", "x" * 63])
def test_tenant_accepts_dns_labels(tenant: str) -> None:
    assert check_tenant(tenant) == tenant


def test_tenant_accepts_none() -> None:
    assert check_tenant(None) is None


@pytest.mark.parametrize("tenant", [
    "", "Acme", "-acme", "acme-", "ac_me", "ac.me", "x" * 64, "acme\n", "acmé", "a b", 7,
])
def test_tenant_refuses_non_labels_and_names_it(tenant: object) -> None:
    _refused_naming(check_tenant, tenant)


@given(nasty_text)
@FUZZ
def test_tenant_fuzz_accepts_only_dns_labels(text: str) -> None:
    try:
        accepted = check_tenant(text)
    except InvalidInputError:
        assert not TENANT_PATTERN.match(text)
    else:
        assert accepted == text
        assert TENANT_PATTERN.match(text)


# --------------------------------------------------------- idempotency keys

@pytest.mark.parametrize("key", ["order-42", "a", "k" * 255, "spaces are fine", "ünïcode"])
def test_idempotency_key_accepts_printable_text(key: str) -> None:
    assert check_idempotency_key(key) == key


def test_idempotency_key_accepts_none() -> None:
    assert check_idempotency_key(None) is None


@pytest.mark.parametrize("key", ["", 42, "bad\nkey", "nul\x00", "del\x7f"])
def test_idempotency_key_refuses_empty_non_string_and_control_chars(key: object) -> None:
    _refused_naming(check_idempotency_key, key)


# The docs promise "no control characters": C1 controls (NEL \x85 among them)
# and the Unicode line and paragraph separators break lines in logs too.
LINE_BREAKERS = ["\x80", "\x85", "\x9f", "\u2028", "\u2029"]


@pytest.mark.parametrize("char", LINE_BREAKERS, ids=[f"U+{ord(c):04X}" for c in LINE_BREAKERS])
def test_idempotency_key_refuses_c1_controls_and_line_separators(char: str) -> None:
    with pytest.raises(InvalidInputError, match="idempotency key contains control characters"):
        check_idempotency_key(f"order{char}42")


@pytest.mark.parametrize("char", LINE_BREAKERS, ids=[f"U+{ord(c):04X}" for c in LINE_BREAKERS])
def test_topics_and_tenants_refuse_c1_controls_and_line_separators(char: str) -> None:
    for text in (f"email{char}", f"email.{char}send", char):
        with pytest.raises(InvalidInputError):
            check_topic(text)
        with pytest.raises(InvalidInputError):
            check_tenant(text)


def test_idempotency_key_keeps_other_non_ascii_text() -> None:
    assert check_idempotency_key("commande-n°42-été-\u00a0") == "commande-n°42-été-\u00a0"


def test_idempotency_key_refuses_over_limit_and_names_length() -> None:
    error = _refused_naming(check_idempotency_key, "k" * (IDEMPOTENCY_KEY_MAX_LENGTH + 1), "'kkk")
    assert str(IDEMPOTENCY_KEY_MAX_LENGTH + 1) in str(error)


@given(nasty_text)
@FUZZ
def test_idempotency_key_fuzz_refuses_only_with_invalid_input(text: str) -> None:
    try:
        accepted = check_idempotency_key(text)
    except InvalidInputError:
        assert (not text or len(text) > IDEMPOTENCY_KEY_MAX_LENGTH
                or re.search(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", text))
    else:
        assert accepted == text


def test_idempotency_key_refuses_lone_surrogate() -> None:
    with pytest.raises(InvalidInputError):
        check_idempotency_key("key-\ud800")


# ------------------------------------------------------------- schema names

@pytest.mark.parametrize("schema", ["conveyor", "_private", "app_queue_2", "a" * 40])
def test_schema_name_accepts_lowercase_identifiers(schema: str) -> None:
    assert check_schema_name(schema) == schema


@pytest.mark.parametrize("schema", [
    "x; drop table", 'Robert"', "Conveyor", "2fast", "", "a" * 41, "my-schema",
    "conveyor.events", 'a"; DROP SCHEMA public CASCADE; --', None,
])
def test_schema_name_refuses_anything_else_and_names_it(schema: object) -> None:
    _refused_naming(check_schema_name, schema)


def test_schema_name_refuses_reserved_pg_prefix() -> None:
    with pytest.raises(InvalidInputError):
        check_schema_name("pg_queue")


@given(nasty_text)
@FUZZ
def test_schema_name_fuzz_accepts_only_the_strict_pattern(text: str) -> None:
    try:
        accepted = check_schema_name(text)
    except InvalidInputError:
        assert not SCHEMA_PATTERN.match(text)
    else:
        assert accepted == text
        assert SCHEMA_PATTERN.match(text)


# ---------------------------------------------------------------- event ids

@pytest.mark.parametrize(("value", "expected"), [(1, 1), (2**63 - 1, 2**63 - 1), ("42", 42)])
def test_event_id_accepts_positive_integers_and_digit_strings(value: object, expected: int) -> None:
    assert check_event_id(value) == expected


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "abc", "-3", "", None, "1 OR 1=1"])
def test_event_id_refuses_non_positive_integers_and_names_it(value: object) -> None:
    _refused_naming(check_event_id, value)


def test_event_id_refuses_out_of_bigint_range() -> None:
    _refused_naming(check_event_id, 2**63, str(2**63))


def test_event_id_refuses_digit_string_out_of_bigint_range() -> None:
    with pytest.raises(InvalidInputError):
        check_event_id("9" * 30)


def test_event_id_refuses_unicode_superscript_digit() -> None:
    with pytest.raises(InvalidInputError):
        check_event_id("²")


# ------------------------------------------------ delays, priority, attempts

@pytest.mark.parametrize(("value", "expected"), [(0, 0.0), (1.5, 1.5), (3600, 3600.0)])
def test_delay_accepts_finite_non_negative_seconds(value: float, expected: float) -> None:
    assert check_delay(value) == expected


@pytest.mark.parametrize("value", [-1, -0.001, math.inf, math.nan, "10", True, None])
def test_delay_refuses_negative_non_finite_and_non_numbers(value: object) -> None:
    _refused_naming(check_delay, value)


def test_delay_refuses_int_too_large_for_a_float() -> None:
    with pytest.raises(InvalidInputError):
        check_delay(10**400)


def test_delay_refuses_delay_beyond_postgres_interval_range() -> None:
    with pytest.raises(InvalidInputError):
        check_delay(1e300)


@pytest.mark.parametrize(("value", "reason"), [
    (-1, "must be from"), (1e300, "must be from"), (math.inf, "must be from"),
    (-math.inf, "must be from"), (10**400, "must be from"), (math.nan, "must be a number from"),
    ("10", "must be a number of seconds from"), (True, "must be a number of seconds from"),
])
def test_delay_refusals_give_the_reason_and_the_range(value: object, reason: str) -> None:
    """Regression (F10): NaN and 1e400 were refused as '>= 0', without the upper end."""
    with pytest.raises(InvalidInputError) as info:
        check_delay(value)
    assert str(info.value).startswith(f"delay {reason} ")
    assert "0 to 3162240000 seconds (100 years), got " in str(info.value)


@pytest.mark.parametrize("value", [-32768, 0, 32767])
def test_priority_accepts_smallint_range(value: int) -> None:
    assert check_priority(value) == value


@pytest.mark.parametrize("value", [-32769, 32768, 1.0, True, "1", None])
def test_priority_refuses_outside_smallint_and_names_it(value: object) -> None:
    _refused_naming(check_priority, value)


@pytest.mark.parametrize("value", [1, 5, 1000])
def test_max_attempts_accepts_1_to_1000(value: int) -> None:
    assert check_max_attempts(value) == value


@pytest.mark.parametrize("value", [0, -1, 1001, 2.0, False, "3"])
def test_max_attempts_refuses_outside_range_and_names_it(value: object) -> None:
    _refused_naming(check_max_attempts, value)


# ----------------------------------------------------------------- payloads

def test_payload_encodes_compact_json() -> None:
    assert encode_payload({"a": [1, 2], "b": "é"}, **LIMITS) == '{"a":[1,2],"b":"é"}'


@pytest.mark.parametrize(("payload", "key"), [
    ({1: "int-key", "1": "str-key"}, "'1'"),
    ({"x": [{"true": 1, True: 2}]}, "'true'"),
    ({None: 1, "null": 2}, "'null'"),
    ({1.5: "a", "1.5": "b"}, "'1.5'"),
    ({"outer": {False: 0, "false": 1, "other": 2}}, "'false'"),
], ids=["int", "nested-bool", "none", "float", "nested-false"])
def test_payload_keys_that_collide_as_json_are_refused_naming_the_key(
    payload: object, key: str,
) -> None:
    """Regression (F11): {1: "a", "1": "b"} was stored as {"1": "b"}, one value dropped."""
    with pytest.raises(InvalidInputError) as info:
        encode_payload(payload, **LIMITS)
    assert str(info.value).startswith(f"payload has two keys that are both {key} in JSON")


def test_payload_non_string_keys_that_do_not_collide_become_strings() -> None:
    # As json.dumps does: documented, like a tuple coming back as a list.
    assert json.loads(encode_payload({1: "a", 2: "b", "c": 3, None: 4}, **LIMITS)) == {
        "1": "a", "2": "b", "c": 3, "null": 4}


@pytest.mark.parametrize(("value", "text"), [
    (1e16, "10000000000000000.0"),
    (1e300, "1" + "0" * 300 + ".0"),
    (-2.5e20, "-250000000000000000000.0"),
    (1.7976931348623157e308, "17976931348623157" + "0" * 292 + ".0"),
    (1e-07, "1e-07"),
    (1234.5, "1234.5"),
])
def test_payload_floats_keep_a_decimal_point_jsonb_keeps(value: float, text: str) -> None:
    """jsonb prints 1e+16 as 10000000000000000, which decodes as an int."""
    assert encode_payload({"x": value}, **LIMITS) == '{"x":' + text + "}"


def test_payload_strings_that_look_like_big_floats_are_left_alone() -> None:
    payload = {"e": "1e+16", "q": 'say "2e+20" \\', "n": [3e+20]}
    assert json.loads(encode_payload(payload, **LIMITS)) == payload


def test_payload_refuses_non_json_value_naming_its_type() -> None:
    with pytest.raises(InvalidInputError, match="set"):
        encode_payload({"tags": {1, 2}}, **LIMITS)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_payload_refuses_non_finite_floats(value: float) -> None:
    with pytest.raises(InvalidInputError, match="not JSON"):
        encode_payload({"x": value}, **LIMITS)


def test_payload_refusal_of_nan_names_the_value() -> None:
    with pytest.raises(InvalidInputError, match=r"(?i)nan"):
        encode_payload({"x": math.nan}, **LIMITS)


@pytest.mark.parametrize("payload", ["a\x00b", {"k": "\x00"}, {"\x00": 1}, ["\u0000"]])
def test_payload_refuses_nul_character(payload: object) -> None:
    with pytest.raises(InvalidInputError, match=r"NUL character \(\\u0000\)"):
        encode_payload(payload, **LIMITS)


def test_payload_accepts_literal_backslash_u0000_text() -> None:
    text = encode_payload({"path": "C:\\u0000dir"}, **LIMITS)
    assert json.loads(text) == {"path": "C:\\u0000dir"}


def test_payload_refuses_lone_surrogate() -> None:
    with pytest.raises(InvalidInputError):
        encode_payload({"k": "\ud800"}, **LIMITS)


def test_payload_over_size_limit_is_refused_naming_size_and_limit() -> None:
    with pytest.raises(PayloadTooLargeError) as info:
        encode_payload("x" * 100, max_bytes=50, max_depth=64)
    assert "102 bytes" in str(info.value) and "50 bytes" in str(info.value)


def test_payload_size_counts_utf8_bytes_not_characters() -> None:
    # 30 characters of 'é' are 60 bytes, plus two quotes.
    with pytest.raises(PayloadTooLargeError, match="62 bytes"):
        encode_payload("é" * 30, max_bytes=61, max_depth=64)


def test_payload_exactly_at_size_limit_is_accepted() -> None:
    assert encode_payload("x" * 48, max_bytes=50, max_depth=64) == '"' + "x" * 48 + '"'


def test_payload_over_depth_limit_is_refused_naming_limit() -> None:
    with pytest.raises(PayloadTooLargeError, match="limit of 3 levels"):
        encode_payload({"a": [{"b": []}]}, max_bytes=1000, max_depth=3)


def test_payload_at_depth_limit_is_accepted() -> None:
    assert encode_payload({"a": [{"b": 1}]}, max_bytes=1000, max_depth=3) == '{"a":[{"b":1}]}'


def test_payload_nested_beyond_recursion_limit_is_refused_not_crashed() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(PayloadTooLargeError):
        encode_payload(deep, max_bytes=10**9, max_depth=10**9)


# JSON values as jsonb stores them: finite floats, strings without NUL or lone
# surrogates, string keys.
json_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                           blacklist_characters="\x00"), max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False) | json_text,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(json_text, children, max_size=5),
    max_leaves=30,
)


@given(json_values)
@settings(max_examples=500, deadline=None)
def test_payload_fuzz_json_values_round_trip(value: Any) -> None:
    try:
        text = encode_payload(value, **LIMITS)
    except PayloadTooLargeError:
        return
    assert json.loads(text) == value


@pytest.fixture(scope="module")
def jsonb_conn(shared_db_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(shared_db_url, autocommit=True) as conn:
        yield conn


@given(json_values)
@settings(max_examples=200, deadline=None)
def test_payload_fuzz_round_trips_through_jsonb(
    jsonb_conn: psycopg.Connection[Any], value: Any
) -> None:
    try:
        text = encode_payload(value, **LIMITS)
    except InvalidInputError:
        return
    row = jsonb_conn.execute("SELECT %s::jsonb", (text,)).fetchone()
    assert row is not None
    # jsonb keeps numbers as numeric: compare after normalising floats.
    assert _normalise(row[0]) == _normalise(value)


@given(json_values)
@settings(max_examples=200, deadline=None)
def test_payload_fuzz_keeps_every_number_type_through_jsonb(
    jsonb_conn: psycopg.Connection[Any], value: Any
) -> None:
    """A float comes back a float (1e300 came back as a 301-digit int)."""
    try:
        text = encode_payload(value, **LIMITS)
    except InvalidInputError:
        return
    row = jsonb_conn.execute("SELECT %s::jsonb", (text,)).fetchone()
    assert row is not None
    assert _typed(row[0]) == _typed(value)


def _typed(value: Any) -> Any:
    """The value with each number tagged by its type; -0.0 is 0.0 (numeric has no sign of zero)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return (type(value).__name__, value + 0.0 if isinstance(value, float) else value)
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return {k: _typed(v) for k, v in value.items()}


def _normalise(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    return {k: _normalise(v) for k, v in value.items()}
