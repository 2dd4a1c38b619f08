"""Find and load SD1.5 / SDXL checkpoints (single `.safetensors` files and diffusers folders) offline.

Everything here runs without network: configs and tokenizers come from `assets/`, and
`HF_HUB_OFFLINE=1` is set before the Hugging Face libraries are imported so that an accidental hub
call fails loudly instead of downloading. (The flag is read once, at import of `huggingface_hub`;
entry points should import this module, or set the variable, before anything imports diffusers.)

Nothing is ever unpickled: only safetensors are accepted, and a file's header is validated with
`safe_open` before diffusers sees it, so a truncated, empty or renamed-pickle file gets an error that
names the file and the reason instead of a deep stack trace.

Pipelines come back on CPU in the requested dtype, with no accelerate hooks; moving them is the job of
`placement.py`.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before any Hugging Face import: the flag is read at import time

import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterable, Iterator  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    UNet2DConditionModel,
)
from transformers import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
)

from app.engine.pipelines import PIPELINE_CLASSES  # noqa: E402
from app.families.ldm_layout import TEXT_ENCODER_PREFIXES, UNET_PREFIX, ldm_plan  # noqa: E402
from app.paths import UnsafePathError, resolve_under  # noqa: E402
from app.safetensors_files import FileFacts, FileIdentity, SafetensorsFileError, read_header  # noqa: E402

logger = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
CONFIG_DIRS = {"sd15": ASSETS_DIR / "configs" / "sd15", "sdxl": ASSETS_DIR / "configs" / "sdxl"}
TOKENIZER_DIR = ASSETS_DIR / "clip_tokenizer"
# Tiny checkpoints (demo, tests) are not a standard architecture, and single files carry no config,
# so they embed their component configs as JSON under this safetensors metadata key; real
# checkpoints do not have it and get the bundled full-size configs.
CONFIGS_METADATA_KEY = "steady_diffusion.configs"
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
# Hashes and finite-weight verdicts of the checkpoints in a folder, kept beside them (a dot file, so
# discovery skips it) and valid while a file's size and mtime are unchanged: see `FileFacts`.
FACTS_FILE = ".steady-diffusion-facts.json"
_TEXT_ENCODER_CLASSES = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
_ARCH_BY_PIPELINE_CLASS = {"StableDiffusionPipeline": "sd15", "StableDiffusionXLPipeline": "sdxl"}
_CONFIG_FILES = {
    "unet": "unet/config.json",
    "vae": "vae/config.json",
    "text_encoder": "text_encoder/config.json",
    "text_encoder_2": "text_encoder_2/config.json",
}
# One marker key per component; a checkpoint must hold all of them to be loadable as that arch.
_ARCH_MARKERS = {
    "sd15": (
        UNET_PREFIX + "input_blocks.0.0.weight",
        TEXT_ENCODER_PREFIXES["sd15"]["text_encoder"] + "embeddings.token_embedding.weight",
    ),
    "sdxl": (
        UNET_PREFIX + "label_emb.0.0.weight",
        TEXT_ENCODER_PREFIXES["sdxl"]["text_encoder"] + "embeddings.token_embedding.weight",
        TEXT_ENCODER_PREFIXES["sdxl"]["text_encoder_2"] + "token_embedding.weight",
    ),
}
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
    ("SD3/SD3.5 (not supported)", lambda k: "joint_blocks." in k or k.startswith("text_encoders.")),
    ("Flux (not supported)", lambda k: "double_blocks." in k),
    ("an SDXL refiner (not supported)", lambda k: k.startswith("conditioner.embedders.0.model.")),
    ("SD2.x, OpenCLIP ViT-H text encoder (not supported)", lambda k: k.startswith("cond_stage_model.model.")),
    ("a UNet without its text encoder (a full checkpoint is needed)", lambda k: k.startswith(UNET_PREFIX)),
    ("a single diffusers component; load the whole diffusers folder", lambda k: k.startswith("down_blocks.")),
    ("a standalone VAE (not a full checkpoint)", lambda k: k.startswith(("encoder.down.", "encoder.down_"))),
)


class ModelLoadError(ValueError):
    """A checkpoint could not be found, was refused, or failed to load; the message names the file."""


class UnknownArchitectureError(ModelLoadError):
    """The file is valid but is not an SD1.5 or SDXL checkpoint."""


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
    root: Path | None = None  # the checkpoint folder it was found in (where its FACTS_FILE lives)


@dataclass(frozen=True)
class LoadedModel:
    """A loaded pipeline and where it came from; `short_hash` is the first 10 hex of its sha256."""

    pipe: Any
    arch: str
    info: CheckpointInfo
    short_hash: str


# ------------------------------------------------------------------------------------ architecture


def detect_architecture(keys: Iterable[str]) -> str:
    """Return "sd15" or "sdxl" for single-file (LDM layout) keys; otherwise say what the file looks like.

    Each architecture needs one marker key per component (UNet, every text encoder), so a partial
    file is not mistaken for a loadable one; foreign files are described for the user.
    """
    keys = set(keys)
    for arch, markers in _ARCH_MARKERS.items():
        if all(m in keys for m in markers):
            return arch
    for description, matches in _OTHER_FORMATS:
        example = next((k for k in sorted(keys) if matches(k)), None)
        if example is not None:
            raise UnknownArchitectureError(
                f"not an SD1.5/SDXL checkpoint: looks like {description} ({example!r})"
            )
    samples = ", ".join(sorted(keys)[:5])
    raise UnknownArchitectureError(
        f"not an SD1.5/SDXL checkpoint: unrecognised layout with {len(keys)} tensors (e.g. {samples})"
    )


# ---------------------------------------------------------------------------- discovery, resolution


def discover_checkpoints(root: Path) -> list[CheckpointInfo]:
    """`*.safetensors` files and diffusers folders in `root` and its direct subfolders, sorted by name.
    Symlinks the user placed there are followed (model folders often live on another drive)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in _candidates(root):
        if _is_diffusers_folder(entry):
            found.append(_info(root, entry, "folder"))
        elif entry.is_file() and entry.suffix == ".safetensors":
            found.append(_info(root, entry, "file"))
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
    return CheckpointInfo(path.relative_to(root).as_posix(), path, kind, size, root)


def resolve_checkpoint(name_or_path: str, root: Path) -> CheckpointInfo:
    """The checkpoint a user asked for, by its name relative to `root`.

    Refuses absolute paths and `..` (names come from the UI and the API), and anything but
    safetensors files and diffusers folders: pickle-based files (.ckpt/.bin/.pt) can run code when
    loaded. A bare name without suffix also matches `<name>.safetensors`.
    """
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
    if path.suffix != ".safetensors":
        raise UnsupportedCheckpointFormatError(f"{name_or_path!r} is not a .safetensors file")
    return _info(root, path, "file")


# -------------------------------------------------------------------------------------- validation


def read_safetensors_header(path: Path) -> tuple[frozenset[str], dict[str, str]]:
    """Tensor names and metadata of a safetensors file, raising ModelLoadError if it is not one."""
    try:
        return read_header(path)
    except SafetensorsFileError as exc:
        raise ModelLoadError(str(exc)) from exc


# ----------------------------------------------------------------------------------------- loading


def load_tokenizers(arch: str) -> dict[str, CLIPTokenizer]:
    """The bundled CLIP tokenizer(s) as pipeline kwargs; SDXL's second one pads with "!"."""
    tokenizers = {"tokenizer": CLIPTokenizer.from_pretrained(TOKENIZER_DIR)}
    if arch == "sdxl":
        tokenizers["tokenizer_2"] = CLIPTokenizer.from_pretrained(TOKENIZER_DIR, pad_token="!")
    return tokenizers


def load_pipeline(info: CheckpointInfo, dtype: torch.dtype) -> LoadedModel:
    """Load a checkpoint on CPU in `dtype`, offline, with the safety checker off.

    Why loading is not slower than diffusers' own: the file's sha256 is computed on a helper thread
    while diffusers builds the pipeline (hashlib and file reads release the GIL), and both the hash
    and the finite-weights verdict are kept in the folder's `FACTS_FILE`, so only the first load of
    a file reads it end to end; later loads leave the memory-mapped weights untouched, as diffusers does.
    """
    if info.kind == "folder":
        weights = info.path / "unet" / "diffusion_pytorch_model.safetensors"
        if not weights.is_file():
            raise ModelLoadError(f"{info.name}: no unet/diffusion_pytorch_model.safetensors in the folder")
        arch = _folder_arch(info)
        _validate_folder_weights(info)
        load = _load_folder
    else:
        weights = info.path
        keys, metadata = read_safetensors_header(info.path)
        try:
            arch = detect_architecture(keys)
        except UnknownArchitectureError as exc:
            raise UnknownArchitectureError(f"{info.name}: {exc}") from exc
        load = _single_file_loader(keys, metadata)
    facts = FileFacts(info.root / FACTS_FILE if info.root is not None else None)
    hashing = ThreadPoolExecutor(1, thread_name_prefix="sha256")
    try:
        digest = hashing.submit(facts.sha256, weights)
        pipe = _run_loader(load, info, arch, dtype)
        _check_loaded(pipe, dtype, info.name)
        _check_finite_once(facts, info, pipe, dtype)
        short_hash = digest.result()[:10]
    finally:
        hashing.shutdown(wait=False, cancel_futures=True)  # a failed load does not wait for the hash
    logger.info("loaded %s (%s, %s, %s)", info.name, arch, dtype, short_hash)
    return LoadedModel(pipe=pipe, arch=arch, info=info, short_hash=short_hash)


def _run_loader(load, info: CheckpointInfo, arch: str, dtype: torch.dtype):
    try:
        return load(info, arch, dtype)
    except ModelLoadError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{info.name}: diffusers failed to load it as {arch}: {exc}") from exc


def _check_finite_once(facts: FileFacts, info: CheckpointInfo, pipe, dtype: torch.dtype) -> None:
    """`check_finite_weights`, skipped for a checkpoint already verified in this dtype: the verdict
    depends only on the weight files' contents (a folder's identity covers all its weight files)."""
    if info.kind == "file":
        identity = FileIdentity.of(info.path)
    else:
        identity = FileIdentity.of_folder(info.path, sorted(info.path.glob("*/*.safetensors")))
    verified = facts.get(identity, "finite_dtypes") or []
    if str(dtype) in verified:
        return
    check_finite_weights(pipe, dtype, info.name)
    facts.put(identity, "finite_dtypes", sorted({*verified, str(dtype)}))


def _pipeline_kwargs(arch: str, dtype: torch.dtype) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if arch == "sd15":
        kwargs.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return kwargs


def _folder_arch(info: CheckpointInfo) -> str:
    try:
        class_name = json.loads((info.path / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{info.name}: unreadable model_index.json ({exc})") from exc
    if class_name not in _ARCH_BY_PIPELINE_CLASS:
        raise UnknownArchitectureError(
            f"{info.name}: model_index.json names {class_name!r}; "
            f"supported: {sorted(_ARCH_BY_PIPELINE_CLASS)}"
        )
    return _ARCH_BY_PIPELINE_CLASS[class_name]


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
    return PIPELINE_CLASSES[arch].from_pretrained(info.path, use_safetensors=True, **kwargs)


def meta_components(arch: str, config_dir: Path) -> SimpleNamespace:
    """UNet, VAE and text encoder(s) built from `config_dir` on the meta device: names and shapes of
    the full pipeline at no memory cost (enough for `ldm_plan`)."""
    with torch.device("meta"):
        parts = {
            "unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(config_dir / "unet")),
            "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(config_dir / "vae")),
        }
        for name in TEXT_ENCODER_PREFIXES[arch]:
            config = CLIPTextConfig.from_pretrained(config_dir / name)
            parts[name] = _TEXT_ENCODER_CLASSES[name](config)
    return SimpleNamespace(**parts)


def _single_file_loader(keys: frozenset[str], metadata: dict[str, str]):
    """Loader for one file that refuses it unless it holds every tensor the pipeline has.

    diffusers loads single files non-strictly: without accelerate a missing tensor silently keeps its
    random initial value, with accelerate it stays on `meta` and fails later with an unrelated error.
    The check compares the file's keys with the loaded pipeline's own LDM plan; only when diffusers
    fails does it build the pipeline's shape on the meta device (a third of a second for SD1.5) to
    tell a missing tensor apart from other failures.
    """

    def load(info: CheckpointInfo, arch: str, dtype: torch.dtype):
        with _config_folder(arch, metadata, info.name) as config_dir:
            try:
                pipe = PIPELINE_CLASSES[arch].from_single_file(
                    str(info.path),
                    config=str(config_dir),
                    **load_tokenizers(arch),
                    **_pipeline_kwargs(arch, dtype),
                )
            except (OSError, RuntimeError, KeyError, ValueError):
                _refuse_missing(keys, meta_components(arch, config_dir), arch, info.name)
                raise
        _refuse_missing(keys, pipe, arch, info.name)
        return pipe

    return load


def _refuse_missing(keys: frozenset[str], components, arch: str, name: str) -> None:
    missing = sorted({entry.key for entry in ldm_plan(components, arch)} - keys)
    if missing:
        raise ModelLoadError(
            f"{name}: {len(missing)} tensors of the {arch} pipeline are missing from the file "
            f"(e.g. {', '.join(missing[:3])})"
        )


@contextlib.contextmanager
def _config_folder(arch: str, metadata: dict[str, str], name: str) -> Iterator[Path]:
    """The bundled config folder, or a temporary copy with the file's embedded component configs."""
    if CONFIGS_METADATA_KEY not in metadata:
        yield CONFIG_DIRS[arch]
        return
    overrides = _embedded_configs(arch, metadata[CONFIGS_METADATA_KEY], name)
    with tempfile.TemporaryDirectory(prefix="sd-config-") as tmp:
        folder = Path(tmp) / arch
        shutil.copytree(CONFIG_DIRS[arch], folder)
        for component, config in overrides.items():
            (folder / _CONFIG_FILES[component]).write_text(json.dumps(config))
        yield folder


def _embedded_configs(arch: str, text: str, name: str) -> dict[str, dict]:
    try:
        configs = json.loads(text)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: metadata {CONFIGS_METADATA_KEY!r} is not valid JSON ({exc})") from exc
    allowed = {"unet", "vae", *TEXT_ENCODER_PREFIXES[arch]}
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
    both), with no tensor-sized temporary: about 0.3-0.6 ns per weight on two CPU cores, but the
    first pass over a memory-mapped file also faults every page in (seconds for SDXL), which is why
    `load_pipeline` runs it once per file and dtype (`_check_finite_once`)."""
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
    """Every tensor on CPU, floating ones in `dtype`, no accelerate hooks: the contract of this module."""
    problems = []
    for component, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        for tensor_name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.device.type != "cpu" or (tensor.is_floating_point() and tensor.dtype != dtype):
                problems.append(f"{component}.{tensor_name} on {tensor.device} in {tensor.dtype}")
        problems += [
            f"{component}.{n} has an accelerate hook"
            for n, m in module.named_modules()
            if hasattr(m, "_hf_hook")
        ]
    if problems:
        raise ModelLoadError(f"{name}: loaded pipeline breaks the CPU/{dtype} contract: {problems[:5]}")
