"""`POST /sdapi/v1/txt2img`: an A1111 request -> the UI's `GenerateParams` -> the engine -> A1111's answer.

The numbers go through `params_from_form`, the rule set the UI uses, so the API has the UI's limits (steps 1–150,
sizes 64–2048 rounded down to the family's multiple, the prompt and pixel-step caps) and its messages. `<lora:…>`
tags in the prompt apply to this request only, as the engine does for the UI; `enable_hr` runs the engine's hires
fix (`hr_*` fields); `subseed`, `subseed_strength` and `seed_resize_from_w/h` are A1111's variation seed; `styles`
names saved styles (the shared `styles.csv` and the account's own, applied as A1111 applies them);
`refiner_checkpoint` (a checkpoint's name or title) finishes the image after `refiner_switch_at` (default 0.8);
`alwayson_scripts.controlnet` units (`app.a1111.controlnet`) go on the parameters as `controlnet_units`, and
`alwayson_scripts.ADetailer` runs the detail passes after the image (`details`); other always-on scripts are
refused; `override_settings` `steady_step_cache` (ours) is the step cache's threshold for the request
(`app/engine/step_cache.py`, 0 or absent: off). Features this app does not have (hires to a fixed size, scripts
on txt2img, infotext-filled requests) are refused with a 422 that names them instead of silently producing a
different picture; sampler tuning (`eta`, `s_churn` …) and saving switches are ignored. Images always go to the
outputs folder too, as the engine saves every image it makes."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, PngImagePlugin

from app.a1111 import checkpoints, controlnet
from app.a1111.errors import ApiError
from app.a1111.options import CLIP_SKIP, OVERRIDABLE, STEP_CACHE, unsupported_overrides
from app.a1111.schema import Txt2ImgRequest
from app.a1111.state import ApiState, owner_of
from app.accounts import LOCAL_ACCOUNT, Account
from app.controlnet.units import with_units
from app.detailer import passes, units
from app.detailer.detect import DetectorLibrary
from app.engine.desired import Desired
from app.engine.detailing import DetailParams
from app.engine.generate import SCHEDULERS, GeneratedImage, GenerateParams, params_from_form
from app.engine.stage_params import SAME, HiresParams
from app.families import family
from app.infotext import parse_infotext
from app.report import app_version
from app.styles import StyleBook

log = logging.getLogger(__name__)
# A1111's names for the samplers we share with it (`/sdapi/v1/samplers` lists them as aliases).
SAMPLER_ALIASES: dict[str, list[str]] = {
    "Euler": ["k_euler"], "Euler a": ["k_euler_a", "k_euler_ancestral"], "DPM++ 2M": ["k_dpmpp_2m"],
    "DPM++ 2M Karras": ["k_dpmpp_2m_ka"], "DDIM": ["ddim"], "UniPC": ["unipc"], "PLMS": ["plms"],
}
KARRAS = " Karras"
SCHEDULES = ("automatic", "karras")  # A1111 schedule types this app can honour
# (field, what it asks for): a request setting one of these to a true value is refused.
UNSUPPORTED = (("hr_resize_x", "hires fix to a fixed size (hr_resize_x/y; use hr_scale)"),
               ("hr_resize_y", "hires fix to a fixed size (hr_resize_x/y; use hr_scale)"),
               ("hr_checkpoint_name", "another checkpoint for the hires pass"),
               ("firstpass_image", "a first-pass image"),
               ("infotext", "filling the request from infotext (send the fields instead)"))


# The always-on scripts (A1111's extension titles, matched without case) this app runs; others are refused.
ALWAYSON = ("adetailer", controlnet.SCRIPT_TITLE)


def details(state: ApiState, req: Txt2ImgRequest) -> DetailParams | None:
    """ADetailer's `alwayson_scripts.ADetailer.args` as the engine's detail passes (None: not asked or not
    enabled); a bad unit or detector is refused (422) with the `ad_*` key or the file named."""
    asked = units.from_alwayson(req.alwayson_scripts)
    if asked is None or not asked.enabled:
        return None
    return passes.detail_params(asked.units, DetectorLibrary(state.ctx.settings.adetailer_dir), asked.skip_img2img)


def sampler_for(name: str | None, schedule: str | None, family_name: str | None) -> tuple[str, str | None]:
    """Our sampler for A1111's sampler (name or alias, any case) and schedule type on the loaded
    family (`family_name`; any family's with none loaded), and a note when the family has no exact counterpart and runs
    its nearest one instead (`Sampling.nearest_samplers`); 400 if there is neither."""
    fam = family(family_name) if family_name else None
    ours = fam.sampling.samplers if fam else SCHEDULERS
    known = {n: n for n in ours} | (dict(fam.sampling.nearest_samplers) if fam else {})
    lookup = {n.lower(): n for n in known}
    lookup |= {alias: n for n, aliases in SAMPLER_ALIASES.items() if n in known for alias in aliases}
    asked = lookup.get((name or "Euler").strip().lower())
    if asked is None:
        raise ApiError(400, f"Sampler not found: {name!r}; choose one of {', '.join(ours)} "
                            "(GET /sdapi/v1/samplers)")
    base = known[asked]
    note = None if base == asked else f"sampler {asked}: {fam.label} has no such sampler; ran {base}, its nearest"
    kind = (schedule or "automatic").strip().lower()
    if kind not in SCHEDULES:
        raise ApiError(400, f"Scheduler not found: {schedule!r}; this app has {', '.join(SCHEDULES)}")
    if kind == "automatic" or base.endswith(KARRAS):
        return base, note
    if base + KARRAS in ours:
        return base + KARRAS, note
    with_karras = [n.removesuffix(KARRAS) for n in ours if n.endswith(KARRAS)]
    raise ApiError(400, f"sampler {base} has no Karras schedule here; Karras works with {', '.join(with_karras)}")


def field_value(req: Txt2ImgRequest, field: str) -> Any:
    """The field as sent, or A1111's default where a client sent null."""
    value = getattr(req, field)
    return type(req).model_fields[field].get_default(call_default_factory=True) if value is None else value


def plan(req: Txt2ImgRequest, family_name: str | None, book: StyleBook,
         clip_skip: int = 1) -> tuple[GenerateParams, tuple[str, ...]]:
    """The engine's parameters and notes (rounding, a cut prompt); refuses unsupported features and
    out-of-range values. `styles` (names in the account's `book`) are applied to the prompts as A1111
    applies them; `clip_skip` is the account's option, which `override_settings` may override."""
    asked = list(dict.fromkeys(what for field, what in UNSUPPORTED if getattr(req, field)))
    others = [name for name in req.alwayson_scripts or {} if name.lower() not in ALWAYSON]
    asked += [f"the always-on script {name!r}" for name in others]
    if asked:
        raise ApiError(422, f"not supported by this app: {', '.join(asked)}")
    if req.script_name and type(req) is Txt2ImgRequest:
        raise ApiError(422, f"script {req.script_name!r} not found: txt2img has no scripts here (img2img has "
                            "\"SD upscale\")")
    fields = {"prompt": "prompt", "negative_prompt": "negative_prompt", "steps": "steps", "cfg": "cfg_scale",
              "seed": "seed", "width": "width", "height": "height", "batch": "batch_size", "n_iter": "n_iter",
              "subseed": "subseed", "subseed_strength": "subseed_strength"}
    values = {ours: field_value(req, theirs) for ours, theirs in fields.items()}
    values["prompt"], values["negative_prompt"] = book.apply(req.styles or [], values["prompt"],
                                                             values["negative_prompt"])
    for field in ("seed_resize_from_w", "seed_resize_from_h"):  # A1111 sends -1 for "off"; ours is 0
        value = field_value(req, field)
        values[field] = 0 if isinstance(value, int) and value < 0 else value
    if req.refiner_switch_at is not None:
        values["refiner_switch_at"] = req.refiner_switch_at
    values["sampler"], stand_in = sampler_for(req.sampler_name or req.sampler_index, req.scheduler, family_name)
    hires_stand_in = sampler_for(req.hr_sampler_name, req.hr_scheduler, family_name)[1] \
        if req.enable_hr and req.hr_sampler_name else None
    values["clip_skip"] = (req.override_settings or {}).get(CLIP_SKIP, clip_skip)
    values["step_cache"] = (req.override_settings or {}).get(STEP_CACHE, 0)
    values["tiling"] = bool(req.tiling)
    values["restore_faces"] = bool(req.restore_faces)
    params, notes = params_from_form(values, family_name)
    stand_ins = [stand_in, hires_stand_in and f"hires pass: {hires_stand_in}"]
    return params, (*(note for note in stand_ins if note), *notes)


def hires(req: Txt2ImgRequest, family_name: str | None) -> HiresParams | None:
    """A1111's `enable_hr` fields as the engine's hires fix (None when not asked for); a bad value is
    refused (422, `errors`) with the range, like every other field."""
    if not req.enable_hr:
        return None
    sampler = sampler_for(req.hr_sampler_name, req.hr_scheduler, family_name)[0] if req.hr_sampler_name else SAME
    return HiresParams(scale=field_value(req, "hr_scale"), upscaler=req.hr_upscaler or "Latent",
                       steps=field_value(req, "hr_second_pass_steps"),
                       denoising_strength=field_value(req, "denoising_strength"),
                       sampler=sampler,
                       prompt=field_value(req, "hr_prompt"), negative_prompt=field_value(req, "hr_negative_prompt"))


def desired_for(state: ApiState, model: str, account: Account) -> Desired:
    """The whole state an API generation of `account` carries: `model`, the engine-wide dtype, offload and
    storage, and no LoRA but its prompt's tags, as in A1111."""
    return state.ctx.desired_for(owner_of(account)).replace(model=model, loras=())


def asked_checkpoint(state: ApiState, req: Txt2ImgRequest) -> str | None:
    asked = (req.override_settings or {}).get(OVERRIDABLE)
    if asked is None:
        return None
    return checkpoints.resolve(state.ctx.settings, state.engine.snapshot(wait_for_hash=True), asked)


@dataclass(frozen=True)
class Outcome:
    """A generation and the checkpoint it ran on (read before any restore loads another one)."""

    params: GenerateParams
    images: list[GeneratedImage]
    model: str | None
    model_hash: str | None
    styles: tuple[str, ...] = ()  # the styles applied to the prompts (A1111's `styles` field)


def run(state: ApiState, req: Txt2ImgRequest, account: Account = LOCAL_ACCOUNT,
        produce: Callable[[GenerateParams, Desired], list[GeneratedImage]] | None = None,
        notes: tuple[str, ...] = ()) -> dict:
    """The whole request of `account` (default: the local user of an app without logins), blocking (run it
    in the API's lane): checkpoint, generation, restore, answer. `produce` makes the images from the checked
    parameters and the state they carry (default: txt2img, with hires fix when asked; img2img passes its
    own); `notes` go to the answer's comments."""
    wanted = asked_checkpoint(state, req)
    units = controlnet.request_units(req.alwayson_scripts, state.ctx.settings)
    notes = [*notes, *unsupported_overrides(state.ctx.settings, req.override_settings or {})]
    produce = produce or (lambda params, desired: state.engine.generate(
        params, owner=owner_of(account), hires=hires(req, checkpoints.family_of_model(state, desired.model)),
        desired=desired, details=details(state, req)))

    def generate(model: str) -> Outcome:
        params, rounding = plan(req, checkpoints.family_of_model(state, model), state.ctx.styles_for(account),
                                state.clip_skip(account))
        if req.refiner_checkpoint not in (None, "", "None", "none"):  # A1111's spellings of "no refiner"
            params = dataclasses.replace(params, refiner_checkpoint=checkpoints.resolve(
                state.ctx.settings, state.engine.snapshot(), req.refiner_checkpoint))
        params = with_units(params, units)
        notes.extend(rounding)
        images = produce(params, desired_for(state, model, account))
        ran = parse_infotext(images[0].infotext).settings if images else {}
        snap = state.engine.snapshot(wait_for_hash=True)
        return Outcome(params, images, model, ran.get("Model hash", snap.model_hash if snap.model == model else None),
                       tuple(req.styles or ()))

    outcome, restore_notes = checkpoints.with_checkpoint(
        state, wanted, field_value(req, "override_settings_restore_afterwards"), generate, account)
    sent = field_value(req, "send_images")
    images = [saved_png(im.path, im.image, im.infotext) for im in outcome.images] if sent else []
    return {"images": images, "parameters": req.echoed(),
            "info": info_json(state, outcome, notes + restore_notes)}


def saved_png(path: Path | None, image: Image.Image, infotext: str, chunks: Mapping[str, str] | None = None) -> str:
    """Base64 of the PNG the engine saved at `path` (the same pixels and text chunks `encode_png` writes), else
    encoded here. Why: a PNG encode costs ~120 ms of CPU per 1024² image, and the engine already spent it when
    it saved the picture; encoding it again for the answer made every API image pay twice."""
    if path is not None:
        try:
            return base64.b64encode(path.read_bytes()).decode("ascii")
        except OSError as exc:  # deleted or moved since it was saved: the answer is still due
            log.warning("re-encoding %s for the answer: %s", path.name, exc)
    return encode_png(image, infotext, chunks)


def encode_png(image: Image.Image, infotext: str, chunks: Mapping[str, str] | None = None) -> str:
    """Base64 PNG carrying the infotext in its `parameters` chunk, as A1111 sends images (`chunks`: the
    text chunks to carry instead, as Extras sends its postprocessing text beside the source's)."""
    meta = PngImagePlugin.PngInfo()
    for key, value in ({"parameters": infotext} if chunks is None else chunks).items():
        meta.add_text(key, value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=meta)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _denoising(images: list[GeneratedImage]) -> float | None:
    """The denoising strength the engine wrote into the first image's infotext (img2img, hires fix)."""
    value = parse_infotext(images[0].infotext).settings.get("Denoising strength") if images else None
    return None if value is None else float(value)


def _stop_notes(images: list[GeneratedImage]) -> list[str]:
    """Where an Interrupt or Skip cut an image short (A1111 says only `interrupted`)."""
    return [f"seed {im.seed}: stopped at step {im.stopped_at} of its pass" for im in images if not im.complete]


def info_json(state: ApiState, outcome: Outcome, notes: list[str]) -> str:
    """A1111's `info`: the JSON of its `Processed` object, with the keys clients read."""
    params, images = outcome.params, outcome.images
    notes = [*notes, *_stop_notes(images), *(note for im in images for note in im.notes)]
    seeds = [im.seed for im in images]
    subseeds = [-1 if im.subseed is None else im.subseed for im in images]
    count = len(images)
    info = {
        "prompt": params.prompt, "all_prompts": [params.prompt] * count,
        "negative_prompt": params.negative_prompt, "all_negative_prompts": [params.negative_prompt] * count,
        "seed": seeds[0] if seeds else params.seed, "all_seeds": seeds,
        "subseed": subseeds[0] if subseeds else params.subseed, "all_subseeds": subseeds,
        "subseed_strength": params.subseed_strength,
        "width": params.width, "height": params.height, "sampler_name": params.sampler, "cfg_scale": params.cfg,
        "steps": params.steps, "batch_size": params.batch, "restore_faces": params.restore_faces,
        "face_restoration_model": None,
        "sd_model_name": checkpoints.model_name(outcome.model or ""), "sd_model_hash": outcome.model_hash,
        "sd_vae_name": None, "sd_vae_hash": None, "seed_resize_from_w": params.seed_resize_from_w or -1,
        "seed_resize_from_h": params.seed_resize_from_h or -1,
        "denoising_strength": _denoising(images), "extra_generation_params": {}, "index_of_first_image": 0,
        "infotexts": [im.infotext for im in images], "styles": list(outcome.styles),
        "job_timestamp": state.job.timestamp,
        "clip_skip": params.clip_skip, "is_using_inpainting_conditioning": False, "version": app_version(),
        "comments": "\n".join(notes), "interrupted": any(not im.complete for im in images),
    }
    return json.dumps(info)
