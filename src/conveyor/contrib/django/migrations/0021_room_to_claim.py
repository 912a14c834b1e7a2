"""Conveyor migration 21: the events table leaves room on each page for the rows'
next versions (conveyor/schema/migrations/0021_room_to_claim.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0020_written_when_used")]
    operations = [conveyor_migration(21)]
