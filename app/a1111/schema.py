"""Request and response bodies with A1111's field names, types and defaults (its `modules/api/models.py`).

A1111 builds its txt2img model from the processing class's constructor, so every field is
optional and the defaults are the constructor's: `steps` 50, `cfg_scale` 7, 512×512,
`sampler_index` "Euler". They are spelled out here instead of generated, so a reader sees them.
Unknown fields are ignored as A1111 ignores them: SillyTavern, for one, sends its own keys along.
Fields this app cannot honour are accepted and then checked by `app.a1111.txt2img`, which refuses
the ones that would change the picture and ignores the rest (see the README).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from app.engine.generate import LIMITS, MAX_PROMPT_CHARS

# Every field's shape is bounded, so that refusing a hostile body is cheap and its answer small:
# pydantic checks a list's or dict's length before its items, so a million `{}` in `styles` is one
# error, found at once. Prompts may run past the engine's own cap (which refuses them with its own
# message) but not without end; names are short; a free-form dict (`override_settings`, scripts)
# holds few entries and nests only a few levels.
MAX_NAME_CHARS = 1024
MAX_ITEMS = 64
MAX_DEPTH = 8
Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
Prompt = Annotated[str, StringConstraints(max_length=4 * MAX_PROMPT_CHARS)]


def _shallow(value: Any, depth: int = 0) -> Any:
    """Refuse JSON nested deeper than `MAX_DEPTH` levels below a field."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        _shallow(child, depth + 1)
    return value


Free = Annotated[Any, AfterValidator(_shallow)]
FreeDict = Annotated[dict[Name, Free], Field(max_length=MAX_ITEMS)]
Images = Annotated[list[str], Field(max_length=int(LIMITS["batch"].high))]  # one per image of a batch at most


class Txt2ImgRequest(BaseModel):
    """`POST /sdapi/v1/txt2img`."""

    prompt: Prompt | None = ""
    negative_prompt: Prompt | None = ""
    styles: Annotated[list[Name], Field(max_length=MAX_ITEMS)] | None = None
    seed: int | None = -1
    subseed: int | None = -1
    subseed_strength: float | None = 0
    seed_resize_from_h: int | None = -1
    seed_resize_from_w: int | None = -1
    sampler_name: Name | None = None
    scheduler: Name | None = None
    batch_size: int | None = 1
    n_iter: int | None = 1
    steps: int | None = 50
    cfg_scale: float | None = 7.0
    width: int | None = 512
    height: int | None = 512
    restore_faces: bool | None = None
    tiling: bool | None = None
    do_not_save_samples: bool | None = False
    do_not_save_grid: bool | None = False
    eta: float | None = None
    denoising_strength: float | None = 0.75
    s_min_uncond: float | None = None
    s_churn: float | None = None
    s_tmax: float | None = None
    s_tmin: float | None = None
    s_noise: float | None = None
    override_settings: FreeDict | None = None
    override_settings_restore_afterwards: bool | None = True
    refiner_checkpoint: Name | None = None
    refiner_switch_at: float | None = None
    disable_extra_networks: bool | None = False
    firstpass_image: str | None = None
    comments: FreeDict | None = None
    enable_hr: bool | None = False
    firstphase_width: int | None = 0
    firstphase_height: int | None = 0
    hr_scale: float | None = 2.0
    hr_upscaler: Name | None = None
    hr_second_pass_steps: int | None = 0
    hr_resize_x: int | None = 0
    hr_resize_y: int | None = 0
    hr_checkpoint_name: Name | None = None
    hr_sampler_name: Name | None = None
    hr_scheduler: Name | None = None
    hr_prompt: Prompt | None = ""
    hr_negative_prompt: Prompt | None = ""
    force_task_id: Name | None = None
    sampler_index: Name | None = "Euler"
    script_name: Name | None = None
    script_args: Annotated[list[Free], Field(max_length=MAX_ITEMS)] | None = Field(default_factory=list)
    send_images: bool | None = True
    save_images: bool | None = False
    alwayson_scripts: FreeDict | None = Field(default_factory=dict)
    infotext: Prompt | None = None

    def echoed(self) -> dict:
        """The request as the answer's `parameters` carries it back."""
        return self.model_dump()


class Img2ImgRequest(Txt2ImgRequest):
    """`POST /sdapi/v1/img2img`: txt2img's fields plus A1111's img2img ones, with its defaults."""

    init_images: Images | None = None
    resize_mode: int | None = 0
    image_cfg_scale: float | None = None
    mask: str | None = None
    mask_blur_x: int | None = 4
    mask_blur_y: int | None = 4
    mask_blur: int | None = None
    mask_round: bool | None = True
    inpainting_fill: int | None = 0
    inpaint_full_res: bool | None = True
    inpaint_full_res_padding: int | None = 0
    inpainting_mask_invert: int | None = 0
    initial_noise_multiplier: float | None = None
    latent_mask: str | None = None
    include_init_images: bool | None = False
    # Ours (A1111 has no such model): `init_images` are reference pictures a model whose family takes them edits
    # from or combines, at the request's size; `denoising_strength`, `resize_mode` and `mask` are not used.
    reference_images: bool | None = False

    def echoed(self) -> dict:
        """As A1111: the pictures sent (init images, mask) come back only with `include_init_images`."""
        if self.include_init_images:
            return self.model_dump()
        return self.model_dump(exclude={"init_images", "mask"}) | {"init_images": None, "mask": None}


class TextToImageResponse(BaseModel):
    images: list[str] | None = Field(default=None, description="The generated images, base64 PNG with infotext")
    parameters: dict
    info: str


class ImageToImageResponse(TextToImageResponse):
    pass


class PNGInfoRequest(BaseModel):
    image: str = Field(description="The base64 encoded PNG image (a data: URL works too)")


class PNGInfoResponse(BaseModel):
    info: str
    items: dict
    parameters: dict


class ProgressResponse(BaseModel):
    progress: float
    eta_relative: float
    state: dict
    current_image: str | None = None
    textinfo: str | None = None


class PromptStyleItem(BaseModel):
    name: str
    prompt: str | None
    negative_prompt: str | None


class SamplerItem(BaseModel):
    name: str
    aliases: list[str]
    options: dict[str, Any]


class SchedulerItem(BaseModel):
    name: str
    label: str
    aliases: list[str] | None
    default_rho: float | None
    need_inner_model: bool | None


class SDModelItem(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    title: str
    model_name: str
    hash: str | None
    sha256: str | None
    filename: str
    config: str | None


class LoraItem(BaseModel):
    name: str
    alias: str
    path: str
    metadata: dict[str, Any]


class EmbeddingItem(BaseModel):
    step: int | None
    sd_checkpoint: str | None
    sd_checkpoint_name: str | None
    shape: int
    vectors: int


class EmbeddingsResponse(BaseModel):
    loaded: dict[str, EmbeddingItem]
    skipped: dict[str, EmbeddingItem]


class MemoryResponse(BaseModel):
    ram: dict
    cuda: dict


class UpscalerItem(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    name: str
    model_name: str | None
    model_path: str | None
    model_url: str | None
    scale: float | None


class ScriptsList(BaseModel):
    txt2img: list | None = None
    img2img: list | None = None


class ExtrasBaseRequest(BaseModel):
    """A1111's Extras fields (`/extra-single-image`, `/extra-batch-images`): `resize_mode` 0 scales by
    `upscaling_resize`, 1 to `upscaling_resize_w/h` (cropped with `upscaling_crop`)."""

    resize_mode: int | None = 0
    show_extras_results: bool | None = True
    gfpgan_visibility: float | None = 0
    codeformer_visibility: float | None = 0
    codeformer_weight: float | None = 0
    upscaling_resize: float | None = 2
    upscaling_resize_w: int | None = 512
    upscaling_resize_h: int | None = 512
    upscaling_crop: bool | None = True
    upscaler_1: Name | None = "None"
    upscaler_2: Name | None = "None"
    extras_upscaler_2_visibility: float | None = 0
    upscale_first: bool | None = False


class ExtrasSingleImageRequest(ExtrasBaseRequest):
    image: str = Field(default="", description="The base64 encoded image (a data: URL works too)")


class ExtrasSingleImageResponse(BaseModel):
    html_info: str
    image: str | None = None


class FileData(BaseModel):
    data: str = Field(description="The base64 encoded image")
    name: Name = ""


class ExtrasBatchImagesRequest(ExtrasBaseRequest):
    # At most a batch's worth per request: the API's image decoder caps the pixels of a request too.
    imageList: Annotated[list[FileData], Field(max_length=int(LIMITS["batch"].high))] = Field(  # noqa: N815
        default_factory=list)  # A1111's field name


class ExtrasBatchImagesResponse(BaseModel):
    html_info: str
    images: list[str]
