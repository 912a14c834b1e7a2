"""The release, in one place: ``conveyor.__version__``, the tracer and ``conveyor_build_info``.

A leaf, so that naming the version loads nothing else (``from conveyor import
__version__`` inside the package would load the package face, and the worker with it).
"""

__version__ = "0.1.0"
