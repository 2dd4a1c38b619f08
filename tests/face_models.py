"""A tiny face-restoration model file for tests: a real RestoreFormer (spandrel builds it from its tensors'
shapes, purpose FaceSR) with 32 channels and six levels (~1 MB; 512² faces in well under a second on a CPU).

Why RestoreFormer and not GFPGAN: spandrel 0.4.2 builds GFPGAN only at its full size (out_size 512, channel
multiplier 2: ~340 MB), whatever the tensors' shapes; RestoreFormer's size is read from the tensors, so the same
path (spandrel → descriptor → slot → paste) runs on a model small enough for every test run.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from spandrel.architectures.RestoreFormer import RestoreFormer


def tiny_restorer_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = RestoreFormer(n_embed=16, embed_dim=32, ch=32, ch_mult=(1, 1, 1, 1, 1, 1), num_res_blocks=1,
                          z_channels=32, attn_resolutions=(16,), resolution=512, head_size=8)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def write_tiny_restorer(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tiny_restorer_tensors(seed), str(path))
    return path
