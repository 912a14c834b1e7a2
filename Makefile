# Convenience targets. DATABASE_URL empty = the embedded PostgreSQL.
PYTHON ?= .venv/bin/python
DATABASE_URL ?=
DB_FLAG = $(if $(DATABASE_URL),--database-url $(DATABASE_URL),)

.PHONY: bench bench-quick bench-json

bench:        ## full benchmark against the same-run raw-SQL baseline (a few minutes)
	$(PYTHON) -m conveyor.cli.main $(DB_FLAG) bench

bench-quick:  ## smoke-sized benchmark (well under a minute)
	$(PYTHON) -m conveyor.cli.main $(DB_FLAG) bench --quick

bench-json:   ## full benchmark, one JSON object on stdout
	$(PYTHON) -m conveyor.cli.main $(DB_FLAG) bench --json
