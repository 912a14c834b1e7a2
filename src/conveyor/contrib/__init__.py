"""Integrations with frameworks, each behind its own extra: ``conveyor.contrib.sqlalchemy``."""
