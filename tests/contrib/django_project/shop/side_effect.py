"""A module whose import has a side effect: the Django worker must never import it.

Adversary N13: an event on a ``django.*`` topic made the worker import any
module its payload named, running its import-time code, before checking that
it named a task.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

MARKER = Path(tempfile.gettempdir()) / f"conveyor-django-side-effect-{os.getpid()}"
MARKER.write_text("imported")


def run() -> None:
    """Not a task either."""
