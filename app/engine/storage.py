"""Weights stored in fewer bits: which layers, their codec, the hook; and which of them compute in fp8.

Why: a model whose large matrices rest in fp8 takes about half the memory of bf16, at rest and on
the bus. The engine never computes in fp8: a `quant.dequant` hook widens a stored weight to the
layer's compute dtype for its forward and points back to the stored bytes afterwards (the same
`.data` swap streaming uses, so the Parameter object stays). Those bytes never change while the
model is loaded: LoRAs on such layers are bypass forwards in the compute dtype (app/adapters/
bypass.py), never fused and re-quantised, so a LoRA delta is not rounded to 3 mantissa bits and
removing it is bit-exact by construction.

Which layers: the weights of linear and convolution layers of the denoiser and the text
encoders. They stay in the compute dtype where peers keep high precision too: every norm and
embedding (not linear/conv, so never chosen), the VAE, biases, and the family's sensitive first
and last layers (`Precision.high_precision`: SD's conv_in, conv_out, time and class embeddings,
text projection). The cast is a plain round-to-nearest cast (ComfyUI's `fp8_e4m3fn` weight
dtype does the same): e4m3 keeps ~2 significant digits up to ±448, ample for these weights.

How a layer rests is its codec (app/engine/codecs.py: fp8, int8, the GGUF block types): the
weights mode picks fp8 or int8 for the layers above; a `.gguf` file brings its packed layers with
their codec (`codecs.FILE_LAYERS`, set by the loader on each component), whatever the mode.

The `fp8-compute` mode stores the same layers, and the Linear ones that qualify (`MatmulLayers`,
app/engine/fp8_matmul.py) are stored with a float32 scale per row and computed as fp8 matmuls, their
weight never widened; the others keep the path above.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from app.adapters.layer_ops import weight_shape
from app.engine import codecs, fp8_matmul
from app.engine.codecs import Codec
from app.engine.placement import Pinned
from app.families import Family
from app.hooks import HookRegistry, ModelHook
from app.settings import WEIGHTS_CHOICES

log = logging.getLogger(__name__)

# weights mode -> the codec its large weights rest in ("full": none, every weight in the compute dtype)
WEIGHTS_MODES: dict[str, Codec | None] = {"full": None, "fp8": codecs.FP8, "fp8-compute": codecs.FP8,
                                          "int8": codecs.INT8}
if tuple(WEIGHTS_MODES) != WEIGHTS_CHOICES:
    raise ImportError(f"weights modes {tuple(WEIGHTS_MODES)} and settings.WEIGHTS_CHOICES {WEIGHTS_CHOICES} disagree")
MATMUL_MODES = frozenset({"fp8-compute"})  # modes whose qualifying Linear layers compute in fp8
_STORABLE = (torch.nn.Linear, torch.nn.Conv2d)

Stored = dict[str, dict[str, Codec]]  # component -> {module path: the codec its weight rests in}


@dataclass(frozen=True)
class MatmulLayers:
    """Of the stored layers, those computed as fp8 matmuls, and why each other one is not."""

    layers: Mapping[str, frozenset[str]] = field(default_factory=dict)  # component -> module paths
    unfit: Mapping[str, str] = field(default_factory=dict)  # "component.path" -> why it widens instead

    def __len__(self) -> int:
        return sum(map(len, self.layers.values()))

    def kept(self) -> dict[str, Pinned]:
        """What the placement plan keeps in its own dtype at rest and at compute: the fp8 weight and
        its float32 scales (a move or a repair never widens either)."""
        return {component: {key: dtype for path in paths
                            for key, dtype in (((path, "weight"), fp8_matmul.E4M3),
                                               ((path, fp8_matmul.SCALE), torch.float32))}
                for component, paths in self.layers.items()}

    def unfit_summary(self) -> tuple[str, ...]:
        """Each reason with how many layers it keeps on the storage path, most first."""
        counts: dict[str, int] = {}
        for reason in self.unfit.values():
            counts[reason] = counts.get(reason, 0) + 1
        return tuple(f"{n} × {reason}" for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def layers_to_store(pipe, family: Family, weights: str) -> Stored:
    """The layers whose weight rests in a codec: those its file holds packed, and those `weights`' codec
    takes (none for "full")."""
    out: Stored = {}
    for component in family.components:
        layers = component_layers(getattr(pipe, component), component, family, weights)
        if layers:
            out[component] = layers
    return out


def component_layers(root: torch.nn.Module, component: str, family: Family, weights: str) -> dict[str, Codec]:
    """Of one component (the denoiser, a text encoder, an attached ControlNet), the layers `layers_to_store`
    picks: those its file holds packed, then linear and convolution weights in the mode's codec, the family's
    high-precision layers and pinned tensors aside."""
    packed: dict[str, Codec] = dict(getattr(root, codecs.FILE_LAYERS, None) or {})
    codec = WEIGHTS_MODES[weights]
    if codec is None:
        return packed
    sensitive = codecs.sensitive(family.precision.high_precision)
    return {**{path: codec for path, module in root.named_modules()
               if isinstance(module, _STORABLE) and family.pinned_dtype(component, path, "weight") is None
               and not sensitive(path)}, **packed}


def dtypes(layers: Stored) -> dict[str, dict[str, torch.dtype]]:
    """What each stored weight rests in, as the placement plan keeps it."""
    return {component: {path: codec.dtype for path, codec in paths.items()} for component, paths in layers.items()}


def kept(layers: Stored, matmul: MatmulLayers) -> dict[str, Pinned]:
    """The tensors the placement plan keeps in their own dtype beside the stored weights: the float32 row
    scales of int8 layers and the fp8-matmul layers' weights and scales (a move never widens either)."""
    out = {component: dict(pins) for component, pins in matmul.kept().items()}
    for component, paths in layers.items():
        out.setdefault(component, {}).update({(path, codecs.SCALE): torch.float32
                                              for path, codec in paths.items() if codec.row_scale})
    return {component: pins for component, pins in out.items() if pins}


def matmul_layers(pipe, layers: Stored, weights: str, compute_dtype: torch.dtype) -> MatmulLayers:
    """The stored layers `weights` computes as fp8 matmuls; each other stored layer with its reason
    (logged once here, shown in Diagnostics). None in a storage-only mode."""
    if weights not in MATMUL_MODES:
        return MatmulLayers()
    chosen: dict[str, frozenset[str]] = {}
    unfit: dict[str, str] = {}
    for component, paths in layers.items():
        root = getattr(pipe, component)
        reasons = {path: fp8_matmul.unfit(root.get_submodule(path), compute_dtype)
                   for path, codec in paths.items() if codec is codecs.FP8}
        chosen[component] = frozenset(path for path, reason in reasons.items() if reason is None)
        unfit.update({f"{component}.{path}": reason for path, reason in reasons.items() if reason is not None})
    found = MatmulLayers(chosen, unfit)
    log.info("fp8 matmuls: %d layers; %d stored layers widen instead (%s)", len(found), len(unfit),
             "; ".join(found.unfit_summary()) or "none")
    return found


def store(pipe, layers: Stored, matmul: MatmulLayers | None = None) -> None:
    """Encode each chosen weight in its codec in place (the Parameter object stays): an fp8 cast, or int8
    rows with their float32 scales registered beside the weight as a buffer (an fp8-matmul layer's are
    e4m3 rows the same way). Layers their file holds packed are already stored."""
    computed = {} if matmul is None else matmul.layers
    with torch.no_grad():
        for component, paths in layers.items():
            root = getattr(pipe, component)
            for path, codec in paths.items():
                if codec.from_file:
                    continue
                module = root.get_submodule(path)
                weight = module.weight
                if path in computed.get(component, ()):
                    weight.data, scale = fp8_matmul.quantise_rows(weight.data)
                    module.register_buffer(fp8_matmul.SCALE, scale)
                elif codec.row_scale:
                    weight.requires_grad_(False)  # an integer tensor cannot require grad (inference only here)
                    weight.data, scale = codecs.quantise_int8(weight.data)
                    module.register_buffer(codecs.SCALE, scale)
                else:
                    weight.data = weight.data.to(codec.dtype)


class _Widen:
    """The `quant.dequant` hook of one layer: the weight its codec widens for the forward, stored bytes after."""

    def __init__(self, codec: Codec, compute_dtype: torch.dtype) -> None:
        self.codec = codec
        self.compute_dtype = compute_dtype
        self.stash: list[torch.Tensor] = []

    def pre(self, module, _args, _kwargs) -> None:
        weight = module._parameters["weight"]
        self.stash.append(weight.data)
        weight.data = self.codec.dequant(module, weight.data, self.compute_dtype)

    def after(self, module) -> None:
        if self.stash:
            module._parameters["weight"].data = self.stash.pop()


def install_dequant(hooks: HookRegistry, pipe, layers: Stored, compute_dtypes: Mapping[str, torch.dtype],
                    matmul: MatmulLayers | None = None, readers: fp8_matmul.WeightReaders | None = None) -> None:
    """Give every stored layer its `quant.dequant` hook, widening to its component's compute dtype; an
    fp8-matmul layer gets its fp8 forward instead (as the module's `forward`), whose hook only points back
    to the stored bytes after a LoRA that reads the weight (`readers`) had it dequantised."""
    computed = {} if matmul is None else matmul.layers
    for component, paths in layers.items():
        root = getattr(pipe, component)
        for path, codec in paths.items():
            module = root.get_submodule(path)
            if path in computed.get(component, ()):
                forward = fp8_matmul.Fp8Matmul(module, compute_dtypes[component], readers or (lambda _m: False))
                module.forward = forward.forward
                hooks.add(module, forward.hook())
                continue
            widen = _Widen(codec, compute_dtypes[component])
            hooks.add(module, ModelHook("quant.dequant", pre=widen.pre, after=widen.after))


def bytes_saved(pipe, layers: Stored, compute_dtypes: Mapping[str, torch.dtype]) -> int:
    """How many bytes the stored weights save against holding them in the compute dtype (less the
    scales kept beside them)."""
    wide = sum(math.prod(weight_shape(getattr(pipe, component).get_submodule(path)))
               * torch.empty((), dtype=compute_dtypes[component]).element_size()
               for component, paths in layers.items() for path in paths)
    return wide - resting_bytes(pipe, layers)


def resting_bytes(pipe, layers: Stored) -> int:
    """The bytes the stored weights rest in, with the scales beside them."""
    total = 0
    for component, paths in layers.items():
        root = getattr(pipe, component)
        for path in paths:
            module = root.get_submodule(path)
            scale = module._buffers.get(codecs.SCALE)
            total += _nbytes(module.weight) + (0 if scale is None else _nbytes(scale))
    return total


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def packed_names(layers: Stored) -> dict[tuple[str, str], str]:
    """(component, path) -> codec name of the layers held packed from their file, as Diagnostics shows them."""
    return {(component, path): codec.name for component, paths in layers.items()
            for path, codec in paths.items() if codec.from_file}


def codec_counts(layers: Stored) -> tuple[str, ...]:
    """How many layers rest in each codec, most first ("12 × gguf Q4_K")."""
    counts: dict[str, int] = {}
    for paths in layers.values():
        for codec in paths.values():
            counts[codec.name] = counts.get(codec.name, 0) + 1
    return tuple(f"{n} × {name}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
