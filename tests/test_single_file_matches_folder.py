"""One model stored two ways, as an LDM single file and as a diffusers folder, must generate the same
image: the single file takes its scheduler settings from the bundled config, the folder from its
own, and both must be the original configs' ("leading" spacing, steps_offset 1)."""

from __future__ import annotations

import json

import diffusers
import pytest
import torch

from app.families import family


@pytest.mark.parametrize("family_name", ["sd15", "sdxl"])
def test_samplers_from_the_bundled_config_match_the_diffusers_folder(demo_paths, family_name):
    """A single file takes its scheduler from the bundled config, a diffusers folder from its own;
    every sampler built from either must step through the same timesteps and sigmas: the original
    configs' "leading" spacing with steps_offset 1 (Euler, 20 steps: 951, 901, …)."""
    index = json.loads((family(family_name).files.config_dir / "model_index.json").read_text())
    scheduler_cls = getattr(diffusers, index["scheduler"][1])
    bundled = scheduler_cls.from_pretrained(family(family_name).files.config_dir, subfolder="scheduler")
    folder = scheduler_cls.from_pretrained(demo_paths[f"{family_name}_folder"], subfolder="scheduler")
    for name, (cls, overrides) in family(family_name).sampling.samplers.items():
        ours, theirs = cls.from_config(bundled.config, **overrides), cls.from_config(folder.config, **overrides)
        ours.set_timesteps(20)
        theirs.set_timesteps(20)
        assert torch.equal(ours.timesteps, theirs.timesteps), name
        if hasattr(ours, "sigmas"):
            assert torch.equal(ours.sigmas, theirs.sigmas), name
        if name == "Euler":
            assert ours.timesteps[:3].tolist() == [951, 901, 851]
