"""Load SD1.5 / SDXL / FLUX.1 checkpoints (single `.safetensors` files and diffusers folders) offline.

Everything here runs without network: configs and tokenizers come from `assets/`, and importing any
part of the app sets `HF_HUB_OFFLINE=1` first (see `app/__init__.py`), so an accidental hub call
fails loudly instead of downloading. Finding and naming checkpoints is `checkpoint_files.py`.

Nothing is ever unpickled: only safetensors are accepted, and a file's header is validated with
`safe_open` before diffusers sees it, so a truncated, empty or renamed-pickle file gets an error that
names the file and the reason instead of a deep stack trace.

Pipelines come back on CPU in the requested dtype, with no accelerate hooks; moving them is the job of
`placement.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:  # transformers >= 5
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4
    from transformers.modeling_utils import no_init_weights

from app.engine import component_files
from app.engine.checkpoint_files import (
    CheckpointInfo,
    ModelLoadError,
    UnknownFamilyError,
    UnsupportedCheckpointFormatError,
    detect_family,
    read_safetensors_header,
    resolve_checkpoint,
    weights_file,
)
from app.engine.checkpoint_shapes import CheckpointShapeError, check_header_shapes, check_loaded_shapes
from app.engine.component_files import CONFIGS_METADATA_KEY
from app.engine.file_scans import FileScans
from app.engine.part_choices import PartFiles
from app.families import FAMILIES, family, family_of_pipeline
from app.families.ldm_layout import UNET_PREFIX
from app.gguf_files import is_gguf
from app.safetensors_files import FileFacts, FileIdentity, SafetensorsFileError, read_shapes

logger = logging.getLogger(__name__)

# Tiny checkpoints (demo, tests) are not a standard architecture, and single files carry no config,
# so they embed their component configs as JSON under CONFIGS_METADATA_KEY; real checkpoints do
# not have it and get the bundled full-size configs.
# What reads of the checkpoints in a folder found (hashes, weight values, header-shape verdicts), kept
# beside them (a dot file, so discovery skips it), valid while a file's size and mtime are unchanged:
# see `FileFacts` and `file_scans`.
FACTS_FILE = ".steady-diffusion-facts.json"


@dataclass(frozen=True)
class LoadedModel:
    """A loaded pipeline and where it came from: `files` are the weight files its tensors were read
    from, the first the one whose sha256 names it ("Model hash", `checkpoint_files.weights_file`)."""

    pipe: Any
    family: str
    info: CheckpointInfo
    files: tuple[Path, ...]
    parts: PartFiles = PartFiles()  # the separate component files it was loaded with


_LAYOUT_NAMES = {"file": "single files", "folder": "diffusers folders (with model_index.json)"}


def facts_store(info: CheckpointInfo) -> Path:
    """Where the facts about a checkpoint's files are kept (beside it, a dot file)."""
    return info.path.parent / FACTS_FILE


# ----------------------------------------------------------------------------------------- loading


def load_pipeline(info: CheckpointInfo, dtype: torch.dtype, parts: PartFiles | None = None,
                  scans: FileScans | None = None) -> LoadedModel:
    """Load a checkpoint on CPU in `dtype`, offline, with the safety checker off. `parts` names the
    separate text-encoder/VAE files and folders a family that assembles single files reads; `scans`
    (the engine's) holds what earlier reads of the files found.

    Why a first load is as fast as diffusers' own: nothing here reads a weight. A single file's
    header shapes are checked against the pipeline diffusers built (or, for a config the file
    brings, against a meta build first), and the file's hash and the check of its values are read
    after the load, in the background (`file_scans`, begun by the lifecycle once the load step is
    over); a file such a read found holding NaN/Inf is refused here, before anything is built.
    """
    parts = parts or PartFiles()
    facts = FileFacts(None) if scans is None else scans.facts(facts_store(info))
    family_name = checkpoint_family(info)
    if info.kind == "folder":
        _validate_folder_weights(info)
        load = _load_folder
    else:
        _keys, metadata = read_safetensors_header(info.path)
        load = _parts_loader(parts) if family(family_name).files.parts else _single_file_loader(metadata, facts)
    if dtype == torch.float16 and not family(family_name).precision.fp16_ok:
        raise ModelLoadError(f"{info.name}: {family(family_name).label} overflows in fp16 (activations beyond ±65504 "
                             "become Inf and the image black); use bf16, or fp32 on the CPU")
    files = _run_loader(lambda *_: _weight_files(info, family_name, parts), info, family_name, dtype)
    refusal = None if scans is None else scans.known_refusal(info.name, facts_store(info), files, dtype)
    if refusal:
        raise ModelLoadError(refusal)
    pipe = _run_loader(load, info, family_name, dtype)
    pipe.family = family(family_name)
    _check_loaded(pipe, dtype, info.name)
    logger.info("loaded %s (%s, %s)", info.name, family_name, dtype)
    return LoadedModel(pipe=pipe, family=family_name, info=info, files=files, parts=parts)


def _run_loader(load, info: CheckpointInfo, family_name: str, dtype: torch.dtype):
    try:
        return load(info, family_name, dtype)
    except ModelLoadError:
        raise
    except (component_files.MissingPartError, CheckpointShapeError, SafetensorsFileError) as exc:
        raise ModelLoadError(f"{info.name}: {exc}") from exc
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{info.name}: diffusers failed to load it as {family_name}: {exc}") from exc


def _weight_files(info: CheckpointInfo, family_name: str, parts: PartFiles) -> tuple[Path, ...]:
    """The files the pipeline's tensors come from, the one whose hash names it first: a single file;
    a family's part files (headers read to find them); a folder's component weights, without the
    variants (`*.fp16.safetensors`) and the safety checker, which are never loaded."""
    first = weights_file(info)
    if info.kind == "folder":
        found = [f for f in sorted(info.path.glob("*/*.safetensors"))
                 if "." not in f.stem and f.parent.name != "safety_checker"]
    elif family(family_name).files.parts:
        found = component_files.source_files(family(family_name), info.path, parts.choices, parts.folders)
    else:
        found = []
    return tuple(dict.fromkeys([first, *found]))


def checkpoint_family(info: CheckpointInfo) -> str:
    """The family of a checkpoint from its header or `model_index.json` alone (no weight read): what a
    request planned before its model is loaded (the A1111 API's) is checked against. A checkpoint in a
    layout its family does not load (`Files.layouts`: a single file of a folder-only family) is refused
    saying which layout the family loads from, not as an unknown or broken file."""
    if info.kind == "folder":
        if not weights_file(info).is_file():
            raise ModelLoadError(f"{info.name}: no denoiser weights (unet/ or transformer/ "
                                 "diffusion_pytorch_model.safetensors) in the folder")
        family_name = _folder_family(info)
    else:
        keys, metadata = read_safetensors_header(info.path)
        try:
            family_name = detect_family(keys)
        except UnknownFamilyError as exc:
            said = metadata.get("general.architecture")  # GGUF's own field: shown, never trusted
            told = f" (its GGUF architecture field says {said!r}; families are told by tensor names and shapes)" \
                if said else ""
            raise UnknownFamilyError(f"{info.name}: {exc}{told}") from exc
    fam = family(family_name)
    if info.kind not in fam.files.layouts:
        loads = " or ".join(_LAYOUT_NAMES[layout] for layout in fam.files.layouts)
        raise ModelLoadError(f"{info.name}: a {fam.label} checkpoint, but {fam.label} loads from {loads} only, "
                             f"not from {_LAYOUT_NAMES[info.kind]}")
    if info.kind == "file" and is_gguf(info.path) and not fam.files.parts:
        raise UnsupportedCheckpointFormatError(f"{info.name}: .gguf files are read for families assembled from "
                                               f"parts (a transformer-only file); {fam.label} is not one")
    return family_name


def planned_family(checkpoints_dir: Path, model: str) -> str | None:
    """`checkpoint_arch` of the checkpoint named `model`, or None when it cannot be read (its load says why)."""
    try:
        return checkpoint_family(resolve_checkpoint(model, checkpoints_dir))
    except (ModelLoadError, OSError):
        return None


def _pipeline_kwargs(family_name: str, dtype: torch.dtype) -> dict[str, Any]:
    return {"dtype": dtype, "local_files_only": True, **family(family_name).pipeline_kwargs}


def _folder_family(info: CheckpointInfo) -> str:
    try:
        class_name = json.loads((info.path / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{info.name}: unreadable model_index.json ({exc})") from exc
    fam = family_of_pipeline(class_name, info.path)
    if fam is None:
        raise UnknownFamilyError(
            f"{info.name}: model_index.json names {class_name!r}; "
            f"supported: {sorted(f.diffusers_pipeline for f in FAMILIES.values())}"
        )
    return fam.name


def _validate_folder_weights(info: CheckpointInfo) -> None:
    """Every model folder (one with a `config.json`) must hold valid safetensors weights.

    Refusing here keeps diffusers from falling back to unpickling `.bin` files. The safety checker
    is never loaded, so its folder is not checked.
    """
    for config in sorted(info.path.glob("*/config.json")):
        component = config.parent
        if component.name == "safety_checker":
            continue
        files = sorted(component.glob("*.safetensors"))
        if not files:
            raise UnsupportedCheckpointFormatError(f"{info.name}/{component.name}: no .safetensors weights")
        for weights in files:
            read_safetensors_header(weights)


def _load_folder(info: CheckpointInfo, family_name: str, dtype: torch.dtype):
    """A diffusers folder brings its own tokenizers (they may carry added tokens), so ours stay out."""
    kwargs = _pipeline_kwargs(family_name, dtype)
    return family(family_name).pipeline_class.from_pretrained(info.path, use_safetensors=True, **kwargs)


def _single_file_loader(metadata: dict[str, str], facts: FileFacts):
    """Loader for one file that checks the file holds every tensor the pipeline has, each in the
    shape its config asks for, once per file and config (`facts`).

    diffusers loads single files non-strictly: without accelerate a missing tensor silently keeps its
    random initial value, with accelerate it stays on `meta` and fails later with an unrelated error.
    A config the file brings (or one adapted to it) is untrusted: it is checked on the meta device
    before anything is built (`check_header_shapes`). The bundled config is checked against the
    pipeline diffusers built from it, which costs no second build; when diffusers refuses the file,
    the meta check runs after all, to name the tensors that do not fit.

    Every weight comes from the file, so diffusers builds the models with weight initialisation off
    (`no_init_weights`, as its own and transformers' `from_pretrained` do): its single-file path
    initialises the text encoders on the meta device otherwise, 0.9 s of SDXL's 2.4 s load on two
    CPU cores (0.05 s of SD1.5's 0.47). The switch is process-wide while it lasts; only the worker
    builds models.
    """

    def load(info: CheckpointInfo, family_name: str, dtype: torch.dtype):
        fam = family(family_name)
        bundled = f"the {family_name.upper()} architecture"
        source = "its embedded config" if CONFIGS_METADATA_KEY in metadata else bundled
        shapes = read_shapes(info.path)
        with _config_folder(family_name, metadata, info.name, shapes) as config_dir:
            shipped = config_dir == fam.files.config_dir

            def once(check) -> None:
                facts.once(FileIdentity.of(info.path), "shapes_match", _config_digest(fam, config_dir), check)

            if not shipped:
                once(lambda: check_header_shapes(family_name, config_dir, shapes, source))
            try:
                with no_init_weights():
                    pipe = fam.pipeline_class.from_single_file(
                        str(info.path), config=str(config_dir), **fam.tokenizers(),
                        **_pipeline_kwargs(family_name, dtype))
            except (OSError, RuntimeError, KeyError, ValueError):
                if shipped:
                    check_header_shapes(family_name, config_dir, shapes, source)
                raise
            if shipped:
                once(lambda: check_loaded_shapes(pipe, family_name, shapes, source))
            return pipe

    return load


def _config_digest(fam, config_dir: Path) -> str:
    """sha256 of the model configs the shape check builds from (denoiser, VAE, text encoders): the
    same file checked against an edited or embedded config is checked again."""
    digest = hashlib.sha256()
    for component in (fam.denoiser, "vae", *(te.component for te in fam.text_encoders)):
        digest.update(component.encode() + b"\0" + (config_dir / component / "config.json").read_bytes())
    return digest.hexdigest()


def _parts_loader(parts: PartFiles):
    """Loader for families that assemble a single file component by component (see component_files)."""

    def load(info: CheckpointInfo, family_name: str, dtype: torch.dtype):
        return component_files.assemble(family(family_name), info.path, dtype, parts.choices, parts.folders)

    return load


@contextlib.contextmanager
def _config_folder(family_name: str, metadata: dict[str, str], name: str, shapes: dict[str, tuple[int, ...]]
                   ) -> Iterator[Path]:
    """The bundled config folder, or a temporary copy with the file's embedded component configs, or
    with the UNet's input channels the file holds (an inpainting checkpoint's 9)."""
    if CONFIGS_METADATA_KEY in metadata:
        overrides = _embedded_configs(family_name, metadata[CONFIGS_METADATA_KEY], name)
    else:
        overrides = unet_channel_override(family(family_name).files.config_dir, shapes)
    if not overrides:
        yield family(family_name).files.config_dir
        return
    with tempfile.TemporaryDirectory(prefix="sd-config-") as tmp:
        folder = Path(tmp) / family_name
        shutil.copytree(family(family_name).files.config_dir, folder)
        for component, config in overrides.items():
            (folder / component / "config.json").write_text(json.dumps(config))
        yield folder


def unet_channel_override(config_dir: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, dict]:
    """{"unet": config} with `in_channels` as the file's first UNet conv has them, when that differs
    from the bundled config: SD inpainting checkpoints take 9 (latents, mask, masked-image latents)."""
    config = json.loads((config_dir / "unet" / "config.json").read_text())
    conv_in = shapes.get(UNET_PREFIX + "input_blocks.0.0.weight")
    if conv_in is None or len(conv_in) != 4 or conv_in[1] == config.get("in_channels"):
        return {}
    return {"unet": {**config, "in_channels": conv_in[1]}}


def _embedded_configs(family_name: str, text: str, name: str) -> dict[str, dict]:
    try:
        configs = json.loads(text)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: metadata {CONFIGS_METADATA_KEY!r} is not valid JSON ({exc})") from exc
    allowed = {"unet", "vae", *family(family_name).components}
    if not isinstance(configs, dict) or not set(configs) <= allowed:
        raise ModelLoadError(
            f"{name}: metadata {CONFIGS_METADATA_KEY!r} must map {sorted(allowed)} to configs"
        )
    if not all(isinstance(c, dict) for c in configs.values()):
        raise ModelLoadError(f"{name}: metadata {CONFIGS_METADATA_KEY!r} holds a non-object config")
    return configs


def _check_loaded(pipe, dtype: torch.dtype, name: str) -> None:
    """Every tensor on CPU, floating ones in `dtype` (a tensor the family pins, in its pinned dtype),
    no accelerate hooks: the contract of this module."""
    problems, fam = [], pipe.family
    for component, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        for tensor_name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            path, _, leaf = tensor_name.rpartition(".")
            want = fam.pinned_dtype(component, path, leaf) or dtype
            if tensor.device.type != "cpu" or (tensor.is_floating_point() and tensor.dtype != want):
                problems.append(f"{component}.{tensor_name} on {tensor.device} in {tensor.dtype}"
                                + ("" if want == dtype else f" (pinned to {want})"))
        problems += [
            f"{component}.{n} has an accelerate hook"
            for n, m in module.named_modules()
            if hasattr(m, "_hf_hook")
        ]
    if problems:
        raise ModelLoadError(f"{name}: loaded pipeline breaks the CPU/{dtype} contract: {problems[:5]}")
