"""The documented setup without the django-tasks backport in INSTALLED_APPS (Django 6's).

Adversary N9: the admin module subscripted ``ModelAdmin`` at run time, which
only django_tasks' import makes possible, so this setup crashed at start.
"""

from __future__ import annotations

from settings import *  # noqa: F403
from settings import INSTALLED_APPS

INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "django_tasks"]
