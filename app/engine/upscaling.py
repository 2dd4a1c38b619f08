"""Upscaler models on the engine: the Extras upscale, and the hires fix's upscale with a model.

`Upscaling` is a part of `Engine` (its base class), as `Workflows` is. An Extras request is one
queued command; each image is a transition of its own (`upscale`), so the upscaler's placement is
verified and repaired before and after it like every other component's, and its history row says
what ran. The model is loaded by name on first use (`UpscalerSlot.ensure`), runs tile by tile with
progress, and Interrupt (or Skip: this image only) stops it between two tiles.

Names: the resamplers `Lanczos` and `Nearest`, and every model file found (`UpscalerLibrary`);
`None` (Extras) leaves the image as it is. A factor beyond the model's scale runs it again, as A1111
does (`tiling.upscale_by`); Lanczos brings the result to the exact size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from app.detailer.detect import BUILTIN_FACE, DetectorLibrary
from app.engine import generate, job_memory
from app.engine.generating import Job
from app.engine.snapshot import EngineState, Snapshot
from app.engine.stage_params import LATENT_UPSCALERS, PIXEL_UPSCALERS
from app.upscalers import faces
from app.upscalers.extras import NONE, ExtrasParams
from app.upscalers.face_paste import restore_faces
from app.upscalers.tiling import Tiling, UpscaleStopped, upscale_by

EXTRAS_FOLDER = "extras-images"  # under the outputs folder, as A1111 names it
FACE_CONFIDENCE = 0.3  # the built-in face detector's threshold: ADetailer's default, which it is tuned for


@dataclass(frozen=True)
class UpscaledImage:
    """One Extras result: the image, A1111's postprocessing text, where it was saved, and the PNG text
    chunks it was saved with (the source's `parameters`, `postprocessing`, `extras`)."""

    image: Image.Image
    infotext: str
    path: Path | None = None
    chunks: Mapping[str, str] = field(default_factory=dict)


class Upscaling:
    """Upscaler models of `Engine` (see the module docstring)."""

    tiling = Tiling()  # tile and overlap, in input pixels

    @property
    def upscaler_slot(self):
        """The live upscaler component, for tests. Not for the UI."""
        return self._upscaler

    def hires_upscalers(self) -> list[str]:
        """What the hires fix takes: A1111's latent modes, the resamplers, the model files found now."""
        return [*LATENT_UPSCALERS, *PIXEL_UPSCALERS, *self.upscalers.names()]

    def extras_upscalers(self) -> list[str]:
        """What Extras takes, as A1111 lists its upscalers: `None` first, then resamplers and models."""
        return [NONE, *PIXEL_UPSCALERS, *self.upscalers.names()]

    def check_upscaler(self, name: str, *, hires: bool = False) -> None:
        """Refuse, before anything is queued, a name the hires fix (or Extras) does not take, listing those
        it does: a model file must be in an upscaler folder now."""
        choices = self.hires_upscalers() if hires else self.extras_upscalers()
        if name not in choices:
            what = "hires upscaler" if hires else "upscaler"
            raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(choices)}")

    @property
    def tile_side(self) -> int:
        """The side of one tile the upscaler runs, its context included (input pixels)."""
        return self.tiling.tile + 2 * self.tiling.overlap

    def upscaler_scale(self, name: str) -> int:
        """The scale of upscaler model `name` as known before it runs: the loaded one's, else the usual
        `job_memory.ASSUMED_UPSCALER_SCALE` (`_upscale_image` checks the budget again once it is loaded)."""
        facts = self._upscaler.facts()
        return facts.scale if facts is not None and facts.name == name else job_memory.ASSUMED_UPSCALER_SCALE

    def check_face_restorer(self, folders: tuple[str, ...] = faces.FACE_FOLDERS) -> faces.FaceModel:
        """The face-restoration model `restore_faces` would run, or `FaceModelError` naming the folders."""
        return faces.first_model(self.upscalers.models_dir, folders)

    def unload_upscaler(self) -> Snapshot:
        """Drop the loaded upscaler and face-restoration models and give their memory back (each is read again at
        its next use)."""
        def unload() -> None:
            self._upscaler.unload()
            self._face_restorer.unload()
        return self._call("unload_upscaler", "", EngineState.MOVING, unload)

    def extras(self, images: Sequence[Image.Image], params: ExtrasParams, *,
               owner: str | None = None) -> list[UpscaledImage]:
        """A1111's Extras upscale of each image (single image or batch); each result saved to
        `outputs/extras-images` with the source's `parameters` kept and A1111's postprocessing text.
        Interrupt keeps the images finished before it; Skip drops the current one and goes on."""
        images = tuple(images)
        if not images or not all(isinstance(im, Image.Image) for im in images):
            raise ValueError("extras needs at least one image (PNG, JPEG or WebP)")
        for name in (params.upscaler, params.upscaler_2):
            self.check_upscaler(name)
        for folder, _visibility in params.face_passes():  # a face model must be there now (never downloaded)
            self.check_face_restorer((folder,))
        scales = {name: self.upscaler_scale(name) for name in (params.upscaler, params.upscaler_2)
                  if name != NONE and name not in PIXEL_UPSCALERS}  # the models' (factors checked in `extras`)
        job_memory.admit(self.memory_budget, job_memory.extras([im.size for im in images], params, scales,
                                                               self.tile_side))
        detail = f"{len(images)} image(s) {params.upscaler} {params.infotext().split(', ')[0]}"

        def body() -> list[UpscaledImage]:
            job = self._job = Job(owner)
            try:
                return self._extras_images(images, params, job)
            finally:
                self._job = None
        return self.submit("extras", detail, EngineState.GENERATING, body, record=False).result()

    # ------------------------------------------------------------------ worker side
    def _extras_images(self, images: tuple[Image.Image, ...], params: ExtrasParams, job: Job) -> list[UpscaledImage]:
        out = []
        for i, image in enumerate(images):
            phase = f"extras, image {i + 1}/{len(images)}"
            result = self._run_stage("upscale", f"{image.width}x{image.height} {params.upscaler}",
                                     EngineState.GENERATING, lambda im=image, p=phase: self._extras_one(im, params,
                                                                                                        job, p))
            if job.stop in ("interrupt", "drop"):
                return [] if job.stop == "drop" else out
            job.stop = None  # a Skip drops this image only
            if result is not None:
                out.append(self._save_extras(image, result, params, len(out)))
        return out

    def _extras_one(self, image: Image.Image, params: ExtrasParams, job: Job, phase: str) -> Image.Image | None:
        """One image through upscaler 1 (and 2, blended); None when stopped between tiles."""
        self._job = job  # each stage's transition ends by clearing it
        rgb = image.convert("RGB")
        upscaled = rgb if params.upscaler == NONE else self._extras_upscale(rgb, params, job, phase)
        for folder, visibility in params.face_passes() if upscaled is not None else ():
            upscaled = self._restore_faces(upscaled, visibility, (folder,))[0]
        return upscaled

    def _extras_upscale(self, rgb: Image.Image, params: ExtrasParams, job: Job, phase: str) -> Image.Image | None:
        factor = params.factor_for(rgb.size)
        first = self._upscale_image(rgb, params.upscaler, factor, job, phase)
        if first is None or not params.blends:
            return None if first is None else params.finish(first)
        second = self._upscale_image(rgb, params.upscaler_2, factor, job, f"{phase}, upscaler 2")
        if second is None:
            return None
        return params.finish(Image.blend(first, second, params.visibility_2))

    def _save_extras(self, source: Image.Image, image: Image.Image, params: ExtrasParams, index: int) -> UpscaledImage:
        text = params.infotext()
        chunks = {"postprocessing": text, "extras": text}
        if isinstance(source.info.get("parameters"), str):
            chunks = {"parameters": source.info["parameters"], **chunks}
        path = generate.save_png(image, text, self.settings.outputs_dir / EXTRAS_FOLDER, index, chunks=chunks,
                                 compress_level=self.settings.png_compress_level)
        return UpscaledImage(image, text, path, chunks)

    def _upscale_to(self, images: list[Image.Image], name: str, size: tuple[int, int], job: Job,
                    phase: str) -> list[Image.Image] | None:
        """A1111's `resize_image` with an upscaler model: each image upscaled by the larger ratio to
        `size`, then Lanczos to exactly `size`; None when stopped between tiles."""
        self._job = job
        out = []
        for i, image in enumerate(images):
            factor = max(size[0] / image.width, size[1] / image.height)
            done = self._upscale_image(image, name, factor, job, f"{phase}, image {i + 1}/{len(images)}") \
                if factor > 1 else image
            if done is None:
                return None
            out.append(done if done.size == size else done.resize(size, Image.Resampling.LANCZOS))
        return out

    def _upscale_image(self, image: Image.Image, name: str, factor: float, job: Job, phase: str) -> Image.Image | None:
        """`image` by `factor` with the resampler or model `name` (size rounded down to a multiple of 8)."""
        if name in PIXEL_UPSCALERS:
            target = (int(image.width * factor) // 8 * 8, int(image.height * factor) // 8 * 8)
            return image.resize(target, PIXEL_UPSCALERS[name])
        slot = self._upscaler
        slot.ensure(name, self.upscalers.path_for(name), self._desired.dtype, self._desired.offload)
        job_memory.admit(self.memory_budget, job_memory.peak(
            f"upscaling {image.width}x{image.height} by {factor:g} with {name}",
            [job_memory.upscale(image.size, factor, slot.scale, self.tile_side)]))

        def on_pass(i: int):
            def on_tile(done: int, total: int) -> bool:
                self._set_progress(f"upscaling with {name}, {phase}, pass {i + 1}", done, total)
                return job.stop is not None
            return on_tile

        try:
            return upscale_by(image, factor, slot.run_tile, slot.scale, self.tiling, on_pass)
        except UpscaleStopped:
            return None
        except torch.OutOfMemoryError as exc:
            raise MemoryError(f"out of GPU memory upscaling {image.width}x{image.height} with {name}: try an offload "
                              "mode (model, sequential) or a smaller tile") from exc
        finally:
            slot.settle()

    def _restore_faces(self, image: Image.Image, visibility: float = 1.0,
                       folders: tuple[str, ...] = faces.FACE_FOLDERS) -> tuple[Image.Image, str]:
        """`image` with its faces (the built-in detector's) restored by the first face model (`faces`), and that
        model's kind for the infotext. The model is a placed component of its own slot, settled after the image."""
        model = faces.first_model(self.upscalers.models_dir, folders)
        slot = self._face_restorer
        slot.ensure(model.name, model.path, self._desired.dtype, self._desired.offload)
        rgb = image.convert("RGB")
        found = DetectorLibrary(self.upscalers.models_dir / "adetailer").detect(rgb, BUILTIN_FACE, FACE_CONFIDENCE)
        self._set_progress(f"restoring {len(found)} face(s) with {model.name}", 0, max(1, len(found)))

        def run(face: Image.Image) -> Image.Image:
            tensor = torch.from_numpy(np.array(face)).permute(2, 0, 1)[None].float().div(255)
            out = slot.run_tile(tensor)[0].float().clamp(0, 1).mul(255).round().byte().permute(1, 2, 0).cpu()
            return Image.fromarray(out.numpy())

        try:
            with torch.inference_mode():
                return restore_faces(rgb, [r.box for r in found], run, faces.input_size(slot.descriptor),
                                     visibility), model.kind
        finally:
            slot.settle()
