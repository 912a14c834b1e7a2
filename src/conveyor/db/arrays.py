"""PostgreSQL array literals for the parameters of hot statements.

psycopg adapts a Python list element by element, in Python. For statements
that run thousands of times a second (claims, acknowledgements) a literal
built once, or with one ``join``, costs a fraction of that (docs/benchmarks.md,
"Behind choices in the code"). The statement
casts the parameter (``%(ids)s::bigint[]``), so PostgreSQL parses the text.
"""

from __future__ import annotations

from collections.abc import Iterable


def int_array(values: Iterable[int]) -> str:
    """``{1,2,3}``: integers need no quoting."""
    return "{" + ",".join(map(str, values)) + "}"


def text_array(values: Iterable[str]) -> str:
    """``{"a","b"}``: every element quoted, so commas, braces, spaces and the
    word NULL stay text; backslashes and double quotes are escaped."""
    return "{" + ",".join(
        '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"
