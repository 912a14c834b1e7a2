"""``--json`` on the commands that print a result: one exact JSON object for scripts."""

from __future__ import annotations

import json

import psycopg
import pytest

from cli_support import no_conveyor_env, restore_logging
from conveyor.schema.migrator import load_migrations
from test_cli import Run, _invoke, cli, row

__all__ = ["cli", "no_conveyor_env", "restore_logging"]  # fixtures shared with test_cli


def _json(run: Run, *args: str) -> dict[str, object]:
    code, out, err = run(*args, "--json")
    assert code == 0, err
    assert len(out.splitlines()) == 1, out
    result = json.loads(out)
    assert isinstance(result, dict)
    return result


def test_enqueue_json_says_whether_the_key_deduplicated(cli: Run, fresh_db: str) -> None:
    first = _json(cli, "enqueue", "a.b", '{"n": 1}', "--tenant", "acme", "--key", "k1")
    assert first == {"id": first["id"], "deduplicated": False}
    again = _json(cli, "enqueue", "a.b", '{"n": 2}', "--tenant", "acme", "--key", "k1")
    assert again == {"id": first["id"], "deduplicated": True}
    other = _json(cli, "enqueue", "a.b", "--key", "k1")        # no tenant: another key space
    assert other["deduplicated"] is False and other["id"] != first["id"]
    plain = _json(cli, "enqueue", "a.b")
    assert plain["deduplicated"] is False
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events") == (3,)


def test_enqueue_text_still_prints_the_id_only(cli: Run) -> None:
    code, out, _ = cli("enqueue", "a.b", "--key", "k9")
    assert code == 0 and out.strip().isdigit()
    code, again, _ = cli("enqueue", "a.b", "--key", "k9")
    assert (code, again) == (0, out)


def test_migrate_json_lists_the_versions_applied(empty_db: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _invoke(capsys, ["--database-url", empty_db, "migrate", "--json"])
    assert code == 0, err
    assert json.loads(out) == {
        "schema": "conveyor",
        "applied": [{"version": m.version, "name": m.name} for m in load_migrations()],
        "version": max(m.version for m in load_migrations())}
    code, out, _ = _invoke(capsys, ["--database-url", empty_db, "migrate", "--json"])
    assert json.loads(out)["applied"] == []
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT count(*) FROM conveyor.events").fetchone() == (0,)


def test_migrate_sql_refuses_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _invoke(capsys, ["migrate", "--sql", "--json"])
    assert code == 2 and out == ""
    assert "--json" in err and "--sql" in err
