"""Commands from other distributions: the ``conveyor.commands`` entry points.

Each test installs a throwaway distribution the way pip would (a
``*.dist-info`` directory on ``PYTHONPATH``) and runs the real command in a
subprocess, so the entry points are discovered exactly as in production.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _distribution(root: Path, name: str, entry_points: str, modules: dict[str, str]) -> None:
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[conveyor.commands]\n{entry_points}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


def _conveyor(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("CONVEYOR_DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


HELLO = '''
def run(ctx, args):
    print(f"hello {args.who} in schema {ctx.schema}")
    return 0


def register(sub):
    parser = sub.add_parser("hello", help="say hello")
    parser.add_argument("who")
    parser.set_defaults(handler=run)
'''

HALF = '''
def register(sub):
    sub.add_parser("half", help="registered, then the plugin fails")
    raise RuntimeError("boom")
'''


def test_a_plugin_command_runs_next_to_the_built_in_ones(tmp_path: Path) -> None:
    _distribution(tmp_path, "hello_plugin", "hello = hello_plugin:register",
                  {"hello_plugin": HELLO})
    done = _conveyor(tmp_path, "--schema", "jobs", "hello", "world")
    assert (done.returncode, done.stdout, done.stderr) == (0, "hello world in schema jobs\n", "")
    listed = _conveyor(tmp_path, "--help")
    assert "hello" in listed.stdout and "migrate" in listed.stdout
    # The global options are accepted after a plugin's command too.
    after = _conveyor(tmp_path, "hello", "you", "--schema", "other")
    assert after.stdout == "hello you in schema other\n", after.stderr


@pytest.mark.parametrize(("entry", "modules", "reason"), [
    ("gone = conveyor_no_such_plugin:register", {}, "No module named 'conveyor_no_such_plugin'"),
    ("half = half_plugin:register", {"half_plugin": HALF}, "RuntimeError: boom"),
    ("notcallable = half_plugin:MISSING", {"half_plugin": HALF}, "MISSING"),
])
def test_a_broken_plugin_is_one_warning_and_the_rest_still_works(
        tmp_path: Path, entry: str, modules: dict[str, str], reason: str) -> None:
    _distribution(tmp_path, "broken_plugin", entry, modules)
    name = entry.split(" = ")[0]
    done = _conveyor(tmp_path, "migrate", "--sql")
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE" in done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"conveyor: warning: command {name!r} from broken_plugin")
    assert reason in line
    listed = _conveyor(tmp_path, "--help")
    assert listed.returncode == 0
    # A command the plugin added before it failed is taken back out.
    assert "half" not in listed.stdout.split("global options")[0]
    refused = _conveyor(tmp_path, name)
    assert refused.returncode == 2
    assert f"invalid choice: '{name}'" in refused.stderr


def test_the_tools_register_bench_and_demo() -> None:
    done = subprocess.run([sys.executable, "-m", "conveyor.cli.main", "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stderr == ""
    for command in ("bench", "demo"):
        assert f"    {command} " in done.stdout, done.stdout
