"""A PNG's size and text chunks, read from its chunk headers alone, with every size capped.

Why not Pillow's `Image.open(...).info`: Pillow inflates each compressed text chunk (zTXt, iTXt)
up to 1 MB and all of them up to 64 MB, so a 63 KB PNG once made the PNG Info API answer 63 MB.
Here a chunk's text may inflate to `MAX_TEXT_BYTES` and all of them to `MAX_TOTAL_TEXT`; past
either the file is refused with the cap named. Only the chunks before the image data are read
(where A1111, Forge and we write `parameters`, and the ones Pillow reports), no pixel is decoded,
and nothing is kept beyond the `PngFacts` returned.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_TEXT_BYTES = 1 << 20  # one chunk's text once inflated: an infotext is a few KB
MAX_TOTAL_TEXT = 4 << 20  # every text chunk together
MAX_CHUNKS = 256  # chunks before the image data (a PNG carries a handful)
_TEXT_TYPES = (b"tEXt", b"zTXt", b"iTXt")


class PngTextError(ValueError):
    """Not a PNG, or one whose text breaks a cap; the message says which."""


@dataclass(frozen=True)
class PngFacts:
    width: int
    height: int
    text: dict[str, str]


def read_png(stream: BinaryIO) -> PngFacts:
    """The size (IHDR) and text chunks of the PNG in `stream`, read up to its first image data."""
    if stream.read(8) != SIGNATURE:
        raise PngTextError("not a PNG file")
    size, text, total = None, {}, 0
    for _ in range(MAX_CHUNKS):
        header = stream.read(8)
        if len(header) < 8:
            break
        length, kind = struct.unpack(">I4s", header)
        if kind in (b"IDAT", b"IEND"):
            break
        if kind == b"IHDR" or kind in _TEXT_TYPES:
            if length > MAX_TEXT_BYTES:
                raise PngTextError(f"a {kind.decode()} chunk of {length:,} bytes is over the "
                                   f"{MAX_TEXT_BYTES:,}-byte cap")
            data = stream.read(length)
            if kind == b"IHDR":
                size = struct.unpack(">II", data[:8]) if len(data) >= 8 else None
            else:
                key, value = _text(kind, data)
                total += len(value)
                if total > MAX_TOTAL_TEXT:
                    raise PngTextError(f"its text chunks hold over {MAX_TOTAL_TEXT:,} characters, the cap")
                text.setdefault(key, value)
            stream.seek(4, 1)  # the CRC
        else:
            stream.seek(length + 4, 1)
    else:
        raise PngTextError(f"over {MAX_CHUNKS} chunks before the image data")
    if size is None:
        raise PngTextError("a PNG without its IHDR header chunk")
    return PngFacts(size[0], size[1], text)


def _text(kind: bytes, data: bytes) -> tuple[str, str]:
    """(keyword, text) of one text chunk; tEXt and zTXt are Latin-1, iTXt UTF-8 (PNG spec 11.3.4)."""
    keyword, _, rest = data.partition(b"\0")
    name = keyword.decode("latin-1")
    if kind == b"tEXt":
        return name, rest.decode("latin-1")
    if kind == b"zTXt":
        return name, _inflate(rest[1:], name).decode("latin-1")
    compressed = rest[:1] == b"\1"
    _lang, _, rest = rest[2:].partition(b"\0")
    _translated, _, body = rest.partition(b"\0")
    body = _inflate(body, name) if compressed else body
    return name, body.decode("utf-8", errors="replace")


def _inflate(data: bytes, name: str) -> bytes:
    """zlib data inflated to at most `MAX_TEXT_BYTES`; a chunk that would inflate further is refused."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, MAX_TEXT_BYTES + 1)
    except zlib.error as exc:
        raise PngTextError(f"text chunk {name!r} is not valid compressed data ({exc})") from None
    if len(out) > MAX_TEXT_BYTES:
        raise PngTextError(f"text chunk {name!r} inflates past the {MAX_TEXT_BYTES:,}-byte cap")
    return out
