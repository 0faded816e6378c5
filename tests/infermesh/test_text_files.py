"""infermesh.text.text_files: the digest names the files exactly, and pieces reassemble or are
refused."""

from __future__ import annotations

import pytest

from infermesh.text.text_files import TextFiles, assembled, files_digest


def test_the_digest_changes_with_any_name_or_byte_and_not_with_order():
    files = {"a.json": b"{}", "b.jinja": b"x" * 10}
    digest = files_digest(files)
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert files_digest(dict(reversed(files.items()))) == digest
    assert files_digest({**files, "b.jinja": b"x" * 9 + b"y"}) != digest
    assert files_digest({"a.json": b"{}", "c.jinja": b"x" * 10}) != digest
    # a name's bytes cannot pass for content: lengths are part of the digest
    assert files_digest({"ab": b"c"}) != files_digest({"a": b"bc"})


def test_pieces_reassemble_into_the_files():
    files = TextFiles.of({"big.json": bytes(range(256)) * 9, "empty.txt": b"", "t.jinja": b"t"})
    pieces = list(files.chunks(chunk_bytes=100))
    assert all(len(data) <= 100 for _, data in pieces)
    assert [name for name, _ in pieces if name] == ["big.json", "empty.txt", "t.jinja"]
    assert TextFiles.of(assembled(pieces)) == files


@pytest.mark.parametrize(
    "pieces, error",
    [
        ([("", b"x")], "came before any file's name"),
        ([("../etc/passwd", b"x")], "is not a plain file name"),
        ([("..", b"x")], "is not a plain file name"),
    ],
)
def test_bad_pieces_are_refused(pieces, error):
    with pytest.raises(ValueError, match=error):
        assembled(pieces)
