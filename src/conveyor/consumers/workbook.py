"""Streams the first sheet of an XLSX workbook row by row, refusing hostile files.

Memory stays flat however many rows the sheet has: the sheet XML is fed to
expat in 64 KiB chunks straight from the zip member, rows are handed out one
at a time, and shared strings are never all held at once (see
:func:`aggregate_workbook`).

Hostile input is refused cheaply and early:

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

import posixpath
import pyexpat
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import IO, Any, BinaryIO

from conveyor.errors import WorkbookError

MAX_ROWS = 1_048_576
CHUNK = 64 * 1024

_MAIN_NS = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
_REL_NS = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"
_PKG_REL_NS = "http://schemas.openxmlformats.org/package/2006/relationships"
_CELL_REF_RE = re.compile(r"([A-Z]{1,3})(\d+)")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkbookLimits:
    """Ceilings that keep a hostile file cheap to refuse.

    Attributes:
        max_entries: most members in the zip. Defaults to 1000.
        max_uncompressed_bytes: most bytes all members may inflate to.
            Defaults to 2 GiB (a full 1,048,576-row sheet is about 250 MB).
        max_ratio: highest inflated/compressed ratio of a member over 1 MiB.
            Real sheets compress 5-20x; bombs 300x and more. Defaults to 150.
        max_shared_string_bytes: most bytes of the shared-strings part. Defaults to 256 MiB.
    """

    max_entries: int = 1000
    max_uncompressed_bytes: int = 2 * 1024**3
    max_ratio: float = 150.0
    max_shared_string_bytes: int = 256 * 1024**2


def _col_index(letters: str) -> int:
    n = 0
    for ch in letters:
        n = n * 26 + (ord(ch) - 64)
    return n - 1


class _Refused(Exception):
    """Raised inside expat callbacks; turned into WorkbookError outside."""


def _new_parser() -> Any:
    parser = pyexpat.ParserCreate(namespace_separator="}")
    parser.buffer_text = True
    parser.buffer_size = CHUNK

    def no_dtd(*_args: object) -> None:
        raise _Refused("XML document type declarations (DTDs) are not allowed")

    def no_external(*_args: object) -> int:
        raise _Refused("external XML entities are not allowed")

    parser.StartDoctypeDeclHandler = no_dtd
    parser.EntityDeclHandler = no_dtd
    parser.ExternalEntityRefHandler = no_external
    parser.SetParamEntityParsing(pyexpat.XML_PARAM_ENTITY_PARSING_NEVER)
    return parser


def _feed(parser: Any, stream: IO[bytes], part: str, counter: list[int], limit: int,
          stop: Callable[[], bool] | None = None) -> None:
    try:
        while True:
            chunk = stream.read(CHUNK)
            counter[0] += len(chunk)
            if counter[0] > limit:
                raise WorkbookError(f"workbook inflates to more than {limit} bytes; refused")
            if not chunk:
                parser.Parse(b"", True)
                return
            parser.Parse(chunk, False)
            if stop is not None and stop():
                return
    except _Refused as exc:
        raise WorkbookError(f"{part}: {exc}") from None
    except pyexpat.ExpatError as exc:
        raise WorkbookError(f"{part} is not well-formed XML: {exc}") from None
    except zipfile.BadZipFile as exc:
        raise WorkbookError(f"{part} is corrupt: {exc}") from None
    except (OSError, EOFError, ValueError) as exc:  # zlib.error is not an OSError subclass
        raise WorkbookError(f"{part} cannot be read: {exc}") from None
    except Exception as exc:
        if type(exc).__name__ == "error" and type(exc).__module__ == "zlib":
            raise WorkbookError(f"{part} is corrupt: {exc}") from None
        raise


class Workbook:
    """An opened, pre-checked XLSX file. Use as a context manager.

    Example::

        with Workbook.open("report.xlsx") as wb:
            for row_number, cells in wb.rows():
                ...
    """

    def __init__(self, source: BinaryIO | str | Path, limits: WorkbookLimits | None = None) -> None:
        self.limits = limits or WorkbookLimits()
        try:
            self._zip = zipfile.ZipFile(source)
        except zipfile.BadZipFile:
            raise WorkbookError("not an xlsx file: it is not a zip archive (empty, "
                                "truncated or another format)") from None
        except zipfile.LargeZipFile:
            raise WorkbookError("not an xlsx file: zip64 archive refused") from None
        except OSError as exc:
            raise WorkbookError(f"cannot open workbook: {exc.strerror or exc}") from None
        self._inflated = [0]
        try:
            self._check_archive()
            self._sheet_part = self._first_sheet_part()
        except BaseException:
            self._zip.close()
            raise

    @classmethod
    def open(cls, source: BinaryIO | str | Path, limits: WorkbookLimits | None = None) -> Workbook:
        return cls(source, limits)

    def __enter__(self) -> Workbook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._zip.close()

    # ----------------------------------------------------------------- checks

    def _check_archive(self) -> None:
        infos = self._zip.infolist()
        lim = self.limits
        if len(infos) > lim.max_entries:
            raise WorkbookError(f"workbook has {len(infos)} zip entries, the limit is {lim.max_entries}")
        total = 0
        for info in infos:
            total += info.file_size
            if info.file_size > 1024**2:
                ratio = info.file_size / max(info.compress_size, 1)
                if ratio > lim.max_ratio:
                    raise WorkbookError(
                        f"zip member {info.filename!r} expands {ratio:.0f}x "
                        f"(limit {lim.max_ratio:.0f}x): refused as a zip bomb")
        if total > lim.max_uncompressed_bytes:
            raise WorkbookError(
                f"workbook declares {total} uncompressed bytes, the limit is "
                f"{lim.max_uncompressed_bytes}: refused as a zip bomb")
        if "[Content_Types].xml" not in self._zip.namelist():
            raise WorkbookError("not an xlsx file: [Content_Types].xml is missing")

    def _member(self, name: str) -> IO[bytes]:
        try:
            return self._zip.open(name)
        except KeyError:
            raise WorkbookError(f"not an xlsx file: part {name!r} is missing") from None
        except (zipfile.BadZipFile, NotImplementedError, RuntimeError) as exc:
            raise WorkbookError(f"part {name!r} cannot be opened: {exc}") from None

    def _parse_small(self, name: str, start: Callable[[str, dict[str, str]], None]) -> None:
        parser = _new_parser()
        parser.StartElementHandler = start
        with self._member(name) as stream:
            _feed(parser, stream, name, self._inflated, self.limits.max_uncompressed_bytes)

    def _first_sheet_part(self) -> str:
        names = set(self._zip.namelist())
        if "xl/workbook.xml" not in names:
            raise WorkbookError("not an xlsx file: xl/workbook.xml is missing")
        first: list[str] = []

        def on_workbook(tag: str, attrs: dict[str, str]) -> None:
            if tag == f"{_MAIN_NS}}}sheet" and not first:
                first.append(attrs.get(f"{_REL_NS}}}id", ""))

        self._parse_small("xl/workbook.xml", on_workbook)
        if not first:
            raise WorkbookError("workbook has no sheets")
        targets: dict[str, str] = {}

        def on_rels(tag: str, attrs: dict[str, str]) -> None:
            if tag == f"{_PKG_REL_NS}}}Relationship":
                targets[attrs.get("Id", "")] = attrs.get("Target", "")

        if "xl/_rels/workbook.xml.rels" in names:
            self._parse_small("xl/_rels/workbook.xml.rels", on_rels)
        target = targets.get(first[0], "worksheets/sheet1.xml")
        part = (target.lstrip("/") if target.startswith("/")
                else posixpath.normpath(posixpath.join("xl", target)))
        if part not in names:
            raise WorkbookError(f"not an xlsx file: sheet part {part!r} is missing")
        return part

    # ---------------------------------------------------------- shared strings

    def shared_strings(self, wanted: set[int] | None = None) -> dict[int, str]:
        """Shared strings by index; only the ``wanted`` ones when given (memory stays small)."""
        name = "xl/sharedStrings.xml"
        if name not in self._zip.namelist():
            return {}
        info = self._zip.getinfo(name)
        if info.file_size > self.limits.max_shared_string_bytes:
            raise WorkbookError(
                f"shared strings part is {info.file_size} bytes, the limit is "
                f"{self.limits.max_shared_string_bytes}")
        out: dict[int, str] = {}
        state = {"index": -1, "in_t": False, "in_rph": False}
        parts: list[str] = []
        si, t, rph = f"{_MAIN_NS}}}si", f"{_MAIN_NS}}}t", f"{_MAIN_NS}}}rPh"

        def start(tag: str, attrs: dict[str, str]) -> None:
            if tag == si:
                state["index"] += 1
                parts.clear()
            elif tag == t:
                state["in_t"] = True
            elif tag == rph:
                state["in_rph"] = True  # phonetic runs are not part of the value

        def end(tag: str) -> None:
            if tag == t:
                state["in_t"] = False
            elif tag == rph:
                state["in_rph"] = False
            elif tag == si:
                idx = state["index"]
                if wanted is None or idx in wanted:
                    out[idx] = "".join(parts)

        def text(data: str) -> None:
            if state["in_t"] and not state["in_rph"]:
                parts.append(data)

        parser = _new_parser()
        parser.StartElementHandler = start
        parser.EndElementHandler = end
        parser.CharacterDataHandler = text
        with self._member(name) as stream:
            _feed(parser, stream, name, self._inflated, self.limits.max_uncompressed_bytes)
        return out

    # -------------------------------------------------------------------- rows

    def rows(self, *, max_rows: int = MAX_ROWS + 1, header_only: bool = False,
             columns: set[int] | None = None) -> Iterator[tuple[int, dict[int, Cell]]]:
        """Yield ``(row_number, {column_index: Cell})`` for each non-empty row of the first sheet.

        With ``columns``, only those column indexes are kept (the rest are skipped cheaply).
        """
        reader = _SheetReader(columns)
        yielded = 0
        parser = _new_parser()
        parser.StartElementHandler = reader.start
        parser.EndElementHandler = reader.end
        parser.CharacterDataHandler = reader.text
        limit = self.limits.max_uncompressed_bytes
        with self._member(self._sheet_part) as stream:
            try:
                while True:
                    chunk = stream.read(CHUNK)
                    self._inflated[0] += len(chunk)
                    if self._inflated[0] > limit:
                        raise WorkbookError(f"workbook inflates to more than {limit} bytes; refused")
                    parser.Parse(chunk, not chunk)
                    while reader.done:
                        number, cells = reader.done.pop(0)
                        yielded += 1
                        # Both the declared numbers and the rows actually seen count:
                        # a sheet repeating r="2" forever is capped all the same.
                        if number > max_rows or yielded >= max_rows:
                            raise WorkbookError(f"sheet has more than {max_rows - 1} rows; refused")
                        yield number, cells
                        if header_only:
                            return
                    if not chunk:
                        break
            except _Refused as exc:
                raise WorkbookError(f"{self._sheet_part}: {exc}") from None
            except pyexpat.ExpatError as exc:
                raise WorkbookError(f"sheet XML is not well-formed: {exc}") from None
            except (zipfile.BadZipFile, EOFError, OSError) as exc:
                raise WorkbookError(f"sheet data is corrupt: {exc}") from None
            except Exception as exc:
                if type(exc).__module__ == "zlib":
                    raise WorkbookError(f"sheet data is corrupt: {exc}") from None
                raise
        if not reader.closed:
            raise WorkbookError("sheet XML ended early: the file is truncated")


@dataclass(slots=True)
class Cell:
    """One cell's raw content: ``kind`` is 's' (shared string index), 'str', 'n', 'b' or 'e'."""

    kind: str
    value: str


class _SheetReader:
    """expat callbacks collecting cells per row; finished rows queue in ``done``."""

    def __init__(self, columns: set[int] | None = None) -> None:
        self.columns = columns
        self.done: list[tuple[int, dict[int, Cell]]] = []
        self.closed = False
        self._row: dict[int, Cell] | None = None
        self._row_number = 0
        self._col = -1
        self._kind = "n"
        self._text: list[str] = []
        self._capture = False
        m = _MAIN_NS + "}"
        self._tags = (m + "row", m + "c", m + "v", m + "t", m + "sheetData", m + "is")

    def start(self, tag: str, attrs: dict[str, str]) -> None:
        row_tag, c_tag, v_tag, t_tag, _sd, _is = self._tags
        if tag == c_tag:
            ref = attrs.get("r")
            match = _CELL_REF_RE.fullmatch(ref) if ref else None
            self._col = _col_index(match[1]) if match else self._col + 1
            kind = attrs.get("t", "n")
            self._kind = "str" if kind == "inlineStr" else kind
            self._text = []
        elif tag in (v_tag, t_tag):
            self._capture = True
        elif tag == row_tag:
            r = attrs.get("r")
            self._row_number = int(r) if r and r.isdigit() else self._row_number + 1
            self._row = {}
            self._col = -1

    def end(self, tag: str) -> None:
        row_tag, c_tag, v_tag, t_tag, sheet_data, _is = self._tags
        if tag in (v_tag, t_tag):
            self._capture = False
        elif tag == c_tag:
            if self._row is not None and self._text and (
                    self.columns is None or self._col in self.columns):
                self._row[self._col] = Cell(self._kind, "".join(self._text))
        elif tag == row_tag:
            if self._row:
                self.done.append((self._row_number, self._row))
            self._row = None
        elif tag == sheet_data:
            self.closed = True

    def text(self, data: str) -> None:
        if self._capture:
            self._text.append(data)


# ------------------------------------------------------------------ aggregate

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
