"""Conveyor migration 10: results (conveyor/schema/migrations/0010_results.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0009_claim_index_include")]
    operations = [conveyor_migration(10)]
