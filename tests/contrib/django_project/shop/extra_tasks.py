"""Tasks outside the app's tasks module: the worker loads them from CONVEYOR["TASK_MODULES"]."""

from __future__ import annotations

from django_tasks import task


@task()
def shout(text: str) -> str:
    return text.upper()
