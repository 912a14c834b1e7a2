"""Conveyor migration 28: the primary key and the claim index fill their pages
by appends to the brim (conveyor/schema/migrations/0028_full_append_pages.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0027_history_brin")]
    operations = [conveyor_migration(28)]
