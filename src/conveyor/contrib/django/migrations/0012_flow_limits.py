"""Conveyor migration 12: flow limits (conveyor/schema/migrations/0012_flow_limits.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0011_cron")]
    operations = [conveyor_migration(12)]
