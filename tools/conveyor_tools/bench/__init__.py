"""``conveyor bench``: Conveyor against a raw-SQL baseline, in one run, on one database.

What is measured, each next to plain psycopg doing the same work:

* enqueue, one event per transaction (``Producer.enqueue`` + commit) vs one
  raw ``INSERT`` + commit; and 1000 per transaction (``enqueue_many``) vs raw
  ``COPY``;
* drain of pre-enqueued no-op events by a real ``conveyor worker`` process,
  at the defaults and at the best of a few ``batch_size``/``concurrency``
  settings, vs a raw claim/finish loop at batch 100 and 1000;
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

