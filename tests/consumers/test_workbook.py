"""The streaming XLSX reader (``conveyor.consumers.workbook``) on real files.

Workbooks are written by two different writers (openpyxl, XlsxWriter with
inline strings and with shared strings); hostile files are built here byte by
byte and refused in a subprocess whose time and peak memory are measured.
Expected aggregates are computed from the data the test wrote, never by the
reader under test.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import openpyxl
import pytest
import xlsxwriter

from conveyor.consumers.workbook import Aggregate, Workbook, WorkbookLimits, aggregate_workbook
from conveyor.errors import WorkbookError

PY = sys.executable
CACHE = Path("/tmp/conveyor-tests-xlsx-v3")  # bump the version when the generators change
SHEET = "xl/worksheets/sheet1.xml"

# ---------------------------------------------------------------- the data

TIPOS = ["venta", "compra", "ajuste", "Venta", "devolución"]
# Amounts both writers store verbatim (their "%.16G" text equals the shortest repr); values
# like 99.99, stored as "99.98999999999999", have a test of their own.
AMOUNTS = ["12.5", "-3.25", "1000", "0.1", "45.1", "1234567.89", "7", "0", "-0.5", "3.14159"]
assert all(f"{float(a):.16G}" == a for a in AMOUNTS)


class Cached:
    """A formula whose cached result is known (XlsxWriter only)."""

    def __init__(self, formula: str, value: Any) -> None:
        self.formula, self.value = formula, value


Row = dict[str, Any]


def dataset(n: int = 240, *, numeric_strings: bool = False, formulas: bool = False) -> list[Row | None]:
    """Rows keyed by column name; ``None`` is an empty row left in the middle of the sheet."""
    rows: list[Row | None] = []
    for i in range(n):
        if i % 37 == 5:
            rows.append(None)
        amount = AMOUNTS[i % len(AMOUNTS)]
        monto: Any = Decimal(amount)
        if numeric_strings and i % 4 == 1:
            monto = f" {amount} " if i % 8 == 1 else amount  # text that holds a number
        tipo: Any = TIPOS[(i * 7) % len(TIPOS)]
        if formulas and i % 5 == 2:
            monto = Cached(f"=ROUND({amount},2)", float(amount))
        if formulas and i % 6 == 3:
            tipo = Cached(f'=LOWER("{tipo.upper()}")', tipo)
        rows.append({"id": i + 1, "monto": monto, "descripcion": f"fila {i + 1}", "tipo": tipo,
                     "extra": i * 3})
    return rows


def expected(rows: Iterable[Row | None]) -> tuple[int, Decimal, dict[str, Decimal]]:
    count, total, by_type = 0, Decimal(0), {}
    for row in rows:
        if row is None:
            continue
        m = row["monto"]
        amount = Decimal(str(m.value)) if isinstance(m, Cached) else Decimal(str(m).strip())
        t = row["tipo"].value if isinstance(row["tipo"], Cached) else row["tipo"]
        count += 1
        total += amount
        by_type[t] = by_type.get(t, Decimal(0)) + amount
    return count, total, by_type


def assert_aggregate(agg: Aggregate, rows: Iterable[Row | None]) -> None:
    count, total, by_type = expected(rows)
    assert agg.rows == count
    assert agg.total == total
    assert agg.by_type == by_type


HEADER = ["Id", "MONTO", "descripcion", "Tipo", "extra"]  # any order, any case, extras
KEYS = ["id", "monto", "descripcion", "tipo", "extra"]


def _cell(v: Any) -> Any:
    return float(v) if isinstance(v, Decimal) else v


def write_xlsxwriter(path: Path, rows: Sequence[Row | None], *, constant_memory: bool,
                     header: Sequence[str] = HEADER, keys: Sequence[str] = KEYS) -> Path:
    wb = xlsxwriter.Workbook(str(path), {"constant_memory": constant_memory})
    ws = wb.add_worksheet("datos")
    ws.write_row(0, 0, header)
    r = 1
    for row in rows:
        if row is not None:
            for c, key in enumerate(keys):
                v = row[key]
                if isinstance(v, Cached):
                    ws.write_formula(r, c, v.formula, None, v.value)
                elif isinstance(v, str):
                    ws.write_string(r, c, v)
                else:
                    ws.write_number(r, c, _cell(v))
        r += 1
    wb.close()
    return path


def write_openpyxl(path: Path, rows: Sequence[Row | None], *, header: Sequence[str] = HEADER,
                   keys: Sequence[str] = KEYS) -> Path:
    wb = openpyxl.Workbook()
    ws = wb.active
    ws.title = "datos"
    for c, name in enumerate(header, start=1):
        ws.cell(row=1, column=c, value=name)
    r = 2
    for row in rows:
        if row is not None:
            for c, key in enumerate(keys, start=1):
                v = row[key]
                assert not isinstance(v, Cached), "openpyxl cannot store a cached formula value"
                ws.cell(row=r, column=c, value=_cell(v))
        r += 1
    wb.save(str(path))
    return path


def sheet_xml(path: Path) -> bytes:
    with zipfile.ZipFile(path) as zf:
        return zf.read(SHEET)


def rewrite(src: Path, dst: Path, replace: dict[str, bytes] | None = None,
            add: Iterable[tuple[str, bytes]] = ()) -> Path:
    """Copy a zip, replacing some members and adding others."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = replace.get(info.filename, zin.read(info.filename))
            zout.writestr(info.filename, data)
        for name, data in add:
            zout.writestr(name, data)
    return dst


# --------------------------------------------------------------- valid files

WRITERS: dict[str, Callable[[Path, Sequence[Row | None]], Path]] = {
    "xlsxwriter-inline": lambda p, rows: write_xlsxwriter(p, rows, constant_memory=True),
    "xlsxwriter-sst": lambda p, rows: write_xlsxwriter(p, rows, constant_memory=False),
    "openpyxl": lambda p, rows: write_openpyxl(p, rows),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_aggregates_files_from_each_writer(tmp_path: Path, writer: str) -> None:
    rows = dataset()
    path = WRITERS[writer](tmp_path / f"{writer}.xlsx", rows)
    xml = sheet_xml(path)
    if writer == "xlsxwriter-sst":
        assert b't="s"' in xml and b"inlineStr" not in xml
    else:
        assert b'inlineStr' in xml and b't="s"' not in xml
    assert xml.count(b"<row") < len(rows) + 1  # the empty rows really are absent
    assert_aggregate(aggregate_workbook(path), rows)
    # A file object works as well as a path.
    with open(path, "rb") as fh:
        assert_aggregate(aggregate_workbook(fh), rows)


@pytest.mark.parametrize("constant_memory", [True, False], ids=["inline", "sst"])
def test_formulas_with_cached_values(tmp_path: Path, constant_memory: bool) -> None:
    rows = dataset(formulas=True)
    path = write_xlsxwriter(tmp_path / "f.xlsx", rows, constant_memory=constant_memory)
    xml = sheet_xml(path)
    assert b"<f>" in xml and b't="str"' in xml  # numeric and string formula results are present
    assert_aggregate(aggregate_workbook(path), rows)


@pytest.mark.parametrize("writer", ["xlsxwriter-inline", "openpyxl"])
def test_numeric_strings_in_monto(tmp_path: Path, writer: str) -> None:
    rows = dataset(numeric_strings=True)
    path = WRITERS[writer](tmp_path / "n.xlsx", rows)
    assert_aggregate(aggregate_workbook(path), rows)


def test_numeric_strings_in_monto_shared_strings(tmp_path: Path) -> None:
    rows = dataset(numeric_strings=True)
    path = write_xlsxwriter(tmp_path / "n.xlsx", rows, constant_memory=False)
    assert_aggregate(aggregate_workbook(path), rows)


@pytest.mark.parametrize("writer", WRITERS)
def test_amounts_are_the_stored_doubles(tmp_path: Path, writer: str) -> None:
    rows: list[Row | None] = [{"tipo": t, "monto": Decimal(a), "id": 0, "descripcion": "", "extra": 0}
                              for _ in range(500) for t, a in (("a", "99.99"), ("b", "0.3"))]
    path = WRITERS[writer](tmp_path / "d.xlsx", rows)
    assert b"99.98999999999999" in sheet_xml(path)
    agg = aggregate_workbook(path)
    assert agg.to_json() == {"rows": 1000, "total": 50145, "by_type": {"a": 49995, "b": 150}}
    assert agg.by_type == {"a": Decimal("49995"), "b": Decimal("150")}


def test_only_tipo_and_monto_matter(tmp_path: Path) -> None:
    rows: list[Row | None] = [{"tipo": "a", "monto": Decimal(1)}, {"tipo": "b", "monto": Decimal("2.5")}]
    path = write_xlsxwriter(tmp_path / "min.xlsx", rows, constant_memory=True,
                            header=[" monto ", "TIPO"], keys=["monto", "tipo"])
    assert aggregate_workbook(path).to_json() == {"rows": 2, "total": 3.5, "by_type": {"a": 1, "b": 2.5}}


def test_rich_text_strings(tmp_path: Path) -> None:
    path = tmp_path / "rich.xlsx"
    wb = xlsxwriter.Workbook(str(path))
    ws = wb.add_worksheet()
    bold = wb.add_format({"bold": True})
    ws.write_rich_string(0, 0, bold, "Ti", "po")   # header in a rich shared string
    ws.write_string(0, 1, "monto")
    ws.write_rich_string(1, 0, "ven", bold, "ta")
    ws.write_number(1, 1, 2)
    ws.write_string(2, 0, "venta")
    ws.write_number(2, 1, 3)
    wb.close()
    assert aggregate_workbook(path).to_json() == {"rows": 2, "total": 5, "by_type": {"venta": 5}}


def test_first_sheet_in_workbook_order_is_read(tmp_path: Path) -> None:
    path = tmp_path / "two.xlsx"
    wb = xlsxwriter.Workbook(str(path))
    first, second = wb.add_worksheet("datos"), wb.add_worksheet("otro")
    first.write_row(0, 0, ["tipo", "monto"])
    first.write_row(1, 0, ["a", 1])
    second.write_row(0, 0, ["tipo", "monto"])
    second.write_row(1, 0, ["b", 10])
    second.write_row(2, 0, ["b", 10])
    wb.close()
    assert aggregate_workbook(path).to_json() == {"rows": 1, "total": 1, "by_type": {"a": 1}}
    # Swap the <sheet> elements: the first sheet is now 'otro' (still stored as sheet2.xml).
    with zipfile.ZipFile(path) as zf:
        book = zf.read("xl/workbook.xml")
    sheets = re.findall(rb"<sheet [^>]*/>", book)
    assert len(sheets) == 2
    swapped = book.replace(sheets[0], b"\0").replace(sheets[1], sheets[0]).replace(b"\0", sheets[1])
    other = rewrite(path, tmp_path / "swapped.xlsx", {"xl/workbook.xml": swapped})
    assert aggregate_workbook(other).to_json() == {"rows": 2, "total": 20, "by_type": {"b": 20}}


def test_wrong_dimension_still_reads_every_row(tmp_path: Path) -> None:
    rows = dataset(120)
    good = write_openpyxl(tmp_path / "good.xlsx", rows)
    xml = sheet_xml(good)
    assert re.search(rb'<dimension ref="A1:E\d+" ?/>', xml)
    patched = re.sub(rb'<dimension ref="[^"]*" ?/>', b'<dimension ref="A1"/>', xml)
    bad = rewrite(good, tmp_path / "bad.xlsx", {SHEET: patched})
    # openpyxl itself loses the rows unless told to reset the dimensions: the trap is real.
    wb = openpyxl.load_workbook(bad, read_only=True)
    assert len(list(wb.active.iter_rows(values_only=True))) == 1
    wb.close()
    assert_aggregate(aggregate_workbook(bad), rows)


def test_cells_and_rows_without_r_attributes(tmp_path: Path) -> None:
    rows = dataset(60)
    good = write_openpyxl(tmp_path / "good.xlsx", rows)
    xml = re.sub(rb' r="[A-Z]*\d+"', b"", sheet_xml(good))
    assert b' r="' not in xml.split(b"<sheetData>")[1]
    bad = rewrite(good, tmp_path / "nor.xlsx", {SHEET: xml})
    assert_aggregate(aggregate_workbook(bad), [r for r in rows if r is not None])


def test_workbook_rows_iterates_raw_cells(tmp_path: Path) -> None:
    path = write_xlsxwriter(tmp_path / "w.xlsx", dataset(10), constant_memory=False)
    with Workbook.open(path) as wb:
        got = list(wb.rows())
        strings = wb.shared_strings()
    assert got[0][0] == 1 and len(got) == 11
    assert [strings[int(c.value)] for c in got[0][1].values()] == HEADER


def _plain_sheet(rows: Iterable[bytes]) -> bytes:
    return _SHEET_HEAD + b"".join(rows) + _SHEET_TAIL


def test_row_cap_refuses_too_many_rows(tmp_path: Path) -> None:
    base = _base_workbook(tmp_path / "base.xlsx")
    xml = _plain_sheet(b'<row><c t="inlineStr"><is><t>a</t></is></c><c><v>%d</v></c></row>' % i
                       for i in range(30))
    path = rewrite(base, tmp_path / "many.xlsx", {SHEET: xml})
    with Workbook.open(path) as wb, pytest.raises(WorkbookError, match="more than 10 rows"):
        list(wb.rows(max_rows=11))


def test_row_cap_is_not_fooled_by_repeated_row_numbers(tmp_path: Path) -> None:
    base = _base_workbook(tmp_path / "base.xlsx")
    xml = _plain_sheet(b'<row r="2"><c t="inlineStr"><is><t>a</t></is></c><c><v>%d</v></c></row>' % i
                       for i in range(30))
    path = rewrite(base, tmp_path / "many.xlsx", {SHEET: xml})
    with Workbook.open(path) as wb, pytest.raises(WorkbookError):
        list(wb.rows(max_rows=11))


# ------------------------------------------------------------------ refusals


def refused(path: Path | str, *needles: str) -> str:
    with pytest.raises(WorkbookError) as info:
        aggregate_workbook(path)
    message = str(info.value)
    assert message and "\n" not in message, message
    for needle in needles:
        assert needle.lower() in message.lower(), message
    return message


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    return write_xlsxwriter(tmp_path / "good.xlsx", dataset(3000), constant_memory=True)


def test_refuses_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.xlsx"
    p.write_bytes(b"")
    refused(p, "not an xlsx")


def test_refuses_csv_renamed(tmp_path: Path) -> None:
    buf = io.StringIO()
    csv.writer(buf).writerows([["tipo", "monto"], ["a", "1"], ["b", "2"]])
    p = tmp_path / "data.xlsx"
    p.write_text(buf.getvalue())
    refused(p, "not an xlsx")


def test_refuses_missing_file(tmp_path: Path) -> None:
    refused(tmp_path / "nope.xlsx")


def test_refuses_truncated(tmp_path: Path, good_file: Path) -> None:
    data = good_file.read_bytes()
    p = tmp_path / "half.xlsx"
    p.write_bytes(data[: len(data) // 2])
    refused(p, "not an xlsx")


def _member_data_range(path: Path, name: str) -> tuple[int, int]:
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    raw = path.read_bytes()
    n, m = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
    start = info.header_offset + 30 + n + m
    return start, start + info.compress_size


@pytest.mark.parametrize("where", [0.3, 0.5, 0.8])
def test_refuses_bytes_corrupted_mid_sheet(tmp_path: Path, good_file: Path, where: float) -> None:
    start, end = _member_data_range(good_file, SHEET)
    assert end - start > 10_000  # the sheet is most of the file
    raw = bytearray(good_file.read_bytes())
    at = start + int((end - start) * where)
    raw[at: at + 64] = bytes((b ^ 0x5A) for b in raw[at: at + 64])
    p = tmp_path / "corrupt.xlsx"
    p.write_bytes(bytes(raw))
    refused(p)


def test_refuses_empty_sheet(tmp_path: Path) -> None:
    wb = xlsxwriter.Workbook(str(tmp_path / "e.xlsx"))
    wb.add_worksheet()
    wb.close()
    refused(tmp_path / "e.xlsx", "empty")


def test_refuses_header_only(tmp_path: Path) -> None:
    p = write_openpyxl(tmp_path / "h.xlsx", [])
    refused(p, "no data rows")


@pytest.mark.parametrize(("header", "missing"), [(["id", "monto"], "tipo"), (["tipo", "importe"], "monto"),
                                                 (["x", "y"], "tipo, monto")])
def test_refuses_missing_column(tmp_path: Path, header: list[str], missing: str) -> None:
    rows: list[Row | None] = [{"a": "venta", "b": 1}]
    p = write_xlsxwriter(tmp_path / "m.xlsx", rows, constant_memory=False, header=header, keys=["a", "b"])
    refused(p, missing)


@pytest.mark.parametrize("writer", WRITERS)
def test_refuses_non_numeric_monto_naming_the_row(tmp_path: Path, writer: str) -> None:
    rows = dataset(30)
    rows[20] = dict(rows[20] or {}, monto="doce")  # list index 20 -> sheet row 22 (one empty row before)
    assert rows[5] is None
    msg = refused(WRITERS[writer](tmp_path / "bad.xlsx", rows), "row 22", "monto")
    if writer != "xlsxwriter-sst":
        assert "doce" in msg


def test_refuses_monto_formula_without_cached_value(tmp_path: Path) -> None:
    # openpyxl writes formulas without a cached result: there is no value to add up.
    wb = openpyxl.Workbook()
    ws = wb.active
    ws.append(["tipo", "monto"])
    ws.append(["a", 1])
    ws.append(["b", "=B2*2"])
    wb.save(tmp_path / "f.xlsx")
    refused(tmp_path / "f.xlsx", "row 3", "monto")


@pytest.mark.parametrize("cell", [b'<c r="B2" t="b"><v>1</v></c>', b'<c r="B2" t="e"><v>#DIV/0!</v></c>',
                                  b'<c r="B2"><v>NaN</v></c>', b'<c r="B2"><v>Infinity</v></c>'])
def test_refuses_non_number_cells(tmp_path: Path, cell: bytes) -> None:
    base = write_xlsxwriter(tmp_path / "b.xlsx", [{"tipo": "a", "monto": Decimal(5)}], constant_memory=True,
                            header=["tipo", "monto"], keys=["tipo", "monto"])
    xml = re.sub(rb'<c r="B2"[^>]*>.*?</c>', cell, sheet_xml(base))
    p = rewrite(base, tmp_path / "x.xlsx", {SHEET: xml})
    refused(p, "row 2", "monto")


# --------------------------------------------------------- hostile files

_MEASURE = r"""
import json, sys, time
from conveyor.errors import WorkbookError
from conveyor.consumers.workbook import aggregate_workbook
import conveyor.consumers.workbook, zipfile, pyexpat, decimal  # everything imported before the baseline


def status(key):
    # VmHWM/VmRSS belong to this process image; ru_maxrss would carry the parent's peak over exec.
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])


with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
ballast = b"\x01" * (int(sys.argv[2]) * 1024 * 1024) if len(sys.argv) > 2 else None  # control only
start = time.monotonic()
try:
    agg = aggregate_workbook(sys.argv[1])
    out = {"ok": True, "result": {"rows": agg.rows, "total": str(agg.total),
                                  "by_type": {k: str(v) for k, v in agg.by_type.items()}}}
except WorkbookError as exc:
    out = {"ok": False, "error": str(exc)}
out["seconds"] = time.monotonic() - start
out["rss_before_kb"] = before
out["peak_kb"] = status("VmHWM")
print(json.dumps(out))
"""


def measure(path: Path, timeout: float = 120, ballast_mb: int | None = None) -> dict[str, Any]:
    """Aggregate ``path`` in a fresh interpreter: its time, RSS after imports and peak RSS."""
    extra = [] if ballast_mb is None else [str(ballast_mb)]
    proc = subprocess.run([PY, "-c", _MEASURE, str(path), *extra], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    result["extra_mb"] = (result["peak_kb"] - result["rss_before_kb"]) / 1024
    return result


HOSTILE_FIGURES: dict[str, dict[str, Any]] = {}


def assert_refused_cheaply(name: str, path: Path, *needles: str) -> dict[str, Any]:
    got = measure(path)
    HOSTILE_FIGURES[name] = got
    print(f"\n{name}: refused={not got['ok']} in {got['seconds']:.3f}s, "
          f"+{got['extra_mb']:.1f} MB: {got.get('error')}")
    assert not got["ok"], f"{name} was aggregated: {got.get('result')}"
    assert "\n" not in got["error"]
    for needle in needles:
        assert needle.lower() in got["error"].lower(), got["error"]
    assert got["seconds"] < 2, got
    assert got["extra_mb"] < 64, got
    return got


def test_the_memory_probe_sees_an_allocation(tmp_path: Path) -> None:
    """Positive control for the '+N MB' figures: 100 MB allocated in the child shows up."""
    path = _base_workbook(tmp_path / "base.xlsx")
    assert measure(path)["extra_mb"] < 10
    got = measure(path, ballast_mb=100)
    assert got["ok"] and got["extra_mb"] > 90, got


def _base_workbook(dst: Path) -> Path:
    return write_xlsxwriter(dst, [{"tipo": "a", "monto": Decimal(1)}], constant_memory=True,
                            header=["tipo", "monto"], keys=["tipo", "monto"])


_ROW = (b'<row><c t="inlineStr"><is><t>venta</t></is></c><c><v>1</v></c></row>')
_SHEET_HEAD = (b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
               b'<worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"><sheetData>'
               b'<row><c t="inlineStr"><is><t>tipo</t></is></c><c t="inlineStr"><is><t>monto</t></is>'
               b'</c></row>')
_SHEET_TAIL = b"</sheetData></worksheet>"


def honest_bomb(tmp_path: Path) -> Path:
    """A workbook whose sheet member inflates to ~1 GB of repeated rows; sizes declared honestly.

    Built by streaming the rows through zipfile's deflate writer (nothing big touches the
    disk: the file is ~3.5 MB) and cached across runs.
    """
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / "bomb-honest-1g.xlsx"
    if path.exists():
        return path
    base = _base_workbook(tmp_path / "base.xlsx")
    chunk = _ROW * (1024 * 1024 // len(_ROW))
    tmp = path.with_suffix(".part")
    with zipfile.ZipFile(base) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename == SHEET:
                with zout.open(SHEET, "w") as out:
                    out.write(_SHEET_HEAD)
                    for _ in range(1000):
                        out.write(chunk)
                    out.write(_SHEET_TAIL)
            else:
                zout.writestr(info.filename, zin.read(info.filename))
    tmp.rename(path)
    return path


def lie_about_size(src: Path, dst: Path, member: str, declared: int) -> Path:
    """Patch the member's uncompressed size in its local header and its central directory entry."""
    raw = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo(member)
    local = info.header_offset
    assert raw[local: local + 4] == b"PK\x03\x04"
    struct.pack_into("<I", raw, local + 22, declared)
    name = member.encode()
    central = raw.find(b"PK\x01\x02" + b"".join([]), 0)
    patched = 0
    while central != -1:
        n = struct.unpack_from("<H", raw, central + 28)[0]
        if bytes(raw[central + 46: central + 46 + n]) == name:
            struct.pack_into("<I", raw, central + 24, declared)
            patched += 1
        central = raw.find(b"PK\x01\x02", central + 4)
    assert patched == 1
    dst.write_bytes(bytes(raw))
    with zipfile.ZipFile(dst) as zf:
        assert zf.getinfo(member).file_size == declared
    return dst


def test_hostile_zip_bomb_honest_sizes(tmp_path: Path) -> None:
    path = honest_bomb(tmp_path)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(SHEET)
    assert info.file_size > 1_000_000_000 and path.stat().st_size < 10_000_000
    assert_refused_cheaply("zip bomb (honest sizes, 1 GB)", path, "zip bomb")


@pytest.mark.parametrize("declared", [20_000, 1024**2 - 1])
def test_hostile_zip_bomb_lying_sizes(tmp_path: Path, declared: int) -> None:
    path = lie_about_size(honest_bomb(tmp_path), tmp_path / "liar.xlsx", SHEET, declared)
    assert_refused_cheaply(f"zip bomb (declared size {declared})", path)


def test_hostile_zip_bomb_under_the_ratio_caught_while_streaming(tmp_path: Path) -> None:
    # The central directory says nothing alarming (small size, ratio check not applicable);
    # only counting inflated bytes while streaming can catch it.
    path = lie_about_size(honest_bomb(tmp_path), tmp_path / "liar.xlsx", SHEET, 900_000)
    with pytest.raises(WorkbookError) as info:
        aggregate_workbook(path, WorkbookLimits(max_uncompressed_bytes=600_000))
    assert "\n" not in str(info.value)


def test_hostile_many_entries(tmp_path: Path) -> None:
    base = _base_workbook(tmp_path / "base.xlsx")
    path = rewrite(base, tmp_path / "many.xlsx", add=((f"xl/media/pad{i}.bin", b"x") for i in range(5000)))
    with zipfile.ZipFile(path) as zf:
        assert len(zf.infolist()) > 5000
    assert_refused_cheaply("5,000 zip entries", path, "entries")


def _doctype_sheet(doctype: bytes, cell_text: bytes) -> bytes:
    return (b'<?xml version="1.0" encoding="UTF-8"?>\n' + doctype +
            b'<worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"><sheetData>'
            b'<row r="1"><c r="A1" t="inlineStr"><is><t>tipo</t></is></c>'
            b'<c r="B1" t="inlineStr"><is><t>monto</t></is></c></row>'
            b'<row r="2"><c r="A2" t="inlineStr"><is><t>' + cell_text + b'</t></is></c>'
            b'<c r="B2"><v>1</v></c></row></sheetData></worksheet>')


BILLION_LAUGHS = b"<!DOCTYPE lolz [\n<!ENTITY lol \"lol\">\n" + b"".join(
    b'<!ENTITY lol%d "%s">\n' % (i, (b"&lol%d;" % (i - 1) if i > 1 else b"&lol;") * 10)
    for i in range(1, 10)) + b"]>\n"
XXE = b'<!DOCTYPE x [<!ENTITY x SYSTEM "file:///etc/hostname">]>\n'
XXE_PARAM = b'<!DOCTYPE x [<!ENTITY % p SYSTEM "file:///etc/hostname"> %p;]>\n'
QUADRATIC = b'<!DOCTYPE q [<!ENTITY a "' + b"A" * 50_000 + b'">]>\n'


@pytest.mark.parametrize(("name", "doctype", "text"), [
    ("billion laughs", BILLION_LAUGHS, b"&lol9;"),
    ("XXE", XXE, b"&x;"),
    ("XXE via parameter entity", XXE_PARAM, b"venta"),
    ("quadratic blowup", QUADRATIC, b"&a;" * 20_000),
])
def test_hostile_xml_in_sheet(tmp_path: Path, name: str, doctype: bytes, text: bytes) -> None:
    base = _base_workbook(tmp_path / "base.xlsx")
    path = rewrite(base, tmp_path / "x.xlsx", {SHEET: _doctype_sheet(doctype, text)})
    got = assert_refused_cheaply(name, path, "DTD")
    assert os.uname().nodename not in got["error"]


@pytest.mark.parametrize("member", ["xl/workbook.xml", "xl/sharedStrings.xml", "xl/_rels/workbook.xml.rels"])
def test_hostile_xxe_in_other_parts(tmp_path: Path, member: str) -> None:
    base = write_xlsxwriter(tmp_path / "b.xlsx", [{"tipo": "a", "monto": Decimal(1)}], constant_memory=False,
                            header=["tipo", "monto"], keys=["tipo", "monto"])
    with zipfile.ZipFile(base) as zf:
        original = zf.read(member)
    head, sep, rest = original.partition(b"?>")
    assert sep
    hostile = head + sep + b"\n" + XXE + rest
    path = rewrite(base, tmp_path / "x.xlsx", {member: hostile})
    msg = refused(path, "DTD")
    assert os.uname().nodename not in msg


# --------------------------------------------------------------- big files


def _row_values(i: int) -> tuple[int, str, float, str]:
    """Row ``i`` of the big workbooks: id and date are i's, then tipo, amount, description.

    Amounts in quarters: exact in binary, so every writer stores their exact decimal text
    (99.99-style values are covered by test_amounts_are_the_stored_doubles).
    """
    quarters = (i * 7919) % 400_009 - 200_000  # deterministic, signed
    return quarters, TIPOS[i % len(TIPOS)], quarters / 4, f"movimiento {i}"


def _write_rows_xlsxwriter(path: Path, n: int, rows: Iterable[int] | None = None) -> None:
    """The n-row workbook written cell by cell by XlsxWriter (constant_memory: inline strings).

    ``rows``: write only these data rows (the header always); the dimension still
    says n rows when the last one is among them.
    """
    wb = xlsxwriter.Workbook(str(path), {"constant_memory": True})
    ws = wb.add_worksheet()
    ws.write_row(0, 0, ["id", "fecha", "tipo", "monto", "descripcion"])
    for i in range(1, n + 1) if rows is None else rows:
        _, tipo, amount, text = _row_values(i)
        ws.write_number(i, 0, i)
        ws.write_number(i, 1, 45000 + i % 365)
        ws.write_string(i, 2, tipo)
        ws.write_number(i, 3, amount)
        ws.write_string(i, 4, text)
    wb.close()


def _write_rows_fast(path: Path, n: int) -> None:
    """The same workbook as :func:`_write_rows_xlsxwriter`, byte for byte in every part.

    XlsxWriter spends about 10 us a cell: the million-row workbook took most
    of its test's 95-177 s in CI. So XlsxWriter writes every part but the
    rows (the header and the last row only, so the dimension is right), and
    the rows are formatted here as XlsxWriter formats them (``%.16G`` numbers,
    inline strings; none of ours needs escaping), streamed into the sheet.
    ``test_the_fast_workbook_is_xlsxwriters`` holds the two writers equal.
    """
    skeleton = path.with_suffix(".skeleton.xlsx")
    _write_rows_xlsxwriter(skeleton, n, rows=[n])
    with zipfile.ZipFile(skeleton) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename != SHEET:
                dst.writestr(info, data)
                continue
            head, sep, rest = data.partition(b'<row r="%d"' % (n + 1))
            assert sep, "XlsxWriter's sheet has no data row"
            tail = rest[rest.index(b"</sheetData>"):]
            with dst.open(info, "w") as out:
                out.write(head)
                chunk: list[str] = []
                for i in range(1, n + 1):
                    _, tipo, amount, text = _row_values(i)
                    r = i + 1
                    chunk.append(
                        f'<row r="{r}"><c r="A{r}"><v>{i}</v></c>'
                        f'<c r="B{r}"><v>{45000 + i % 365}</v></c>'
                        f'<c r="C{r}" t="inlineStr"><is><t>{tipo}</t></is></c>'
                        f'<c r="D{r}"><v>{amount:.16G}</v></c>'
                        f'<c r="E{r}" t="inlineStr"><is><t>{text}</t></is></c></row>')
                    if len(chunk) == 10_000:
                        out.write("".join(chunk).encode())
                        chunk.clear()
                out.write("".join(chunk).encode())
                out.write(tail)
    skeleton.unlink()


def generate_rows_file(n: int) -> tuple[Path, dict[str, Any]]:
    """An n-row inline-string workbook (as XlsxWriter's constant_memory writes it), cached
    under /tmp with its totals.

    Safe when two processes (xdist workers, concurrent runs) build the same file:
    each writes files of its own and renames them into place, the totals first,
    so a workbook in the cache always has its totals beside it.
    """
    CACHE.mkdir(parents=True, exist_ok=True)
    path, meta = CACHE / f"rows-{n}.xlsx", CACHE / f"rows-{n}.json"
    if path.exists() and meta.exists():
        return path, json.loads(meta.read_text())
    tmp = path.with_suffix(f".{os.getpid()}.part.xlsx")
    _write_rows_fast(tmp, n)
    quarters_by_type = {t: 0 for t in TIPOS}
    for i in range(1, n + 1):
        quarters, tipo, _, _ = _row_values(i)
        quarters_by_type[tipo] += quarters
    info = {"rows": n, "total": str(Decimal(sum(quarters_by_type.values())) / 4),
            "by_type": {t: str(Decimal(q) / 4) for t, q in quarters_by_type.items()}}
    tmp_meta = meta.with_suffix(f".{os.getpid()}.part.json")
    tmp_meta.write_text(json.dumps(info))
    tmp_meta.rename(meta)
    tmp.rename(path)
    return path, info


def test_the_fast_workbook_is_xlsxwriters(tmp_path: Path) -> None:
    """Every part of the big tests' workbook is what XlsxWriter itself writes, cell by cell."""
    n = 2_500
    _write_rows_xlsxwriter(tmp_path / "slow.xlsx", n)
    _write_rows_fast(tmp_path / "fast.xlsx", n)
    with zipfile.ZipFile(tmp_path / "slow.xlsx") as slow, \
            zipfile.ZipFile(tmp_path / "fast.xlsx") as fast:
        assert [i.filename for i in fast.infolist()] == [i.filename for i in slow.infolist()]
        for info in slow.infolist():
            assert fast.read(info.filename) == slow.read(info.filename), info.filename
        assert fast.read(SHEET).count(b"<row ") == n + 1


def _same_totals(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["rows"] == want["rows"]
    assert Decimal(got["total"]) == Decimal(want["total"])
    assert {k: Decimal(v) for k, v in got["by_type"].items()} == {
        k: Decimal(v) for k, v in want["by_type"].items()}


def test_twenty_thousand_rows_in_process(tmp_path: Path) -> None:
    path, want = generate_rows_file(20_000)
    agg = aggregate_workbook(path)
    _same_totals({"rows": agg.rows, "total": str(agg.total),
                  "by_type": {k: str(v) for k, v in agg.by_type.items()}}, want)


@pytest.mark.slow
# In the parallel tier: its figures are the peak RSS of its own child processes,
# which other processes do not change, and it loads one core, as every xdist
# worker does. Writing the 1M-row workbook (XlsxWriter, 5M cells in Python; cached under /tmp
# afterwards) outlasted the suite's 300 s timeout on the loaded 2-core box, before
# anything was measured. The deadline only bounds a failure: this test's figures
# are memory, not time; generation plus measure()'s own 300 s and 600 s fit.
@pytest.mark.timeout(1800)
def test_million_rows_in_flat_memory() -> None:
    small_path, small_want = generate_rows_file(100_000)
    big_path, big_want = generate_rows_file(1_000_000)
    small = measure(small_path, timeout=300)
    big = measure(big_path, timeout=600)
    print(f"\n100k rows: {small['seconds']:.1f}s, peak RSS {small['peak_kb'] / 1024:.1f} MB "
          f"(+{small['extra_mb']:.1f} MB over the imports); 1M rows: {big['seconds']:.1f}s, peak RSS "
          f"{big['peak_kb'] / 1024:.1f} MB (+{big['extra_mb']:.1f} MB); "
          f"file {big_path.stat().st_size / 1e6:.1f} MB")
    assert small["ok"] and big["ok"], (small, big)
    _same_totals(small["result"], small_want)
    _same_totals(big["result"], big_want)
    assert abs(big["peak_kb"] - small["peak_kb"]) < 10 * 1024
    assert big["peak_kb"] < 100 * 1024


# ------------------------------------------------------------------- the CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "conveyor.cli.main", *args], capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, "CONVEYOR_DATABASE_URL": ""})


def test_cli_prints_one_json_object(tmp_path: Path) -> None:
    rows = dataset(50)
    path = write_openpyxl(tmp_path / "cli.xlsx", rows)
    proc = _cli("xlsx", str(path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    count, total, by_type = expected(rows)
    assert out["rows"] == count
    assert Decimal(str(out["total"])) == total
    assert {k: Decimal(str(v)) for k, v in out["by_type"].items()} == by_type
    assert set(out) == {"rows", "total", "by_type"}


@pytest.mark.parametrize("kind", ["csv", "xxe", "missing"])
def test_cli_refusal_exits_non_zero_with_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "bad.xlsx"
    if kind == "csv":
        path.write_text("tipo,monto\na,1\n")
    elif kind == "xxe":
        rewrite(_base_workbook(tmp_path / "base.xlsx"), path, {SHEET: _doctype_sheet(XXE, b"&x;")})
    proc = _cli("xlsx", str(path))
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
