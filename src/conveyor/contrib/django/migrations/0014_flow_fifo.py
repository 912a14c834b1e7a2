"""Conveyor migration 14: per-key order (conveyor/schema/migrations/0014_flow_fifo.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0013_flow_lanes")]
    operations = [conveyor_migration(14)]
