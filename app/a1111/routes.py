"""The `/sdapi/v1/...` routes: thin handlers over `txt2img`, `options`, `progress`, `pnginfo`, `listings`.

Handlers that change or use the model run in the API's lane (`ApiState.run`), so they reach the
engine one at a time, like every other caller, through its queue; read-only lists run in the
thread pool; `progress`, `interrupt` and `skip` only read the snapshot or set a flag, so they
answer at once, even while a generation holds the engine. Interrupt and Skip act on whatever
generation runs, the UI's too, as A1111's do (it has one job at a time and so do we).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from app.a1111 import checkpoints, img2img, listings, options, pnginfo, progress, txt2img
from app.a1111.auth import BasicAuth
from app.a1111.errors import A1111Route
from app.a1111.schema import (
    EmbeddingsResponse,
    ImageToImageResponse,
    Img2ImgRequest,
    LoraItem,
    MemoryResponse,
    PNGInfoRequest,
    PNGInfoResponse,
    ProgressResponse,
    SamplerItem,
    SchedulerItem,
    ScriptsList,
    SDModelItem,
    TextToImageResponse,
    Txt2ImgRequest,
    UpscalerItem,
)
from app.a1111.state import ApiState
from app.engine.stage_params import LATENT_UPSCALERS, PIXEL_UPSCALERS


def _refuse_bad_input(req: Txt2ImgRequest, state: ApiState) -> None:
    """Check the numbers (and the hires fix's) before the request waits in the lane or switches a checkpoint."""
    arch = state.engine.snapshot().arch
    txt2img.plan(req, arch)
    txt2img.hires(req, arch)


def _generation(router: APIRouter, state: ApiState) -> None:
    @router.post("/txt2img", response_model=TextToImageResponse)
    async def text2img(req: Txt2ImgRequest) -> dict:
        _refuse_bad_input(req, state)
        return await state.run("txt2img", lambda: txt2img.run(state, req))

    @router.post("/img2img", response_model=ImageToImageResponse)
    async def image2img(req: Img2ImgRequest) -> dict:
        _refuse_bad_input(req, state)
        return await state.run("img2img", lambda: img2img.run(state, req))

    @router.post("/png-info", response_model=PNGInfoResponse)
    def png_info(req: PNGInfoRequest) -> dict:
        return pnginfo.png_info(req.image)

    @router.get("/progress", response_model=ProgressResponse)
    async def get_progress(skip_current_image: bool = False) -> dict:
        return progress.progress(state, skip_current_image)

    @router.post("/interrupt")
    async def interrupt() -> dict:
        state.engine.interrupt(keep_partial=True)
        state.job.interrupted = True  # until the next API job begins, as A1111's flag
        return {}

    @router.post("/skip")
    async def skip() -> None:
        state.engine.skip()
        state.job.skipped = True


def _model_control(router: APIRouter, state: ApiState) -> None:
    @router.get("/options")
    def get_options() -> dict:  # not async: with no model loaded it lists the checkpoint folder
        return options.current(state)

    @router.post("/options")
    async def set_options(changes: dict[str, Any]) -> None:
        await state.run("options", lambda: options.apply(state, changes))

    @router.post("/unload-checkpoint")
    async def unload_checkpoint() -> dict:
        state.remember_model()
        await state.run("unload", state.engine.unload)
        return {}

    @router.post("/reload-checkpoint")
    async def reload_checkpoint() -> dict:
        await state.run("reload", lambda: checkpoints.ensure_model(state, None))
        return {}

    @router.post("/refresh-checkpoints")
    def refresh_checkpoints() -> None:
        """Checkpoints are discovered on every listing: nothing to refresh."""

    @router.post("/refresh-loras")
    def refresh_loras() -> None:
        """LoRAs are listed from the folder on every request: nothing to refresh."""


def _listings(router: APIRouter, state: ApiState) -> None:
    ctx = state.ctx

    @router.get("/sd-models", response_model=list[SDModelItem])
    def sd_models() -> list[dict]:
        return checkpoints.sd_models(ctx.settings, state.engine.snapshot(wait_for_hash=True))

    @router.get("/loras", response_model=list[LoraItem])
    def loras() -> list[dict]:
        return listings.loras(ctx)

    @router.get("/samplers", response_model=list[SamplerItem])
    def samplers() -> list[dict]:
        return listings.samplers()

    @router.get("/schedulers", response_model=list[SchedulerItem])
    def schedulers() -> list[dict]:
        return listings.schedulers()

    @router.get("/embeddings", response_model=EmbeddingsResponse)
    def embeddings() -> dict:
        return listings.embeddings(ctx)

    @router.get("/memory", response_model=MemoryResponse)
    def memory() -> dict:
        return listings.memory(state.engine.snapshot().device)

    _probed_by_clients(router)


def _probed_by_clients(router: APIRouter) -> None:
    """Lists clients ask for while setting up (SillyTavern, `webuiapi`, Krita's hires and upscaler menus)."""
    @router.get("/upscalers", response_model=list[UpscalerItem])
    def upscalers() -> list[dict]:
        """The hires fix's pixel resamplers, as A1111 lists its upscalers ("None" first)."""
        return [{"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": None}
                for name in ("None", *PIXEL_UPSCALERS)]

    @router.get("/latent-upscale-modes")
    def latent_upscale_modes() -> list[dict]:
        return [{"name": name} for name in LATENT_UPSCALERS]

    @router.get("/sd-vae")
    def sd_vae() -> list[dict]:
        return []

    @router.get("/scripts", response_model=ScriptsList)
    def scripts() -> dict:
        return {"txt2img": [], "img2img": []}


def sdapi_router(state: ApiState, auth: BasicAuth) -> APIRouter:
    router = APIRouter(prefix="/sdapi/v1", route_class=A1111Route, dependencies=[Depends(auth)])
    _generation(router, state)
    _model_control(router, state)
    _listings(router, state)
    return router
