"""The workbook aggregate ``conveyor xlsx`` computes, over a sheet streamed row by row.

:func:`aggregate_workbook` counts the data rows of the first sheet and sums
``monto``, in all and per ``tipo``, in flat memory whatever the sheet's
size. It stands on two modules, re-exported here so that this one stays the
place to import from:

* :mod:`conveyor.consumers.workbook_reader`: :class:`Workbook`, which
  streams the first sheet's rows and reads only the shared strings asked for;
* :mod:`conveyor.consumers.workbook_limits`: :class:`WorkbookLimits` and
  the refusals of hostile input, cheap and early:

  * zip bombs: the central directory's declared sizes, entry count and
    compression ratios are checked before anything is inflated, and the bytes
    actually inflated are counted while streaming (``zipfile`` also stops at
    the declared size and fails the CRC when a member lies about it);
  * XML attacks: any DTD is refused outright, so entity expansion (billion
    laughs, quadratic blow-up) and external entities (XXE) never happen;
  * absurd sheets: more than 1,048,576 rows (Excel's own limit) is refused.

Every refusal raises :class:`~conveyor.errors.WorkbookError` with a one-line
reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, BinaryIO

from conveyor.consumers.workbook_limits import CHUNK, MAX_ROWS, WorkbookLimits
from conveyor.consumers.workbook_reader import Cell, Workbook
from conveyor.errors import WorkbookError

__all__ = ["CHUNK", "MAX_ROWS", "REQUIRED_COLUMNS", "Aggregate", "Cell", "Workbook",
           "WorkbookLimits", "aggregate_workbook"]


@dataclass(frozen=True, slots=True)
class Aggregate:
    """``rows`` data rows, ``total`` of ``monto``, and ``by_type``: sum of ``monto`` per ``tipo``."""

    rows: int
    total: Decimal
    by_type: dict[str, Decimal]

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "total": _number(self.total),
                "by_type": {k: _number(v) for k, v in sorted(self.by_type.items())}}


def _number(value: Decimal) -> int | float:
    return int(value) if value == value.to_integral_value() else float(value)


REQUIRED_COLUMNS = ("tipo", "monto")


def aggregate_workbook(source: BinaryIO | str | Path, limits: WorkbookLimits | None = None
                       ) -> Aggregate:
    """Count the data rows of the first sheet, sum ``monto``, and sum it per ``tipo``.

    The header is the first non-empty row; ``tipo`` and ``monto`` are required
    (any order, any case), other columns are ignored. Shared strings are looked
    up in two small passes (the header's names first, then only the ``tipo``
    values actually used), so memory does not grow with the sheet.
    """
    with Workbook.open(source, limits) as wb:
        header = next(wb.rows(header_only=True), None)
        if header is None:
            raise WorkbookError("sheet is empty: no header row")
        header_number, header_cells = header
        wanted = {int(c.value) for c in header_cells.values() if c.kind == "s" and c.value.isdigit()}
        strings = wb.shared_strings(wanted)
        names: dict[str, int] = {}
        for col, cell in header_cells.items():
            name = strings.get(int(cell.value), "") if cell.kind == "s" else cell.value
            names.setdefault(name.strip().lower(), col)
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise WorkbookError(f"header row {header_number} lacks required column(s): "
                                f"{', '.join(missing)}")
        tipo_col, monto_col = names["tipo"], names["monto"]
        rows = 0
        total = Decimal(0)
        by_key: dict[tuple[str, str], Decimal] = {}
        # Amounts written as shared strings: (tipo key, sst index) -> count, resolved
        # after the pass like the tipo labels, with the first row of each for errors.
        sst_amounts: dict[tuple[tuple[str, str], int], int] = {}
        sst_first_row: dict[int, int] = {}
        for number, cells in wb.rows(columns={tipo_col, monto_col}):
            if number <= header_number:
                continue
            monto = cells.get(monto_col)
            tipo = cells.get(tipo_col)
            if monto is None and tipo is None:
                continue  # no data in the columns we read: an empty row for our purpose
            key = ("s", tipo.value) if tipo is not None and tipo.kind == "s" else \
                  ("v", tipo.value if tipo is not None else "")
            rows += 1
            if monto is not None and monto.kind == "s" and monto.value.isdigit():
                index = int(monto.value)
                sst_amounts[(key, index)] = sst_amounts.get((key, index), 0) + 1
                sst_first_row.setdefault(index, number)
                continue
            amount = _amount(number, monto)
            by_key[key] = by_key.get(key, Decimal(0)) + amount
            total += amount
        if rows == 0:
            raise WorkbookError("sheet has a header but no data rows")
        if sst_amounts:
            texts = wb.shared_strings(set(sst_first_row))
            for (key, index), count in sst_amounts.items():
                cell = Cell("str", texts.get(index, ""))
                amount = _amount(sst_first_row[index], cell) * count
                by_key[key] = by_key.get(key, Decimal(0)) + amount
                total += amount
        needed = {int(v) for kind, v in by_key if kind == "s" and v.isdigit()}
        strings = wb.shared_strings(needed) if needed else {}
        by_type: dict[str, Decimal] = {}
        for (kind, raw), amount in by_key.items():
            label = strings.get(int(raw), "") if kind == "s" and raw.isdigit() else raw
            by_type[label] = by_type.get(label, Decimal(0)) + amount
        return Aggregate(rows=rows, total=total, by_type=by_type)


def _amount(row: int, cell: Cell | None) -> Decimal:
    if cell is None:
        raise WorkbookError(f"row {row}: monto is empty")
    if cell.kind not in ("n", "str"):
        raise WorkbookError(f"row {row}: monto is not a number: {cell.value[:40]!r}")
    try:
        # A number cell holds a double; its XML text may carry 17 digits of binary
        # noise ('99.98999999999999'), so sum the shortest text of that double.
        # Text cells are summed exactly as written.
        value = (Decimal(repr(float(cell.value))) if cell.kind == "n"
                 else Decimal(cell.value.strip()))
    except (InvalidOperation, ValueError):
        raise WorkbookError(f"row {row}: monto is not a number: {cell.value[:40]!r}") from None
    if not value.is_finite():
        raise WorkbookError(f"row {row}: monto is not a finite number: {cell.value[:40]!r}")
    return value
