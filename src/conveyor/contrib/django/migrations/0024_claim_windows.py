"""Conveyor migration 24: the record of open claim windows
(conveyor/schema/migrations/0024_claim_windows.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0023_runtime_control")]
    operations = [conveyor_migration(24)]
