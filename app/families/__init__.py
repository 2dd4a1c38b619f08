"""Model families as plug-ins: each file states what the engine needs to know about one family.

Why: SD1.5 and SDXL used to be spelled out in a dozen dicts and `if arch == "sdxl"` ladders
(configs, tokenizers, checkpoint markers, pipeline classes, text-encoder prefixes for single files
and for LoRA keys, embedding layouts). A family now says all of that once, and the loader, the
LoRA key table, the embedding loader, the demo and the tests read it from here, so a new family
(Flux, Z-Image, …) is one new file plus its tests.

Block grouping for `group` offload needs no family entry yet: the generic rule in
`app/engine/offload.py` (each element of a ModuleList child, other children whole) is right for
every family here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from transformers import CLIPTokenizer, PreTrainedModel

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
CLIP_TOKENIZER_DIR = ASSETS_DIR / "clip_tokenizer"


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
    # Stage pipeline classes by workflow ("img2img", "inpaint"), built on the loaded pipeline's
    # components (app/engine/stages.py); a family without one refuses that workflow by name.
    stage_pipelines: Mapping[str, type] = field(default_factory=dict)
    default_sampler: str = "Euler a"
    size_multiple: int = 8  # width and height are rounded to this (the VAE's downscale factor)

    @property
    def components(self) -> tuple[str, ...]:
        """The pipeline's `nn.Module` components an adapter may touch, UNet first."""
        return ("unet", *(te.component for te in self.text_encoders))

    def text_encoder(self, component: str) -> TextEncoder:
        return next(te for te in self.text_encoders if te.component == component)

    def tokenizers(self) -> dict[str, CLIPTokenizer]:
        """The bundled tokenizer(s) as pipeline keyword arguments (no download, ever)."""
        out = {}
        for te in self.text_encoders:
            extra = {} if te.pad_token is None else {"pad_token": te.pad_token}
            out[te.tokenizer] = CLIPTokenizer.from_pretrained(CLIP_TOKENIZER_DIR, **extra)
        return out


def _registry() -> Mapping[str, Family]:
    from app.families.sd15 import SD15
    from app.families.sdxl import SDXL

    return {f.name: f for f in (SD15, SDXL)}


FAMILIES: Mapping[str, Family] = _registry()


def family_of_pipeline(class_name: str) -> Family | None:
    """The family whose diffusers pipeline class is `class_name` (from a folder's model_index.json)."""
    return next((f for f in FAMILIES.values() if f.diffusers_pipeline == class_name), None)


def family(name: str) -> Family:
    """The family called `name`; a clear error naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None
