"""Conveyor migration 5: pauses (conveyor/schema/migrations/0005_pauses.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0004_listing_indexes")]
    operations = [conveyor_migration(5)]
