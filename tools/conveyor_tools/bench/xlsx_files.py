"""Workbooks for the consumer benchmark: big honest sheets and hostile files, cached.

Files live under ``<tempdir>/conveyor-bench-xlsx-<VERSION>``; bump
:data:`VERSION` whenever a generator changes so a stale cache is never used.
The n-row sheets are written by XlsxWriter in ``constant_memory`` mode
(inline strings, 5 columns ``id, fecha, tipo, monto, descripcion``), next to
a JSON file with their expected aggregate, computed from the generated data
(never by a reader under test). Writing 1,000,000 rows takes about a minute.

Needs XlsxWriter (a test extra of Conveyor, not a runtime dependency).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zipfile
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

VERSION = "v1"
SHEET = "xl/worksheets/sheet1.xml"
TIPOS = ("venta", "compra", "ajuste", "Venta", "devolución")
HEADER = ("id", "fecha", "tipo", "monto", "descripcion")


def cache_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"conveyor-bench-xlsx-{VERSION}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _xlsxwriter() -> Any:
    try:
        import xlsxwriter  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise SystemExit("conveyor bench --consumers needs XlsxWriter, openpyxl and aiosmtpd "
                         "(pip install 'conveyor[test]')") from None
    return xlsxwriter


def rows_file(n: int) -> tuple[Path, dict[str, Any]]:
    """An n-data-row workbook and its expected ``{rows, total, by_type}`` (as strings)."""
    cache = cache_dir()
    path, meta = cache / f"rows-{n}.xlsx", cache / f"rows-{n}.json"
    if path.exists() and meta.exists():
        return path, json.loads(meta.read_text())
    tmp = cache / f"rows-{n}.{os.getpid()}.part.xlsx"
    wb = _xlsxwriter().Workbook(str(tmp), {"constant_memory": True})
    ws = wb.add_worksheet()
    ws.write_row(0, 0, list(HEADER))
    # Amounts in quarters: exact in binary, so the stored text is the exact decimal.
    quarters_by_type = dict.fromkeys(TIPOS, 0)
    for i in range(1, n + 1):
        quarters = (i * 7919) % 400_009 - 200_000  # deterministic, signed
        tipo = TIPOS[i % len(TIPOS)]
        quarters_by_type[tipo] += quarters
        ws.write_number(i, 0, i)
        ws.write_number(i, 1, 45000 + i % 365)
        ws.write_string(i, 2, tipo)
        ws.write_number(i, 3, quarters / 4)
        ws.write_string(i, 4, f"movimiento {i}")
    wb.close()
    info = {"rows": n, "total": str(Decimal(sum(quarters_by_type.values())) / 4),
            "by_type": {t: str(Decimal(q) / 4) for t, q in quarters_by_type.items()}}
    meta.write_text(json.dumps(info))
    tmp.rename(path)
    return path, info


def same_aggregate(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Equal rows, total and per-type sums (compared as decimals)."""
    try:
        return (got["rows"] == want["rows"] and Decimal(got["total"]) == Decimal(want["total"])
                and {k: Decimal(v) for k, v in got["by_type"].items()}
                == {k: Decimal(v) for k, v in want["by_type"].items()})
    except (KeyError, ArithmeticError, TypeError):
        return False


# ------------------------------------------------------------------ hostile

_ROW = b'<row><c t="inlineStr"><is><t>venta</t></is></c><c><v>1</v></c></row>'
_SHEET_HEAD = (b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
               b'<worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main">'
               b'<sheetData><row><c t="inlineStr"><is><t>tipo</t></is></c>'
               b'<c t="inlineStr"><is><t>monto</t></is></c></row>')
_SHEET_TAIL = b"</sheetData></worksheet>"

BILLION_LAUGHS = b"<!DOCTYPE lolz [\n<!ENTITY lol \"lol\">\n" + b"".join(
    b'<!ENTITY lol%d "%s">\n' % (i, (b"&lol%d;" % (i - 1) if i > 1 else b"&lol;") * 10)
    for i in range(1, 10)) + b"]>\n"
XXE = b'<!DOCTYPE x [<!ENTITY x SYSTEM "file:///etc/hostname">]>\n'
QUADRATIC = b'<!DOCTYPE q [<!ENTITY a "' + b"A" * 50_000 + b'">]>\n'


def _base_workbook() -> Path:
    path = cache_dir() / "base.xlsx"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.part.xlsx")
        wb = _xlsxwriter().Workbook(str(tmp), {"constant_memory": True})
        ws = wb.add_worksheet()
        ws.write_row(0, 0, ["tipo", "monto"])
        ws.write_row(1, 0, ["a", 1])
        wb.close()
        tmp.rename(path)
    return path


def _rewrite(dst: Path, replace: dict[str, bytes] | None = None,
             add: Iterable[tuple[str, bytes]] = ()) -> Path:
    if dst.exists():
        return dst
    tmp = dst.with_suffix(f".{os.getpid()}.part")
    with zipfile.ZipFile(_base_workbook()) as zin, \
            zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = (replace or {}).get(info.filename)
            zout.writestr(info.filename, zin.read(info.filename) if data is None else data)
        for name, data in add:
            zout.writestr(name, data)
    tmp.rename(dst)
    return dst


def _honest_bomb() -> Path:
    """The sheet member inflates to ~1 GB of repeated rows; sizes declared honestly (~3.5 MB file)."""
    path = cache_dir() / "bomb-honest-1g.xlsx"
    if path.exists():
        return path
    chunk = _ROW * (1024 * 1024 // len(_ROW))
    tmp = path.with_suffix(f".{os.getpid()}.part")
    with zipfile.ZipFile(_base_workbook()) as zin, \
            zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename == SHEET:
                with zout.open(SHEET, "w", force_zip64=False) as out:
                    out.write(_SHEET_HEAD)
                    for _ in range(1000):
                        out.write(chunk)
                    out.write(_SHEET_TAIL)
            else:
                zout.writestr(info.filename, zin.read(info.filename))
    tmp.rename(path)
    return path


def _lying_bomb(declared: int) -> Path:
    """The honest bomb with the sheet's uncompressed size patched down to ``declared`` bytes
    (local header and central directory), so no size or ratio check sees anything alarming."""
    path = cache_dir() / f"bomb-lying-{declared}.xlsx"
    if path.exists():
        return path
    src = _honest_bomb()
    raw = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo(SHEET)
    struct.pack_into("<I", raw, info.header_offset + 22, declared)
    name = SHEET.encode()
    central = raw.find(b"PK\x01\x02")
    while central != -1:
        n = struct.unpack_from("<H", raw, central + 28)[0]
        if bytes(raw[central + 46: central + 46 + n]) == name:
            struct.pack_into("<I", raw, central + 24, declared)
        central = raw.find(b"PK\x01\x02", central + 4)
    tmp = path.with_suffix(f".{os.getpid()}.part")
    tmp.write_bytes(bytes(raw))
    tmp.rename(path)
    return path


def _doctype_sheet(doctype: bytes, cell_text: bytes) -> bytes:
    return (b'<?xml version="1.0" encoding="UTF-8"?>\n' + doctype +
            b'<worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main">'
            b'<sheetData><row r="1"><c r="A1" t="inlineStr"><is><t>tipo</t></is></c>'
            b'<c r="B1" t="inlineStr"><is><t>monto</t></is></c></row>'
            b'<row r="2"><c r="A2" t="inlineStr"><is><t>' + cell_text + b'</t></is></c>'
            b'<c r="B2"><v>1</v></c></row></sheetData></worksheet>')


def hostile_files() -> dict[str, tuple[Path, str]]:
    """name -> (file, what it is)."""
    cache = cache_dir()
    return {
        "zip_bomb": (_honest_bomb(),
                     "sheet inflates to ~1 GB (3.5 MB file), sizes declared honestly"),
        "zip_bomb_lying_size": (_lying_bomb(1024**2 - 1),
                                "the same bomb declaring 1 MiB - 1 byte (under the ratio check)"),
        "many_entries": (_rewrite(cache / "many-entries.xlsx",
                                  add=((f"xl/media/pad{i}.bin", b"x") for i in range(5000))),
                         "5,000 extra zip entries"),
        "billion_laughs": (_rewrite(cache / "billion-laughs.xlsx",
                                    {SHEET: _doctype_sheet(BILLION_LAUGHS, b"&lol9;")}),
                           "nested entities expanding to 10^9 'lol's in a cell"),
        "xxe": (_rewrite(cache / "xxe.xlsx", {SHEET: _doctype_sheet(XXE, b"&x;")}),
                "external entity reading file:///etc/hostname into a cell"),
        "quadratic_blowup": (_rewrite(cache / "quadratic.xlsx",
                                      {SHEET: _doctype_sheet(QUADRATIC, b"&a;" * 20_000)}),
                             "a 50 kB entity referenced 20,000 times (1 GB)"),
    }
