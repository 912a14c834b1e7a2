"""Conveyor migration 11: cron (conveyor/schema/migrations/0011_cron.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0010_results")]
    operations = [conveyor_migration(11)]
