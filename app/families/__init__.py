"""Model families as plug-ins: a family is one file in this package, found by the registry.

Why: SD1.5 and SDXL used to be spelled out in a dozen dicts and `if family == "sdxl"` ladders
(configs, tokenizers, checkpoint markers, pipeline classes, text-encoder prefixes for single files
and for LoRA keys, embedding layouts, demo configs, LoRA metadata, preview factors). A family now
says all of that once, as data and small callables on `Family`, and generic code asks the family;
it never branches on a family's name. Every registered family is held to the same proof by one
conformance suite (`tests/families/`), which runs with strict forwards on (`app/engine/strict.py`).

A family consists of these files (`<module>`: its module's name, `<family>`: a family's `name`), and
no others (tests/families/test_isolation.py checks this list against every family added through it):

- `app/families/<module>.py`: its `Family` records and pipeline classes, `FAMILIES = (…)` exported;
- `app/families/<module>_layout.py` (optional): how its single files and LoRAs name its tensors;
- `app/families/<module>_controlnet.py` (optional): its `ControlNetKit`;
- `assets/configs/<family>/`: its bundled offline configs (`Files.config_dir`);
- `assets/make_<module>_configs.py`: the script that wrote those configs;
- `tests/test_<module>.py`: its native file formats (everything else is the conformance suite's);
- and its section of README.md.

How to add a family (Z-Image, Flux.2 Klein, …):

1. Write `app/families/<module>.py` with a `Family(...)` and export it: `FAMILIES = (MY_FAMILY,)` (the
   registry imports every module here that has `FAMILIES`, and refuses one that breaks a rule of the
   contract, naming the rule: `check_contract`). It imports only from this package, never `app.engine`.
2. Its pipeline classes build on `app.families.pipelines`: `EnginePipeline` first, `VariedNoise` on the txt2img
   class, `StrengthSteps` on stage pipelines (`stage_pipelines`; none: img2img and inpaint are refused by name),
   `PackedPatches` where the transformer denoises 2×2 patches. Bundle its offline configs in `assets/`.
3. State only what differs from the defaults, grouped in records: `files` (`Files`: bundled configs, the layouts
   it loads, checkpoint markers, the `parts` a single file is assembled from, what tells its folders apart, whether
   it reads embeddings), `latent_format` (one `LatentFormat` per VAE, shared: statistics in the pipeline's op
   order, preview factors, a video VAE's frame axis), `precision`
   (`Precision`: pinned dtypes such as RoPE `inv_freq` in fp32, layers kept out of 8-bit storage), `adapters`
   (`Adapters`: what LoRA metadata calls it, native layer names), `test_kit` (`TestKit`: tiny configs the demo
   and every test build at DEMO_SIDE pixels, test LoRA targets, bench rows: `benchmarks/` never names a family),
   `sampling` (`Sampling`: samplers, defaults, guidance), and beside them text encoders (their file names only
   where it reads such files), `blocks` (group offload), `controlnet`.
4. Run `python -m pytest -n 0 tests/families`: the conformance suite parametrises itself over the
   registry (load, seeds, PEFT LoRA bit-exact, every offload mode with strict forwards, fp8, dtype changes,
   stages or their refusal).
5. Add `tests/test_<module>.py` for the family's native file formats only, and its README section.

Detection order: single files are matched by `Files.checkpoint_markers`; where several families match
(FLUX.1 dev's markers are schnell's plus the guidance embedder), the one with the most markers wins,
so no family depends on import order. Folders are matched by `diffusers_pipeline` and
`Files.folder_config`. Within a module, `FAMILIES` is the order the registry lists them in; modules are
read in name order.

What varies by family beyond names: the denoiser component (`unet`, or `transformer` for DiTs),
how a single file is read (diffusers' own single-file loader for SD, or `Files.parts`: components the
engine assembles from an all-in-one file or from separate files, as Flux ships), the samplers,
guidance (CFG, or Flux-dev's distilled guidance: no negative prompt), the T5 sequence length,
defaults (steps, guidance, sampler; the size is the loaded model's native size) and the size multiple.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
)
from transformers import CLIPTextConfig, CLIPTokenizer, PretrainedConfig, PreTrainedModel

from app.families.file_layout import Layout, all_in_one_state
from app.families.ldm_layout import to_ldm_state_dict

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
# The demo's rules (app/demo.py writes tiny models every test builds; tests/test_demo.py holds them to these):
# a tiny model's native size is DEMO_SIDE pixels, and its image of a prompt is not flat (pixel std above
# DEMO_MIN_STD, in [0, 1]) and changes with the prompt (some pixel by more than DEMO_MIN_CHANGE).
DEMO_SIDE = 64
DEMO_MIN_STD = 0.05
DEMO_MIN_CHANGE = 0.01
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
    # A1111's PLMS is the pseudo linear multistep method without Runge-Kutta warm-up steps: diffusers' PNDM
    # with `skip_prk_steps`.
    "PLMS": (PNDMScheduler, {"skip_prk_steps": True}),
})


@dataclass(frozen=True)
class TextEncoder:
    """One text encoder of a family and every name it goes by. The names of the files it may appear in are
    optional: an encoder that never sits in a single file, a LoRA or an embedding states none (None), and
    `check_contract` asks for each only where the family reads such files."""

    component: str  # pipeline attribute: "text_encoder", "text_encoder_2"
    tokenizer: str  # its tokenizer's pipeline attribute
    model_class: type[PreTrainedModel]
    single_file_prefix: str | None = None  # where its tensors live in a single file; None: never in one
    open_clip: bool = False  # OpenCLIP key layout in single files (fused qkv), else CLIP's
    lora_prefix: str | None = None  # kohya LoRA key prefix ("lora_te_", …); None: kohya's positional `lora_teN_`
    embedding_key: str | None = None  # its vectors' key in a textual-inversion file ("emb_params", …); None: none
    pad_token: str | None = None  # the bundled CLIP tokenizer pads with this instead of its own
    config_class: type[PretrainedConfig] = CLIPTextConfig
    tokenizer_class: type = CLIPTokenizer
    tokenizer_dir: Path = CLIP_TOKENIZER_DIR  # bundled in assets/
    # How prompts reach the pipeline through it, as A1111 reads it (app/prompts/encode.py):
    # its hidden states are the prompt embeddings; "pooled": its pooled output; "both"; "text": the pipeline
    # reads the prompt as text itself (an LLM encoder through its chat template: app/prompts/as_text.py)
    reads: str = "sequence"
    layer: str = "last"  # the last layer, normed (clip skip applies); "penultimate": layer -2 unnormed (no clip skip)
    chunked: bool = True  # 75-token chunks, any number (CLIP); False: one sequence of `max_sequence_length` (T5)
    # `reads == "text"`: the keyword arguments the family's pipeline applies its chat template with (whether the
    # template opens a thinking block), so a prompt's length is counted as the pipeline counts it
    chat_template: Mapping[str, object] = field(default_factory=dict)


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
    # A `.gguf` file of this part written by llama.cpp's converter names tensors its own way: (regex, replacement)
    # rules, each matched against a whole name, that rewrite them to the model's (app/engine/component_files.py)
    gguf_names: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Files:
    """How a family's checkpoints are found and read (`Family.files`): its bundled offline configs, the layouts it
    loads, what tells a single file or a folder of it from another family's, how a single file is read, and
    whether A1111's `embeddings/` folder is read for it. Why one record: the loader, the model list and the demo
    read these together, and a family states only what differs from an SD checkpoint's."""

    config_dir: Path  # bundled offline configs (model_index.json, component configs, scheduler)
    layouts: tuple[str, ...] = ("file", "folder")  # checkpoint layouts it loads: single file, diffusers folder
    # Keys a single file must hold to be this family; a folder-only family may state none, or state them so that
    # a single file of it is refused as such (`layouts`) instead of as an unknown file.
    checkpoint_markers: tuple[str, ...] = ()
    marker_prefixes: tuple[str, ...] = ("",)  # checkpoint_markers may sit under any of these
    parts: tuple[ComponentFile, ...] = ()  # empty: diffusers' single-file loader reads the file
    # Pipeline arguments a single file of `parts` implies, from its path (FLUX.2 Klein: distilled unless
    # named "…base…"); a diffusers folder states them in its model_index.json.
    pipeline_kwargs: Callable[[Path], Mapping[str, object]] = lambda path: {}
    # {config file in a folder: {key: value}}: what tells variants that share a diffusers pipeline class apart
    folder_config: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    # Textual-inversion embeddings (A1111's `embeddings/`): the file holds one tensor per text
    # encoder under `TextEncoder.embedding_key`. False: the folder is not read for this family.
    takes_embeddings: bool = True

    def matches(self, keys: frozenset[str] | set[str]) -> bool:
        """Does a single file with these tensor names hold this family's markers?"""
        return bool(self.checkpoint_markers) and any(all(p + m in keys for m in self.checkpoint_markers)
                                                     for p in self.marker_prefixes)

    def fits_folder(self, folder: Path) -> bool:
        """Do a diffusers folder's component configs hold the values `folder_config` tells this variant by?"""
        for config, values in self.folder_config.items():
            try:
                found = json.loads((folder / config).read_text())
            except (OSError, ValueError):
                return False
            if any(found.get(k) != v for k, v in values.items()):
                return False
        return True


@dataclass(frozen=True)
class LatentStats:
    """How a VAE's raw latents relate to the ones the denoiser works on, per channel or for all:
    denoised = (raw - mean) * scale / std, raw = denoised * std / scale + mean. SD: mean 0, std 1;
    Flux: mean = the VAE's shift factor; VAEs with `latents_mean`/`latents_std` use those.

    `inverse_std`: the family's pipeline states the std as its reciprocal r = 1/std, computed in the
    latents' dtype (Qwen-Image: raw = denoised / r + mean, denoised = (raw - mean) * r). It is the
    same number on paper, but rounds differently from `x * std`: an image off by a grey level against
    the family's own pipeline. The op order is part of the format, so bit-exactness is."""

    scale: float = 1.0
    mean: float | tuple[float, ...] = 0.0
    std: float | tuple[float, ...] = 1.0
    inverse_std: bool = False

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        """Denoised latents -> what the VAE decodes."""
        mean, std = _per_channel(self.mean, latents), _per_channel(self.std, latents)
        if self.inverse_std:
            return latents / (1.0 / std) / self.scale + mean
        return latents * std / self.scale + mean

    def from_vae(self, raw: torch.Tensor) -> torch.Tensor:
        """What the VAE encoded -> the latents the denoiser works on (the inverse of `to_vae`)."""
        mean, std = _per_channel(self.mean, raw), _per_channel(self.std, raw)
        if self.inverse_std:
            return (raw - mean) * (1.0 / std) * self.scale
        return (raw - mean) * self.scale / std


def vae_latent_stats(config) -> LatentStats:
    """The rule diffusers' pipelines apply, read from the VAE's config (the default `LatentFormat.stats`)."""
    scale = getattr(config, "scaling_factor", None) or 1.0
    mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
    if mean is not None and std is not None:
        return LatentStats(scale, tuple(mean), tuple(std))
    return LatentStats(scale, getattr(config, "shift_factor", None) or 0.0)


def inverse_std_stats(config) -> LatentStats:
    """`vae_latent_stats` with the std applied as its reciprocal (see `LatentStats.inverse_std`)."""
    return dataclasses.replace(vae_latent_stats(config), inverse_std=True)


def _per_channel(value: float | tuple[float, ...], like: torch.Tensor) -> float | torch.Tensor:
    """A per-channel statistic as a tensor in `like`'s dtype on its device, shaped to broadcast over
    axis 1 of any rank (an image's (b, c, h, w), a video VAE's (b, c, frames, h, w)), as pipelines build it."""
    if isinstance(value, tuple):
        return torch.tensor(value).view(1, -1, *(1,) * (like.ndim - 2)).to(like.device, like.dtype)
    return value


# (factors: one RGB row per latent channel, RGB bias): the live preview's linear map (app/preview.py)
PreviewFactors = tuple[tuple[tuple[float, float, float], ...], tuple[float, float, float]]


@dataclass(frozen=True)
class LatentFormat:
    """One latent space: what a VAE's latents are, shared by every family on that VAE (as ComfyUI keeps
    one latent format per VAE). Why one object: the statistics, the preview factors and the frame axis
    describe the VAE, not the family, and two families on one VAE must not state them twice.

    The engine's latents are images, (batch, channels, h, w), whatever the VAE: a video VAE (`frames`:
    Qwen-Image's, Wan's) takes and returns (batch, channels, frames, h, w), so the engine adds a one-frame
    axis at the VAE's boundary and takes it off what the VAE gives back (`app/engine/decoding.py`,
    `app/engine/stages.py`)."""

    stats: Callable[[Any], LatentStats] = vae_latent_stats  # VAE config -> LatentStats
    preview_rgb: PreviewFactors | None = None  # None: no live preview of the latents
    frames: bool = False  # the VAE has a frame axis (a video VAE); images are one frame

    def to_vae_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """An image-shaped tensor (latents or pixels) as the VAE takes it: one frame where it has frames."""
        return tensor.unsqueeze(2) if self.frames and tensor.ndim == 4 else tensor

    def from_vae_output(self, tensor: torch.Tensor) -> torch.Tensor:
        """What the VAE gave back, image-shaped: its one frame where it has frames."""
        return tensor[:, :, 0] if self.frames and tensor.ndim == 5 else tensor


IMAGE_LATENTS = LatentFormat()  # SD's VAE rule, read from the VAE's config, no preview


# (family, denoiser config, rows, latent side, empty(*shape) -> a meta tensor) -> one denoiser call's arguments
CallInputs = Callable[["Family", Any, int, int, Callable[..., torch.Tensor]], dict]


@dataclass(frozen=True)
class BenchSpec:
    """How the benchmark (`python -m app.bench`, `python -m app.devicecheck`) runs this family's
    full-size architecture with random weights. Why on the family: a new family brings its bench rows
    and its device-check sections with it, and `benchmarks/` never names one."""

    side: int  # the rows' image side in pixels, as the model card generates
    call_inputs: CallInputs  # one denoiser call on meta tensors: op counts and TFLOP per step
    lora_layers: str  # regex over the denoiser's linear layers the bench LoRAs cover (attention, feed-forward)
    lora_convs: str | None = None  # regex over the conv layers its LoCon adds; None: no LoCon (no convs)
    check: tuple[str, ...] = ()  # the device check's section: `app.bench` arguments after `--families`; (): none
    check_s: int = 0  # that section's estimate, device seconds on an H100, process start included
    check_title: str = ""  # what the section shows, for its plan line and summary
    check_order: int = 0  # families' sections run in this order (the device check's priorities)
    offload_check_s: int = 0  # > 0: a later section of every offload mode at `check`'s steps, this estimate


@dataclass(frozen=True)
class Precision:
    """What dtypes a family's tensors keep beyond the model's (`Family.precision`)."""

    # Tensors that keep their own dtype whatever the model's: fnmatch patterns over
    # "component.module.tensor" -> dtype (RoPE `inv_freq` in fp32). The load check, the placement
    # plan, every move, streaming and verify honour them.
    pinned_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    # Layers whose weights stay in the compute dtype when the others are stored in 8 bits
    # (app/engine/storage.py): the sensitive first and last layers and the conditioning embeddings.
    high_precision: tuple[str, ...] = ()
    fp16_ok: bool = True  # False: activations overflow fp16 (Flux); an fp16 request is refused with why
    # The VAE decodes in fp32 when the model computes in fp16 and the VAE's config says
    # `force_upcast` — where the family's own diffusers pipeline does so (SDXL's VAE overflows fp16).
    # Nowhere else: bf16 has fp32's range, and an SD1.5 pipeline never upcasts.
    vae_upcast_in_fp16: bool = False


@dataclass(frozen=True)
class Adapters:
    """What LoRA files call a family and how they name its layers (`Family.adapters`; app/adapters/)."""

    # What LoRA metadata calls the architecture ("flux" for dev and schnell; "": the family's name), its badge
    # ("": the family's label), and the metadata markers (substrings of kohya's `ss_base_model_version` /
    # `modelspec.architecture`): the synthetic writer writes markers[0] and markers[1], `declared_architecture`
    # and the LoRA card badge match any of them (the longest match over all families wins).
    lora_arch: str = ""
    label: str = ""
    markers: tuple[str, ...] = ()
    # (architecture, fragments of layer names only it has): an adapter with an unmatched layer so named is
    # refused as made for it, even where its other layers fit by shape (FLUX.1 LoRAs on FLUX.2 Klein 4B).
    foreign_layers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    kohya_ldm_names: bool = False  # kohya's sd-scripts name this UNet's layers with LDM names (SDXL)
    native_modules: Callable[[Any], Any] = lambda denoiser: ()  # (alias, parts, spelling) of native names


@dataclass(frozen=True)
class TestKit:
    """What the demo, the tests and the benchmark build for a family (`Family.test_kit`), kept out of what
    generation reads."""

    __test__ = False  # a record, not a pytest test class

    # Component configs of a tiny random-weight model of this family, by component: what the demo
    # writes (app/demo.py) and every test builds. Keep the real structure, at a CPU-friendly size.
    tiny_configs: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    tiny_inpainting_channels: int | None = None  # the demo also writes an inpainting checkpoint with these
    # Tiny pipeline -> nothing, after its random init: gives it, in place, what a trained model has where random
    # weights would hide a path the demo's rules and the tests compare (how much the prompt reaches the image).
    tiny_trained: Callable[[Any], None] = lambda pipe: None
    lora_targets: tuple[str, ...] = ()  # module globs a test LoRA spreads over (every layer kind)
    demo_lora_targets: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # the demo's style and detail LoRAs
    bench: BenchSpec | None = None  # None: the benchmark does not run this family


@dataclass(frozen=True)
class Sampling:
    """How a family samples (`Family.sampling`): its samplers, the defaults the page fills in, its guidance
    and prompt length."""

    default_sampler: str = "Euler a"
    samplers: Samplers = field(default_factory=lambda: SD_SAMPLERS)
    # A1111 sampler names this family has no exact counterpart for -> the nearest of its own `samplers`: what an
    # A1111 client's request runs instead (the answer says so), as Forge and ComfyUI run them on such models.
    nearest_samplers: Mapping[str, str] = field(default_factory=dict)
    default_steps: int = 20
    default_guidance: float = 7.0
    guidance_range: tuple[float, float] = (1.0, 30.0)  # what the CFG field takes for this family
    guidance_label: str = "CFG scale"  # what the page calls the field
    # guidance value -> pipeline-call arguments; None: `guidance_scale=value` (CFG, or Flux's distilled guidance)
    guidance_call: Callable[[float], dict[str, object]] | None = None
    distilled_guidance: bool = False  # guidance is an input of the model (Flux dev), not CFG
    negative_prompt: bool = True  # False: the pipeline has no unconditional pass to use one in
    max_sequence_length: int | None = None  # T5 tokens per prompt, where the family has T5
    # (steps, guidance) for a loaded pipeline where checkpoints of one family want other settings (FLUX.2
    # Klein's undistilled "base": 50 steps, guidance 4); None: `default_steps`, `default_guidance`.
    loaded_defaults: Callable[[Any], tuple[int, float]] | None = None
    # a step-distilled checkpoint: a few steps, each unlike the last (no step cache)
    step_distilled: Callable[[Any], bool] = lambda pipe: False


# Architectures whose LoRAs exist but that no family here runs: (LoRA arch, badge, metadata markers),
# so a LoRA card and a refusal can still say what a file was made for.
FOREIGN_ADAPTERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("sd2", "SD2", ("sd_v2", "stable-diffusion-v2", "v2")),
    ("sd3", "SD3", ("sd3", "stable-diffusion-3")),
)


# (stack, stage kind, control maps (PIL, at the generation's size), units, guidance) -> the control pipeline's
# keyword arguments for one call; it may also ready the stack for that call (per-unit control modes).
ControlArm = Callable[[Any, str, Sequence[Any], Sequence[Any], float], dict]


@dataclass(frozen=True)
class ControlNetKit:
    """What ControlNets a family takes and how it runs them (`Family.controlnet`; app/controlnet/,
    app/engine/control.py). Why on the family: generic code loads, places and runs ControlNets without
    naming a family; a file made for another family is recognised (`matches`) and set aside with the reason.

    The engine holds the ControlNets of a generation's units as ONE pipeline component, `component`
    (`stack_class(nets)`: one entry per unit, in unit order), beside the denoiser: placed, offloaded, stored
    in fp8, verified and strict-checked like it. The control pipelines are stage pipelines built on the
    loaded pipeline's own components (app/engine/stages.py) plus that component."""

    model_classes: tuple[type, ...]  # diffusers ControlNet classes its files load as; [0] reads single files
    pipelines: Mapping[str, type]  # stage kind ("txt2img", "img2img", "inpaint") -> control pipeline class
    stack_class: type  # the component holding the loaded nets: `stack_class(list_of_nets)`
    # A file's {tensor name: shape} (its safetensors header) -> was it made for this family? Shapes decide
    # where names do not (SD1.5's and SDXL's ControlNets share names; cross-attention width differs).
    matches: Callable[[Mapping[str, tuple[int, ...]]], bool]
    # The diffusers configs its single files may have, tried in order until one fits the file's shapes
    # (full-size ones first, then `tiny_config`): a single file carries no config.
    single_file_configs: Callable[[], tuple[Mapping[str, object], ...]]
    tiny_config: Mapping[str, object]  # a tiny ControlNet fitting `TestKit.tiny_configs` (tests, the demo)
    arm: ControlArm  # units -> pipeline kwargs (see `ControlArm`)
    # A single file's state dict -> diffusers names (None: diffusers' own single-file converter of
    # `model_classes[0]`, e.g. LDM `control_model.*` names for SD); called as convert(state, config).
    convert: Callable[[dict, Mapping[str, object]], dict] | None = None
    # (diffusers-named state, config) -> the single-file layout users have (the tests' writer; None: users'
    # files are diffusers-named)
    to_single_file: Callable[[dict, Mapping[str, object]], dict] | None = None
    component: str = "controlnet"  # the pipeline attribute the control pipelines take it as


@dataclass(frozen=True)
class Family:
    """Everything family-specific; see the module docstring."""

    name: str  # "sd15": what snapshots, LoRA metadata hints and the UI call it
    label: str  # "SD1.5"
    pipeline_class: type  # our pipeline subclass (EnginePipeline first)
    diffusers_pipeline: str  # `_class_name` in a diffusers folder's model_index.json
    text_encoders: tuple[TextEncoder, ...]
    files: Files  # how its checkpoints are found and read: configs, layouts, markers, parts
    pipeline_kwargs: Mapping[str, object] = field(default_factory=dict)  # passed when a pipeline is built
    # Stage pipeline classes by workflow ("img2img", "inpaint"), built on the loaded pipeline's
    # components (app/engine/stages.py); a family without one refuses that workflow by name.
    stage_pipelines: Mapping[str, type] = field(default_factory=dict)
    size_multiple: int = 8  # width and height are rounded to this (the VAE's downscale factor)
    denoiser: str = "unet"  # the denoising component: "unet", or "transformer" for DiTs
    denoiser_class: type = UNet2DConditionModel
    vae_class: type = AutoencoderKL
    # Components built of 2-D convolutions, whose 4-D weights may rest channels_last (`--channels-last`);
    # text encoders have none, nor has a DiT's transformer (its patch embedding is a linear layer).
    conv_components: tuple[str, ...] = ("unet", "vae")
    # How many reference images the txt2img pipeline edits from (`image=[…]`); 0: none. Where it takes some,
    # the img2img tab offers a "reference images" input and the A1111 img2img API reads `init_images` so
    # with `reference_images`. Each reference adds its tokens to every attention of every step.
    reference_images: int = 0
    # A component's groups for `group` offload: None is the generic rule (app/engine/offload.py:
    # what executes: ModuleList/ModuleDict elements, other children whole, tensors the component
    # owns itself around its forward); a callable (component name, module) -> [modules] replaces it
    # (returning None for a component keeps the generic rule there).
    blocks: Callable[[str, torch.nn.Module], list[torch.nn.Module]] | None = None
    latent_format: LatentFormat = IMAGE_LATENTS  # the VAE's latent space: statistics, preview, frames
    # Does this loaded pipeline's denoiser read a mask and masked-image latents (an inpainting checkpoint)?
    inpainting: Callable[[Any], bool] = lambda pipe: False
    # The side, in pixels, the loaded model was trained at: the size the page switches to on load.
    native_size: Callable[[Any], int] = lambda pipe: pipe.unet.config.sample_size * pipe.vae_scale_factor
    # A denoiser call's prompt length (the compiled path compiles only a few distinct ones, so a new
    # prompt never recompiles past torch's limit); None: axis 1 of `encoder_hidden_states`.
    prompt_length: Callable[[tuple, dict], int | None] | None = None
    # `--compile` compiles regions: denoiser -> the class names of its repeated blocks, each class compiled
    # once and shared by its instances (app/engine/compile_regions.py: seconds, not minutes, for a DiT's
    # dozens of blocks). None: the whole denoiser is compiled (with CUDA graphs in reduce-overhead mode).
    compile_regions: Callable[[torch.nn.Module], tuple[str, ...]] | None = None
    # Families whose checkpoints may finish this one's txt2img after a switch point (A1111's refiner):
    # both pipelines take diffusers' `denoising_end` / `denoising_start`. Empty: no refiner stage.
    refiner_families: tuple[str, ...] = ()
    # Step caching (app/engine/step_cache.py): the denoiser's first block (a module path), which runs every step
    # and whose output says whether the rest may be reused from the last whole step (`Sampling.step_distilled`:
    # where the cache is refused).
    first_block: str = "down_blocks.0"
    sampling: Sampling = Sampling()  # samplers, defaults, guidance, prompt length
    controlnet: ControlNetKit | None = None  # None: this family takes no ControlNet (a unit is refused by name)
    precision: Precision = Precision()  # dtypes beyond the model's: pinned tensors, 8-bit exceptions, fp16
    adapters: Adapters = Adapters()  # what LoRA files call the family and how they name its layers
    test_kit: TestKit = TestKit()  # tiny models, test LoRAs and bench rows: what the demo, tests and bench read

    @property
    def plain_pipeline_class(self) -> type:
        """diffusers' own pipeline class for this family (files written with it load in any tool);
        our own class where diffusers has none of that name."""
        import diffusers

        return getattr(diffusers, self.diffusers_pipeline, self.pipeline_class)

    @property
    def components(self) -> tuple[str, ...]:
        """The pipeline's `nn.Module` components an adapter may touch, the denoiser first."""
        return (self.denoiser, *(te.component for te in self.text_encoders))

    @property
    def lora_arch(self) -> str:
        """What LoRA metadata calls the architecture of this family's adapters ("flux" for dev and schnell)."""
        return self.adapters.lora_arch or self.name

    @property
    def badge(self) -> str:
        """The short name a LoRA card shows for adapters of this family's architecture."""
        return self.adapters.label or self.label

    def defaults_for(self, pipe) -> tuple[int, float]:
        """The steps and guidance the page fills in when `pipe` is loaded."""
        sampling = self.sampling
        if sampling.loaded_defaults:
            return sampling.loaded_defaults(pipe)
        return sampling.default_steps, sampling.default_guidance

    def pinned_dtype(self, component: str, module: str, tensor: str) -> torch.dtype | None:
        """The dtype `pinned_dtypes` holds this tensor in, or None (it follows the model's)."""
        path = ".".join(p for p in (component, module, tensor) if p)
        pinned = self.precision.pinned_dtypes.items()
        return next((d for pattern, d in pinned if fnmatch.fnmatchcase(path, pattern)), None)

    def check_guidance(self, value: float) -> None:
        """Refuse a guidance value outside this family's range, naming the range and the field."""
        low, high = self.sampling.guidance_range
        if not low <= value <= high:
            raise ValueError(f"{self.label} takes {self.sampling.guidance_label} {low:g}…{high:g}, got {value:g}")

    def negative_unused(self, guidance: float) -> str:
        """Why a negative prompt changes nothing at `guidance`, or "" where it counts: it is read only by an
        unconditional pass, which a family without CFG (distilled guidance, FLUX.2 Klein) never runs, nor
        CFG at 1 or below (diffusers' pipelines skip it there: Z-Image Turbo's default)."""
        if not self.sampling.negative_prompt or self.sampling.distilled_guidance:
            return f"{self.label} runs no unconditional pass"
        if guidance <= 1:
            return f"{self.sampling.guidance_label} {guidance:g} runs no unconditional pass (above 1 it does)"
        return ""

    def latents_for_vae(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Denoised latents -> what the VAE decodes (the one rule `decode` uses; `latents_from_vae` inverts it)."""
        return self.latent_format.stats(vae.config).to_vae(latents)

    def latents_from_vae(self, vae, raw: torch.Tensor) -> torch.Tensor:
        """What the VAE encoded -> the latents the denoiser works on (the inverse of `latents_for_vae`)."""
        return self.latent_format.stats(vae.config).from_vae(raw)

    def single_file_state(self, pipe) -> dict:
        """The pipeline's weights as one single file of this family (the demo's and the tests' writer):
        the LDM layout for SD, the all-in-one layout of `parts` otherwise."""
        parts = self.files.parts
        return all_in_one_state(pipe, parts) if parts else to_ldm_state_dict(pipe, self)

    def call_arguments(self, guidance: float) -> dict[str, object]:
        """The pipeline-call arguments that differ by family (the prompts go as embeddings: app/prompts)."""
        call = self.sampling.guidance_call
        out: dict[str, object] = {"guidance_scale": guidance} if call is None else dict(call(guidance))
        if self.sampling.max_sequence_length is not None:
            out["max_sequence_length"] = self.sampling.max_sequence_length
        return out

    def text_encoder(self, component: str) -> TextEncoder:
        return next(te for te in self.text_encoders if te.component == component)

    def kohya_prefix(self, component: str) -> str:
        """The kohya LoRA key prefix of a text encoder: its own, else kohya's positional `lora_te<N>_`."""
        number = next(n for n, te in enumerate(self.text_encoders, start=1) if te.component == component)
        return self.text_encoder(component).lora_prefix or f"lora_te{number}_"

    def tokenizers(self) -> dict[str, object]:
        """The bundled tokenizer(s) as pipeline keyword arguments (no download, ever)."""
        out = {}
        for te in self.text_encoders:
            extra = {} if te.pad_token is None else {"pad_token": te.pad_token}
            out[te.tokenizer] = te.tokenizer_class.from_pretrained(te.tokenizer_dir, **extra)
        return out


class FamilyContractError(ValueError):
    """A family that breaks a rule of the contract, named with the rule when it is registered."""


def check_contract(fam: Family) -> Family:
    """Refuse a family that breaks a rule generic code or the demo relies on, naming the family and the rule
    (found at registration, not by a crash in some test later); returns it."""
    broken = [rule for rule, holds in _contract_rules(fam) if not holds]
    if broken:
        raise FamilyContractError(f"model family {fam.name!r} breaks the family contract: {'; '.join(broken)}")
    return fam


def _contract_rules(fam: Family) -> list[tuple[str, bool]]:
    encoders, files = fam.text_encoders, fam.files
    ldm_file = "file" in files.layouts and not files.parts  # diffusers' single-file loader reads each encoder's prefix
    return [
        (f"files.layouts {files.layouts} must be some of ('file', 'folder')", bool(files.layouts)
         and set(files.layouts) <= {"file", "folder"}),
        ("a family that loads single files ('file' in files.layouts) states files.checkpoint_markers",
         "file" not in files.layouts or bool(files.checkpoint_markers)),
        ("an LDM single-file family states each TextEncoder.single_file_prefix",
         not ldm_file or all(te.single_file_prefix is not None for te in encoders)),
        ("a family that takes embeddings (files.takes_embeddings) states each TextEncoder.embedding_key",
         not files.takes_embeddings or all(te.embedding_key is not None for te in encoders)),
        (f"the demo's tiny models are {DEMO_SIDE}² (DEMO_SIDE): size_multiple {fam.size_multiple} must divide it",
         DEMO_SIDE % fam.size_multiple == 0),
        ("tiny_configs states a config for the denoiser, the VAE and every text encoder (the demo builds them)",
         set(fam.test_kit.tiny_configs) == {fam.denoiser, "vae", *(te.component for te in encoders)}),
    ]


def discover() -> dict[str, Family]:
    """Every family the modules of this package export (`FAMILIES = (...)` in a module), modules in
    name order and each module's families in its own order, each checked against the contract
    (`check_contract`). A name exported twice is a bug."""
    found: dict[str, Family] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        for fam in getattr(importlib.import_module(f"{__name__}.{module}"), "FAMILIES", ()):
            if fam.name in found:
                raise ImportError(f"model family {fam.name!r} is exported twice (again by app/families/{module}.py)")
            found[fam.name] = check_contract(fam)
    return found


# The registry: a plain dict, so a test may register a family of its own for one test (monkeypatch).
FAMILIES: dict[str, Family] = discover()


def detect(keys: frozenset[str] | set[str]) -> Family | None:
    """The family of a single file's tensor names: of the families whose markers it holds, the one
    with the most markers (FLUX.1 dev's are schnell's plus the guidance embedder), else None."""
    matching = [fam for fam in FAMILIES.values() if fam.files.matches(keys)]
    return max(matching, key=lambda fam: len(fam.files.checkpoint_markers), default=None)


def lora_arch_of(text: str) -> tuple[str, str] | None:
    """(LoRA architecture, badge) named by a LoRA's recorded base model (kohya's `ss_base_model_version`,
    `modelspec.architecture`), families and foreign architectures alike; the longest marker found wins
    ("sdxl_base_v1-0" holds both SDXL's "sdxl" and "v1"). None when no marker is in it."""
    lowered = text.lower()
    candidates = [(fam.lora_arch, fam.badge, m) for fam in FAMILIES.values() for m in fam.adapters.markers]
    candidates += [(arch, badge, m) for arch, badge, markers in FOREIGN_ADAPTERS for m in markers]
    found = [(len(marker), arch, badge) for arch, badge, marker in candidates if marker in lowered]
    return max(found)[1:] if found else None


def family_of_pipeline(class_name: str, folder: Path | None = None) -> Family | None:
    """The family whose diffusers pipeline class is `class_name` (from a folder's model_index.json);
    where variants share a class (Flux dev and schnell), the one whose `folder_config` values the
    folder's component configs hold."""
    for fam in FAMILIES.values():
        if fam.diffusers_pipeline == class_name and (folder is None or fam.files.fits_folder(folder)):
            return fam
    return None


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
