"""Read-only admin pages of the events, with retry and cancel actions (docs/django.md).

Nothing is edited through the model: the actions call :class:`conveyor.Admin`
on Django's connection, so they keep its rules (which states may be retried
or cancelled) and wake the workers at commit. The list never counts the whole
table (``show_full_result_count``): at millions of events an exact count is
the slow part of an admin page.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from conveyor.admin import Admin
from conveyor.contrib.django import psycopg_connection, setting
from conveyor.contrib.django.models import Event
from conveyor.errors import ConveyorError


def _apply(request: HttpRequest, queryset: QuerySet[Event], verb: str) -> None:
    conveyor = Admin(setting("SCHEMA"))
    conn = psycopg_connection(queryset.db)
    done, refused = 0, []
    for event_id in queryset.values_list("id", flat=True)[:1000]:
        try:
            (conveyor.retry if verb == "retried" else conveyor.cancel)(conn, event_id)
            done += 1
        except ConveyorError as exc:
            refused.append(str(exc))
    if done:
        messages.success(request, f"{done} event(s) {verb}.")
    for reason in refused[:10]:
        messages.warning(request, reason)


@admin.register(Event)
# Not ModelAdmin[Event]: ModelAdmin is generic for django-stubs only, and
# subscripting it at run time works just after django_stubs_ext.monkeypatch(),
# which importing the django-tasks backport does; Django 6's setup leaves the
# backport out, and the admin crashed at start (adversary N9).
class EventAdmin(admin.ModelAdmin):
    list_display = ("id", "topic", "tenant", "state", "attempts", "max_attempts", "run_at",
                    "last_error")
    list_filter = ("state",)
    search_fields = ("=id", "topic", "=tenant")
    show_full_result_count = False
    list_per_page = 50
    actions = ("retry_events", "cancel_events")
    readonly_fields = tuple(f.name for f in Event._meta.fields)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Retry and cancel: for users granted "Can change event" (the pages stay read-only)."""
        return bool(request.user.has_perm("conveyor.change_event"))

    @admin.action(description="Retry the selected events now", permissions=["operate"])
    def retry_events(self, request: HttpRequest, queryset: QuerySet[Event]) -> None:
        _apply(request, queryset, "retried")

    @admin.action(description="Cancel the selected events", permissions=["operate"])
    def cancel_events(self, request: HttpRequest, queryset: QuerySet[Event]) -> None:
        _apply(request, queryset, "cancelled")
