"""A small but real workflow engine for the demo and the tests (Starlette on uvicorn).

It accepts registrations of object types and triggers (409 on conflicts) and
events (deduplicated by ``Idempotency-Key``), records them in a JSON file,
and verifies the caller's service JWT. Run it with::

    WORKFLOW_ENGINE_JWT_SECRET=... python -m examples.workflow_engine --port 8088
"""
