"""Text inputs (recipes, JSON datasets) must be UTF-8: where the first byte that is not, named as a user can find
it (byte offset, line, column), and what the file looks like instead (a UTF-16/32 byte-order mark)."""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import Optional

# Byte-order marks of the encodings an editor may save text in instead of UTF-8 (UTF-32's first: it begins
# with UTF-16's little-endian mark).
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))
_CHUNK = 1 << 20


def describe_bad_byte(head: bytes, offset: int, line: int, column: int, byte: int) -> str:
    """'byte 13 (line 2, column 6) is 0xff, not UTF-8: expected a UTF-8 text file' (+ a byte-order-mark hint);
    ``head``: the file's first bytes."""
    bom = next((name for mark, name in _BOMS if head.startswith(mark)), None)
    hint = f" (it starts with a {bom} byte-order mark: save it as UTF-8)" if bom else ""
    return f"byte {offset} (line {line}, column {column}) is 0x{byte:02x}, not UTF-8: expected a UTF-8 text file{hint}"


def decode_utf8(raw: bytes) -> tuple[Optional[str], Optional[str]]:
    """(text, None), or (None, the ``describe_bad_byte`` of the first byte that is not UTF-8)."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, _describe(raw[:4], raw, e.start, 0, 0, -1)


def utf8_problem(path: Path) -> Optional[str]:
    """None if ``path`` is UTF-8 throughout, else the ``describe_bad_byte`` of its first bad byte. Read in 1 MiB
    chunks through an incremental decoder: a large file is checked without holding it (or its text)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    start = newlines = 0  # file offset of the chunk; newlines before it
    last_newline = -1  # file offset of the last newline before the chunk
    head = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            head = head or chunk[:4]
            pending = len(decoder.getstate()[0])  # bytes of a character split by the previous chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                buffer = e.object  # the pending bytes, then this chunk
                return _describe(head, buffer, e.start, start - pending, newlines, last_newline)
            if not chunk:
                return None
            n = chunk.count(b"\n")
            if n:
                newlines += n
                last_newline = start + chunk.rfind(b"\n")
            start += len(chunk)


def _describe(head: bytes, buffer: bytes, index: int, buffer_start: int, newlines: int, last_newline: int) -> str:
    """The bad byte at ``buffer[index]``; ``buffer`` begins at file offset ``buffer_start``, after ``newlines``
    newlines, the last of them at file offset ``last_newline`` (-1: none)."""
    before = buffer[:index]
    n = before.count(b"\n")
    if n:
        last_newline = buffer_start + before.rfind(b"\n")
    offset = buffer_start + index
    return describe_bad_byte(head, offset, newlines + n + 1, offset - last_newline, buffer[index])
