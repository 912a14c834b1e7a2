"""Conveyor migration 22: operator overrides of flow limits and cron schedules,
and the control audit log (conveyor/schema/migrations/0022_runtime_control.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0021_room_to_claim")]
    operations = [conveyor_migration(22)]
