"""Z-Image's union ControlNets (alibaba-pai `Z-Image-Turbo-Fun-Controlnet-Union` 1.0, 2.0, 2.1, 2.1-lite), read
into diffusers' `ZImageControlNetModel`, and the kit that runs them (`Family.controlnet` of Z-Image Turbo and Base).

The files use diffusers' names already (`control_layers.N`, `control_all_x_embedder.2-1`, `control_noise_refiner.N`).
A file states no config; what the shapes do not say is the published rule:

* `control_layers_places`: VideoX-Fun spreads the control blocks evenly over the transformer's layers
  (1.0: 6 over 30, every 5th; 2.x: 15, every 2nd; lite: 3, every 10th): `range(0, n_layers, n_layers // count)`;
* `control_in_dim`: 16 latent channels (1.0), or 33 (2.x: control latents, the inpaint mask, the masked image's
  latents; zeros where there is no inpainting);
* how the control branch meets the noise refiner: 2.1 has blocks of its own for it (`control_noise_refiner.0`
  with a trained `before_proj`); 2.0 reuses its control layers there (its refiner tensors, if the file has them,
  are the untrained zero initialisation, which diffusers drops too: 2.0 and 2.1 differ by those values alone);
  1.0's refiner blocks are plain transformer blocks.

A union model takes no mode: it reads any map (canny, HED, depth, pose, MLSD…) as it is.

Why a stack of our own rather than diffusers' pipeline as it is: diffusers' ControlNet runs the transformer's own
embedders and refiners, which `from_transformer` assigns to it, registering them as its submodules: the same
parameters would be placed, offloaded, stored in fp8 and strict-checked twice, once under each component. The
stack takes that assignment instead and lends the parts to its nets as plain attributes for each forward, so
every tensor belongs to one component, the transformer. It also runs several units (diffusers' pipeline takes
one ControlNet), each with its weight and guidance window (diffusers' has neither start nor end).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch
from diffusers import ZImageControlNetModel
from diffusers.configuration_utils import FrozenDict
from diffusers.models.modeling_utils import ModelMixin

from app.controlnet.units import CONTROL_MODES

Shapes = Mapping[str, tuple[int, ...]]
# What `ZImageControlNetModel.from_transformer` hands over from the transformer.
BORROWED = frozenset({"t_scale", "t_embedder", "all_x_embedder", "cap_embedder", "rope_embedder", "noise_refiner",
                      "context_refiner", "x_pad_token", "cap_pad_token"})
# (control blocks, input channels, refiner kind) of the published files: 2.1, 2.0, 1.0, 2.1-lite (and 2.0-lite's
# shape). 2.1 is tried before 2.0, whose shapes it shares when a 2.0 file keeps its untrained refiner tensors.
PUBLISHED = ((15, 33, "control_noise_refiner"), (15, 33, "control_layers"), (6, 16, None),
             (3, 33, "control_noise_refiner"), (3, 33, "control_layers"))
_EMBEDDER = re.compile(r"^control_all_x_embedder\.\d+-\d+\.weight$")
_BEFORE = "control_noise_refiner.0.before_proj.weight"


class ZImageControlNetStack(ModelMixin):
    """The ControlNets of one generation's units (one entry per unit, in unit order; two units naming one model
    share it), run as one: each net on its unit's control latents, times its weight inside its guidance window,
    the residuals summed per transformer layer. Control latents come image-major, unit-minor
    (`SteadyZImageControlNetPipeline.prepare_image`): row `j·units + u` is unit u's map for latent row j, with
    or without the CFG batch, whose halves diffusers' pipeline repeats whole."""

    def __init__(self, controlnets) -> None:
        super().__init__()
        self.nets = torch.nn.ModuleList(list(controlnets))
        self._borrowed: dict[str, object] = {}
        self.windows: tuple[tuple[float, float], ...] = ()  # (start, end) per unit: `arm`
        self.steps = 1  # of the call under way, and the step reached: `begin`
        self._step = 0

    def __setattr__(self, name: str, value) -> None:
        if name in BORROWED:  # `ZImageControlNetModel.from_transformer(stack, transformer)`, in the pipeline's init
            self._borrowed[name] = value
        else:
            super().__setattr__(name, value)

    @property
    def config(self) -> FrozenDict:
        """What the pipeline reads of its ControlNet: the channels to pad the control latents to. The stack takes
        them as the VAE gives them, the latents' own channels, and pads for each net (`_padded`)."""
        key, embedder = next(iter(self._borrowed["all_x_embedder"].items()))
        patch, frames = (int(n) for n in key.split("-"))
        return FrozenDict(control_in_dim=embedder.in_features // (patch * patch * frames))

    def begin(self, steps: int) -> None:
        """A denoising call of `steps` steps starts: the guidance windows count from its first step."""
        self.steps, self._step = max(1, int(steps)), 0

    def forward(self, x, t, cap_feats, control_context, conditioning_scale=1.0, patch_size=2, f_patch_size=1):
        step, self._step = self._step, self._step + 1
        units = len(self.nets)
        scales = conditioning_scale if isinstance(conditioning_scale, (list, tuple)) else [conditioning_scale] * units
        # The pad tokens are tensors the transformer owns itself, brought in around the transformer's own forward
        # only (offload streams them so): lent as the latents' device and dtype, as that forward would see them.
        lent = {k: v.to(device=x[0].device, dtype=x[0].dtype) if isinstance(v, torch.Tensor) else v
                for k, v in self._borrowed.items()}
        total: dict[int, torch.Tensor] = {}
        for u, net in enumerate(self.nets):
            start, end = self.windows[u] if u < len(self.windows) else (0.0, 1.0)
            if step / self.steps < start or (step + 1) / self.steps > end:  # diffusers' keep rule for SD and FLUX.1
                continue
            for name, value in lent.items():
                object.__setattr__(net, name, value)  # lent, never registered: the transformer owns them
            out = net(x, t, cap_feats, _padded(control_context[u::units], net.config.control_in_dim),
                      conditioning_scale=scales[u], patch_size=patch_size, f_patch_size=f_patch_size)
            total = {i: total[i] + h if i in total else h for i, h in out.items()}
        return total


def _padded(control: torch.Tensor, channels: int) -> torch.Tensor:
    """(rows, latent channels, 1, h, w) control latents with zero channels up to `channels` (2.x's inpaint mask and
    masked-image latents, absent without inpainting: diffusers' pipeline pads so)."""
    missing = channels - control.shape[1]
    if missing <= 0:
        return control
    return torch.cat([control, control.new_zeros(control.shape[0], missing, *control.shape[2:])], dim=1)


def arm(stack: ZImageControlNetStack, kind: str, maps: Sequence, units: Sequence, guidance: float) -> dict:
    """The Z-Image control pipeline's arguments for one call: the maps (one per unit), one weight per unit; the
    stack told each unit's guidance window. A control mode other than Balanced is refused by name (the
    extension's modes rescale a UNet's residuals)."""
    other = next((u.control_mode for u in units if u.control_mode != CONTROL_MODES[0]), None)
    if other is not None:
        raise ValueError(f"Z-Image ControlNets run with control mode {CONTROL_MODES[0]!r} only, got {other!r}")
    stack.windows = tuple((float(u.guidance_start), float(u.guidance_end)) for u in units)
    return {"control_image": list(maps), "controlnet_conditioning_scale": [float(u.weight) for u in units]}


def _count(shapes: Shapes, prefix: str) -> int:
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return len({m.group(1) for key in shapes if (m := pattern.match(key))})


def matches(shapes: Shapes) -> bool:
    """A Z-Image union ControlNet: control blocks with their output projection and a control patch embedder."""
    return "control_layers.0.after_proj.weight" in shapes and any(_EMBEDDER.match(k) for k in shapes)


def _config(base: Mapping, count: int, channels: int, kind: str | None) -> dict:
    layers, refiners = base["n_layers"], base["n_refiner_layers"]
    return {"control_layers_places": list(range(0, layers, max(1, layers // count)))[:count],
            "control_refiner_layers_places": list(range(refiners)), "control_in_dim": channels,
            "add_control_noise_refiner": kind, "n_refiner_layers": refiners,
            **{k: base[k] for k in ("all_patch_size", "all_f_patch_size", "dim", "n_heads", "n_kv_heads", "norm_eps",
                                    "qk_norm") if k in base}}


def single_file_configs(config_dir: Path, tiny_transformer: Mapping) -> tuple[dict, ...]:
    """The published layouts on the full-size transformer (the bundled config), then the tiny ones (a control
    block on each of the tiny transformer's layers, in each refiner kind)."""
    full = json.loads((config_dir / "transformer" / "config.json").read_text())
    tiny = tiny_transformer["n_layers"]
    return (*(_config(full, *layout) for layout in PUBLISHED),
            *(_config(tiny_transformer, tiny, channels, kind) for _, channels, kind in PUBLISHED[:3]))


def convert(state: dict, config: Mapping) -> dict:
    """A file's tensors for `config` (diffusers' names already), or ValueError when its block count or refiner kind
    is another (before the loader builds anything): 2.1's refiner `before_proj` is trained, 2.0's is absent or zero
    (its refiner tensors are then left out, as diffusers does)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    count = _count(shapes, "control_layers")
    if count != len(config["control_layers_places"]):
        raise ValueError(f"{count} control blocks, not {len(config['control_layers_places'])}")
    kind = config["add_control_noise_refiner"]
    trained = _BEFORE in state and bool(state[_BEFORE].any())
    if (kind == "control_noise_refiner") != trained or (kind is None and _BEFORE in state):
        raise ValueError(f"its noise-refiner blocks are not {kind!r}'s")
    if kind == "control_layers":
        return {k: v for k, v in state.items() if not k.startswith("control_noise_refiner.")}
    return state


def tiny_config(transformer: Mapping) -> dict:
    """A tiny 2.1-style union ControlNet on the tiny Z-Image transformer: a control block on each of its layers,
    refiner blocks of its own, 33 input channels (control, mask, masked-image latents)."""
    return _config(transformer, transformer["n_layers"], 33, "control_noise_refiner")


def zimage_controlnet_kit(pipelines: Mapping[str, type], config_dir: Path, tiny_transformer: Mapping):
    """Z-Image's `ControlNetKit`: diffusers' `ZImageControlNetModel`, this module's stack, files and `arm`."""
    from app.families import ControlNetKit

    return ControlNetKit(
        model_classes=(ZImageControlNetModel,), pipelines=MappingProxyType(dict(pipelines)),
        stack_class=ZImageControlNetStack, matches=matches,
        single_file_configs=lambda: single_file_configs(config_dir, tiny_transformer),
        tiny_config=MappingProxyType(tiny_config(tiny_transformer)), arm=arm, convert=convert)
