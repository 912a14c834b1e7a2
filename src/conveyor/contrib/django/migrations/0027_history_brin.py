"""Conveyor migration 27: a BRIN index on each history partition's finish times
(conveyor/schema/migrations/0027_history_brin.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0026_history_span")]
    operations = [conveyor_migration(27)]
