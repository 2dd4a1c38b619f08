"""A single-file checkpoint's config checked against the tensor shapes in its header.

A config decides how much memory the model takes; the file only says what its tensors hold. When
the two disagree diffusers first builds the model the config describes (random weights, full
size) and only then finds the mismatch: a 12 MB file whose embedded config asked for
`block_out_channels=[4096, 8192, …]` drove the process past 10 GiB before failing. So a config the
file brings (or one we adapted to it) is built on the meta device (names and shapes, no memory),
laid out as the LDM file would be, and compared with the header's shapes before anything is built.

Even a meta build costs Python objects per layer, and a config can ask for any number of layers
(`layers_per_block=100000`). A model needs one file tensor per parameter (OpenCLIP keeps q, k
and v in one), so building stops as soon as it registers more than three parameters per tensor
the file holds: the check costs at most what the file's header already describes.

A config we ship is bounded (the full-size architecture) and diffusers builds it on the meta
device anyway, so a real checkpoint is compared with the pipeline diffusers built from it
(`check_loaded_shapes`): the same verdict without building the model twice.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

from app.families import family
from app.families.ldm_layout import ldm_shapes, to_ldm_state_dict

PARAMETERS_PER_TENSOR = 3  # OpenCLIP stores q, k, v as one in_proj tensor
_SHOWN = 3


class CheckpointShapeError(ValueError):
    """The config and the file's tensors disagree; the message says where and how."""


def build_components(family_name: str, config_dir: Path) -> dict[str, torch.nn.Module]:
    """The family's denoiser, VAE and text encoder(s) from the configs in `config_dir`, on the
    current default device (the caller's `torch.device(...)` context): one builder for the meta
    shapes here and for the benchmark's random-weight pipelines, so both describe the same model."""
    fam = family(family_name)
    denoiser = fam.denoiser_class
    parts = {fam.denoiser: denoiser.from_config(denoiser.load_config(config_dir / fam.denoiser)),
             "vae": fam.vae_class.from_config(fam.vae_class.load_config(config_dir / "vae"))}
    for te in fam.text_encoders:
        parts[te.component] = te.model_class(te.config_class.from_pretrained(config_dir / te.component))
    return parts


def meta_components(family_name: str, config_dir: Path, max_parameters: int | None = None) -> SimpleNamespace:
    """Denoiser (`unet`, or `transformer` for DiTs), VAE and text encoder(s) built from `config_dir` on
    the meta device: names and shapes of the full pipeline at no memory cost. With `max_parameters`,
    building stops past that many."""
    with torch.device("meta"), parameter_budget(max_parameters):
        return SimpleNamespace(**build_components(family_name, config_dir))


@contextlib.contextmanager
def parameter_budget(limit: int | None) -> Iterator[None]:
    """Raise once this thread registers more than `limit` parameters (other threads are not counted)."""
    if limit is None:
        yield
        return
    thread, count = threading.get_ident(), 0

    def count_one(_module, _name, _param) -> None:
        nonlocal count
        if threading.get_ident() == thread:
            count += 1
            if count > limit:
                raise CheckpointShapeError(f"the config describes more than {limit} parameters, more than "
                                           "the file's tensors can fill")

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(count_one)
    try:
        yield
    finally:
        handle.remove()


def expected_shapes(family_name: str, config_dir: Path,
                    max_parameters: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor an LDM single file of this config must hold, with its shape."""
    try:
        meta = meta_components(family_name, config_dir, max_parameters)
    except CheckpointShapeError:
        raise
    except Exception as exc:  # the config is untrusted input to third-party constructors: any error is its fault
        raise CheckpointShapeError(f"the config does not build a {family_name} model "
                                   f"({type(exc).__name__}: {exc})") from exc
    return {key: tuple(tensor.shape) for key, tensor in to_ldm_state_dict(meta, family(family_name)).items()}


def check_header_shapes(family_name: str, config_dir: Path, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Refuse unless the file (`shapes`, from its header) holds every tensor `source` (the config's
    description, for messages) asks for, each with the shape it asks for: checked before building,
    on the meta device, for a config we did not ship."""
    _compare(family_name, expected_shapes(family_name, config_dir, PARAMETERS_PER_TENSOR * len(shapes)), shapes, source)


def check_loaded_shapes(pipe, family_name: str, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """The same check against the pipeline diffusers built from a config we ship: its size is bounded
    and diffusers builds it on the meta device, so nothing is gained by building it twice (a third
    of the load), while diffusers, which loads single files non-strictly, would leave a tensor the
    file lacks at its random or meta initial value. Reads shapes only, never a weight."""
    _compare(family_name, ldm_shapes(pipe, family(family_name)), shapes, source)


def _compare(family_name: str, expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]],
             source: str) -> None:
    missing = sorted(expected.keys() - shapes.keys())
    if missing:
        raise CheckpointShapeError(f"{len(missing)} tensors of the {family_name} pipeline are missing from the file "
                                   f"(e.g. {', '.join(missing[:_SHOWN])})")
    wrong = sorted(key for key, shape in expected.items() if tuple(shapes[key]) != shape)
    if wrong:
        examples = "; ".join(f"{key}: the file holds {list(shapes[key])}, {source} expects {list(expected[key])}"
                             for key in wrong[:_SHOWN])
        raise CheckpointShapeError(f"{len(wrong)} tensors do not have the shapes {source} asks for ({examples}); "
                                   "refused")
