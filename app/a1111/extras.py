"""`POST /sdapi/v1/extra-single-image` and `/extra-batch-images`: A1111's Extras upscale on the engine.

The request's A1111 fields become `ExtrasParams` (the rule set the Extras tab uses); images are
decoded by the API's one decoder (`pnginfo.decode_images`: header-checked, pixel-capped). Face
restoration (`gfpgan_visibility`, `codeformer_visibility`) runs the model in `models/GFPGAN` or
`models/Codeformer`; with none there the request is refused with a 422 naming the folder. The answer
is A1111's: the upscaled PNG(s) in base64, carrying the source's `parameters`
and the postprocessing text, and that text as `html_info`.
"""

from __future__ import annotations

import re

from app.a1111.errors import ApiError
from app.a1111.pnginfo import decode_images
from app.a1111.schema import ExtrasBaseRequest, ExtrasBatchImagesRequest, ExtrasSingleImageRequest
from app.a1111.state import ApiState, owner_of
from app.a1111.txt2img import field_value, saved_png
from app.accounts import Account
from app.engine.upscaling import UpscaledImage
from app.shown_paths import without_folders
from app.upscalers.extras import ExtrasParams

_SCALE_IN_NAME = re.compile(r"(?<![0-9a-z])([1-8])x|x([1-8])(?![0-9])")  # 4x-UltraSharp, RealESRGAN_x4plus


def params(req: ExtrasBaseRequest) -> ExtrasParams:
    """The engine's settings for the request; bad values refused (422)."""
    fields = {name: field_value(req, name) for name in ExtrasBaseRequest.model_fields}  # defaults for nulls
    return ExtrasParams(upscaler=fields["upscaler_1"], resize_mode=fields["resize_mode"],
                        factor=fields["upscaling_resize"], width=fields["upscaling_resize_w"],
                        height=fields["upscaling_resize_h"], crop=bool(fields["upscaling_crop"]),
                        upscaler_2=fields["upscaler_2"], visibility_2=fields["extras_upscaler_2_visibility"],
                        gfpgan_visibility=fields["gfpgan_visibility"],
                        codeformer_visibility=fields["codeformer_visibility"],
                        codeformer_weight=fields["codeformer_weight"])


def _png(result: UpscaledImage) -> str:
    """Base64 PNG with the saved file's text chunks (source `parameters`, `postprocessing`, `extras`)."""
    return saved_png(result.path, result.image, result.infotext, result.chunks)


def single(state: ApiState, req: ExtrasSingleImageRequest, account: Account) -> dict:
    """The whole request of `account`, blocking (run it in the API's lane)."""
    if not req.image:
        raise ApiError(422, "extra-single-image needs image: a base64 image (a data: URL works too)")
    results = state.engine.extras(decode_images([(req.image, "image")]), params(req), owner=owner_of(account))
    return {"html_info": results[0].infotext if results else "", "image": _png(results[0]) if results else None}


def batch(state: ApiState, req: ExtrasBatchImagesRequest, account: Account) -> dict:
    if not req.imageList:
        raise ApiError(422, "extra-batch-images needs imageList: [{data: base64 image, name}]")
    images = decode_images([(item.data, item.name or f"image {i + 1}") for i, item in enumerate(req.imageList)])
    results = state.engine.extras(images, params(req), owner=owner_of(account))
    return {"html_info": results[0].infotext if results else "", "images": [_png(r) for r in results]}


def upscalers(state: ApiState) -> list[dict]:
    """`GET /sdapi/v1/upscalers`: `None`, the resamplers and every model file found, as A1111 lists them
    (`scale` of a model as its name states it, `4x-…` or `…x4`: reading each file to know would cost a load;
    `model_path` relative to the data folder, as the other listings)."""
    models = {e.name: e for e in state.engine.upscalers.entries()}
    out = []
    for name in state.engine.extras_upscalers():
        entry = models.get(name)
        out.append({"name": name, "model_name": entry.folder if entry else None,
                    "model_path": str(entry.path) if entry else None, "model_url": None,
                    "scale": _scale_in_name(name) if entry else None})
    return without_folders(out, state.ctx.settings.data_dir)


def realesrgan_models(state: ApiState) -> list[dict]:
    """`GET /sdapi/v1/realesrgan-models`: the upscaler files in `models/RealESRGAN`, with A1111's fields."""
    entries = [e for e in state.engine.upscalers.entries() if e.folder == "RealESRGAN"]
    out = [{"name": e.name, "path": str(e.path), "scale": _scale_in_name(e.name)} for e in entries]
    return without_folders(out, state.ctx.settings.data_dir)


def _scale_in_name(name: str) -> float | None:
    found = _SCALE_IN_NAME.search(name.lower())
    return None if found is None else float(found.group(1) or found.group(2))
