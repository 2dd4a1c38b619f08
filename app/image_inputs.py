"""Images sent by clients: format and size checked from the header before a pixel is decoded.

A 132-byte PNG whose header claims 13376² RGBA passes Pillow's own bomb check (it warns from 89 M
pixels and refuses from 179 M) and decodes to 715 MB; four in one request kept +2 GiB. A 70-byte
BMP kept +374 MiB, and an EPS made Pillow look for Ghostscript. So an input image must be PNG,
JPEG or WebP (Pillow tries no other format), PNG text chunks keep to `png_text`'s caps (checked
before Pillow inflates any), one image claims at most `MAX_INPUT_PIXELS` and one request's images
together `MAX_REQUEST_PIXELS`; then they are decoded one at a time. Nothing is cached: the decoded
images live as long as the request that holds them.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from PIL import Image, UnidentifiedImageError

from app.png_text import SIGNATURE, PngTextError, read_png

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_INPUT_PIXELS = 4096 * 4096  # one image: 64 MiB decoded as RGBA, twice the largest generation's side
MAX_REQUEST_PIXELS = 4 * MAX_INPUT_PIXELS  # all the images of one request


class ImageInputError(ValueError):
    """An input image refused before decoding; the message names the image and the rule."""


def open_checked(data: bytes, what: str) -> Image.Image:
    """`data` opened lazily (header read, nothing decoded) when it is an allowed image within the pixel cap."""
    try:
        if data.startswith(SIGNATURE):  # size and text from the chunk headers, before Pillow inflates any text
            facts = read_png(io.BytesIO(data))
            _check_pixels(facts.width, facts.height, what)
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except ImageInputError:
        raise
    except PngTextError as exc:
        raise ImageInputError(f"{what}: {exc}") from None
    except Image.DecompressionBombError:
        raise ImageInputError(f"{what}: its header claims over {2 * Image.MAX_IMAGE_PIXELS:,} pixels; one input "
                              f"image may have at most {MAX_INPUT_PIXELS:,} (4096x4096)") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise ImageInputError(f"{what}: not a PNG, JPEG or WebP image (the formats accepted)") from None
    try:
        _check_pixels(*image.size, what)
    except ImageInputError:
        image.close()
        raise
    return image


def _check_pixels(width: int, height: int, what: str) -> None:
    if width * height > MAX_INPUT_PIXELS:
        raise ImageInputError(f"{what}: {width}x{height} is {width * height:,} pixels; one input image may have "
                              f"at most {MAX_INPUT_PIXELS:,} (4096x4096)")


def decode_all(items: Sequence[tuple[bytes, str]]) -> list[Image.Image]:
    """Every `(data, what)` checked from its header first, then decoded one after another."""
    images = [open_checked(data, what) for data, what in items]
    total = sum(im.width * im.height for im in images)
    if total > MAX_REQUEST_PIXELS:
        for image in images:
            image.close()
        raise ImageInputError(f"the request's images hold {total:,} pixels together; the most is "
                              f"{MAX_REQUEST_PIXELS:,} (four of 4096x4096)")
    for image, (_data, what) in zip(images, items, strict=True):
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageInputError(f"{what} could not be decoded: {exc}") from None
    return images
