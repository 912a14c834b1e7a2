"""Declaring a command-line option once, together with its ``CONVEYOR_*`` variable.

:func:`option` adds the flag, reads the variable, and writes the help's
``[env CONVEYOR_X] (default: ...)`` from the value that will really be used,
with its unit, once. A variable's text is converted only after parsing, and
only for the command that runs, by :class:`ArgumentParser`; a bad one is
refused in one line that names the variable, never a flag the user did not
type.

Example::

    option(parser, "--poll-interval", env="POLL_INTERVAL", type=duration,
           default=1.0, unit="s", help="fallback poll when no NOTIFY arrives")
"""

from __future__ import annotations

import argparse
import os
import sys
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from conveyor.errors import ConveyorError

ENV_PREFIX = "CONVEYOR_"


@dataclass(frozen=True)
class EnvValue:
    """A default taken from a variable, converted after parsing (see ArgumentParser)."""

    variable: str
    text: str
    convert: Callable[[str], Any]
    choices: Sequence[Any] | None = None


class ArgumentParser(argparse.ArgumentParser):
    """argparse with Conveyor's error shape: one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"conveyor: error: {message} (see '{self.prog} --help')\n")

    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse swallows OSError here; a closed pipe must reach main() so
        # `conveyor --help | head -1` ends like every other command.
        if message:
            (file or sys.stderr).write(message)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        for dest, value in vars(parsed).items():
            if isinstance(value, EnvValue):
                setattr(parsed, dest, self._from_environment(value))
        self._check_string_choices(parsed)
        return parsed, extras

    def _from_environment(self, value: EnvValue) -> Any:
        where = f"invalid {value.variable}={value.text!r}"
        try:
            converted = value.convert(value.text)
        except (argparse.ArgumentTypeError, ValueError, ConveyorError) as exc:
            self.error(f"{where}: {exc}")
        if value.choices is not None and converted not in value.choices:
            self.error(f"{where}: expected one of " + ", ".join(map(str, value.choices)))
        return converted

    def _check_string_choices(self, parsed: argparse.Namespace) -> None:
        # argparse checks the choices of values typed on the command line, not of
        # defaults; options declared without option() may still take theirs
        # from a CONVEYOR_* variable as a plain string.
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.choices is None or isinstance(action, argparse._SubParsersAction) \
                    or not isinstance(value, str) or value in action.choices:
                continue
            flag = action.option_strings[-1]
            variable = ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")
            self.error(f"invalid {variable}={value!r} (for {flag}): expected one of "
                       + ", ".join(map(str, action.choices)))


def add_command(sub: Any, name: str, help_text: str, description: str,
                run: Callable[..., int] | None = None,
                examples: Sequence[tuple[str, str]] = ()) -> argparse.ArgumentParser:
    """A command's parser: one-line help, description, and examples after the options.

    ``run`` is the command's handler; a parser of sub-commands (``workflow``) has none.
    """
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help_text, description=description, epilog=format_examples(examples),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    if run is not None:
        parser.set_defaults(handler=run)
    return parser


def format_examples(examples: Sequence[tuple[str, str]]) -> str | None:
    """A help epilog: each command line, then what it does, indented below it."""
    if not examples:
        return None
    lines = ["examples:"]
    for command, what in examples:
        lines.extend(f"  {line}" for line in command.splitlines())
        lines.append(f"      {what}")
    return "\n".join(lines)


def add_json(parser: argparse.ArgumentParser, shape: str) -> None:
    parser.add_argument("--json", action="store_true", help=f"print one JSON object: {shape}")


def usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    """Refuse a combination of options the way argparse refuses a value: one line, exit 2."""
    parser: argparse.ArgumentParser = args.command_parser
    parser.error(message)


def format_seconds(seconds: float) -> str:
    """A duration as the shortest of ``1h30m``, ``90s`` or ``0.5s`` that is exact."""
    if seconds <= 0 or seconds != int(seconds):
        return f"{seconds:g}s"
    rest, parts = int(seconds), []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(parts)


def format_default(value: Any, unit: str | None) -> str:
    if unit == "s" and isinstance(value, int | float) and not isinstance(value, bool):
        return format_seconds(float(value))
    return f"{value}{unit or ''}"


def option(parser: argparse.ArgumentParser | Any, *flags: str, help: str,
           env: str | None = None, type: Callable[[str], Any] | None = None,
           default: Any = None, unit: str | None = None, shown: str | None = None,
           env_type: Callable[[str], Any] | None = None, secret: bool = False,
           **kwargs: Any) -> argparse.Action:
    """Add ``flags`` to ``parser``, defaulting to ``CONVEYOR_<env>`` when that is set.

    ``default`` is the built-in default, already converted (seconds for a
    duration, with ``unit="s"``); ``shown`` replaces it in the help (e.g.
    ``"every tenant"`` for ``None``). ``env_type`` converts the variable when
    the flag's own ``type`` does not apply (flags that store a constant).
    ``secret`` keeps the variable's value out of the help. Anything else goes
    to ``add_argument``; ``required=True`` holds only while the variable is
    unset.
    """
    variable = ENV_PREFIX + env if env else None
    text = os.environ.get(variable) if variable else None
    convert = env_type or type or str
    if text is not None:
        assert variable is not None
        kwargs.pop("required", None)
        effective: Any = EnvValue(variable, text, convert, kwargs.get("choices"))
        described = "set" if secret else _describe_text(text, convert, unit)
        note = f" (default: {described}, from {variable})"
    else:
        effective = default
        if kwargs.get("required"):
            note = ""
        elif shown is not None:
            note = f" (default: {shown})"
        elif default is not None:
            note = f" (default: {format_default(default, unit)})"
        else:
            note = ""
    where = f" [env {variable}]" if variable else ""
    if variable and convert is boolean:
        where = f" [env {variable}=true|false]"
    if unit == "s" and kwargs.get("action") is None:
        kwargs.setdefault("metavar", "DURATION")
    elif type is not None and getattr(type, "__name__", "") == "positive_int":
        kwargs.setdefault("metavar", "N")
    full_help = (help + where + note.replace("%", "%%"))
    if type is not None:
        kwargs["type"] = type
    return parser.add_argument(*flags, default=effective, help=full_help, **kwargs)


def _describe_text(text: str, convert: Callable[[str], Any], unit: str | None) -> str:
    """How a variable's value reads in the help; its raw text when it does not convert."""
    try:
        value = convert(text)
    except (argparse.ArgumentTypeError, ValueError, ConveyorError):
        return f"{text!r} (invalid)"
    if value is None or isinstance(value, bool):
        return text.strip()
    return format_default(value, unit)



_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def boolean(text: str) -> bool:
    """argparse type: the usual spellings of true and false, nothing else."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def has_control_character(text: str) -> bool:
    """True for C0/C1 controls, DEL and other non-printable code points (e.g. U+2028)."""
    return any(not ch.isprintable() and ch != " " for ch in text) or any(
        unicodedata.category(ch) == "Cf" for ch in text)


def label(text: str) -> str:
    """argparse type: a one-line label such as a worker name (no control characters)."""
    if has_control_character(text):
        raise argparse.ArgumentTypeError(
            f"control characters are not allowed, got {text!r}")
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty name, got {text!r}")
    return text
