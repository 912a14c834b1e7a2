"""Conveyor migration 2: failed index (conveyor/schema/migrations/0002_failed_index.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0001_initial")]
    operations = [conveyor_migration(2)]
