"""Conveyor migration 19: the ordered relay's xid and index on demand
(conveyor/schema/migrations/0019_relay_order_on_demand.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0018_aside_lane")]
    operations = [conveyor_migration(19)]
