"""Conveyor's schema as Django migrations: one per Conveyor migration, from the same SQL.

Each file in ``conveyor/contrib/django/migrations`` applies one Conveyor
migration with :func:`conveyor_migration`: the text ``conveyor migrate --sql
--from N --to N`` prints, which records the version in Conveyor's own table
and skips a migration already applied (by ``conveyor migrate`` too). So
``manage.py migrate`` and ``conveyor migrate`` can be mixed, and ``conveyor
migrate --check`` agrees with Django. tests/contrib/django/test_django.py
holds the files to the migrations, one to one.

A stepped Conveyor migration cannot run in the one transaction Django opens
for a migration: its file sets ``atomic = False`` and takes
:func:`conveyor_operations`, one operation per part of the script (each
step's SQL with its record is one statement, so it commits on its own; a
no-transaction step's statement runs alone)::

    class Migration(migrations.Migration):
        atomic = False
        dependencies = [("conveyor", "0024_...")]
        operations = conveyor_operations(25)
"""

from __future__ import annotations

from django.db import migrations

from conveyor.contrib.django import setting
from conveyor.errors import MigrationError
from conveyor.schema.migrator import migration_script, migration_script_parts
from conveyor.schema.migrator_core import known_migrations


def conveyor_migration(version: int) -> migrations.RunSQL:
    """The RunSQL operation applying Conveyor migration ``version`` to CONVEYOR's schema.

    Not reversible: Conveyor's migrations only go forward (a rollback would
    drop events). A stepped migration needs :func:`conveyor_operations`.
    """
    if any(m.stepped for m in known_migrations() if m.version == version):
        raise MigrationError(f"conveyor migration {version} runs in steps: its Django migration "
                             f"needs atomic = False and operations = conveyor_operations({version})")
    return migrations.RunSQL(migration_script(setting("SCHEMA"), version, version),
                             reverse_sql=migrations.RunSQL.noop, elidable=False)


def conveyor_operations(version: int) -> list[migrations.RunSQL]:
    """The operations applying Conveyor migration ``version``, one per transaction it needs.

    For a migration without steps, ``[conveyor_migration(version)]``; for a
    stepped one, one RunSQL per part of its script, for a Django migration
    with ``atomic = False`` (Django then runs each operation in autocommit).
    """
    parts = migration_script_parts(setting("SCHEMA"), version, version)
    if len(parts) == 1 and parts[0].transaction:
        return [conveyor_migration(version)]
    return [migrations.RunSQL(part.sql, reverse_sql=migrations.RunSQL.noop, elidable=False)
            for part in parts]
