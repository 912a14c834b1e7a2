"""``conveyor bench``: Conveyor against a raw-SQL baseline, in one run, on one database.

What is measured, each next to plain psycopg doing the same work, and each
against the strongest raw variant of its kind (the report names it):

* enqueue, one event per transaction, in two shapes: ``Producer.enqueue`` +
  COMMIT vs a raw INSERT + COMMIT, and each alone on an autocommit
  connection; and 1000 per transaction (``enqueue_bulk``/``enqueue_many``)
  vs raw ``COPY``;
* the outbox's marginal cost: what ``enqueue`` adds to a business
  transaction (an order INSERT) against what a raw event INSERT adds;
* drain of pre-enqueued no-op events by a real ``conveyor worker`` process,
  at the defaults (vs the raw mark loop at the same batch and the worker's
  own commit setting) and at the best of a few
  ``batch_size``/``concurrency``/``retention`` settings (vs the fastest of
  the raw loops: mark or DELETE, synchronous or asynchronous commit, batch
  100 to 1000); WAL bytes and client CPU per drained event beside each;
* wake-up latency of an idle worker (commit returned -> handler started);
* the worker's peak RSS (``VmHWM``).

The command is registered by :mod:`conveyor_tools.bench.command`. Everything
happens in scratch schemas that are dropped at the end; see
:mod:`conveyor_tools.bench.measure` for the timing method. Progress goes to stderr;
stdout gets the table, or with ``--json`` exactly one JSON object.

``conveyor bench --consumers`` measures the consumers instead (the XLSX reader
against openpyxl, hostile files, SMTP with and without connection reuse); see
:mod:`conveyor_tools.bench.consumers`.
"""

