"""Conveyor migration 17: fair claims in turn (conveyor/schema/migrations/0017_fair_turns.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0016_relay_order")]
    operations = [conveyor_migration(17)]
