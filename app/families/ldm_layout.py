"""Names of Stable Diffusion weights in diffusers versus the original LDM ("single-file") layout.

Two users need this mapping to be exact:

* adapter code (kohya SDXL LoRAs name UNet layers in LDM spelling, e.g.
  `input_blocks_4_1_transformer_blocks_0_attn1_to_q`) builds its key lookup tables from
  `unet_module_to_ldm`, so that function is pure string work on one path: cheap enough to call for
  every module of a model;
* the demo/test fixtures write tiny checkpoints in the single-file layout with `to_ldm_state_dict`,
  and `models.py` checks that a single file really holds every tensor the pipeline needs (diffusers
  loads single files with `strict=False` and silently keeps random weights for anything missing).

The rules, per UNet level i with `lpb` = layers_per_block:
`input_blocks` hold lpb (resnet, attention) pairs and then the downsampler, so resnet j of
`down_blocks.i` is `input_blocks.{1 + i*(lpb+1) + j}.0`, its attention `.1`, the downsampler
`input_blocks.{1 + i*(lpb+1) + lpb}.0.op`; `output_blocks` hold lpb+1 pairs per level, resnet j of
`up_blocks.i` is `output_blocks.{i*(lpb+1) + j}.0`, its attention `.1`, and the upsampler sits in the
last one of the level after the attention (`.2.conv`) or, in a level without attention, at `.1.conv`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch

from app.families.file_layout import FileTensor

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."

_RESNET_PARTS = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_UNET_TOP_LEVEL = {
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
    "time_embedding": "time_embed",
    "add_embedding": "label_emb.0",
}
# TimestepEmbedding children; LDM keeps them in an nn.Sequential(linear, SiLU, linear).
_EMBEDDING_PARTS = {"linear_1": "0", "linear_2": "2"}
_MID_BLOCK = {
    ("resnets", 0): "middle_block.0",
    ("attentions", 0): "middle_block.1",
    ("resnets", 1): "middle_block.2",
}

_VAE_ATTENTION_PARTS = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v"}
_OPEN_CLIP_LAYER_PARTS = {
    "self_attn.out_proj": "attn.out_proj",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_OPEN_CLIP_TOP_LEVEL = {
    "embeddings.token_embedding.weight": "token_embedding.weight",
    "embeddings.position_embedding.weight": "positional_embedding",
    "final_layer_norm.weight": "ln_final.weight",
    "final_layer_norm.bias": "ln_final.bias",
}


def _join(*pieces: str) -> str:
    return ".".join(p for p in pieces if p)


def _index(text: str, path: str) -> int:
    if not text.isdigit():
        raise ValueError(f"malformed module path {path!r}: expected a block index, got {text!r}")
    return int(text)


# --------------------------------------------------------------------------------------------- UNet


def unet_module_to_ldm(
    path: str, layers_per_block: int, attention_up_blocks: Collection[int] | None = None
) -> str | None:
    """LDM name of a diffusers UNet module (or parameter) path; None where LDM has no counterpart.

    Containers without an LDM twin (`down_blocks.1`, `mid_block.resnets`) and parameterless
    modules (activations, `time_proj`) map to None. Trailing names (`.weight`) pass through.
    `attention_up_blocks` (indices of up blocks with attentions) is needed only for upsampler
    paths, whose LDM slot depends on it; `unet_module_map` derives it from a model.
    """
    parts = path.split(".")
    if parts[0] in ("down_blocks", "up_blocks"):
        return _level_block_to_ldm(parts, path, layers_per_block, attention_up_blocks)
    if parts[0] == "mid_block":
        return _mid_block_to_ldm(parts, path)
    base = _UNET_TOP_LEVEL.get(parts[0])
    if base is None:
        return None
    rest = parts[1:]
    if parts[0] in ("time_embedding", "add_embedding") and rest:
        slot = _EMBEDDING_PARTS.get(rest[0])
        return None if slot is None else _join(base, slot, *rest[1:])
    return _join(base, *rest)


def _resnet_tail(rest: list[str]) -> str | None:
    if not rest:
        return ""
    part = _RESNET_PARTS.get(rest[0])
    return None if part is None else _join(part, *rest[1:])


def _level_block_to_ldm(
    parts: list[str], path: str, lpb: int, attention_up_blocks: Collection[int] | None
) -> str | None:
    if len(parts) < 4:
        return None
    down = parts[0] == "down_blocks"
    level, kind, index, rest = _index(parts[1], path), parts[2], _index(parts[3], path), parts[4:]
    first = 1 + level * (lpb + 1) if down else level * (lpb + 1)
    blocks = "input_blocks" if down else "output_blocks"
    if kind in ("resnets", "attentions"):
        limit = lpb if down else lpb + 1
        if index >= limit:
            raise ValueError(f"{path!r}: index {index} does not fit layers_per_block={lpb}")
        if kind == "attentions":
            return _join(f"{blocks}.{first + index}.1", *rest)
        tail = _resnet_tail(rest)
        return None if tail is None else _join(f"{blocks}.{first + index}.0", tail)
    if index != 0 or kind != ("downsamplers" if down else "upsamplers"):
        return None
    if down:
        if rest and rest[0] != "conv":
            return None
        return _join(f"input_blocks.{first + lpb}.0", *(["op", *rest[1:]] if rest else []))
    if attention_up_blocks is None:
        raise ValueError(f"{path!r}: mapping an upsampler needs attention_up_blocks")
    slot = 2 if level in attention_up_blocks else 1
    return _join(f"output_blocks.{first + lpb}.{slot}", *rest)


def _mid_block_to_ldm(parts: list[str], path: str) -> str | None:
    if len(parts) == 1:
        return "middle_block"
    if len(parts) < 3:
        return None
    base = _MID_BLOCK.get((parts[1], _index(parts[2], path)))
    if base is None:
        return None
    if parts[1] == "attentions":
        return _join(base, *parts[3:])
    tail = _resnet_tail(parts[3:])
    return None if tail is None else _join(base, tail)


def attention_up_blocks(unet: torch.nn.Module) -> frozenset[int]:
    """Indices of the UNet's up blocks that carry attentions (their upsampler moves to slot 2)."""
    return frozenset(i for i, block in enumerate(unet.up_blocks) if hasattr(block, "attentions"))


def unet_module_map(unet: torch.nn.Module) -> dict[str, str]:
    """Every named module of `unet` that has an LDM counterpart -> its LDM path (no prefix)."""
    lpb = unet.config.layers_per_block
    with_attention = attention_up_blocks(unet)
    table = {}
    for name, _ in unet.named_modules():
        ldm = unet_module_to_ldm(name, lpb, with_attention) if name else None
        if ldm is not None:
            table[name] = ldm
    return table


# ---------------------------------------------------------------------------------------------- VAE


def _vae_key_to_ldm(key: str, num_levels: int) -> str:
    """LDM name of an AutoencoderKL state-dict key (decoder levels are numbered bottom-up in LDM)."""
    parts = key.split(".")
    if parts[0] in ("quant_conv", "post_quant_conv", "bn"):  # bn: FLUX.2's latent statistics, top level in BFL's file
        return key
    side, block, rest = parts[0], parts[1], parts[2:]
    if block in ("conv_in", "conv_out"):
        return key
    if block == "conv_norm_out":
        return _join(side, "norm_out", *rest)
    if block == "mid_block":
        kind, index, tail = rest[0], _index(rest[1], key), rest[2:]
        if kind == "attentions":
            return _join(side, "mid.attn_1", _vae_attention_tail(tail, key))
        return _join(side, f"mid.block_{index + 1}", _vae_resnet_tail(tail))
    if block in ("down_blocks", "up_blocks"):
        level, kind, tail = _index(rest[0], key), rest[1], rest[3:]
        ldm_level = f"down.{level}" if block == "down_blocks" else f"up.{num_levels - 1 - level}"
        if kind == "resnets":
            return _join(side, ldm_level, f"block.{rest[2]}", _vae_resnet_tail(tail))
        sampler = "downsample" if kind == "downsamplers" else "upsample"
        return _join(side, ldm_level, sampler, *tail)
    raise ValueError(f"VAE key {key!r} has no known LDM name")


def _vae_resnet_tail(tail: list[str]) -> str:
    return _join("nin_shortcut" if tail[0] == "conv_shortcut" else tail[0], *tail[1:])


def _vae_attention_tail(tail: list[str], key: str) -> str:
    if tail[:2] == ["to_out", "0"]:
        return _join("proj_out", *tail[2:])
    if tail[0] not in _VAE_ATTENTION_PARTS:
        raise ValueError(f"VAE attention key {key!r} has no known LDM name")
    return _join(_VAE_ATTENTION_PARTS[tail[0]], *tail[1:])


# ------------------------------------------------------------------------------------ text encoders


def _clip_key_to_ldm(key: str) -> str:
    """transformers CLIP keys keep their names in LDM; only the `text_model.` wrapper is normalised.

    transformers >= 5.6 flattened `CLIPTextModel` (no `text_model.` level) while
    `CLIPTextModelWithProjection` still has it, so accept both spellings.
    """
    return key.removeprefix("text_model.")


def _open_clip_key_to_ldm(key: str) -> str:
    """OpenCLIP name of a `CLIPTextModelWithProjection` key (q/k/v map to one fused in_proj)."""
    name = key.removeprefix("text_model.")
    if name in _OPEN_CLIP_TOP_LEVEL:
        return _OPEN_CLIP_TOP_LEVEL[name]
    if name == "text_projection.weight":
        return "text_projection"
    parts = name.split(".")
    if parts[:2] != ["encoder", "layers"] or len(parts) < 5:
        raise ValueError(f"text encoder key {key!r} has no known OpenCLIP name")
    layer, inner, param = parts[2], ".".join(parts[3:-1]), parts[-1]
    if inner in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        return f"transformer.resblocks.{layer}.attn.in_proj_{param}"
    if inner not in _OPEN_CLIP_LAYER_PARTS:
        raise ValueError(f"text encoder key {key!r} has no known OpenCLIP name")
    return f"transformer.resblocks.{layer}.{_OPEN_CLIP_LAYER_PARTS[inner]}.{param}"


# ------------------------------------------------------------------------------ whole-pipeline plan


@dataclass(frozen=True)
class LdmTensor:
    """One tensor of an LDM single file and the component tensors it is made from.

    `layout` says how: "same" (copy), "conv1x1" (LDM VAE attention stores linear weights as
    1x1 convolutions), "transposed" (OpenCLIP keeps `text_projection` as in x @ P) or "concat"
    (OpenCLIP fuses q, k, v into one in_proj, in that order).
    """

    key: str
    component: str
    sources: tuple[str, ...]
    layout: str = "same"


_LAYOUTS: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
    "same": lambda ts: ts[0],
    "conv1x1": lambda ts: ts[0][:, :, None, None] if ts[0].ndim == 2 else ts[0],
    "transposed": lambda ts: ts[0].T.contiguous(),
    "concat": lambda ts: torch.cat(ts, dim=0),
}


def ldm_plan(pipe, family) -> list[LdmTensor]:
    """Where every tensor of the pipeline's UNet, VAE and text encoder(s) goes in an LDM file;
    `family` (an `app.families.Family`) says where its text encoders live and in which layout."""
    plan = _unet_plan(pipe.unet) + _vae_plan(pipe.vae)
    for te in family.text_encoders:
        keys = getattr(pipe, te.component).state_dict().keys()
        prefix = te.single_file_prefix
        plan += _open_clip_plan(keys, prefix) if te.open_clip else _clip_plan(keys, te.component, prefix)
    return plan


def to_ldm_state_dict(pipe, family, view: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
    """The pipeline's weights as one LDM single-file state dict (SD1.5 or SDXL layout), each component
    tensor taken through `view` first (None: as it is)."""
    states = {}
    result = {}
    for entry in ldm_plan(pipe, family):
        if entry.component not in states:
            state = getattr(pipe, entry.component).state_dict()
            states[entry.component] = state if view is None else {k: view(t) for k, t in state.items()}
        tensors = [states[entry.component][s] for s in entry.sources]
        result[entry.key] = _LAYOUTS[entry.layout](tensors)
    return result


def ldm_shapes(pipe, family) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor `to_ldm_state_dict` would write, worked out on meta stand-ins: no
    weight is read, so a loaded model's weights that are still memory-mapped stay on disk (the fused
    OpenCLIP q/k/v alone would otherwise read 0.3 GB of an SDXL file)."""
    meta = to_ldm_state_dict(pipe, family, lambda t: t.to("meta"))
    return {key: tuple(tensor.shape) for key, tensor in meta.items()}


def _unet_plan(unet: torch.nn.Module) -> list[LdmTensor]:
    table = unet_module_map(unet)
    plan = []
    for key in unet.state_dict():
        module, _, param = key.rpartition(".")
        if module not in table:
            raise ValueError(f"UNet tensor {key!r} has no LDM name")
        plan.append(LdmTensor(f"{UNET_PREFIX}{table[module]}.{param}", "unet", (key,)))
    return plan


def _vae_plan(vae: torch.nn.Module) -> list[LdmTensor]:
    levels = len(vae.config.block_out_channels)
    plan = []
    for key in vae.state_dict():
        ldm = _vae_key_to_ldm(key, levels)
        conv = ".mid.attn_1." in ldm and ldm.endswith(("q.weight", "k.weight", "v.weight", "proj_out.weight"))
        plan.append(LdmTensor(VAE_PREFIX + ldm, "vae", (key,), "conv1x1" if conv else "same"))
    return plan


def _clip_plan(keys: Iterable[str], component: str, prefix: str) -> list[LdmTensor]:
    return [LdmTensor(prefix + _clip_key_to_ldm(k), component, (k,)) for k in keys]


def _open_clip_plan(keys: Iterable[str], prefix: str) -> list[LdmTensor]:
    plan = []
    for key in keys:
        if ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue  # folded into the q_proj entry below
        if ".self_attn.q_proj." in key:
            qkv = tuple(key.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj"))
            plan.append(LdmTensor(prefix + _open_clip_key_to_ldm(key), "text_encoder_2", qkv, "concat"))
        else:
            layout = "transposed" if key == "text_projection.weight" else "same"
            plan.append(LdmTensor(prefix + _open_clip_key_to_ldm(key), "text_encoder_2", (key,), layout))
    return plan


# ------------------------------------------------------------------- per-component file layouts
def vae_layout(vae: torch.nn.Module, prefix: str = "") -> dict[str, FileTensor]:
    """The VAE's tensors in the LDM layout (BFL's `ae.safetensors` too, with no prefix)."""
    return {entry.sources[0]: FileTensor(entry.key.replace(VAE_PREFIX, prefix, 1),
                                         unit_dims=2 if entry.layout == "conv1x1" else 0)
            for entry in _vae_plan(vae)}


def clip_layout(encoder: torch.nn.Module, prefix: str = "") -> dict[str, FileTensor]:
    """A CLIP text encoder's tensors as a standalone file (`clip_l.safetensors`) names them: the
    transformers names with their `text_model.` level, whichever spelling the installed model uses."""
    return {key: FileTensor(f"{prefix}text_model.{_clip_key_to_ldm(key)}") for key in encoder.state_dict()}


KOHYA_LDM = "kohya (LDM block names)"
LYCORIS = "LyCORIS"


def lora_aliases(unet: torch.nn.Module):
    """(key, parts, spelling) for every UNet module under its LDM name, as sd-scripts (SDXL) and
    LyCORIS spell it; `parts` is `((("unet", path), None),)`: one whole module."""
    for path, ldm in unet_module_map(unet).items():
        if getattr(unet.get_submodule(path), "weight", None) is None:
            continue
        parts = ((("unet", path), None),)
        flat = ldm.replace(".", "_")
        yield f"lora_unet_{flat}", parts, KOHYA_LDM
        yield f"lycoris_{flat}", parts, LYCORIS
