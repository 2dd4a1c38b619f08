"""`POST /sdapi/v1/png-info`: the generation parameters inside a base64 PNG, as A1111 reports them.

`info` is the raw `parameters` text, `items` the image's other text chunks, and `parameters`
the text parsed by `app.infotext` (the reader the PNG Info tab uses) into A1111's flat dict:
`Prompt` (with its LoRA tags, so the prompt can be sent back as it is), `Negative prompt`, every
`Key: value` as a string, and `Size` also split into `Size-1` and `Size-2` as A1111 splits it.
Only the PNG's header chunks are read, within `app.png_text`'s caps; the pixels are never decoded.
Images for img2img go through `app.image_inputs` (format and pixel caps before decoding).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence

from PIL import Image

from app.a1111.errors import ApiError
from app.image_inputs import ImageInputError, decode_all, open_checked
from app.infotext import LoraUse, parse_infotext, prompt_with_tags
from app.png_text import SIGNATURE, PngTextError, read_png

# Chunks PIL reports that are not text an image carries (A1111 drops the same kind).
_NOT_TEXT = {"dpi", "gamma", "transparency", "aspect", "srgb", "icc_profile", "exif", "chromaticity"}


def _bytes(data: str, what: str) -> bytes:
    """The bytes of base64 (optionally a `data:image/…;base64,` URL); 422 when it is not base64."""
    text = data.strip()
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(422, f"Invalid encoded image ({what}): {exc}") from None


def decode_images(items: Sequence[tuple[str, str]]) -> list[Image.Image]:
    """`(base64, what)` pairs as decoded images, checked before decoding (`app.image_inputs`); 422 when refused."""
    try:
        return decode_all([(_bytes(data, what), what) for data, what in items])
    except ImageInputError as exc:
        raise ApiError(422, f"Invalid encoded image: {exc}") from None


def parameters(text: str) -> dict[str, str]:
    """A1111's parsed-parameters dict for an infotext; a text without a settings line is all prompt."""
    if not text:
        return {}
    try:
        info = parse_infotext(text)
    except ValueError:
        return {"Prompt": text.strip(), "Negative prompt": ""}
    uses = tuple(LoraUse(s.name, s.unet_strength, "", s.te_strength, s.schedule_text) for s in info.loras)
    out = {"Prompt": prompt_with_tags(info.prompt, uses), "Negative prompt": info.negative_prompt}
    for key, value in info.settings.items():
        out[key] = value
        width, sep, height = value.partition("x")
        if key == "Size" and sep and width.isdigit() and height.isdigit():
            out["Size-1"], out["Size-2"] = width, height
    return out


def _text_chunks(raw: bytes) -> dict[str, str]:
    """A PNG's text chunks (capped, `app.png_text`), or a JPEG's or WebP's text fields from its header."""
    try:
        if raw.startswith(SIGNATURE):
            return read_png(io.BytesIO(raw)).text
        with open_checked(raw, "image") as image:
            return {k: v for k, v in image.info.items() if isinstance(v, str)}
    except (PngTextError, ImageInputError) as exc:
        raise ApiError(422, f"Invalid encoded image: {exc}") from None


def png_info(data: str) -> dict:
    """The `PNGInfoResponse` fields for one image."""
    chunks = _text_chunks(_bytes(data, "image"))
    text = chunks.pop("parameters", "")
    items = {k: v for k, v in chunks.items() if k.lower() not in _NOT_TEXT}
    return {"info": text, "items": items, "parameters": parameters(text)}
