"""Conveyor migration 4: listing indexes (conveyor/schema/migrations/0004_listing_indexes.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0003_prunable_index")]
    operations = [conveyor_migration(4)]
