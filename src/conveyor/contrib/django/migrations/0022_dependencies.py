"""Conveyor migration 22: events that wait for other events, and their edges
(conveyor/schema/migrations/0022_dependencies.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0021_room_to_claim")]
    operations = [conveyor_migration(22)]
