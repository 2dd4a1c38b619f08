"""`POST /sdapi/v1/img2img`: A1111's img2img and inpaint on the engine's workflows.

The request is txt2img's (same checks, same limits, same answer) plus the init images, the
denoising strength, A1111's `resize_mode` (0 just resize, 1 crop and resize, 2 resize and fill)
and, with a `mask`, inpaint: `mask_blur` (or the larger of `mask_blur_x/y`), `inpainting_fill`
(0 fill, 1 original, 2 latent noise, 3 latent nothing) and `inpainting_mask_invert`. Inpaint
repaints at the whole picture's resolution: A1111's "only masked" (`inpaint_full_res`, its
default) is not built, so it is ignored and the answer's comments say so.

`reference_images: true` (ours: a model whose family takes reference images) reads `init_images` as the
reference pictures the model edits from or combines (`Engine.edit`), generating at the request's size; a
model that takes none refuses it by name.
"""

from __future__ import annotations

import dataclasses

from app import heap
from app.a1111 import sd_upscale, txt2img
from app.a1111.errors import ApiError
from app.a1111.pnginfo import decode_images
from app.a1111.schema import Img2ImgRequest
from app.a1111.state import ApiState, owner_of
from app.accounts import LOCAL_ACCOUNT, Account
from app.engine.desired import Desired
from app.engine.generate import MAX_SEED, GeneratedImage, GenerateParams, resolve_seed

ONLY_MASKED = ("inpaint_full_res (only masked) is not supported: the whole picture was repainted at its size")


def run(state: ApiState, req: Img2ImgRequest, account: Account = LOCAL_ACCOUNT) -> dict:
    """The whole request of `account` (`txt2img.run`), blocking (run it in the API's lane). The decoded
    pictures live only in `_run`'s frame; the heap's pages they took go back to the OS afterwards (`heap.give_back`: the
    process keeps freed memory for reuse otherwise, and 4 inputs of 4096² are 256 MiB)."""
    try:
        return _run(state, req, account)
    finally:
        heap.give_back()


def _run(state: ApiState, req: Img2ImgRequest, account: Account) -> dict:
    if not req.init_images:
        raise ApiError(422, "img2img needs init_images: a list of base64 images (data: URLs work too)")
    sent = [(data, f"init_images[{i}]") for i, data in enumerate(req.init_images)]
    decoded = decode_images(sent + ([(req.mask, "mask")] if req.mask else []))
    images, mask = (decoded[:-1], decoded[-1]) if req.mask else (decoded, None)
    script = script_args(state, req)
    blur = req.mask_blur if req.mask_blur is not None else max(req.mask_blur_x or 0, req.mask_blur_y or 0)

    def img2img(params: GenerateParams, desired: Desired, pictures: list) -> list[GeneratedImage]:
        return state.engine.img2img(
            params, pictures, denoising_strength=txt2img.field_value(req, "denoising_strength"),
            resize_mode=req.resize_mode or 0, mask=mask, mask_blur=blur, inpainting_fill=req.inpainting_fill or 0,
            inpainting_mask_invert=bool(req.inpainting_mask_invert), owner=owner_of(account), desired=desired)

    def produce(params: GenerateParams, desired: Desired) -> list[GeneratedImage]:
        if script is not None:
            return _sd_upscaled(state, account, images, params, script,
                                lambda tile_params, tile: next(iter(img2img(tile_params, desired, [tile])), None))
        if req.reference_images:
            return state.engine.edit(params, images, owner=owner_of(account), desired=desired)
        return img2img(params, desired, images)

    notes = (ONLY_MASKED,) if mask is not None and req.inpaint_full_res else ()
    return txt2img.run(state, req, account, produce, notes)


def script_args(state: ApiState, req: Img2ImgRequest) -> sd_upscale.SdUpscaleArgs | None:
    """The "SD upscale" script's arguments when the request names it (None without a script); 422 for another
    script, or for the script with a mask or reference images, which it does not take."""
    if not req.script_name:
        return None
    if not sd_upscale.asked(req.script_name):
        raise ApiError(422, f"script {req.script_name!r} not found; img2img has: {sd_upscale.TITLE}")
    if req.mask or req.reference_images:
        raise ApiError(422, f"{sd_upscale.TITLE} upscales whole pictures: send it without a mask or reference_images")
    return sd_upscale.parse_args(req.script_args or [], state.engine.extras_upscalers())


def _sd_upscaled(state: ApiState, account: Account, images: list, params: GenerateParams,
                 args: sd_upscale.SdUpscaleArgs, denoise) -> list[GeneratedImage]:
    """Each init image through the script (`sd_upscale.upscale_tiled`), the Extras job upscaling it first; as
    A1111's script, `n_iter` makes that many results, result n with seed + n for all its tiles (a random seed is
    drawn once, not per tile)."""
    def upscale(image, extras_params):
        return state.engine.extras([image], extras_params, owner=owner_of(account))[0].image

    seed = resolve_seed(params.seed)
    done = [sd_upscale.upscale_tiled(image, dataclasses.replace(params, seed=(seed + n) % (MAX_SEED + 1)), args,
                                     upscale, denoise) for n in range(params.n_iter) for image in images]
    return [image for image in done if image is not None]
