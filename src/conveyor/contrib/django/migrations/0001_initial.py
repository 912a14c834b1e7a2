"""Conveyor migration 1: initial (conveyor/schema/migrations/0001_initial.sql)."""

from django.db import migrations, models

from conveyor.contrib.django.models import events_table
from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    initial = True
    dependencies = []
    operations = [
        conveyor_migration(1),
        # The admin's read-only view of the events table: no SQL (unmanaged).
        migrations.CreateModel(
            name="Event",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("tenant", models.TextField(null=True)),
                ("topic", models.TextField()),
                ("payload", models.JSONField()),
                ("state", models.TextField()),
                ("attempts", models.IntegerField()),
                ("max_attempts", models.IntegerField()),
                ("priority", models.SmallIntegerField()),
                ("run_at", models.DateTimeField()),
                ("last_error", models.TextField(null=True)),
                ("errors", models.JSONField()),
                ("idempotency_key", models.TextField(null=True)),
                ("created_at", models.DateTimeField()),
                ("updated_at", models.DateTimeField()),
                ("attempted_at", models.DateTimeField(null=True)),
                ("finished_at", models.DateTimeField(null=True)),
                ("result", models.JSONField(null=True)),
            ],
            options={"managed": False, "db_table": events_table(), "ordering": ("-id",),
                     "verbose_name": "event"},
        ),
    ]
