"""``manage.py conveyor_worker [WORKER OPTIONS]``: a Conveyor worker inside the Django project.

It serves :mod:`conveyor.contrib.django.worker`'s router: every Django task
(the ``django.*`` topics of :class:`~conveyor.contrib.django.backend.ConveyorBackend`)
and the routes of ``CONVEYOR["ROUTER"]``. The options are ``conveyor
worker``'s (``--concurrency``, ``--metrics-port``, ...): ``manage.py
conveyor_worker --help`` lists them. SIGTERM drains it like any worker.
"""

from __future__ import annotations

from conveyor.contrib.django.management.commands.conveyor import PassThroughCommand


class Command(PassThroughCommand):
    help = "Run a Conveyor worker for this project's Django tasks and CONVEYOR['ROUTER']."

    def conveyor_arguments(self, arguments: list[str]) -> list[str]:
        return ["worker", "--app", "conveyor.contrib.django.worker:router", *arguments]
