"""Conveyor migration 18: the aside lane (conveyor/schema/migrations/0018_aside_lane.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    # 0017 is flow fairness's (written beside this one): depend on it once it lands.
    dependencies = [("conveyor", "0017_fair_turns")]
    operations = [conveyor_migration(18)]
