"""Schema: numbered migrations, the snapshot they produce, and the migrator."""

from conveyor.schema.migrator import AsyncMigrator, Migration, Migrator, load_migrations

__all__ = ["AsyncMigrator", "Migration", "Migrator", "load_migrations"]
