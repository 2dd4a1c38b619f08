"""What lies in the checkpoint folder: find checkpoints, resolve a user's name safely, recognise a file's family.

Only `.safetensors` and `.gguf` files and diffusers folders count (and `models/unet`'s files); pickle
formats are refused by name (they can run code when loaded), and names from the UI or the API never
leave the folder. A file that is not a checkpoint of a family we run is described ("a LoRA", "SD3", "a
standalone VAE") so the user knows where it belongs. Loading what was found is `models.py`'s job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from app.families import FAMILIES, detect
from app.families.ldm_layout import UNET_PREFIX
from app.paths import UnsafePathError, resolve_under, utf8_names
from app.safetensors_files import SafetensorsFileError, read_header

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
WEIGHT_SUFFIXES = (".safetensors", ".gguf")  # single weight files read (GGUF: app/gguf_files.py)
UNET_FOLDER = "unet"  # models/unet beside the checkpoint folder: transformer-only files (ComfyUI's folder)
_LORA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lycoris_")
_LORA_MARKERS = (".lora_down.", ".lora_up.", ".lora_A.", ".lora_B.", ".hada_w1_a", ".lokr_w1", ".oft_blocks")
# What other files dropped into the checkpoint folder look like, checked in order (SD2 before
# "UNet without text encoder", since SD2 files have a UNet too).
_OTHER_FORMATS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    (
        "a LoRA/LyCORIS adapter (put it in models/Lora)",
        lambda k: k.startswith(_LORA_PREFIXES) or any(m in k for m in _LORA_MARKERS),
    ),
    (
        "a textual-inversion embedding (put it in embeddings/)",
        lambda k: k in ("emb_params", "clip_l", "clip_g") or k.startswith("string_to_param"),
    ),
    ("SD3/SD3.5 (not supported)", lambda k: "joint_blocks." in k),
    ("part of a Flux transformer, missing the blocks a whole one has", lambda k: "double_blocks." in k),
    ("an SDXL refiner (not supported)", lambda k: k.startswith("conditioner.embedders.0.model.")),
    ("SD2.x, OpenCLIP ViT-H text encoder (not supported)", lambda k: k.startswith("cond_stage_model.model.")),
    ("a UNet without its text encoder (a full checkpoint is needed)", lambda k: k.startswith(UNET_PREFIX)),
    ("a single diffusers component; load the whole diffusers folder", lambda k: k.startswith("down_blocks.")),
    ("a standalone VAE (not a full checkpoint)", lambda k: k.startswith(("encoder.down.", "encoder.down_"))),
)


_NOT_KNOWN = f"not a checkpoint of a family this app runs ({', '.join(f.label for f in FAMILIES.values())})"


class ModelLoadError(ValueError):
    """A checkpoint could not be found, was refused, or failed to load; the message names the file."""


class UnknownFamilyError(ModelLoadError):
    """The file is valid but is not a checkpoint of a supported family (app/families)."""


class CheckpointNotFoundError(ModelLoadError):
    """No checkpoint by that name under the checkpoint folder."""


class UnsafeCheckpointPathError(ModelLoadError):
    """The name points outside the checkpoint folder (`..`, absolute path elsewhere, symlink out)."""


class UnsupportedCheckpointFormatError(ModelLoadError):
    """Not a `.safetensors` file or diffusers folder; pickle formats are refused on purpose."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint on disk. `name` is its path relative to the checkpoint folder (what the UI shows)."""

    name: str
    path: Path
    kind: str  # "file" | "folder"
    size_bytes: int


# ------------------------------------------------------------------------------------------ family


def detect_family(keys: Iterable[str]) -> str:
    """The name of the family of a single file's keys (`app.families.detect`); otherwise say what it looks like.

    Each family needs one marker key per component (UNet, every text encoder), so a partial
    file is not mistaken for a loadable one; foreign files are described for the user.
    """
    keys = set(keys)
    fam = detect(keys)
    if fam is not None:
        return fam.name
    for description, matches in _OTHER_FORMATS:
        example = next((k for k in sorted(keys) if matches(k)), None)
        if example is not None:
            raise UnknownFamilyError(
                f"{_NOT_KNOWN}: looks like {description} ({example!r})"
            )
    samples = ", ".join(sorted(keys)[:5])
    raise UnknownFamilyError(
        f"{_NOT_KNOWN}: unrecognised layout with {len(keys)} tensors (e.g. {samples})"
    )


# ---------------------------------------------------------------------------- discovery, resolution


def discover_checkpoints(root: Path) -> list[CheckpointInfo]:
    """`*.safetensors` and `*.gguf` files and diffusers folders in `root` and its direct subfolders, and the
    weight files of `models/unet` beside it (ComfyUI's folder for transformer-only files, listed as
    `unet/<file>`), sorted by name. Symlinks the user placed there are followed (model folders often live
    on another drive); names that are not valid UTF-8 are logged and left out."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in utf8_names(root, _candidates(root), "checkpoint"):
        if _is_diffusers_folder(entry):
            found.append(_info(root, entry, "folder"))
        elif entry.is_file() and entry.suffix in WEIGHT_SUFFIXES:
            found.append(_info(root, entry, "file"))
    unet = root.parent / UNET_FOLDER
    if unet.is_dir():
        found += [dataclasses.replace(_info(unet, entry, "file"), name=f"{UNET_FOLDER}/{entry.name}")
                  for entry in utf8_names(unet, sorted(unet.iterdir()), "checkpoint")
                  if entry.is_file() and entry.suffix in WEIGHT_SUFFIXES]
    return sorted(found, key=lambda info: info.name.lower())


def _candidates(root: Path) -> Iterator[Path]:
    for child in root.iterdir():
        if child.name.startswith("."):
            continue
        yield child
        if child.is_dir() and not _is_diffusers_folder(child):
            yield from (c for c in child.iterdir() if not c.name.startswith("."))


def _is_diffusers_folder(path: Path) -> bool:
    return path.is_dir() and (path / "model_index.json").is_file()


def _info(root: Path, path: Path, kind: str) -> CheckpointInfo:
    if kind == "file":
        size = path.stat().st_size
    else:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return CheckpointInfo(path.relative_to(root).as_posix(), path, kind, size)


def resolve_checkpoint(name_or_path: str, root: Path) -> CheckpointInfo:
    """The checkpoint a user asked for, by its name relative to `root`.

    Refuses absolute paths and `..` (names come from the UI and the API), and anything but
    safetensors files and diffusers folders: pickle-based files (.ckpt/.bin/.pt) can run code when
    loaded. A bare name without suffix also matches `<name>.safetensors`.
    """
    folder, _, rest = str(name_or_path).partition("/")
    if folder == UNET_FOLDER and rest and not (Path(root) / UNET_FOLDER).exists():
        info = resolve_checkpoint(rest, Path(root).parent / UNET_FOLDER)
        return dataclasses.replace(info, name=f"{UNET_FOLDER}/{info.name}")
    try:
        path = resolve_under(Path(root), name_or_path, "checkpoint")
    except UnsafePathError as exc:
        raise UnsafeCheckpointPathError(str(exc)) from None
    if not path.exists() and not path.suffix and path.with_suffix(".safetensors").is_file():
        path = path.with_suffix(".safetensors")
    if not path.exists():
        available = ", ".join(info.name for info in discover_checkpoints(root)[:10]) or "none"
        raise CheckpointNotFoundError(
            f"checkpoint {name_or_path!r} not found in {root} (available: {available})"
        )
    if _is_diffusers_folder(path):
        return _info(root, path, "folder")
    if path.is_dir():
        raise UnsupportedCheckpointFormatError(f"{name_or_path!r} is a folder without model_index.json")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UnsupportedCheckpointFormatError(
            f"refusing {name_or_path!r}: {path.suffix} files are pickles and can run code when loaded; "
            "convert it to .safetensors"
        )
    if path.suffix not in WEIGHT_SUFFIXES:
        raise UnsupportedCheckpointFormatError(f"{name_or_path!r} is not a .safetensors or .gguf file")
    return _info(root, path, "file")


# -------------------------------------------------------------------------------------- validation


def read_safetensors_header(path: Path) -> tuple[frozenset[str], dict[str, str]]:
    """Tensor names and metadata of a safetensors file, raising ModelLoadError if it is not one."""
    try:
        return read_header(path)
    except SafetensorsFileError as exc:
        raise ModelLoadError(str(exc)) from exc


def weights_file(info: CheckpointInfo) -> Path:
    """The file whose sha256 names a checkpoint ("Model hash" in infotext): the file itself, or a
    diffusers folder's denoiser weights (the first shard where they are sharded)."""
    if info.kind != "folder":
        return info.path
    for denoiser in dict.fromkeys(f.denoiser for f in FAMILIES.values()):
        shards = sorted((info.path / denoiser).glob("diffusion_pytorch_model*.safetensors"))
        if shards:
            return shards[0]
    return info.path / "unet" / "diffusion_pytorch_model.safetensors"
