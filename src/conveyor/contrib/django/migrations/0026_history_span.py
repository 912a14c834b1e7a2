"""Conveyor migration 26: the history's partitions span any whole number of
minutes that divides a day (conveyor/schema/migrations/0026_history_span.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0025_history_partitions")]
    operations = [conveyor_migration(26)]
