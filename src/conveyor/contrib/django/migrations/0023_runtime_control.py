"""Conveyor migration 23: operator overrides of flow limits and cron schedules,
and the control audit log (conveyor/schema/migrations/0023_runtime_control.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0022_dependencies")]
    operations = [conveyor_migration(23)]
