"""The family contract's rules, checked when a family is registered (`app.families.check_contract`) and when a
checkpoint is opened, so a new family's mistake is named with its rule instead of surfacing as a crash in some
test later (`test_demo`'s native size, a missing encoder prefix), and a user's file in a layout its family does
not load is refused as such instead of as an unknown or broken file."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import toy_family
from safetensors.torch import save_file

from app.demo import build_tiny_pipeline
from app.engine import checkpoint_files, models
from app.families import FAMILIES, FamilyContractError, check_contract, family


def test_a_family_breaking_a_rule_is_refused_naming_the_family_and_the_rule():
    """Each rule generic code relies on, broken once on the toy family: the error names the family and the
    rule. A folder-only family needs no markers and no encoder names for files it never reads."""
    toy = toy_family.toy_family()
    encoder = toy.text_encoders[0]
    def files(**changes):
        return dict(files=dataclasses.replace(toy.files, **changes))

    broken = {
        "states files.checkpoint_markers": files(layouts=("file", "folder"), checkpoint_markers=()),
        "states each TextEncoder.single_file_prefix": files(layouts=("file", "folder")),
        "states each TextEncoder.embedding_key": files(takes_embeddings=True),
        "size_multiple 48 must divide it": dict(size_multiple=48),
        "tiny_configs states a config for the denoiser": dict(test_kit=dataclasses.replace(
            toy.test_kit, tiny_configs={"unet": toy.test_kit.tiny_configs["unet"]})),
        r"files.layouts \('files',\) must be some of": files(layouts=("files",)),
    }
    for rule, changes in broken.items():
        with pytest.raises(FamilyContractError, match=rf"model family 'toy' breaks the family contract: .*{rule}"):
            check_contract(dataclasses.replace(toy, **changes))
    assert encoder.single_file_prefix is encoder.lora_prefix is encoder.embedding_key is None
    assert check_contract(dataclasses.replace(toy, **files(checkpoint_markers=()))).files.layouts == ("folder",)


def test_a_tiny_model_off_the_demos_native_size_is_refused_when_built(monkeypatch):
    """The demo's rule that every tiny model is DEMO_SIDE pixels (what `test_demo` and every 64² test assume) is
    checked when the tiny model is built, naming the family and the rule."""
    monkeypatch.setitem(FAMILIES, toy_family.NAME, dataclasses.replace(toy_family.toy_family(),
                                                                       native_size=lambda pipe: 128))
    with pytest.raises(FamilyContractError, match=r"'toy' .*native size is 128, the demo's rule is 64"):
        build_tiny_pipeline(toy_family.NAME)


def test_a_single_file_of_a_folder_only_family_is_refused_as_such(monkeypatch, tmp_path):
    """A single file holding a folder-only family's markers is refused saying the family loads from diffusers
    folders only, before any loader runs (not a misleading single-file error), for a planned request too."""
    monkeypatch.setitem(FAMILIES, toy_family.NAME, toy_family.toy_family())
    path = tmp_path / "toy.safetensors"
    save_file({marker: torch.zeros(1) for marker in family(toy_family.NAME).files.checkpoint_markers}, path)
    info = checkpoint_files.CheckpointInfo(path.name, path, "file", path.stat().st_size)
    expected = r"toy.safetensors: a Toy checkpoint, but Toy loads from diffusers folders .* only, not from single"
    with pytest.raises(models.ModelLoadError, match=expected):
        models.checkpoint_family(info)
    with pytest.raises(models.ModelLoadError, match=expected):
        models.load_pipeline(info, torch.float32)
    assert models.planned_family(tmp_path, path.name) is None
