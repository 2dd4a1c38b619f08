"""FLUX.1 ControlNets as users have them, read into diffusers' `FluxControlNetModel`.

Two lines of files, one class (diffusers reads both):

* **InstantX / Shakker-Labs** (`FLUX.1-dev-Controlnet-Union`, `…-Union-Pro`, `…-Canny`, `…-Union-Pro-2.0`):
  diffusers' own tensor names (`controlnet_blocks.N`, `controlnet_single_blocks.N`, `controlnet_x_embedder`),
  as a folder with `config.json` or as the bare `diffusion_pytorch_model.safetensors` renamed. The control
  image is VAE-encoded and packed like the latents. A union model (`controlnet_mode_embedder`) also reads a
  control mode, one learned token prepended to the text: see `union_mode`.
* **XLabs** (`flux-canny-controlnet-v3.safetensors`, x-flux's `ControlNetFlux`): Black Forest Labs' block
  names, a pixel-space hint encoder (`input_hint_block`) and `pos_embed_input`; two double blocks whose
  residuals repeat over the transformer's 19 (`flux_layout.xlabs_controlnet_layout` names them).

A bare file states no config, so it is read from the tensor shapes: block counts, widths, head size (the
q-norm's length), guidance embedder, union modes. The rotary axes are not in any tensor; they are the
base transformer's (the ControlNet attends with the same positions), as every FLUX.1 model states (16, 56, 56).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

Shapes = Mapping[str, tuple[int, ...]]

INSTANTX_MARKERS = ("controlnet_blocks.0.weight", "controlnet_x_embedder.weight", "x_embedder.weight")
XLABS_MARKERS = ("controlnet_blocks.0.weight", "input_hint_block.0.weight", "pos_embed_input.weight")

# InstantX's union modes (its model card; Shakker-Labs' Union-Pro keeps them), and the A1111 preprocessor
# modules whose maps each mode was trained on, matched as name prefixes. Edge maps of every kind (lines,
# scribbles, thresholds, inverted drawings) go to canny, the one edge mode the union model has.
UNION_MODES = ("canny", "tile", "depth", "blur", "pose", "gray", "lq")
_MODE_OF_MODULE = (
    ("canny", ("canny", "lineart", "softedge", "scribble", "threshold", "invert", "mlsd")),
    ("tile", ("tile",)),
    ("depth", ("depth",)),
    ("blur", ("blur",)),
    ("pose", ("openpose", "dw_openpose", "densepose")),
    ("gray", ("recolor",)),
)


def union_mode(module: str) -> int:
    """The union mode index of a unit whose map comes from preprocessor `module` (an A1111 name): the
    union model is told what kind of map it reads, as InstantX's model card lists them (canny 0, tile 1,
    depth 2, blur 3, pose 4, gray 5, low quality 6). A mode name itself is taken too. A module with no
    mode ("none": a map made elsewhere; normal maps; inpaint) is refused by name: a wrong mode draws a
    plausible but wrong image, which is worse than a clear error."""
    asked = (module or "none").strip().lower()
    if asked in UNION_MODES:
        return UNION_MODES.index(asked)
    for mode, prefixes in _MODE_OF_MODULE:
        if asked.startswith(prefixes):
            return UNION_MODES.index(mode)
    takes = ", ".join(f"{mode} ({'/'.join(p + '…' for p in prefixes)})" for mode, prefixes in _MODE_OF_MODULE)
    raise ValueError(f"a FLUX.1 union ControlNet reads the kind of map from the preprocessor; {module!r} names "
                     f"none of its modes: {takes}")


def _count(shapes: Shapes, prefix: str) -> int:
    """How many numbered blocks `prefix.N.` the file holds."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return len({m.group(1) for key in shapes if (m := pattern.match(key))})


def _common(inner: int, head: int, denoiser: Mapping) -> dict:
    if inner % head:
        raise ValueError(f"a FLUX.1 ControlNet of width {inner} cannot have heads of {head}")
    return {"attention_head_dim": head, "num_attention_heads": inner // head,
            "axes_dims_rope": list(denoiser["axes_dims_rope"])}


def instantx_config(shapes: Shapes, denoiser: Mapping) -> dict:
    """`FluxControlNetModel`'s config for a file in diffusers' names (InstantX, Shakker-Labs, or an XLabs
    model saved by diffusers), from its shapes and the base transformer's config `denoiser`."""
    inner, in_channels = shapes["x_embedder.weight"]
    config = {"in_channels": in_channels, "num_layers": _count(shapes, "controlnet_blocks"),
              "num_single_layers": _count(shapes, "controlnet_single_blocks"),
              "joint_attention_dim": shapes["context_embedder.weight"][1],
              "pooled_projection_dim": shapes["time_text_embed.text_embedder.linear_1.weight"][1],
              "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in shapes,
              "num_mode": shapes["controlnet_mode_embedder.weight"][0] if "controlnet_mode_embedder.weight" in shapes
              else None,
              **_common(inner, shapes["transformer_blocks.0.attn.norm_q.weight"][0], denoiser)}
    if "input_hint_block.conv_out.weight" in shapes:  # XLabs in diffusers' names: 2×2 patches of hint features
        channels = shapes["input_hint_block.conv_out.weight"][0]
        config |= {"conditioning_embedding_channels": channels, "patch_size": _patch(in_channels, channels)}
    return config


def xlabs_config(shapes: Shapes, denoiser: Mapping) -> dict:
    """`FluxControlNetModel`'s config for an XLabs file (BFL names), from its shapes and `denoiser`'s config:
    double blocks only, the hint encoder's features cut into 2×2 patches (x-flux's rearrange)."""
    inner, in_channels = shapes["img_in.weight"]
    hint = max(int(m.group(1)) for key in shapes if (m := re.match(r"^input_hint_block\.(\d+)\.weight$", key)))
    channels = shapes[f"input_hint_block.{hint}.weight"][0]
    return {"in_channels": in_channels, "num_layers": _count(shapes, "double_blocks"), "num_single_layers": 0,
            "joint_attention_dim": shapes["txt_in.weight"][1],
            "pooled_projection_dim": shapes["vector_in.in_layer.weight"][1],
            "guidance_embeds": "guidance_in.in_layer.weight" in shapes, "conditioning_embedding_channels": channels,
            "patch_size": _patch(in_channels, channels),
            **_common(inner, shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0], denoiser)}


def _patch(in_channels: int, channels: int) -> int:
    """The side of the square patches that turn `channels` hint features into `in_channels` per token."""
    side = round((in_channels // channels) ** 0.5)
    if side * side * channels != in_channels:
        raise ValueError(f"a FLUX.1 ControlNet hint of {channels} channels cannot make tokens of {in_channels}")
    return side


def fits(config: Mapping, denoiser: Mapping) -> str:
    """Why a ControlNet of `config` cannot steer a transformer of config `denoiser` ("" when it can): its
    residuals are added to the transformer's hidden states, so widths must agree, and it reads the same
    latent tokens and text states."""
    for key in ("in_channels", "joint_attention_dim", "pooled_projection_dim"):
        if config[key] != denoiser[key]:
            return f"its {key} is {config[key]}, the loaded FLUX.1 model's is {denoiser[key]}"
    width, base = (c["num_attention_heads"] * c["attention_head_dim"] for c in (config, denoiser))
    if width != base:
        return f"it is {width} wide, the loaded FLUX.1 model is {base} wide"
    if config["guidance_embeds"] and not denoiser["guidance_embeds"]:
        return "it was made for FLUX.1-dev (it reads the distilled guidance), the loaded model has no guidance input"
    return ""


def tiny_configs(dev: bool, transformer: Mapping) -> dict[str, dict]:
    """Tiny ControlNets that fit the tiny FLUX.1 transformer: InstantX-style union (one double and one single
    block, whose residuals spread over the transformer's two of each, and InstantX's 10 mode slots) and
    XLabs-style (two double blocks that repeat, a pixel hint encoder)."""
    base = {k: transformer[k] for k in ("in_channels", "attention_head_dim", "num_attention_heads",
                                        "joint_attention_dim", "pooled_projection_dim", "axes_dims_rope")}
    return {"union": dict(base, num_layers=1, num_single_layers=1, guidance_embeds=dev, num_mode=10),
            "xlabs": dict(base, num_layers=2, num_single_layers=0, guidance_embeds=dev, patch_size=2,
                          conditioning_embedding_channels=transformer["in_channels"] // 4)}
