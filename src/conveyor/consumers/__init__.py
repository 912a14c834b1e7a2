"""Built-in consumers: ready-made handlers for common events.

* :mod:`conveyor.consumers.email` sends templated mail over SMTP (``email.send``).
* :mod:`conveyor.consumers.writeback` sets a created row's status through the engine.
* :mod:`conveyor.consumers.xlsx` aggregates a workbook and writes the result back.

Consumers import no worker code: each is a plain async callable taking an
:class:`~conveyor.types.Event`, so it can be routed like any other handler.

Each needs an extra (``email``, ``http`` for the write-back, ``xlsx``); importing
one without it raises :class:`~conveyor.errors.MissingExtraError` naming it.
"""
