"""Conveyor migration 3: prunable index (conveyor/schema/migrations/0003_prunable_index.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0002_failed_index")]
    operations = [conveyor_migration(3)]
