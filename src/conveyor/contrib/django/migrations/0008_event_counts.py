"""Conveyor migration 8: event counts (conveyor/schema/migrations/0008_event_counts.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0007_cheaper_writes")]
    operations = [conveyor_migration(8)]
