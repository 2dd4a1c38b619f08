"""Z-Image's union ControlNets (alibaba-pai `Z-Image-Turbo-Fun-Controlnet-Union` 1.0, 2.0, 2.1, 2.1-lite),
read into diffusers' `ZImageControlNetModel`, and the one way this engine holds them.

The files use diffusers' names already (`control_layers.N`, `control_all_x_embedder.2-1`,
`control_noise_refiner.N`); diffusers' own single-file conversion only drops 2.0's unused refiner blocks.
A file states no config, so it is read from the shapes and the base transformer's config:

* `control_layers_places`: VideoX-Fun spreads the control blocks evenly over the transformer's layers
  (1.0: 6 over 30 → every 5th; 2.x: 15 → every 2nd; lite: 3 → every 10th): `range(0, n_layers, n_layers // count)`;
* `control_in_dim`: the patch embedder's input over the patch volume: 16 latent channels (1.0), or 33 (2.x:
  control latents, the inpaint mask, the masked image's latents; zeros where there is no inpainting);
* how the control branch meets the noise refiner: 2.1 has blocks of its own for it (`control_noise_refiner.0`
  with a trained `before_proj`); 2.0 reuses its control layers there (its refiner tensors, if any, are the
  untrained zero initialisation, which diffusers drops too); 1.0's refiner blocks are plain transformer blocks.

A union model takes no mode: it reads any map (canny, HED, depth, pose, MLSD…) as it is.

Why `ZImageControlOnDenoiser`: diffusers' ControlNet runs the transformer's own embedders and refiners
(`from_transformer` assigns them to it), which registers them as its submodules: the same parameters would
be walked, placed, offloaded and counted twice, once under each component. Here they stay the
transformer's alone; the ControlNet only borrows them for its forward (plain attributes), so placement,
offload hooks, fp8 storage and LoRAs see each tensor exactly once, as the transformer's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
from diffusers import ZImageControlNetModel

Shapes = Mapping[str, tuple[int, ...]]
MARKERS = ("control_layers.0.after_proj.weight", "control_layers.0.before_proj.weight")
# What `ZImageControlNetModel.from_transformer` hands over from the transformer.
BORROWED = frozenset({"t_scale", "t_embedder", "all_x_embedder", "cap_embedder", "rope_embedder", "noise_refiner",
                      "context_refiner", "x_pad_token", "cap_pad_token"})


class ZImageControlOnDenoiser(ZImageControlNetModel):
    """`ZImageControlNetModel` whose borrowed transformer parts are plain attributes, not submodules:
    its parameters, state dict and moves are its own control branch only (see the module docstring)."""

    def __setattr__(self, name: str, value) -> None:
        if name in BORROWED:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def _count(shapes: Shapes, prefix: str) -> int:
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return len({m.group(1) for key in shapes if (m := pattern.match(key))})


def refiner_kind(shapes: Shapes, read: Callable[[str], torch.Tensor], latent_channels: int) -> str | None:
    """How the control branch meets the noise refiner (see the module docstring): "control_noise_refiner"
    (2.1), "control_layers" (2.0) or None (1.0). `read(key)` returns one file tensor (2.0 and 2.1 differ
    only by whether the refiner's `before_proj` was trained)."""
    before = "control_noise_refiner.0.before_proj.weight"
    if before in shapes and bool(read(before).any()):
        return "control_noise_refiner"
    if before in shapes or _control_in_dim(shapes) > latent_channels:
        return "control_layers"
    return None


_EMBEDDER = re.compile(r"^control_all_x_embedder\.(\d+)-(\d+)\.weight$")


def _control_in_dim(shapes: Shapes) -> int:
    """The channels per latent pixel: the patch embedder's input over its patch volume (`2-1`: 2×2×1)."""
    key, match = next((k, m) for k in shapes if (m := _EMBEDDER.match(k)))
    patch, frames = int(match.group(1)), int(match.group(2))
    return shapes[key][1] // (patch * patch * frames)


def config(shapes: Shapes, read: Callable[[str], torch.Tensor], denoiser: Mapping) -> dict:
    """`ZImageControlNetModel`'s config for a union file, from its shapes, `read` (see `refiner_kind`) and
    the base transformer's config `denoiser`."""
    count, layers = _count(shapes, "control_layers"), denoiser["n_layers"]
    if not 0 < count <= layers:
        raise ValueError(f"a Z-Image ControlNet with {count} control blocks cannot steer {layers} layers")
    kind = refiner_kind(shapes, read, denoiser["in_channels"])
    refiners = _count(shapes, "control_noise_refiner") if kind != "control_layers" else denoiser["n_refiner_layers"]
    return {"control_layers_places": list(range(0, layers, layers // count))[:count],
            "control_refiner_layers_places": list(range(denoiser["n_refiner_layers"])),
            "control_in_dim": _control_in_dim(shapes), "add_control_noise_refiner": kind,
            "n_refiner_layers": refiners or denoiser["n_refiner_layers"],
            **{k: denoiser[k] for k in ("all_patch_size", "all_f_patch_size", "dim", "n_heads", "n_kv_heads",
                                         "norm_eps", "qk_norm")}}


def file_keys(config: Mapping, keys) -> list[str]:
    """The file's tensors the model reads: 2.0's untrained refiner blocks are left out, as diffusers does."""
    drop = config["add_control_noise_refiner"] == "control_layers"
    return [k for k in keys if not (drop and k.startswith("control_noise_refiner."))]


def tiny_config(transformer: Mapping) -> dict:
    """A tiny 2.1-style union ControlNet on the tiny Z-Image transformer: a control block on each of its two
    layers, its own refiner block, 33 input channels (control, mask, masked-image latents)."""
    return {"control_layers_places": [0, 1], "control_refiner_layers_places": [0], "control_in_dim": 33,
            "add_control_noise_refiner": "control_noise_refiner", "n_refiner_layers": transformer["n_refiner_layers"],
            **{k: transformer[k] for k in ("all_patch_size", "all_f_patch_size", "dim", "n_heads", "n_kv_heads")}}
