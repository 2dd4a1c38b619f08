"""Reading one ControlNet into a module, for a family, in the engine's dtype; on the CPU (the engine places it).

* a diffusers folder: the family's ControlNet class named by its `config.json`, `from_pretrained` offline;
* a single file: its tensors converted to diffusers names (the family's `convert`, else diffusers' own
  single-file converter for the class: LDM `control_model.*` for SD), then assigned to a model built from the
  first of the family's `single_file_configs` whose shapes fit — a single file carries no config, and
  reading configs from the hub is never done here.

Nothing half-loaded: every failure raises `ControlNetFileError` naming the file before anything is handed on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import torch
from accelerate import init_empty_weights
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
from safetensors.torch import load_file

from app.controlnet.files import ControlNetEntry, ControlNetFileError
from app.families import ControlNetKit, Family
from app.safetensors_files import SafetensorsFileError, read_header, refuse_bad_values

log = logging.getLogger(__name__)


def load(entry: ControlNetEntry, fam: Family, dtype: torch.dtype) -> torch.nn.Module:
    """`entry` as a module of `fam`'s ControlNet classes, every tensor on the CPU in `dtype`, in eval mode."""
    kit = fam.controlnet
    if kit is None:
        raise ControlNetFileError(f"{fam.label} models take no ControlNet")
    try:
        read_header(entry.weights)  # a corrupt or renamed-pickle file is refused here, unopened by torch
        model = _from_folder(entry, kit) if entry.folder else _from_file(entry, kit)
    except SafetensorsFileError as exc:
        raise ControlNetFileError(f"ControlNet {entry.name}: {exc}") from exc
    if any(p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def _from_folder(entry: ControlNetEntry, kit: ControlNetKit) -> torch.nn.Module:
    try:
        class_name = json.loads((entry.path / "config.json").read_text()).get("_class_name")
    except (OSError, ValueError) as exc:
        raise ControlNetFileError(f"ControlNet {entry.name}: config.json is not readable JSON ({exc})") from exc
    cls = next((c for c in kit.model_classes if c.__name__ == class_name), None)
    if cls is None:
        raise ControlNetFileError(f"ControlNet {entry.name} is a {class_name}; this model takes "
                                  f"{', '.join(c.__name__ for c in kit.model_classes)}")
    state = _tensors(entry)
    config = cls.load_config(entry.path)
    return _assigned(entry, cls, config, state)


def _from_file(entry: ControlNetEntry, kit: ControlNetKit) -> torch.nn.Module:
    state = _tensors(entry)
    cls = kit.model_classes[0]
    convert = kit.convert or SINGLE_FILE_LOADABLE_CLASSES[cls.__name__]["checkpoint_mapping_fn"]
    tried = []
    for config in kit.single_file_configs():
        try:
            converted = convert(dict(state), config=dict(config)) if kit.convert is None else convert(state, config)
        except (KeyError, IndexError, ValueError) as exc:  # the converter met another layout
            tried.append(str(exc))
            continue
        fits = _fits(cls, config, converted)
        if fits is None:
            return _assigned(entry, cls, config, converted)
        tried.append(fits)
    raise ControlNetFileError(f"ControlNet {entry.name}: its tensors fit no {cls.__name__} layout this app knows "
                              f"({'; '.join(tried[:2])})")


def _tensors(entry: ControlNetEntry) -> dict[str, torch.Tensor]:
    state = load_file(str(entry.weights))
    refuse_bad_values(entry.weights, state, ControlNetFileError)
    return state


def _fits(cls: type, config: Mapping[str, object], state: Mapping[str, torch.Tensor]) -> str | None:
    """Why `state` does not fit a `cls` built from `config` (missing, extra or reshaped tensors); None: it fits."""
    with init_empty_weights():
        shell = cls.from_config(dict(config))
    want = {k: tuple(v.shape) for k, v in shell.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    reshaped = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    if not (missing or extra or reshaped):
        return None
    first = (missing or extra or reshaped)[0]
    return f"{len(missing)} missing, {len(extra)} unexpected, {len(reshaped)} reshaped tensors, e.g. {first}"


def _assigned(entry: ControlNetEntry, cls: type, config: Mapping[str, object], state: dict) -> torch.nn.Module:
    """A `cls` from `config` whose parameters are `state`'s tensors (assigned, never copied twice)."""
    why = _fits(cls, config, state)
    if why is not None:
        raise ControlNetFileError(f"ControlNet {entry.name}: its tensors do not fit its config ({why})")
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(dict(config))
    model.load_state_dict(state, strict=True, assign=True)
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ControlNetFileError(f"ControlNet {entry.name}: {len(left)} tensors were not in the file, e.g. {left[0]}")
    return model
