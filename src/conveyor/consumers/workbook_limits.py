"""The ceilings that keep a hostile XLSX file cheap to refuse, and the refusals.

Everything the reader does before or while inflating a part goes through
here: the zip's central directory is judged before anything is inflated
(:func:`check_archive`), every byte actually inflated is counted against the
same ceiling (:func:`feed`), and every XML parser is made unable to read a
DTD (:func:`new_parser`), so entity expansion and external entities never
happen. Kept apart from the sheet reader so the defences can be read, and
reviewed, on one page; each refusal raises
:class:`~conveyor.errors.WorkbookError` with a one-line reason.
"""

from __future__ import annotations

import pyexpat
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from conveyor.errors import WorkbookError

MAX_ROWS = 1_048_576
CHUNK = 64 * 1024


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


class Refused(Exception):
    """Raised inside expat callbacks; turned into WorkbookError outside."""


def new_parser() -> Any:
    """An expat parser that refuses any DTD, entity declaration or external entity."""
    parser = pyexpat.ParserCreate(namespace_separator="}")
    parser.buffer_text = True
    parser.buffer_size = CHUNK

    def no_dtd(*_args: object) -> None:
        raise Refused("XML document type declarations (DTDs) are not allowed")

    def no_external(*_args: object) -> int:
        raise Refused("external XML entities are not allowed")

    parser.StartDoctypeDeclHandler = no_dtd
    parser.EntityDeclHandler = no_dtd
    parser.ExternalEntityRefHandler = no_external
    parser.SetParamEntityParsing(pyexpat.XML_PARAM_ENTITY_PARSING_NEVER)
    return parser


def feed(parser: Any, stream: IO[bytes], part: str, counter: list[int], limit: int,
         stop: Callable[[], bool] | None = None) -> None:
    """Parse ``stream`` in chunks, counting the inflated bytes in ``counter`` against ``limit``."""
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
    except Refused as exc:
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


def check_archive(archive: zipfile.ZipFile, limits: WorkbookLimits) -> None:
    """Refuse a zip whose central directory declares a bomb, before anything is inflated."""
    infos = archive.infolist()
    if len(infos) > limits.max_entries:
        raise WorkbookError(f"workbook has {len(infos)} zip entries, the limit is "
                            f"{limits.max_entries}")
    total = 0
    for info in infos:
        total += info.file_size
        if info.file_size > 1024**2:
            ratio = info.file_size / max(info.compress_size, 1)
            if ratio > limits.max_ratio:
                raise WorkbookError(
                    f"zip member {info.filename!r} expands {ratio:.0f}x "
                    f"(limit {limits.max_ratio:.0f}x): refused as a zip bomb")
    if total > limits.max_uncompressed_bytes:
        raise WorkbookError(
            f"workbook declares {total} uncompressed bytes, the limit is "
            f"{limits.max_uncompressed_bytes}: refused as a zip bomb")
    if "[Content_Types].xml" not in archive.namelist():
        raise WorkbookError("not an xlsx file: [Content_Types].xml is missing")
