"""S8: file references in payloads cannot leave the store (LocalDirectoryStore
had no test of its own before this file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conveyor.consumers.filestore import FileStoreError, LocalDirectoryStore

SECRET_TEXT = b"outside-secret"


@pytest.fixture
def layout(tmp_path: Path) -> tuple[LocalDirectoryStore, Path, Path]:
    root = tmp_path / "store" / "acme"
    (root / "in").mkdir(parents=True)
    (root / "in" / "book.xlsx").write_bytes(b"inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET_TEXT)
    (tmp_path / "store" / "globex").mkdir()
    (tmp_path / "store" / "globex" / "theirs.xlsx").write_bytes(b"other tenant")
    (root / "link-out").symlink_to(outside / "secret.txt")
    (root / "dir-out").symlink_to(outside, target_is_directory=True)
    (root / "link-tenant").symlink_to(tmp_path / "store" / "globex" / "theirs.xlsx")
    (root / "link-in").symlink_to(root / "in" / "book.xlsx")
    return LocalDirectoryStore(root), root, outside


REFUSED = [
    "", "../../etc/passwd", "../globex/theirs.xlsx", "in/../../globex/theirs.xlsx", "/etc/passwd",
    "//etc/passwd", "\\\\server\\share\\file", "\\\\?\\C:\\Windows\\win.ini", "C:\\Windows\\win.ini",
    "c:win.ini", "C:/Windows/win.ini", "in\\..\\..\\globex\\theirs.xlsx", "..\\..\\etc\\passwd",
    "in/./book.xlsx", ".", "..", "in/\x00book.xlsx", "\x00", "link-out", "dir-out/secret.txt",
    "link-tenant", "in/../link-out",
]


@pytest.mark.parametrize("name", REFUSED)
def test_traversal_absolute_unc_drive_nul_and_escaping_symlinks_are_refused(
        layout: tuple[LocalDirectoryStore, Path, Path], name: str) -> None:
    store, _, _ = layout
    with pytest.raises(FileStoreError), store.open(name) as f:
        f.read()


@pytest.mark.parametrize("name", ["%2e%2e/%2e%2e/etc/passwd", "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
                                  "..%2f..%2fetc%2fpasswd", "\uff0e\uff0e/\uff0e\uff0e/etc/passwd",
                                  "in/book.xlsx%00.txt", "x" * 5000, ("a/" * 2000) + "b"])
def test_encoded_and_lookalike_names_are_literal_and_stay_inside(
        layout: tuple[LocalDirectoryStore, Path, Path], name: str) -> None:
    # Nothing is URL-decoded or normalised: these are odd literal names under the root.
    store, root, _ = layout
    try:
        resolved = store.resolve(name)
    except FileStoreError:
        return
    assert root in resolved.parents
    with pytest.raises(FileStoreError):
        store.open(name)


def test_legitimate_names_and_inside_symlinks_open(layout: tuple[LocalDirectoryStore, Path, Path]) -> None:
    store, _, _ = layout
    for name in ("in/book.xlsx", "in//book.xlsx", "link-in"):
        with store.open(name) as f:
            assert f.read() == b"inside"


def test_a_directory_is_not_a_file(layout: tuple[LocalDirectoryStore, Path, Path]) -> None:
    store, _, _ = layout
    with pytest.raises(FileStoreError):
        store.open("in")


# Found here and fixed in dfd7a49 (the store now verifies where the opened file really is).
def test_a_directory_swapped_for_a_symlink_after_the_check_is_not_followed(
        layout: tuple[LocalDirectoryStore, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    store, root, outside = layout
    (root / "sub").mkdir()
    (root / "sub" / "secret.txt").write_bytes(b"harmless")
    checked = store.resolve

    def resolve_then_swap(name: str) -> Path:
        path = checked(name)
        (root / "sub" / "secret.txt").unlink()
        (root / "sub").rmdir()
        os.symlink(outside, root / "sub", target_is_directory=True)   # the race, made certain
        return path

    monkeypatch.setattr(store, "resolve", resolve_then_swap)
    try:
        with store.open("sub/secret.txt") as f:
            leaked = f.read()
    except FileStoreError:
        leaked = b""
    assert leaked != SECRET_TEXT
