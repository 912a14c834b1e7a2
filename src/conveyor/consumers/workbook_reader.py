"""Streams the first sheet of an XLSX workbook row by row, within its limits.

Memory stays flat however many rows the sheet has: the sheet XML is fed to
expat in 64 KiB chunks straight from the zip member, rows are handed out one
at a time, and shared strings are read only when, and only those, asked for
(:meth:`Workbook.shared_strings`). Every part is opened and parsed under the
checks of :mod:`conveyor.consumers.workbook_limits`; what a sheet *means*
(the aggregate ``conveyor xlsx`` computes) is :mod:`conveyor.consumers.workbook`'s.
"""

from __future__ import annotations

import posixpath
import pyexpat
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from conveyor.consumers.workbook_limits import (
    CHUNK,
    MAX_ROWS,
    Refused,
    WorkbookLimits,
    check_archive,
    feed,
    new_parser,
)
from conveyor.errors import WorkbookError

_MAIN_NS = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
_REL_NS = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"
_PKG_REL_NS = "http://schemas.openxmlformats.org/package/2006/relationships"
_CELL_REF_RE = re.compile(r"([A-Z]{1,3})(\d+)")


def _col_index(letters: str) -> int:
    n = 0
    for ch in letters:
        n = n * 26 + (ord(ch) - 64)
    return n - 1


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
            check_archive(self._zip, self.limits)
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

    def _member(self, name: str) -> IO[bytes]:
        try:
            return self._zip.open(name)
        except KeyError:
            raise WorkbookError(f"not an xlsx file: part {name!r} is missing") from None
        except (zipfile.BadZipFile, NotImplementedError, RuntimeError) as exc:
            raise WorkbookError(f"part {name!r} cannot be opened: {exc}") from None

    def _parse_small(self, name: str, start: Callable[[str, dict[str, str]], None]) -> None:
        parser = new_parser()
        parser.StartElementHandler = start
        with self._member(name) as stream:
            feed(parser, stream, name, self._inflated, self.limits.max_uncompressed_bytes)

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

        parser = new_parser()
        parser.StartElementHandler = start
        parser.EndElementHandler = end
        parser.CharacterDataHandler = text
        with self._member(name) as stream:
            feed(parser, stream, name, self._inflated, self.limits.max_uncompressed_bytes)
        return out

    def rows(self, *, max_rows: int = MAX_ROWS + 1, header_only: bool = False,
             columns: set[int] | None = None) -> Iterator[tuple[int, dict[int, Cell]]]:
        """Yield ``(row_number, {column_index: Cell})`` for each non-empty row of the first sheet.

        With ``columns``, only those column indexes are kept (the rest are skipped cheaply).
        """
        reader = _SheetReader(columns)
        yielded = 0
        parser = new_parser()
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
            except Refused as exc:
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

