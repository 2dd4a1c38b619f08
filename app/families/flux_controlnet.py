"""FLUX.1 ControlNets as users have them, read into diffusers' `FluxControlNetModel`, and the kit that runs them
(`Family.controlnet` of FLUX.1-dev and -schnell).

Two lines of files, one class (diffusers runs both):

* **InstantX / Shakker-Labs / jasperai** (`FLUX.1-dev-Controlnet-Union`, `…-Union-Pro`, `…-Canny`, `…-Union-Pro-2.0`,
  `Flux.1-dev-Controlnet-Upscaler`): diffusers' own tensor names (`controlnet_blocks.N`, `controlnet_single_blocks.N`,
  `controlnet_x_embedder`), as a folder with `config.json` or as the bare `diffusion_pytorch_model.safetensors`.
  The control image is VAE-encoded and packed like the latents. A union model (`controlnet_mode_embedder`) also
  reads a control mode, one learned token prepended to the text: see `union_mode`.
* **XLabs** (`flux-canny-controlnet-v3.safetensors`, x-flux's `ControlNetFlux`): Black Forest Labs' block names, a
  pixel-space hint encoder (`input_hint_block`) and `pos_embed_input`; two double blocks whose residuals repeat
  over the transformer's 19 (`flux_layout.xlabs_controlnet_layout` names them for diffusers' class).

A bare file states no config. Every config value but the rotary axes (the base transformer's: the ControlNet
attends at the same positions) follows from the shapes, so the published layouts are listed by block counts
(`PUBLISHED`) and `convert` tells at once, from the file's own block counts, hint encoder and mode table, whether
a candidate is the file's layout, before the loader builds anything. The loader tries them in order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch
from diffusers import FluxControlNetModel, FluxMultiControlNetModel

from app.controlnet.units import CONTROL_MODES
from app.families.file_layout import file_shapes, to_file, to_model
from app.families.flux_layout import xlabs_controlnet_layout

Shapes = Mapping[str, tuple[int, ...]]

# (double blocks, single blocks, union modes) of the InstantX-style files people use: InstantX's single-purpose
# ones (Canny, Depth; first: the bench's full-size ControlNet, which any preprocessor runs), its Union (and
# Shakker-Labs' Union-Pro, 10 mode slots), Shakker-Labs' Union-Pro-2.0, jasperai's (Upscaler, Depth, Surface
# Normals), and the two others DiffSynth-Studio lists.
PUBLISHED = ((5, 10, None), (5, 10, 10), (6, 0, None), (5, 0, None), (4, 10, None), (4, 1, None))
XLABS_DOUBLE_BLOCKS = 2  # x-flux's ControlNetFlux(controlnet_depth=2)
_BASE_KEYS = ("in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
              "pooled_projection_dim", "axes_dims_rope")

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
    """The union mode index of a unit whose map comes from preprocessor `module` (an A1111 name): the union
    model is told what kind of map it reads, as InstantX's model card numbers them (canny 0, tile 1, depth 2,
    blur 3, pose 4, gray 5, low quality 6); a mode's own name is taken too. A module with no mode ("none": a
    map made elsewhere; normal maps; inpaint) is refused by name: a wrong mode draws a plausible but wrong
    image, which is worse than a clear error."""
    asked = (module or "none").strip().lower()
    if asked in UNION_MODES:
        return UNION_MODES.index(asked)
    for mode, prefixes in _MODE_OF_MODULE:
        if asked.startswith(prefixes):
            return UNION_MODES.index(mode)
    takes = ", ".join(f"{mode} ({'/'.join(p + '…' for p in prefixes)})" for mode, prefixes in _MODE_OF_MODULE)
    raise ValueError(f"a FLUX.1 union ControlNet reads the kind of map from the preprocessor; {module!r} names "
                     f"none of its modes: {takes}")


class FluxControlNetStack(FluxMultiControlNetModel):
    """The ControlNets of one generation's units (one entry per unit, in unit order; two units naming one
    model share it): diffusers' multi-ControlNet, whose forward sums the units' residuals, so the pipeline
    always takes its multi path (bit-identical to the single one for one unit)."""

    def __init__(self, controlnets) -> None:
        super().__init__(list(controlnets))


def arm(stack: FluxControlNetStack, kind: str, maps: Sequence, units: Sequence, guidance: float) -> dict:
    """The FLUX.1 control pipelines' arguments for one call: one map, weight, start, end and union mode per
    unit. Refused by name: a control mode other than Balanced (the extension's modes rescale a UNet's
    residuals; FLUX.1-dev has no CFG batch to inject into), and XLabs beside InstantX-style ControlNets
    (diffusers adds residuals by one rule for all: XLabs' repeat over the blocks, or InstantX's spread)."""
    other = next((u.control_mode for u in units if u.control_mode != CONTROL_MODES[0]), None)
    if other is not None:
        raise ValueError(f"FLUX.1 ControlNets run with control mode {CONTROL_MODES[0]!r} only, got {other!r}")
    if len({net.input_hint_block is None for net in stack.nets}) > 1:
        raise ValueError("XLabs and InstantX-style FLUX.1 ControlNets cannot run in one generation: "
                         "use ControlNets of one kind")
    return {"control_image": list(maps),
            "control_mode": [union_mode(u.module) if net.union else None
                             for u, net in zip(units, stack.nets, strict=True)],
            "controlnet_conditioning_scale": [float(u.weight) for u in units],
            "control_guidance_start": [float(u.guidance_start) for u in units],
            "control_guidance_end": [float(u.guidance_end) for u in units]}


def _count(shapes: Shapes, prefix: str) -> int:
    """How many numbered blocks `prefix.N.` the file holds."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return len({m.group(1) for key in shapes if (m := pattern.match(key))})


def matches(shapes: Shapes) -> bool:
    """A FLUX.1 ControlNet: its residual projections beside FLUX.1's pooled-text embedder (which FLUX.2's lack),
    in diffusers' names (InstantX-style) or BFL's (XLabs, with its hint encoder)."""
    instantx = "time_text_embed.text_embedder.linear_1.weight" in shapes
    xlabs = "vector_in.in_layer.weight" in shapes and "input_hint_block.0.weight" in shapes
    return "controlnet_blocks.0.weight" in shapes and (instantx or xlabs)


def _configs(base: Mapping) -> list[dict]:
    """The published layouts on one transformer config `base` (full size or tiny), dev's guidance first."""
    common = {k: base[k] for k in _BASE_KEYS}
    out = []
    for guided in (True, False):
        out += [dict(common, num_layers=d, num_single_layers=s, num_mode=m, guidance_embeds=guided)
                for d, s, m in PUBLISHED]
        out.append(dict(common, num_layers=XLABS_DOUBLE_BLOCKS, num_single_layers=0, guidance_embeds=guided,
                        patch_size=2, conditioning_embedding_channels=base["in_channels"] // 4))
    return out


def single_file_configs(config_dir: Path, tiny_transformer: Mapping) -> tuple[dict, ...]:
    """Every layout on the full-size transformer (the bundled config), then on the tiny one."""
    full = json.loads((config_dir / "transformer" / "config.json").read_text())
    return (*_configs(full), *_configs(tiny_transformer), tiny_config(tiny_transformer),
            tiny_config(tiny_transformer, union=True))


def convert(state: dict, config: Mapping) -> dict:
    """A single file's tensors in diffusers' names for `config`, or ValueError when the file's own block counts,
    hint encoder, mode table or guidance embedder show it has another layout (checked before any shell is built)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    xlabs = config.get("conditioning_embedding_channels") is not None
    blocks = _count(shapes, "double_blocks" if xlabs else "controlnet_blocks")
    if xlabs != ("pos_embed_input.weight" in shapes) or blocks != config["num_layers"]:
        names = "BFL" if "img_in.weight" in shapes else "diffusers"
        raise ValueError(f"not the {'XLabs' if xlabs else 'InstantX'} layout of {config['num_layers']} double "
                         f"blocks (the file has {blocks} in {names} names)")
    embedder = shapes["img_in.weight" if xlabs else "x_embedder.weight"]
    if embedder != (config["num_attention_heads"] * config["attention_head_dim"], config["in_channels"]):
        raise ValueError(f"its patch embedder is {embedder}")
    if xlabs:
        found = {"guidance_embeds": "guidance_in.in_layer.weight" in shapes}
    else:
        modes = shapes.get("controlnet_mode_embedder.weight", (None,))[0]
        found = {"num_single_layers": _count(shapes, "controlnet_single_blocks"), "num_mode": modes,
                 "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in shapes}
    differs = [k for k, v in found.items() if config.get(k) != v]
    if differs:
        raise ValueError(f"the file's {differs[0]} is {found[differs[0]]}")
    if not xlabs:
        return state
    with torch.device("meta"):
        shell = FluxControlNetModel.from_config(dict(config))
    shapes = {k: v.shape for k, v in shell.state_dict().items()}
    return to_model(xlabs_controlnet_layout(shell), state.__getitem__, shapes)


def to_single_file(state: dict, config: Mapping) -> dict:
    """The inverse of `convert` (the tests' writer): XLabs' names for an XLabs config, diffusers' otherwise."""
    if config.get("conditioning_embedding_channels") is None:
        return dict(state)
    with torch.device("meta"):
        shell = FluxControlNetModel.from_config(dict(config))
    layout = xlabs_controlnet_layout(shell)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return to_file(layout, state, file_shapes(layout, shapes))


def tiny_config(transformer: Mapping, union: bool = False) -> dict:
    """A tiny InstantX-style ControlNet on the tiny FLUX.1 transformer: one double and one single block, whose
    residuals spread over the transformer's two of each; with `union`, InstantX's 10 mode slots. The demo's is
    plain, so a unit with any preprocessor (or none) runs it."""
    return dict({k: transformer[k] for k in _BASE_KEYS}, num_layers=1, num_single_layers=1,
                guidance_embeds=transformer["guidance_embeds"], num_mode=10 if union else None)


def flux_controlnet_kit(pipelines: Mapping[str, type], config_dir: Path, tiny_transformer: Mapping):
    """FLUX.1's `ControlNetKit`: diffusers' `FluxControlNetModel`, this module's stack, files and `arm`."""
    from app.families import ControlNetKit

    return ControlNetKit(
        model_classes=(FluxControlNetModel,), pipelines=MappingProxyType(dict(pipelines)),
        stack_class=FluxControlNetStack, matches=matches,
        single_file_configs=lambda: single_file_configs(config_dir, tiny_transformer),
        tiny_config=MappingProxyType(tiny_config(tiny_transformer)), arm=arm, convert=convert,
        to_single_file=to_single_file)
