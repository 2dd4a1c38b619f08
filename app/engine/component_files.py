"""Assemble a pipeline from single files component by component (families that list `Files.parts`: Flux).

Why our own reader instead of diffusers' `from_single_file`: Flux ships as pieces — a transformer
file in BFL's layout, a CLIP-L file, a T5-XXL file (fp16, bf16 or fp8), an `ae.safetensors` — or
as a ComfyUI/Forge all-in-one, and diffusers' converter hard-codes the 12B model's widths, so it
cannot read the tiny demo model the tests run. Here each component is:

1. found: in the checkpoint under one of its prefixes, else in the file the user chose for it
   (`choices`), else the one file of its folder (`models/text_encoder`, `models/VAE`) that holds
   it; none or several is an error that names the part and the folder;
2. configured: from the config embedded in its file's metadata (tiny models), else the bundled
   full-size one in `assets/configs/<family>/`;
3. checked before anything is built: the model is built on the meta device (bounded by the
   file's tensor count, as `checkpoint_shapes` does for SD) and every tensor its layout needs
   must be in the file with the right shape, so a wrong or truncated file is refused by name;
4. read: only the tensors it needs (from a `.gguf` file, quantised layer weights stay packed:
   app/engine/gguf_load.py), cast once to the load dtype (fp8 files are widened here:
   fp8 storage is another module's job), cut into the model's names by the family's layout, and
   assigned to a model whose parameters were never allocated (`init_empty_weights`).

The same tensors give bit-identical weights to a diffusers-folder load: nothing is computed, only
sliced, concatenated and cast.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from accelerate import init_empty_weights
from safetensors import safe_open

from app.engine import gguf_load
from app.engine.checkpoint_shapes import CheckpointShapeError, parameter_budget
from app.families import ComponentFile, Family
from app.families.file_layout import file_shapes, to_model
from app.gguf_files import GGUFHeader, is_gguf, same_shape
from app.safetensors_files import SafetensorsFileError, gguf_header, read_header, read_shapes

log = logging.getLogger(__name__)
CONFIGS_METADATA_KEY = "steady_diffusion.configs"  # component configs embedded by the demo and tests
_SHOWN = 3


class MissingPartError(ValueError):
    """A component is in neither the checkpoint nor a chosen or found separate file."""


@dataclass(frozen=True)
class Source:
    """Where one component's tensors are: a file and the prefix they sit under there."""

    path: Path
    prefix: str
    keys: frozenset[str]
    metadata: Mapping[str, str]


def find_source(part: ComponentFile, checkpoint: Source, chosen: Path | None, folder: Path | None) -> Source:
    """The checkpoint if it holds the part, else the chosen file, else the one file in `folder` that does."""
    for candidate in ([checkpoint] if chosen is None else [checkpoint, _open(chosen)]):
        prefix = _prefix_in(part, candidate)
        if prefix is not None:
            return Source(candidate.path, prefix, candidate.keys, candidate.metadata)
    if chosen is not None:
        raise MissingPartError(f"{chosen.name} holds no {part.label} (no {part.marker!r} tensor)")
    found = [s for s in _folder_files(folder) if _prefix_in(part, s) is not None]
    where = f"{folder}" if folder is not None else "no folder"
    if len(found) != 1:
        listed = ", ".join(s.path.name for s in found)
        why = f"several files hold one ({listed}): choose one" if found else f"none was found in {where}"
        raise MissingPartError(f"{checkpoint.path.name} has no {part.label} and {why}")
    return Source(found[0].path, _prefix_in(part, found[0]), found[0].keys, found[0].metadata)


def _prefix_in(part: ComponentFile, source: Source) -> str | None:
    keys = frozenset(_gguf(part, source).tensors) if is_gguf(source.path) and part.gguf_names else source.keys
    return next((p for p in part.prefixes if p + part.marker in keys), None)


def _gguf(part: ComponentFile, source: Source) -> GGUFHeader:
    """A GGUF source's header with its tensors named as the part's model names them (a file from llama.cpp's
    converter names an encoder's tensors its own way: `ComponentFile.gguf_names` rewrites them)."""
    return gguf_header(source.path).renamed(part.gguf_names)


def _open(path: Path) -> Source:
    keys, metadata = read_header(path)
    return Source(path, "", keys, metadata)


def _folder_files(folder: Path | None) -> Iterator[Source]:
    if folder is None or not folder.is_dir():
        return
    for path in sorted([*folder.glob("*.safetensors"), *folder.glob("*.gguf")]):
        try:
            yield _open(path)
        except SafetensorsFileError as exc:
            log.info("skipping %s: %s", path.name, exc)


def _config(part: ComponentFile, fam: Family, source: Source, checkpoint: Source) -> dict:
    """The part's config: embedded in its own file, else in the checkpoint, else the bundled one."""
    for holder in (source, checkpoint):
        text = holder.metadata.get(CONFIGS_METADATA_KEY)
        if text:
            configs = json.loads(text)
            if part.component in configs:
                return configs[part.component]
    folder = fam.files.config_dir / part.component
    if part.config_class is not None:
        return part.config_class.from_pretrained(folder).to_dict()
    return dict(part.model_class.load_config(folder))


def _build(part: ComponentFile, config: dict):
    if part.config_class is not None:
        return part.model_class(part.config_class(**config))
    return part.model_class.from_config(config)


def _shell(part: ComponentFile, config: dict, tensors: int):
    """The model with its parameters on `meta` (buffers real: nothing is allocated until the file's
    tensors are assigned), built under a budget of three parameters per file tensor."""
    try:
        with init_empty_weights(include_buffers=False), parameter_budget(3 * tensors):
            return _build(part, config)
    except CheckpointShapeError:
        raise
    except Exception as exc:  # the config is untrusted input to third-party constructors
        raise CheckpointShapeError(f"the {part.label} config does not build ({type(exc).__name__}: {exc})") from exc


def _check_shapes(part: ComponentFile, source: Source, want: Mapping[str, tuple[int, ...]]) -> None:
    have = _gguf(part, source).shapes() if is_gguf(source.path) else read_shapes(source.path)
    missing = sorted(k for k in want if source.prefix + k not in have)
    if missing:
        raise CheckpointShapeError(f"{len(missing)} tensors of the {part.label} are missing from {source.path.name} "
                                   f"(e.g. {', '.join(source.prefix + k for k in missing[:_SHOWN])})")
    fits = same_shape if is_gguf(source.path) else lambda have_shape, shape: tuple(have_shape) == tuple(shape)
    wrong = sorted(k for k, shape in want.items() if not fits(have[source.prefix + k], shape))
    if wrong:
        shown = "; ".join(f"{source.prefix + k}: {list(have[source.prefix + k])}, expected {list(want[k])}"
                          for k in wrong[:_SHOWN])
        raise CheckpointShapeError(f"{len(wrong)} tensors of the {part.label} in {source.path.name} do not have "
                                   f"the shapes its config asks for ({shown}); refused before building anything")


def _reader(handle, source: Source, dtype: torch.dtype, pinned: Mapping[str, torch.dtype]):
    """Read one file tensor in `dtype` (or the dtype the family pins it to, `pinned` by file key). ComfyUI's
    scaled fp8 files store a scale beside each 8-bit weight: `scale_weight` (FLUX.1's) or `weight_scale` (its
    newer layout, later families', beside `comfy_quant`), one number or one per output row; it is applied while
    widening. Any other count (NVFP4/MXFP8 block scales) is refused by name: it is not a factor per tensor or row."""
    def read(key: str) -> torch.Tensor:
        tensor = handle.get_tensor(source.prefix + key)
        stem = source.prefix + key.removesuffix("weight")
        scale_key = next((k for k in (stem + "scale_weight", stem + "weight_scale") if k in source.keys), None)
        if key.endswith("weight") and scale_key is not None:
            scale = handle.get_tensor(scale_key).to(torch.float32)
            if scale.numel() not in (1, tensor.shape[0]):
                raise CheckpointShapeError(f"{scale_key} holds {scale.numel()} scales for {tensor.shape[0]} rows (a "
                                           "block-quantised format): only one scale per tensor or row is supported")
            rows = scale.reshape(-1, *(1,) * (tensor.dim() - 1)) if scale.numel() > 1 else scale
            tensor = tensor.to(torch.float32) * rows
        return tensor.to(pinned.get(key, dtype)) if tensor.is_floating_point() else tensor
    return read


def load_part(part: ComponentFile, fam: Family, source: Source, checkpoint: Source, dtype: torch.dtype):
    """One component, checked against its file's header, then read and assigned (see module doc)."""
    model = _shell(part, _config(part, fam, source, checkpoint), len(source.keys))
    layout = part.layout(model)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    _check_shapes(part, source, file_shapes(layout, shapes))
    # tensors the family pins (fp32 norm scales) are read in their own dtype, as `from_pretrained` keeps them
    pinned = {name: kept for name in layout
              if (kept := fam.pinned_dtype(part.component, *name.rpartition(".")[::2])) is not None}
    packed: gguf_load.Packed = {}
    if is_gguf(source.path):
        state, packed = gguf_load.read_state(layout, _gguf(part, source), source.prefix, dtype, shapes,
                                             gguf_load.packable(model, fam.precision.high_precision), pinned)
    else:
        with safe_open(str(source.path), "pt") as handle:
            reader = _reader(handle, source, dtype, {layout[name].key: kept for name, kept in pinned.items()})
            state = to_model(layout, reader, shapes)
    result = model.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if result.unexpected_keys or set(result.missing_keys) - tied - set(packed):
        raise CheckpointShapeError(f"{part.label}: the layout left {sorted(result.missing_keys)[:_SHOWN]} unset")
    gguf_load.attach(model, packed)
    if tied:
        model.tie_weights()
    return model.eval()


def source_files(fam: Family, checkpoint_path: Path, choices: Mapping[str, Path], folders: Mapping[str, Path]
                 ) -> list[Path]:
    """The files `assemble` reads the family's parts from (headers only are read to find them)."""
    checkpoint = _open(checkpoint_path)
    return [find_source(part, checkpoint, choices.get(part.component), folders.get(part.folder)).path
            for part in fam.files.parts]


def assemble(fam: Family, checkpoint_path: Path, dtype: torch.dtype, choices: Mapping[str, Path],
             folders: Mapping[str, Path]):
    """The family's pipeline from `checkpoint_path` plus separate files (`choices`: component ->
    file; `folders`: ComponentFile.folder -> directory), on the CPU in `dtype`."""
    checkpoint = _open(checkpoint_path)
    components = {}
    for part in fam.files.parts:
        source = find_source(part, checkpoint, choices.get(part.component), folders.get(part.folder))
        components[part.component] = load_part(part, fam, source, checkpoint, dtype)
    index = json.loads((fam.files.config_dir / "model_index.json").read_text())
    scheduler = getattr(diffusers, index["scheduler"][1]).from_pretrained(fam.files.config_dir, subfolder="scheduler")
    return fam.pipeline_class(scheduler=scheduler, **components, **fam.tokenizers(), **fam.pipeline_kwargs,
                              **fam.files.pipeline_kwargs(checkpoint_path))
