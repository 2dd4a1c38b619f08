"""Model families as plug-ins: each file states what the engine needs to know about one family.

Why: SD1.5 and SDXL used to be spelled out in a dozen dicts and `if arch == "sdxl"` ladders
(configs, tokenizers, checkpoint markers, pipeline classes, text-encoder prefixes for single files
and for LoRA keys, embedding layouts). A family now says all of that once, and the loader, the
LoRA key table, the embedding loader, the demo and the tests read it from here, so a new family
(Flux, Z-Image, …) is one new file plus its tests.

Block grouping for `group` offload needs no family entry yet: the generic rule in
`app/engine/offload.py` (each element of a ModuleList child, other children whole) is right for
every family here.

What varies by family beyond names: the denoiser component (`unet`, or `transformer` for DiTs),
how a single file is read (diffusers' own single-file loader for SD, or `parts`: components the
engine assembles from an all-in-one file or from separate files, as Flux ships), the samplers,
guidance (CFG, or Flux-dev's distilled guidance: no negative prompt), the T5 sequence length,
defaults (steps, guidance, size) and the size multiple.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
)
from transformers import CLIPTextConfig, CLIPTokenizer, PretrainedConfig, PreTrainedModel

from app.families.file_layout import Layout, all_in_one_state
from app.families.ldm_layout import to_ldm_state_dict

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
CLIP_TOKENIZER_DIR = ASSETS_DIR / "clip_tokenizer"
# sampler name -> (scheduler class, overrides of the model's scheduler config)
Samplers = Mapping[str, tuple[type, Mapping[str, object]]]
SD_SAMPLERS: Samplers = MappingProxyType({
    "Euler": (EulerDiscreteScheduler, {}),
    "Euler a": (EulerAncestralDiscreteScheduler, {}),
    "DPM++ 2M": (DPMSolverMultistepScheduler, {"use_karras_sigmas": False}),
    "DPM++ 2M Karras": (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "DDIM": (DDIMScheduler, {}),
    "UniPC": (UniPCMultistepScheduler, {}),
})


@dataclass(frozen=True)
class TextEncoder:
    """One text encoder of a family and every name it goes by."""

    component: str  # pipeline attribute: "text_encoder", "text_encoder_2"
    tokenizer: str  # its tokenizer's pipeline attribute
    model_class: type[PreTrainedModel]
    single_file_prefix: str  # where its tensors live in an LDM single file
    open_clip: bool  # OpenCLIP key layout in single files (fused qkv), else CLIP's
    lora_prefix: str  # kohya LoRA key prefix ("lora_te_", "lora_te1_", …)
    embedding_key: str  # its vectors' key in a textual-inversion file ("emb_params", "clip_l", …)
    pad_token: str | None = None  # the bundled CLIP tokenizer pads with this instead of its own
    config_class: type[PretrainedConfig] = CLIPTextConfig
    tokenizer_class: type = CLIPTokenizer
    tokenizer_dir: Path = CLIP_TOKENIZER_DIR  # bundled in assets/
    # How prompts reach the pipeline through it, as A1111 reads it (app/prompts/encode.py):
    reads: str = "sequence"  # its hidden states are the prompt embeddings; "pooled": its pooled output; "both"
    layer: str = "last"  # the last layer, normed (clip skip applies); "penultimate": layer -2 unnormed (no clip skip)
    chunked: bool = True  # 75-token chunks, any number (CLIP); False: one sequence of `max_sequence_length` (T5)


@dataclass(frozen=True)
class ComponentFile:
    """One component a family assembles from single files itself (`app/engine/component_files.py`),
    and how to find and read it: in an all-in-one file under one of `prefixes`, or in a file of
    its own (prefix "") in the Settings folder `folder`, recognised by `marker`."""

    component: str  # pipeline attribute
    label: str  # what an error names: "T5-XXL text encoder"
    model_class: type
    prefixes: tuple[str, ...]  # where it sits in an all-in-one file, tried in order
    marker: str  # a key (after the prefix) that only this component holds
    layout: Callable[[Any], Layout]  # model -> {model key: FileTensor (no prefix)}
    folder: str | None = None  # Settings property of the folder holding separate files
    config_class: type[PretrainedConfig] | None = None  # None: a diffusers model (`load_config`)


@dataclass(frozen=True)
class Family:
    """Everything family-specific; see the module docstring."""

    name: str  # "sd15": what snapshots, LoRA metadata hints and the UI call it
    label: str  # "SD1.5"
    pipeline_class: type  # our pipeline subclass (app/engine/pipelines.py)
    diffusers_pipeline: str  # `_class_name` in a diffusers folder's model_index.json
    text_encoders: tuple[TextEncoder, ...]
    checkpoint_markers: tuple[str, ...]  # keys a single file must hold to be this family
    config_dir: Path  # bundled offline configs (model_index.json, component configs, scheduler)
    pipeline_kwargs: Mapping[str, object] = field(default_factory=dict)  # passed when a pipeline is built
    # Layers whose weights stay in the compute dtype when the others are stored in 8 bits
    # (app/engine/storage.py): the sensitive first and last layers and the conditioning embeddings.
    high_precision: tuple[str, ...] = ()
    # The VAE decodes in fp32 when the model computes in fp16 and the VAE's config says
    # `force_upcast` — where the family's own diffusers pipeline does so (SDXL's VAE overflows fp16).
    # Nowhere else: bf16 has fp32's range, and an SD1.5 pipeline never upcasts.
    vae_upcast_in_fp16: bool = False
    # Stage pipeline classes by workflow ("img2img", "inpaint"), built on the loaded pipeline's
    # components (app/engine/stages.py); a family without one refuses that workflow by name.
    stage_pipelines: Mapping[str, type] = field(default_factory=dict)
    default_sampler: str = "Euler a"
    size_multiple: int = 8  # width and height are rounded to this (the VAE's downscale factor)
    denoiser: str = "unet"  # the denoising component: "unet", or "transformer" for DiTs
    denoiser_class: type = UNet2DConditionModel
    # Components built of 2-D convolutions, whose 4-D weights may rest channels_last (`--channels-last`);
    # text encoders have none, nor has a DiT's transformer (its patch embedding is a linear layer).
    conv_components: tuple[str, ...] = ("unet", "vae")
    marker_prefixes: tuple[str, ...] = ("",)  # checkpoint_markers may sit under any of these
    parts: tuple[ComponentFile, ...] = ()  # empty: diffusers' single-file loader reads the file
    samplers: Samplers = field(default_factory=lambda: SD_SAMPLERS)
    default_steps: int = 20
    default_guidance: float = 7.0
    distilled_guidance: bool = False  # guidance is an input of the model (Flux dev), not CFG
    fp16_ok: bool = True  # False: activations overflow fp16 (Flux); an fp16 request is refused with why
    negative_prompt: bool = True  # False: the pipeline has no unconditional pass to use one in
    max_sequence_length: int | None = None  # T5 tokens per prompt, where the family has T5
    adapter_arch: str = ""  # what LoRA metadata calls the architecture ("flux" for dev and schnell)
    folder_config: Mapping[str, Mapping[str, object]] = field(default_factory=dict)  # tells variants' folders apart
    native_size: Callable[[Any], int] = lambda pipe: pipe.unet.config.sample_size * pipe.vae_scale_factor
    native_modules: Callable[[Any], Any] = lambda denoiser: ()  # (alias, parts, spelling) of native names
    # Families whose checkpoints may finish this one's txt2img after a switch point (A1111's refiner):
    # both pipelines take diffusers' `denoising_end` / `denoising_start`. Empty: no refiner stage.
    refiner_families: tuple[str, ...] = ()

    @property
    def plain_pipeline_class(self) -> type:
        """diffusers' own pipeline class for this family (files written with it load in any tool)."""
        import diffusers

        return getattr(diffusers, self.diffusers_pipeline)

    @property
    def components(self) -> tuple[str, ...]:
        """The pipeline's `nn.Module` components an adapter may touch, the denoiser first."""
        return (self.denoiser, *(te.component for te in self.text_encoders))

    @property
    def lora_arch(self) -> str:
        return self.adapter_arch or self.name

    def matches(self, keys: frozenset[str] | set[str]) -> bool:
        """Does a single file with these tensor names hold this family's markers?"""
        return any(all(p + m in keys for m in self.checkpoint_markers) for p in self.marker_prefixes)

    def single_file_state(self, pipe) -> dict:
        """The pipeline's weights as one single file of this family (the demo's and the tests' writer):
        the LDM layout for SD, the all-in-one layout of `parts` otherwise."""
        return all_in_one_state(pipe, self.parts) if self.parts else to_ldm_state_dict(pipe, self)

    def call_arguments(self, guidance: float) -> dict[str, object]:
        """The pipeline-call arguments that differ by family (the prompts go as embeddings: app/prompts)."""
        out: dict[str, object] = {"guidance_scale": guidance}
        if self.max_sequence_length is not None:
            out["max_sequence_length"] = self.max_sequence_length
        return out

    def text_encoder(self, component: str) -> TextEncoder:
        return next(te for te in self.text_encoders if te.component == component)

    def tokenizers(self) -> dict[str, object]:
        """The bundled tokenizer(s) as pipeline keyword arguments (no download, ever)."""
        out = {}
        for te in self.text_encoders:
            extra = {} if te.pad_token is None else {"pad_token": te.pad_token}
            out[te.tokenizer] = te.tokenizer_class.from_pretrained(te.tokenizer_dir, **extra)
        return out


def _registry() -> Mapping[str, Family]:
    from app.families.flux import FLUX_DEV, FLUX_SCHNELL
    from app.families.sd15 import SD15
    from app.families.sdxl import SDXL

    # Flux dev before schnell: dev's markers are schnell's plus the guidance embedder.
    return {f.name: f for f in (SD15, SDXL, FLUX_DEV, FLUX_SCHNELL)}


FAMILIES: Mapping[str, Family] = _registry()


def family_of_pipeline(class_name: str, folder: Path | None = None) -> Family | None:
    """The family whose diffusers pipeline class is `class_name` (from a folder's model_index.json);
    where variants share a class (Flux dev and schnell), the one whose `folder_config` values the
    folder's component configs hold."""
    for fam in FAMILIES.values():
        if fam.diffusers_pipeline == class_name and (folder is None or _folder_fits(fam, folder)):
            return fam
    return None


def _folder_fits(fam: Family, folder: Path) -> bool:
    for config, values in fam.folder_config.items():
        try:
            found = json.loads((folder / config).read_text())
        except (OSError, ValueError):
            return False
        if any(found.get(k) != v for k, v in values.items()):
            return False
    return True


def family_of(pipe) -> Family:
    """The family of a pipeline: ours state it (`pipe.family`, set at load); a plain diffusers
    pipeline (tests, benchmarks) is known by its class."""
    stated = getattr(pipe, "family", None)
    found = stated or next((family_of_pipeline(cls.__name__) for cls in type(pipe).__mro__
                            if family_of_pipeline(cls.__name__) is not None), None)
    if found is None:
        raise ValueError(f"{type(pipe).__name__} is not a pipeline of a known family ({', '.join(FAMILIES)})")
    return found


def family(name: str) -> Family:
    """The family called `name`; a clear error naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None
