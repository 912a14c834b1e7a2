"""Conveyor's schema as Django migrations: one per Conveyor migration, from the same SQL.

Each file in ``conveyor/contrib/django/migrations`` applies one Conveyor
migration with :func:`conveyor_migration`: the text ``conveyor migrate --sql
--from N --to N`` prints, which records the version in Conveyor's own table
and skips a migration already applied (by ``conveyor migrate`` too). So
``manage.py migrate`` and ``conveyor migrate`` can be mixed, and ``conveyor
migrate --check`` agrees with Django. tests/contrib/django/test_django.py
holds the files to the migrations, one to one.
"""

from __future__ import annotations

from django.db import migrations

from conveyor.contrib.django import setting
from conveyor.schema.migrator import migration_script


def conveyor_migration(version: int) -> migrations.RunSQL:
    """The RunSQL operation applying Conveyor migration ``version`` to CONVEYOR's schema.

    Not reversible: Conveyor's migrations only go forward (a rollback would
    drop events).
    """
    return migrations.RunSQL(migration_script(setting("SCHEMA"), version, version),
                             reverse_sql=migrations.RunSQL.noop, elidable=False)
