"""Where consumers read files from: a confined local directory, or content-addressed storage.

Both return binary streams, so a consumer can stream a large file without
loading it. Names come from event payloads and engine records, which is to say
from outside: every name is checked before the filesystem sees it.

A consumer serving several tenants takes a store per tenant,
:class:`TenantDirectories`: tenant ``acme`` reads ``/srv/uploads/acme`` and
nothing else, whatever name its records hold.

Example::

    stores = TenantDirectories("/srv/uploads")
    with stores("acme").open("2026/report.xlsx") as f:     # /srv/uploads/acme/2026/report.xlsx
        ...

    store = LocalDirectoryStore("/srv/uploads/acme")
    with store.open("2026/report.xlsx") as f:
        ...

    cas = ContentAddressedStore("/srv/blobs")
    file_id = cas.put(open("report.xlsx", "rb"))   # SHA-256 of the content
    with cas.open(file_id) as f:
        ...
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from conveyor.errors import ConveyorError

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# A tenant becomes one path segment: no separators, no dot segments, no NUL.
_TENANT_DIR_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
CHUNK = 1024 * 1024


class FileStoreError(ConveyorError):
    """A file name was refused or the file does not exist."""


class FileStore(Protocol):
    def open(self, name: str) -> BinaryIO:
        """Open ``name`` for binary reading; raises FileStoreError when refused or missing."""
        ...


class LocalDirectoryStore:
    """Files under one root directory; nothing outside it can be opened.

    Refused: empty names, NUL bytes, absolute paths, ``..`` segments, and any
    path whose real location (after following symlinks) leaves the root.
    """

    def __init__(self, root: str | Path) -> None:
        try:
            self.root = Path(root).resolve(strict=True)
        except OSError:
            raise FileStoreError(f"file store root {str(root)!r} does not exist") from None
        if not self.root.is_dir():
            raise FileStoreError(f"file store root {str(root)!r} is not a directory")

    def resolve(self, name: str) -> Path:
        if not isinstance(name, str) or not name:
            raise FileStoreError(f"invalid file name {name!r:.80}")
        if "\x00" in name:
            raise FileStoreError(f"file name contains a NUL byte: {name!r:.80}")
        if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
            raise FileStoreError(f"file name must be relative to the store: {name!r:.80}")
        parts = re.split(r"[\\/]", name)
        if any(p in ("..", ".") for p in parts):
            raise FileStoreError(f"file name must not contain '.' or '..' segments: {name!r:.80}")
        candidate = self.root.joinpath(*[p for p in parts if p])
        real = Path(os.path.realpath(candidate))
        if real != self.root and self.root not in real.parents:
            raise FileStoreError(f"file name leads outside the store: {name!r:.80}")
        return real

    def open(self, name: str) -> BinaryIO:
        path = self.resolve(name)
        try:
            # O_NOFOLLOW closes the window between the check above and the open.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise FileStoreError(f"file not found in store: {name!r:.80}") from None
        except OSError as exc:
            raise FileStoreError(f"cannot open {name!r:.80}: {exc.strerror}") from None
        # O_NOFOLLOW guards only the last component: a directory swapped for a
        # symlink between the check and the open would be followed. So check
        # where the opened file really is.
        try:
            opened = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            opened = Path(os.path.realpath(path))
        if opened != self.root and self.root not in opened.parents:
            os.close(fd)
            raise FileStoreError(f"file name leads outside the store: {name!r:.80}")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FileStoreError(f"not a regular file: {name!r:.80}")
        return os.fdopen(fd, "rb")


TenantStores = Callable[[str], FileStore]
"""A tenant's own file store, by tenant name: ``stores("acme").open(name)``."""


class TenantDirectories:
    """One directory per tenant under ``root``: tenant ``acme`` reads ``root/acme`` only.

    Calling it with a tenant gives that tenant's :class:`LocalDirectoryStore`,
    so a name from one tenant's records (``"globex/q3.xlsx"``,
    ``"../globex/q3.xlsx"``, a symlink) can never reach another tenant's files.
    Refused with :class:`FileStoreError`: a tenant that is not one plain path
    segment, a tenant without a directory, and a tenant directory that is a
    symlink (it could point at another tenant's).

    Example::

        stores = TenantDirectories("/srv/uploads")
        stores("acme").open("q3.xlsx")          # /srv/uploads/acme/q3.xlsx
    """

    def __init__(self, root: str | Path) -> None:
        try:
            self.root = Path(root).resolve(strict=True)
        except OSError:
            raise FileStoreError(f"file store root {str(root)!r} does not exist") from None
        if not self.root.is_dir():
            raise FileStoreError(f"file store root {str(root)!r} is not a directory")

    def __call__(self, tenant: str) -> LocalDirectoryStore:
        if not isinstance(tenant, str) or not _TENANT_DIR_RE.fullmatch(tenant):
            raise FileStoreError(f"invalid tenant {tenant!r:.80} for a file store: expected 1-63 "
                                 "letters, digits, '-' or '_'")
        path = self.root / tenant
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise FileStoreError(f"no file directory for tenant {tenant!r}") from None
        if not stat.S_ISDIR(mode):
            raise FileStoreError(f"file directory of tenant {tenant!r} is not a directory "
                                 "(symlinks are refused)")
        return LocalDirectoryStore(path)


class ContentAddressedStore:
    """Files named by the SHA-256 of their content, stored as ``ab/cd/<sha256>``.

    Writing streams the content to a temporary file while hashing it, then
    moves it into place atomically, so a reader never sees half a file.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, file_id: str) -> Path:
        if not isinstance(file_id, str) or not _SHA256_RE.fullmatch(file_id):
            raise FileStoreError(f"invalid file id {file_id!r:.80}: expected 64 lowercase hex digits")
        return self.root / file_id[:2] / file_id[2:4] / file_id

    def put(self, stream: BinaryIO) -> str:
        """Store the stream's content; returns its id. Storing the same content twice is a no-op."""
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := stream.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
            file_id = digest.hexdigest()
            final = self._path(file_id)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return file_id

    def open(self, name: str) -> BinaryIO:
        try:
            return open(self._path(name), "rb")
        except FileNotFoundError:
            raise FileStoreError(f"no file with id {name}") from None
