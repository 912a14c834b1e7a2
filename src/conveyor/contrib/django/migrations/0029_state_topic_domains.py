"""Conveyor migration 29: the state and topic rules kept by domains the table's
CHECKs cast to (conveyor/schema/migrations/0029_state_topic_domains.sql)."""

from django.db import migrations

from conveyor.contrib.django.schema import conveyor_migration


class Migration(migrations.Migration):
    dependencies = [("conveyor", "0028_full_append_pages")]
    operations = [conveyor_migration(29)]
