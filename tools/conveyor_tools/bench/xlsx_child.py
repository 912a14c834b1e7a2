"""One XLSX aggregation in a fresh interpreter, so its peak RSS is its own.

Run as a script (not with ``-m``: the openpyxl side must not import the
conveyor package)::

    python .../bench/xlsx_child.py conveyor|openpyxl FILE

The reader's modules are imported first; then the peak (``VmHWM``) is reset
to the current RSS through ``/proc/self/clear_refs`` and the aggregation is
timed (wall and CPU). One JSON line goes to stdout: ``ok``, the aggregate
(``rows``, ``total``, ``by_type`` as strings) or ``error``, ``seconds``,
``cpu_seconds``, ``rss_before_kb`` (after imports) and ``peak_kb``.

* ``conveyor``: :func:`conveyor.consumers.workbook.aggregate_workbook`, what ``conveyor
  xlsx FILE`` and the XLSX consumer run.
* ``openpyxl``: ``load_workbook(read_only=True, data_only=True)``, first sheet,
  ``reset_dimensions()`` (a wrong declared dimension would drop rows), then
  ``iter_rows(values_only=True)`` computing the same aggregate the same way:
  header = first non-empty row, ``tipo``/``monto`` found by name, empty rows
  skipped, each number summed as the decimal of its shortest repr.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.path and sys.path[0].endswith("bench"):
    del sys.path[0]  # never import a sibling of this file as a top-level module

import json
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

Aggregate = tuple[int, Decimal, dict[str, Decimal]]


def status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _amount(value: Any) -> Decimal:
    if isinstance(value, bool):
        raise ValueError(f"monto is not a number: {value!r}")
    if isinstance(value, int | float):
        return Decimal(repr(float(value)))
    if isinstance(value, str):
        return Decimal(value.strip())
    raise ValueError(f"monto is not a number: {value!r}")


def openpyxl_reader() -> Callable[[str], Aggregate]:
    import openpyxl  # type: ignore[import-untyped,unused-ignore]

    def aggregate(path: str) -> Aggregate:
        wb = openpyxl.load_workbook(path, read_only=True, data_only=True)
        try:
            ws = wb.worksheets[0]
            ws.reset_dimensions()
            rows_iter = ws.iter_rows(values_only=True)
            header: tuple[Any, ...] | None = None
            for values in rows_iter:
                if any(v is not None for v in values):
                    header = values
                    break
            if header is None:
                raise ValueError("sheet is empty")
            names: dict[str, int] = {}
            for i, v in enumerate(header):
                if v is not None:
                    names.setdefault(str(v).strip().lower(), i)
            ti, mi = names["tipo"], names["monto"]
            rows = 0
            total = Decimal(0)
            by_type: dict[str, Decimal] = {}
            for values in rows_iter:
                tipo = values[ti] if ti < len(values) else None
                monto = values[mi] if mi < len(values) else None
                if tipo is None and monto is None:
                    continue
                amount = _amount(monto)
                rows += 1
                total += amount
                key = "" if tipo is None else str(tipo)
                by_type[key] = by_type.get(key, Decimal(0)) + amount
            return rows, total, by_type
        finally:
            wb.close()

    return aggregate


def conveyor_reader() -> Callable[[str], Aggregate]:
    from conveyor.consumers.workbook import aggregate_workbook

    def aggregate(path: str) -> Aggregate:
        agg = aggregate_workbook(path)
        return agg.rows, agg.total, agg.by_type

    return aggregate


def main(argv: list[str]) -> int:
    reader, path = argv[1], argv[2]
    aggregate = conveyor_reader() if reader == "conveyor" else openpyxl_reader()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # reset VmHWM to the current RSS: the peak from here on
    except OSError:
        pass
    before = status("VmRSS")
    start, cpu_start = time.perf_counter(), time.process_time()
    out: dict[str, Any]
    try:
        rows, total, by_type = aggregate(path)
        out = {"ok": True, "rows": rows, "total": str(total),
               "by_type": {k: str(v) for k, v in by_type.items()}}
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which judges it
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300].replace("\n", " ")}
    out["seconds"] = time.perf_counter() - start
    out["cpu_seconds"] = time.process_time() - cpu_start
    out["rss_before_kb"] = before
    out["peak_kb"] = status("VmHWM")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
