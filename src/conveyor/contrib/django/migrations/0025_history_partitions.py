"""Conveyor migration 25: finished events in partitions of their own
(conveyor/schema/migrations/0025_history_partitions.sql).

Three steps, each committed on its own so that none holds the events table's
lock while it reads the table: Django runs them in autocommit."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_operations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("conveyor", "0024_claim_windows")]
    operations = conveyor_operations(25)
