"""Run the example engine: ``python -m examples.engine --database-url URL --jwt-secret S``."""

from __future__ import annotations

import argparse

import uvicorn

from examples.engine.app import EngineSettings, create_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.engine",
                                     description="The example engine (Starlette on uvicorn).")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--jwt-secret", required=True, help="shared HS256 secret, >= 32 bytes")
    parser.add_argument("--tenant-domain", default="app.test")
    parser.add_argument("--tenant", action="append", default=[], help="tenant to create (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    app = create_app(EngineSettings(database_url=args.database_url, jwt_secret=args.jwt_secret,
                                    tenant_domain=args.tenant_domain, tenants=tuple(args.tenant)))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
