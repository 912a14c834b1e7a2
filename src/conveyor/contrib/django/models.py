"""A read-only view of Conveyor's events table for Django's admin (docs/django.md).

Unmanaged: Django never creates, alters or drops the table (Conveyor's
migrations own it) and the admin writes nothing through the model; retry and
cancel go through :class:`conveyor.Admin`, with its checks.
"""

from __future__ import annotations

from django.db import models

from conveyor.contrib.django import setting


def events_table() -> str:
    # Django quotes db_table as one identifier: the inner quotes make it
    # "<schema>"."events", a schema-qualified name.
    return f'{setting("SCHEMA")}"."events'


class Event(models.Model):
    id = models.BigAutoField(primary_key=True)
    tenant = models.TextField(null=True)
    topic = models.TextField()
    payload = models.JSONField()
    state = models.TextField()
    attempts = models.IntegerField()
    max_attempts = models.IntegerField()
    priority = models.SmallIntegerField()
    run_at = models.DateTimeField()
    last_error = models.TextField(null=True)
    errors = models.JSONField()
    idempotency_key = models.TextField(null=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    attempted_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)
    result = models.JSONField(null=True)

    class Meta:
        managed = False
        db_table = events_table()
        ordering = ("-id",)
        verbose_name = "event"

    def __str__(self) -> str:
        return f"event {self.id} ({self.topic}, {self.state})"
