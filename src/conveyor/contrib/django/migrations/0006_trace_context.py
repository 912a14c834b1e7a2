"""Conveyor migration 6: trace context (conveyor/schema/migrations/0006_trace_context.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0005_pauses")]
    operations = [conveyor_migration(6)]
