"""The Django app: ``INSTALLED_APPS = [..., "conveyor.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class ConveyorConfig(AppConfig):
    name = "conveyor.contrib.django"
    label = "conveyor"
    verbose_name = "Conveyor"
    default_auto_field = "django.db.models.BigAutoField"
