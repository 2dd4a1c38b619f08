"""Qwen-Image 2.1 names: diffusers' `QwenImage21Transformer2DModel` versus the files ComfyUI ships.

ComfyUI's transformer file (`qwen_image_2.1_bf16.safetensors` in `models/diffusion_models`, bare or under
`model.diffusion_model.`) names every module as diffusers does but one: each block's SwiGLU gate and up
projections are one matrix, `img_mlp.gate_up`, gate rows first (one GEMM), where diffusers keeps
`img_mlp.gate_layer` and `img_mlp.proj` (diffusers' own converter,
`convert_qwen_image21_transformer_checkpoint_to_diffusers`, cuts it so). The rows here are each projection's
own out-features, read from the model, so the tiny demo model and the full one go through the same code.

LoRAs: diffusers/PEFT and kohya/musubi-tuner over diffusers' names need nothing here; ComfyUI and ai-toolkit
write `diffusion_model.` + those names, and a LoRA trained on ComfyUI's model covers the fused `gate_up`, cut
into the two projections by rows (`lora_aliases`).
"""

from __future__ import annotations

import torch

from app.families.file_layout import FileTensor, Layout, file_name_aliases
from app.families.ldm_layout import LYCORIS

KOHYA_COMFY = "kohya (ComfyUI names, fused gate_up)"
COMFY = "ComfyUI (diffusion_model.)"
_FUSED = ("img_mlp.gate_layer", "img_mlp.proj")  # `img_mlp.gate_up`, in row order


def transformer_layout(transformer: torch.nn.Module) -> Layout:
    """Every tensor of a `QwenImage21Transformer2DModel` -> its key in ComfyUI's file (rows inside `gate_up`)."""
    layout = {}
    for name in transformer.state_dict():
        module, _, param = name.rpartition(".")
        block, _, proj = module.rpartition(".img_mlp.")
        if block and f"img_mlp.{proj}" in _FUSED:
            widths = [transformer.get_submodule(f"{block}.{p}").out_features for p in _FUSED]
            start = sum(widths[: _FUSED.index(f"img_mlp.{proj}")])
            layout[name] = FileTensor(f"{block}.img_mlp.gate_up.{param}", ((start, start + widths[_FUSED.index(
                f"img_mlp.{proj}")]),))
        else:
            layout[name] = FileTensor(name)
    return layout


def lora_aliases(transformer: torch.nn.Module):
    """(key, parts, spelling) for each module as ComfyUI's file names it, `gate_up` listing its two row
    slices: kohya (`lora_unet_transformer_blocks_0_img_mlp_gate_up`), LyCORIS, and ComfyUI / ai-toolkit
    (`diffusion_model.transformer_blocks.0.attn.to_q`, bare or under that prefix)."""
    yield from file_name_aliases(transformer_layout(transformer), "transformer", KOHYA_COMFY, LYCORIS, COMFY)
