"""What a dashboard request may carry: ids, filters and notice codes, checked.

Every value a URL or a form brings is read here and nowhere else, and each
one that is wrong raises :class:`~conveyor.errors.InvalidInputError` naming
the field and the value, which the guard answers 400. Kept apart from the
pages so the whole of what the dashboard accepts can be read in one place,
and from the guard so the rendering can read a notice without importing it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.datastructures import FormData, QueryParams
from starlette.requests import Request

from conveyor.admin_controls_core import AUDIT_KINDS
from conveyor.errors import InvalidInputError
from conveyor.filters import EventFilter

# An event id as a URL may carry it: 1 to 19 ASCII digits, within bigint.
EVENT_ID_MAX = 2**63 - 1
# The "created within" choices of the events filter, in seconds.
WITHIN = {"1h": 3600.0, "24h": 86_400.0, "7d": 7 * 86_400.0, "30d": 30 * 86_400.0}
BULK_KINDS = ("retry", "cancel")
SCHEDULE_ACTIONS = ("set", "clear", "disable", "enable")
# span name -> seconds shown; the charts' own table is charts.SPANS.
CHART_SPANS = ("1h", "24h")


def event_id(text: str, name: str = "event id") -> int:
    """An id from the URL; InvalidInputError (400) for anything but a bigint's digits."""
    if not (1 <= len(text) <= 19 and text.isascii() and text.isdigit()) \
            or int(text) > EVENT_ID_MAX:
        shown = text if len(text) <= 24 else text[:21] + "..."
        raise InvalidInputError(f"invalid {name} {shown!r}: expected a positive integer "
                                f"below 2**63")
    return int(text)


def notice_number(request: Request) -> int | None:
    """The ``n`` of a notice link; InvalidInputError when it is not an integer."""
    n = request.query_params.get("n")
    return None if n is None or "done" not in request.query_params else event_id(n, "n")


def bulk_kind(request: Request) -> str:
    """The bulk action a path names: ``retry`` or ``cancel``."""
    kind = str(request.path_params["kind"])
    if kind not in BULK_KINDS:
        raise InvalidInputError(f"unknown bulk action {kind!r}: expected retry or cancel")
    return kind


def filter_from(params: QueryParams | FormData, *, hide_payloads: bool = False
                ) -> tuple[EventFilter, dict[str, Any]]:
    """The EventFilter a query string or form names, and the form's values to show again.

    Raises InvalidInputError naming the field and the value that is wrong.
    """
    states = tuple(str(s) for s in params.getlist("state") if s)
    topic = str(params.get("topic") or "").strip() or None
    tenant = str(params.get("tenant") or "").strip() or None
    error = str(params.get("error") or "").strip() or None
    payload = str(params.get("payload") or "").strip() or None
    if payload is not None and hide_payloads:
        raise InvalidInputError("the payload filter is off: this dashboard hides payloads")
    within = str(params.get("within") or "")
    before = str(params.get("before") or "")
    for label, choice in (("created-within", within), ("created-before", before)):
        if choice and choice not in WITHIN:
            raise InvalidInputError(f"invalid {label} choice {choice!r}: expected one of "
                                    f"{', '.join(WITHIN)}")
    shown = {"state": list(states), "topic": topic or "", "tenant": tenant or "",
             "error": error or "", "payload": payload or "", "within": within, "before": before}
    return EventFilter(states=states, topic=topic, tenant=tenant, error=error, payload=payload,
                       newer_than=WITHIN.get(within), older_than=WITHIN.get(before)), shown


def query(shown: dict[str, Any], **extra: Any) -> str:
    """The query string that names ``shown`` (a filter's form values) and ``extra`` again."""
    pairs: list[tuple[str, str]] = []
    for key, value in {**shown, **extra}.items():
        for item in value if isinstance(value, list) else [value]:
            if item not in ("", None):
                pairs.append((key, str(item)))
    return urlencode(pairs)



def chart_span(request: Request) -> str:
    """The chart span a page's ``span`` names: ``1h`` (the default) or ``24h``."""
    span = request.query_params.get("span") or "1h"
    if span not in CHART_SPANS:
        raise InvalidInputError(f"invalid chart span {span!r}: expected one of "
                                f"{', '.join(CHART_SPANS)}")
    return span


def text_field(form: FormData, name: str) -> str | None:
    """A form's text field, stripped; None when empty or absent."""
    return str(form.get(name) or "").strip() or None


def _number(form: FormData, name: str, convert: type[int] | type[float]) -> int | float | None:
    text = text_field(form, name)
    if text is None:
        return None
    try:
        return convert(text)
    except ValueError:
        raise InvalidInputError(f"invalid {name.replace('_', ' ')} {text[:60]!r}: expected "
                                f"{'an integer' if convert is int else 'a number'}") from None


def limit_form(form: FormData) -> tuple[str, dict[str, Any]]:
    """The pattern and values of the limits page's form (Admin.set_limit checks them)."""
    rate: str | float | None = text_field(form, "rate")
    if rate is not None:
        try:
            rate = float(rate)
        except ValueError:
            pass        # "10/s" and the like: Admin reads those
    return text_field(form, "pattern") or "", {
        "max_running": _number(form, "max_running", int), "rate": rate,
        "burst": _number(form, "burst", float)}


def schedule_action(request: Request) -> str:
    """The schedule change a path names: set, clear, disable or enable."""
    action = str(request.path_params["action"])
    if action not in SCHEDULE_ACTIONS:
        raise InvalidInputError(f"unknown schedule action {action[:40]!r}: expected one of "
                                f"{', '.join(SCHEDULE_ACTIONS)}")
    return action


def audit_filter(params: QueryParams) -> tuple[str | None, str | None, dict[str, str]]:
    """The audit page's target and kind (a kind or its family), and the form's values."""
    target = str(params.get("target") or "").strip() or None
    kind = str(params.get("kind") or "").strip() or None
    families = {k.partition(".")[0] for k in AUDIT_KINDS}
    if kind is not None and kind not in AUDIT_KINDS and kind not in families:
        raise InvalidInputError(f"invalid audit kind {kind[:40]!r}: expected one of "
                                f"{', '.join(sorted(families))} or a kind such as 'limit.set'")
    return target, kind, {"target": target or "", "kind": kind or ""}
