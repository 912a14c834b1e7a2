"""Built-in consumers: ready-made handlers for common events, and what they stand on.

* :mod:`conveyor.consumers.email` sends templated mail over SMTP (``email.send``).
* :mod:`conveyor.consumers.writeback` sets a created row's status through the engine.
* :mod:`conveyor.consumers.xlsx` aggregates a workbook and writes the result back.
* :mod:`conveyor.consumers.webhooks` fans events out to endpoints and delivers them signed.

Their support, importable on its own:

* :mod:`conveyor.consumers.webhook_signing` signs and verifies webhooks (stdlib only).
* :mod:`conveyor.consumers.engine_client` calls the application's API with scoped service JWTs.
* :mod:`conveyor.consumers.workbook` aggregates an XLSX sheet (stdlib only), streamed by
  :mod:`~conveyor.consumers.workbook_reader` within :mod:`~conveyor.consumers.workbook_limits`.
* :mod:`conveyor.consumers.filestore` opens a tenant's files, refusing names that leave its root.

Consumers are leaves: they import no worker code, and only the CLI composes
them. Each is a plain async callable taking an :class:`~conveyor.types.Event`,
so it can be routed like any other handler.

Each needs an extra (``email``; ``http`` for the write-back, the engine client
and webhook delivery; ``xlsx``); importing one without it raises
:class:`~conveyor.errors.MissingExtraError` naming it. This module imports none
of them, so ``import conveyor.consumers`` costs nothing.
"""
