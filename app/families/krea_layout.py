"""Krea 2 names: diffusers' `Krea2Transformer2DModel` versus the files Krea and ComfyUI ship.

The transformer file (`models/diffusion_models`, bare or under `model.diffusion_model.`) keeps the names of
Krea's own code (`krea-ai/krea-2`): `blocks.N.attn.wq`, `mlp.gate`, `prenorm.scale`, `txtfusion.…`, `first`,
`last`, …, and each block's six modulation vectors as one flat row (`mod.lin`, 6·width elements). The table
here is diffusers' own converter (`convert_krea2_transformer_checkpoint_to_diffusers`) read backwards, built
from the model's tensors, so the tiny demo model and the full one go through the same code.

LoRAs: diffusers/PEFT need nothing here; Krea's trainer and ComfyUI write `diffusion_model.` + the file's
names (lora_A/B), kohya/musubi `lora_unet_` + them with `_` (`lora_aliases`).
"""

from __future__ import annotations

import torch

from app.families.file_layout import FileTensor, Layout, file_name_aliases
from app.families.ldm_layout import LYCORIS

KOHYA_KREA = "kohya (Krea's names)"
COMFY = "ComfyUI (diffusion_model.)"
# diffusers' name -> the file's, for whole top-level modules (the converter's `prefix_rename_dict`, reversed)
_TOP = (("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
        ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
        ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
        ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
        ("final_layer.scale_shift_table", "last.modulation.lin"))
# ... then inside the blocks (the converter's `block_rename_dict`, reversed)
_INNER = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
          (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
          (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
          (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
          (".scale_shift_table", ".mod.lin"))


def file_name(name: str) -> str:
    """A `Krea2Transformer2DModel` tensor's key in Krea's file."""
    name = next((theirs + name[len(ours):] for ours, theirs in _TOP if name.startswith(ours)), name)
    for ours, theirs in _INNER:
        name = name.replace(ours, theirs)
    return name


def transformer_layout(transformer: torch.nn.Module) -> Layout:
    """Every tensor of a `Krea2Transformer2DModel` -> its key in Krea's file (a block's modulation table flat)."""
    return {name: FileTensor(file_name(name), flat=name.startswith("transformer_blocks.")
                             and name.endswith(".scale_shift_table"))
            for name in transformer.state_dict()}


def lora_aliases(transformer: torch.nn.Module):
    """(key, parts, spelling) for each module as Krea's file names it: kohya (`lora_unet_blocks_0_attn_wq`),
    LyCORIS, and ComfyUI / Krea's trainer (`diffusion_model.blocks.0.attn.wq`, bare or under that prefix)."""
    yield from file_name_aliases(transformer_layout(transformer), "transformer", KOHYA_KREA, LYCORIS, COMFY)
