"""Conveyor migration 7: cheaper writes (conveyor/schema/migrations/0007_cheaper_writes.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0006_trace_context")]
    operations = [conveyor_migration(7)]
