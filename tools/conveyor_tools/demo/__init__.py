"""``conveyor demo``: the guided tour on the embedded PostgreSQL (or any database).

It resets a schema of its own (``conveyor_demo``), places orders whose events
are written in the same transactions as the order rows, starts a real worker
process for :mod:`conveyor_tools.demo.app`, shows live progress until everything
that can finish has, stops the worker with SIGTERM and prints the status
summary and the parked event's error history. The command is registered by
:mod:`conveyor_tools.demo.command`; :mod:`conveyor_tools.demo.runner` runs it.
"""
