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

`alwayson_scripts.ADetailer` details the result; with ADetailer's "skip img2img" the init images are
detailed as they are, with no img2img pass (`Engine.detail`).
"""

from __future__ import annotations

from app import heap
from app.a1111 import txt2img
from app.a1111.errors import ApiError
from app.a1111.pnginfo import decode_images
from app.a1111.schema import Img2ImgRequest
from app.a1111.state import ApiState, owner_of
from app.accounts import LOCAL_ACCOUNT, Account
from app.engine.desired import Desired
from app.engine.generate import GeneratedImage, GenerateParams

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
    blur = req.mask_blur if req.mask_blur is not None else max(req.mask_blur_x or 0, req.mask_blur_y or 0)

    def produce(params: GenerateParams, desired: Desired) -> list[GeneratedImage]:
        if req.reference_images:
            return state.engine.edit(params, images, owner=owner_of(account), desired=desired)
        return state.engine.img2img(
            params, images, denoising_strength=txt2img.field_value(req, "denoising_strength"),
            resize_mode=req.resize_mode or 0, mask=mask, mask_blur=blur, inpainting_fill=req.inpainting_fill or 0,
            inpainting_mask_invert=bool(req.inpainting_mask_invert), owner=owner_of(account), desired=desired,
            details=txt2img.details(state, req))

    notes = (ONLY_MASKED,) if mask is not None and req.inpaint_full_res else ()
    return txt2img.run(state, req, account, produce, notes)
