"""Run the example workflow engine: ``python -m examples.workflow_engine --port 8088``.

The JWT secret comes from ``WORKFLOW_ENGINE_JWT_SECRET`` (never a flag, which
``ps`` would show).
"""

from __future__ import annotations

import argparse
import os
import sys

import uvicorn

from examples.workflow_engine.app import WorkflowEngineSettings, create_app


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.workflow_engine",
                                     description="The example workflow engine.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8088)
    parser.add_argument("--state-file", default=None,
                        help="JSON file of the records (default: memory only)")
    parser.add_argument("--tenant-domain", default="workflow.test")
    parser.add_argument("--allow-control", action="store_true",
                        help="serve POST /_control/fail-next (tests and demos only)")
    args = parser.parse_args()
    secret = os.environ.get("WORKFLOW_ENGINE_JWT_SECRET", "")
    if len(secret.encode()) < 32:
        print("error: set WORKFLOW_ENGINE_JWT_SECRET to at least 32 bytes", file=sys.stderr)
        return 2
    app = create_app(WorkflowEngineSettings(
        jwt_secret=secret, tenant_domain=args.tenant_domain, state_file=args.state_file,
        allow_control=args.allow_control))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
