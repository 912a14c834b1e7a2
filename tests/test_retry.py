"""BackoffPolicy: base * factor ** (attempt - 1), capped, jitter only shortens."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import BackoffPolicy, ConfigError, LinearBackoff, RetryPolicy


class FixedRandom(random.Random):
    """An rng whose random() always returns ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


NO_JITTER = FixedRandom(0.0)
MAX_JITTER = FixedRandom(math.nextafter(1.0, 0.0))

policies = st.builds(
    BackoffPolicy,
    base_delay=st.floats(0, 100),
    factor=st.floats(1, 10),
    max_delay=st.floats(100, 100_000),
    jitter=st.floats(0, 1),
)
attempts = st.integers(1, 200)


def test_default_delays_double_from_two_seconds() -> None:
    policy = BackoffPolicy()
    assert [policy.delay(n, NO_JITTER) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]


def test_default_delay_is_capped_at_one_hour() -> None:
    assert BackoffPolicy().delay(50, NO_JITTER) == 3600.0


def test_attempt_below_one_uses_base_delay() -> None:
    assert BackoffPolicy(base_delay=3).delay(0, NO_JITTER) == 3.0


def test_huge_attempt_number_does_not_overflow() -> None:
    assert BackoffPolicy().delay(10**9, NO_JITTER) == 3600.0


def test_full_jitter_draw_shortens_by_the_jitter_fraction() -> None:
    policy = BackoffPolicy(base_delay=10, jitter=0.5)
    assert policy.delay(1, MAX_JITTER) == pytest.approx(5.0)


def test_zero_jitter_is_deterministic_without_an_rng() -> None:
    policy = BackoffPolicy(base_delay=1, jitter=0)
    assert {policy.delay(3) for _ in range(50)} == {4.0}


@given(policies, attempts)
@settings(max_examples=500, deadline=None)
def test_delay_lies_between_jittered_and_capped_base(policy: BackoffPolicy, attempt: int) -> None:
    try:  # the module docstring's formula, without any shortcut
        raw = policy.base_delay * policy.factor ** (attempt - 1)
    except OverflowError:
        raw = math.inf
    base = min(policy.max_delay, raw)
    delay = policy.delay(attempt, random.Random(attempt))
    assert base * (1 - policy.jitter) - 1e-9 <= delay <= base + 1e-9


@given(policies, attempts)
@settings(max_examples=500, deadline=None)
def test_delay_never_exceeds_max_delay(policy: BackoffPolicy, attempt: int) -> None:
    assert policy.delay(attempt, random.Random()) <= policy.max_delay


@given(policies, attempts, st.floats(0, 1, exclude_max=True))
@settings(max_examples=500, deadline=None)
def test_jitter_only_shortens_the_delay(policy: BackoffPolicy, attempt: int, r: float) -> None:
    assert policy.delay(attempt, FixedRandom(r)) <= policy.delay(attempt, NO_JITTER)


@given(policies, attempts, st.floats(0, 1, exclude_max=True))
@settings(max_examples=500, deadline=None)
def test_delay_is_monotone_in_attempt_for_the_same_draw(
    policy: BackoffPolicy, attempt: int, r: float,
) -> None:
    assert policy.delay(attempt, FixedRandom(r)) <= policy.delay(attempt + 1, FixedRandom(r))


def test_delay_grows_strictly_before_the_cap() -> None:
    policy = BackoffPolicy(base_delay=1, factor=3, max_delay=1000, jitter=0)
    delays = [policy.delay(n) for n in range(1, 8)]
    assert delays == [1, 3, 9, 27, 81, 243, 729]
    assert policy.delay(8) == 1000


@pytest.mark.parametrize(("field", "value"), [
    ("base_delay", -1), ("base_delay", math.nan), ("factor", 0.5), ("jitter", 1.5),
    ("jitter", -0.1), ("max_delay", 0.5),
])
def test_invalid_policy_is_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"expected {field}"):
        BackoffPolicy(**{"base_delay": 1.0, field: value})


def test_large_factor_is_capped_not_overflowed() -> None:
    assert BackoffPolicy(base_delay=1, factor=1e10, max_delay=60).delay(70, NO_JITTER) == 60


@pytest.mark.parametrize("field", ["base_delay", "factor", "max_delay"])
def test_infinite_setting_is_refused(field: str) -> None:
    with pytest.raises(ConfigError, match=f"expected {field} to be finite"):
        BackoffPolicy(**{field: math.inf})


def test_linear_backoff_defaults_add_ten_seconds_per_attempt() -> None:
    assert [LinearBackoff().delay(n) for n in (1, 2, 3)] == [10.0, 20.0, 30.0]


def test_linear_backoff_is_capped_at_max_delay() -> None:
    assert LinearBackoff(step=10, max_delay=25).delay(3) == 25.0


def test_linear_backoff_attempt_below_one_counts_as_one() -> None:
    assert LinearBackoff(step=4).delay(0) == 4.0


@pytest.mark.parametrize(("field", "value"), [
    ("step", -1), ("max_delay", -1), ("max_delay", math.nan), ("step", math.inf)])
def test_linear_backoff_refuses_negative_or_non_finite(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{field}.*{value!r}"):
        LinearBackoff(**{field: value})


def test_policies_satisfy_the_retry_policy_protocol() -> None:
    policies: list[RetryPolicy] = [BackoffPolicy(), LinearBackoff()]
    assert all(p.delay(1) > 0 for p in policies)
