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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.engine import component_files
from app.engine.checkpoint_files import (
    CheckpointInfo,
    ModelLoadError,
    UnknownArchitectureError,
    UnsupportedCheckpointFormatError,
    detect_architecture,
    read_safetensors_header,
    weights_file,
)
from app.engine.checkpoint_shapes import CheckpointShapeError, check_header_shapes
from app.engine.component_files import CONFIGS_METADATA_KEY
from app.engine.part_choices import PartFiles
from app.families import FAMILIES, family, family_of_pipeline
from app.families.ldm_layout import UNET_PREFIX
from app.safetensors_files import FileFacts, FileIdentity, SafetensorsFileError, read_shapes

logger = logging.getLogger(__name__)

# Tiny checkpoints (demo, tests) are not a standard architecture, and single files carry no config,
# so they embed their component configs as JSON under CONFIGS_METADATA_KEY; real checkpoints do
# not have it and get the bundled full-size configs.
# Hashes and finite-weight verdicts of the checkpoints in a folder, kept beside them (a dot file, so
# discovery skips it) and valid while a file's size and mtime are unchanged: see `FileFacts`.
FACTS_FILE = ".steady-diffusion-facts.json"


@dataclass(frozen=True)
class LoadedModel:
    """A loaded pipeline and where it came from; `short_hash` is the first 10 hex of its sha256."""

    pipe: Any
    arch: str
    info: CheckpointInfo
    short_hash: str
    parts: PartFiles = PartFiles()  # the separate component files it was loaded with


# ----------------------------------------------------------------------------------------- loading


def load_pipeline(info: CheckpointInfo, dtype: torch.dtype, parts: PartFiles | None = None) -> LoadedModel:
    """Load a checkpoint on CPU in `dtype`, offline, with the safety checker off. `parts` names the
    separate text-encoder/VAE files and folders a family that assembles single files reads.

    Why loading is not slower than diffusers' own: the file's sha256 is computed on a helper thread
    while diffusers builds the pipeline (hashlib and file reads release the GIL), and the hash, the
    finite-weights verdict and the header-shapes verdict are kept in the folder's `FACTS_FILE`, so
    only the first load of a file reads it end to end or builds its config on the meta device;
    later loads leave the memory-mapped weights untouched, as diffusers does.
    """
    weights = weights_file(info)
    facts = FileFacts(info.path.parent / FACTS_FILE)
    if info.kind == "folder":
        if not weights.is_file():
            raise ModelLoadError(f"{info.name}: no denoiser weights (unet/ or transformer/ "
                                 "diffusion_pytorch_model.safetensors) in the folder")
        arch = _folder_arch(info)
        _validate_folder_weights(info)
        load = _load_folder
    else:
        keys, metadata = read_safetensors_header(info.path)
        try:
            arch = detect_architecture(keys)
        except UnknownArchitectureError as exc:
            raise UnknownArchitectureError(f"{info.name}: {exc}") from exc
        load = (_parts_loader(parts or PartFiles()) if family(arch).parts
                else _single_file_loader(keys, metadata, facts))
    if dtype == torch.float16 and not family(arch).fp16_ok:
        raise ModelLoadError(f"{info.name}: {family(arch).label} overflows in fp16 (activations beyond ±65504 "
                             "become Inf and the image black); use bf16, or fp32 on the CPU")
    hashing = ThreadPoolExecutor(1, thread_name_prefix="sha256")
    try:
        digest = hashing.submit(facts.sha256, weights)
        pipe = _run_loader(load, info, arch, dtype)
        pipe.family = family(arch)
        _check_loaded(pipe, dtype, info.name)
        _check_finite_once(facts, info, pipe, dtype)
        short_hash = digest.result()[:10]
    finally:
        hashing.shutdown(wait=False, cancel_futures=True)  # a failed load does not wait for the hash
    logger.info("loaded %s (%s, %s, %s)", info.name, arch, dtype, short_hash)
    return LoadedModel(pipe=pipe, arch=arch, info=info, short_hash=short_hash, parts=parts or PartFiles())


def _run_loader(load, info: CheckpointInfo, arch: str, dtype: torch.dtype):
    try:
        return load(info, arch, dtype)
    except ModelLoadError:
        raise
    except (component_files.MissingPartError, CheckpointShapeError, SafetensorsFileError) as exc:
        raise ModelLoadError(f"{info.name}: {exc}") from exc
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{info.name}: diffusers failed to load it as {arch}: {exc}") from exc


def _check_finite_once(facts: FileFacts, info: CheckpointInfo, pipe, dtype: torch.dtype) -> None:
    """`check_finite_weights`, skipped for a checkpoint already verified in this dtype: the verdict
    depends only on the weight files' contents (a folder's identity covers all its weight files)."""
    if info.kind == "file":
        identity = FileIdentity.of(info.path)
    else:
        identity = FileIdentity.of_folder(info.path, sorted(info.path.glob("*/*.safetensors")))
    facts.once(identity, "finite_dtypes", str(dtype), lambda: check_finite_weights(pipe, dtype, info.name))


def _pipeline_kwargs(arch: str, dtype: torch.dtype) -> dict[str, Any]:
    return {"dtype": dtype, "local_files_only": True, **family(arch).pipeline_kwargs}


def _folder_arch(info: CheckpointInfo) -> str:
    try:
        class_name = json.loads((info.path / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{info.name}: unreadable model_index.json ({exc})") from exc
    fam = family_of_pipeline(class_name, info.path)
    if fam is None:
        raise UnknownArchitectureError(
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


def _load_folder(info: CheckpointInfo, arch: str, dtype: torch.dtype):
    """A diffusers folder brings its own tokenizers (they may carry added tokens), so ours stay out."""
    kwargs = _pipeline_kwargs(arch, dtype)
    return family(arch).pipeline_class.from_pretrained(info.path, use_safetensors=True, **kwargs)


def _single_file_loader(keys: frozenset[str], metadata: dict[str, str], facts: FileFacts):
    """Loader for one file that first checks the file holds every tensor the pipeline will have, each
    in the shape its config (embedded or bundled) asks for, so nothing is built from a lying config.

    diffusers loads single files non-strictly: without accelerate a missing tensor silently keeps its
    random initial value, with accelerate it stays on `meta` and fails later with an unrelated error.
    The check builds the config on the meta device (0.16 s for SD1.5, 0.34 s for SDXL on two CPU
    cores, a third of diffusers' whole load), so its verdict is kept per file and config in `facts`.
    """

    def load(info: CheckpointInfo, arch: str, dtype: torch.dtype):
        source = "its embedded config" if CONFIGS_METADATA_KEY in metadata else f"the {arch.upper()} architecture"
        shapes = read_shapes(info.path)
        with _config_folder(arch, metadata, info.name, shapes) as config_dir:
            fam = family(arch)
            facts.once(FileIdentity.of(info.path), "shapes_match", _config_digest(fam, config_dir),
                       lambda: _check_shapes(info, arch, config_dir, shapes, source))
            return fam.pipeline_class.from_single_file(
                str(info.path),
                config=str(config_dir),
                **fam.tokenizers(),
                **_pipeline_kwargs(arch, dtype),
            )

    return load


def _check_shapes(info: CheckpointInfo, arch: str, config_dir: Path, shapes: dict[str, tuple[int, ...]],
                  source: str) -> None:
    try:
        check_header_shapes(arch, config_dir, shapes, source)
    except CheckpointShapeError as exc:
        raise ModelLoadError(f"{info.name}: {exc}") from exc


def _config_digest(fam, config_dir: Path) -> str:
    """sha256 of the model configs the shape check builds from (denoiser, VAE, text encoders): the
    same file checked against an edited or embedded config is checked again."""
    digest = hashlib.sha256()
    for component in (fam.denoiser, "vae", *(te.component for te in fam.text_encoders)):
        digest.update(component.encode() + b"\0" + (config_dir / component / "config.json").read_bytes())
    return digest.hexdigest()


def _parts_loader(parts: PartFiles):
    """Loader for families that assemble a single file component by component (see component_files)."""

    def load(info: CheckpointInfo, arch: str, dtype: torch.dtype):
        return component_files.assemble(family(arch), info.path, dtype, parts.choices, parts.folders)

    return load


@contextlib.contextmanager
def _config_folder(arch: str, metadata: dict[str, str], name: str, shapes: dict[str, tuple[int, ...]]
                   ) -> Iterator[Path]:
    """The bundled config folder, or a temporary copy with the file's embedded component configs, or
    with the UNet's input channels the file holds (an inpainting checkpoint's 9)."""
    if CONFIGS_METADATA_KEY in metadata:
        overrides = _embedded_configs(arch, metadata[CONFIGS_METADATA_KEY], name)
    else:
        overrides = unet_channel_override(family(arch).config_dir, shapes)
    if not overrides:
        yield family(arch).config_dir
        return
    with tempfile.TemporaryDirectory(prefix="sd-config-") as tmp:
        folder = Path(tmp) / arch
        shutil.copytree(family(arch).config_dir, folder)
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


def _embedded_configs(arch: str, text: str, name: str) -> dict[str, dict]:
    try:
        configs = json.loads(text)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: metadata {CONFIGS_METADATA_KEY!r} is not valid JSON ({exc})") from exc
    allowed = {"unet", "vae", *family(arch).components}
    if not isinstance(configs, dict) or not set(configs) <= allowed:
        raise ModelLoadError(
            f"{name}: metadata {CONFIGS_METADATA_KEY!r} must map {sorted(allowed)} to configs"
        )
    if not all(isinstance(c, dict) for c in configs.values()):
        raise ModelLoadError(f"{name}: metadata {CONFIGS_METADATA_KEY!r} holds a non-object config")
    return configs


def check_finite_weights(pipe, dtype: torch.dtype, name: str) -> None:
    """Refuse weights holding NaN or ±Inf: every image would come out black or noise, with nothing
    in the log to say why. Inf also appears when a checkpoint's values exceed fp16's range (±65504)
    and it is loaded in fp16, hence the hint. One min/max pass per tensor (NaN propagates through
    both), with no tensor-sized temporary: about 0.4 ns per weight on two CPU cores."""
    bad = []
    for component, module in sorted(pipe.components.items()):
        if isinstance(module, torch.nn.Module):
            for tensor_name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                if tensor.is_floating_point() and tensor.numel():
                    low, high = torch.aminmax(tensor)
                    if not (torch.isfinite(low) and torch.isfinite(high)):
                        bad.append(f"{component}.{tensor_name}")
    if bad:
        hint = " (values beyond ±65504 overflow fp16: try bf16 or fp32)" if dtype == torch.float16 else ""
        raise ModelLoadError(f"{name}: {len(bad)} weight tensors hold NaN or Inf values when loaded in "
                             f"{str(dtype).removeprefix('torch.')}, e.g. {', '.join(bad[:3])}{hint}; refusing it, "
                             "since every image would come out black")


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
