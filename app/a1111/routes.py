"""The `/sdapi/v1/...` routes: thin handlers over `txt2img`, `options`, `progress`, `pnginfo`, `listings`.

Handlers that change or use the model run in the API's lane (`ApiState.run`), so they reach the
engine one at a time, like every other caller, through its queue, each counted against its login's
quota and the logins taking turns; read-only lists run in the
thread pool; `progress`, `interrupt` and `skip` only read the snapshot or set a flag, so they
answer at once, even while a generation holds the engine.

Each request acts as its account (`ApiState.account`: its basic-auth login). Interrupt and Skip from
an admin act on whatever generation runs, the UI's too, as A1111's do; from any other login they
stop only that login's own API jobs. The engine-wide routes are an admin's only (403 naming that):
`unload-checkpoint`, `reload-checkpoint`, and `POST /options` of `steady_dtype`/`steady_offload`.
The refresh routes change nothing and stay open.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.a1111 import (
    checkpoints,
    controlnet,
    extras,
    img2img,
    listings,
    options,
    pnginfo,
    progress,
    sd_upscale,
    txt2img,
)
from app.a1111.errors import A1111Route
from app.a1111.schema import (
    EmbeddingsResponse,
    ExtrasBatchImagesRequest,
    ExtrasBatchImagesResponse,
    ExtrasSingleImageRequest,
    ExtrasSingleImageResponse,
    FreeDict,
    ImageToImageResponse,
    Img2ImgRequest,
    LoraItem,
    MemoryResponse,
    PNGInfoRequest,
    PNGInfoResponse,
    ProgressResponse,
    PromptStyleItem,
    SamplerItem,
    SchedulerItem,
    ScriptsList,
    SDModelItem,
    TextToImageResponse,
    Txt2ImgRequest,
    UpscalerItem,
)
from app.a1111.state import ApiState, owner_of
from app.accounts import Account, require_admin
from app.engine.stage_params import LATENT_UPSCALERS


def _refuse_bad_input(req: Txt2ImgRequest, state: ApiState, account: Account) -> None:
    """Check the numbers (and the hires fix's) before the request waits in the lane or switches a checkpoint."""
    family_name = state.engine.snapshot().family
    txt2img.plan(req, family_name, state.ctx.styles_for(account), state.clip_skip(account))
    if isinstance(req, Img2ImgRequest):
        img2img.script_args(state, req)
    txt2img.hires(req, family_name)
    controlnet.request_units(req.alwayson_scripts, state.ctx.settings)  # a unit the app cannot run: 422 now
    if req.restore_faces:  # a face model must be in models/GFPGAN or models/Codeformer now (never downloaded)
        state.engine.check_face_restorer()
    if req.enable_hr:  # a model upscaler must be in a folder now
        state.engine.check_upscaler(req.hr_upscaler or "Latent", hires=True)


def _generation(router: APIRouter, state: ApiState) -> None:
    @router.post("/txt2img", response_model=TextToImageResponse)
    async def text2img(req: Txt2ImgRequest, request: Request) -> dict:
        account = state.account(request)
        _refuse_bad_input(req, state, account)
        return await state.run("txt2img", lambda: txt2img.run(state, req, account), account)

    @router.post("/img2img", response_model=ImageToImageResponse)
    async def image2img(req: Img2ImgRequest, request: Request) -> dict:
        account = state.account(request)
        _refuse_bad_input(req, state, account)
        return await state.run("img2img", lambda: img2img.run(state, req, account), account)

    @router.post("/extra-single-image", response_model=ExtrasSingleImageResponse)
    async def extra_single_image(req: ExtrasSingleImageRequest, request: Request) -> dict:
        extras.params(req)  # refuse bad numbers before the request waits in the lane
        account = state.account(request)
        return await state.run("extras", lambda: extras.single(state, req, account), account)

    @router.post("/extra-batch-images", response_model=ExtrasBatchImagesResponse)
    async def extra_batch_images(req: ExtrasBatchImagesRequest, request: Request) -> dict:
        extras.params(req)
        account = state.account(request)
        return await state.run("extras", lambda: extras.batch(state, req, account), account)

    @router.post("/png-info", response_model=PNGInfoResponse)
    def png_info(req: PNGInfoRequest) -> dict:
        return pnginfo.png_info(req.image)

    @router.get("/progress", response_model=ProgressResponse)
    async def get_progress(skip_current_image: bool = False) -> dict:
        return progress.progress(state, skip_current_image)

    def whose(request: Request) -> str | None:
        """Whatever runs for an admin (A1111's way); the account's own API jobs for anyone else."""
        account = state.account(request)
        return None if account.admin else owner_of(account)

    @router.post("/interrupt")
    async def interrupt(request: Request) -> dict:
        state.engine.interrupt(keep_partial=True, owner=whose(request))
        state.job.interrupted = True  # until the next API job begins, as A1111's flag
        return {}

    @router.post("/skip")
    async def skip(request: Request) -> None:
        state.engine.skip(owner=whose(request))
        state.job.skipped = True


def _model_control(router: APIRouter, state: ApiState) -> None:
    @router.get("/options")
    def get_options(request: Request) -> dict:  # not async: with no model loaded it lists the checkpoint folder
        return options.current(state, state.account(request))

    @router.post("/options")
    async def set_options(changes: FreeDict, request: Request) -> None:
        account = state.account(request)
        await state.run("options", lambda: options.apply(state, changes, account), account)

    @router.post("/unload-checkpoint")
    async def unload_checkpoint(request: Request) -> dict:
        account = require_admin(state.account(request), "unload-checkpoint")
        state.remember_model()
        await state.run("unload", state.engine.unload, account)
        return {}

    @router.post("/reload-checkpoint")
    async def reload_checkpoint(request: Request) -> dict:
        account = require_admin(state.account(request), "reload-checkpoint")
        await state.run("reload", lambda: checkpoints.ensure_model(state, None, account), account)
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

    @router.get("/prompt-styles", response_model=list[PromptStyleItem])
    def prompt_styles(request: Request) -> list[dict]:
        """The shared styles and the account's own (its own winning on a name)."""
        return [style._asdict() for style in ctx.styles_for(state.account(request)).read().values()]

    @router.get("/embeddings", response_model=EmbeddingsResponse)
    def embeddings() -> dict:
        return listings.embeddings(ctx)

    @router.get("/memory", response_model=MemoryResponse)
    def memory() -> dict:
        return listings.memory(state.engine.snapshot().device)

    _probed_by_clients(router, state)


def _probed_by_clients(router: APIRouter, state: ApiState) -> None:
    """Lists clients ask for while setting up (SillyTavern, `webuiapi`, Krita's hires and upscaler menus)."""
    @router.get("/upscalers", response_model=list[UpscalerItem])
    def upscalers() -> list[dict]:
        """"None", the resamplers and the upscaler model files, as A1111 lists its upscalers."""
        return extras.upscalers(state)

    @router.get("/latent-upscale-modes")
    def latent_upscale_modes() -> list[dict]:
        return [{"name": name} for name in LATENT_UPSCALERS]

    @router.get("/sd-vae")
    def sd_vae() -> list[dict]:
        return []

    @router.get("/scripts", response_model=ScriptsList)
    def scripts() -> dict:
        return {"txt2img": [], "img2img": [sd_upscale.TITLE]}

    @router.get("/cmd-flags")
    def cmd_flags() -> dict:
        return listings.cmd_flags(state.ctx.settings)

    @router.get("/hypernetworks")
    def hypernetworks() -> list[dict]:
        """A1111's hypernetworks (`models/hypernetworks`) are a network kind this app does not load: none."""
        return []

    @router.get("/face-restorers")
    def face_restorers() -> list[dict]:
        return listings.face_restorers(state.ctx.settings)

    @router.get("/realesrgan-models")
    def realesrgan_models() -> list[dict]:
        return extras.realesrgan_models(state)


def sdapi_router(state: ApiState) -> APIRouter:
    """The routes; their login is checked by the request guard before a body is read (`auth`)."""
    router = APIRouter(prefix="/sdapi/v1", route_class=A1111Route)
    _generation(router, state)
    _model_control(router, state)
    _listings(router, state)
    return router
