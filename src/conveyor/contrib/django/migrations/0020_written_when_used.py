"""Conveyor migration 20: the error history and update time written when an event has
them (conveyor/schema/migrations/0020_written_when_used.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0019_relay_order_on_demand")]
    operations = [conveyor_migration(20)]
