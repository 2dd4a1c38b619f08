"""`POST /sdapi/v1/png-info`: the generation parameters inside a base64 PNG, as A1111 reports them.

`info` is the raw `parameters` text, `items` the image's other text chunks, and `parameters`
the text parsed by `app.infotext` (the reader the PNG Info tab uses) into A1111's flat dict:
`Prompt` (with its LoRA tags, so the prompt can be sent back as it is), `Negative prompt`, every
`Key: value` as a string, and `Size` also split into `Size-1` and `Size-2` as A1111 splits it.
Only the PNG's header chunks are read; the pixels are never decoded.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

from app.a1111.errors import ApiError
from app.infotext import LoraUse, parse_infotext, prompt_with_tags

# Chunks PIL reports that are not text an image carries (A1111 drops the same kind).
_NOT_TEXT = {"dpi", "gamma", "transparency", "aspect", "srgb", "icc_profile", "exif", "chromaticity"}


def decode_image(data: str) -> Image.Image:
    """A PIL image from base64 (optionally a `data:image/…;base64,` URL); 422 when it is not one."""
    text = data.strip()
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return Image.open(io.BytesIO(base64.b64decode(text, validate=True)))
    except (binascii.Error, ValueError, UnidentifiedImageError) as exc:
        raise ApiError(422, f"Invalid encoded image: {exc}") from None


def parameters(text: str) -> dict[str, str]:
    """A1111's parsed-parameters dict for an infotext; a text without a settings line is all prompt."""
    if not text:
        return {}
    try:
        info = parse_infotext(text)
    except ValueError:
        return {"Prompt": text.strip(), "Negative prompt": ""}
    uses = tuple(LoraUse(s.name, s.unet_strength, "", s.te_strength) for s in info.loras)
    out = {"Prompt": prompt_with_tags(info.prompt, uses), "Negative prompt": info.negative_prompt}
    for key, value in info.settings.items():
        out[key] = value
        width, sep, height = value.partition("x")
        if key == "Size" and sep and width.isdigit() and height.isdigit():
            out["Size-1"], out["Size-2"] = width, height
    return out


def png_info(data: str) -> dict:
    """The `PNGInfoResponse` fields for one image."""
    with decode_image(data) as image:
        chunks = dict(image.info)
    text = chunks.pop("parameters", None)
    text = text if isinstance(text, str) else ""
    items = {k: v for k, v in chunks.items() if isinstance(v, str) and k.lower() not in _NOT_TEXT}
    return {"info": text, "items": items, "parameters": parameters(text)}
