"""Conveyor migration 16: the ordered relay's xid (conveyor/schema/migrations/0016_relay_order.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0015_fair_index")]
    operations = [conveyor_migration(16)]
