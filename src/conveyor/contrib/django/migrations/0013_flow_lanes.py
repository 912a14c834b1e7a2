"""Conveyor migration 13: flow lanes (conveyor/schema/migrations/0013_flow_lanes.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0012_flow_limits")]
    operations = [conveyor_migration(13)]
