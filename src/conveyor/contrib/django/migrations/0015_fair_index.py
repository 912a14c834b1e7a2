"""Conveyor migration 15: the fair claim's index (conveyor/schema/migrations/0015_fair_index.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0014_flow_fifo")]
    operations = [conveyor_migration(15)]
