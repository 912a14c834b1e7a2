"""Conveyor migration 9: claim index include (conveyor/schema/migrations/0009_claim_index_include.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0008_event_counts")]
    operations = [conveyor_migration(9)]
