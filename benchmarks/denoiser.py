"""The denoiser of any family (SD's UNet, Flux's transformer) as the benchmark sees it: which
component it is, one call's inputs at a given size, and that call's FLOPs.

Why one module: the timing hooks, the op counts and the TFLOP per step all wrap "one denoiser
call", and what that call takes differs by family: a UNet reads a spatial latent and CLIP states
(SDXL adds pooled text and size ids) and runs the CFG-doubled batch; Flux's transformer reads 2×2
latent patches packed into a sequence, T5 states, CLIP's pooled vector, position ids and (dev) the
distilled guidance value, and runs the batch once (no unconditional pass); Z-Image's reads lists, one
(channels, 1, h, w) latent and one caption's Qwen3 states per image, the batch once at Turbo's CFG 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from app.families import family, family_of
from benchmarks.config import runs_cfg

_TEXT_TOKENS = 77  # CLIP's sequence length (SD's only text input, Flux's pooled vector comes from it)
# Z-Image's caption: the benchmark prompt in Qwen3's chat template is 19 tokens, which the transformer
# pads to its 32-token multiple
_CAPTION_TOKENS = 19


def denoiser_of(pipe) -> torch.nn.Module:
    """The pipeline's denoising component (`unet`, or `transformer` for DiTs): where step hooks go."""
    return getattr(pipe, family_of(pipe).denoiser)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build models directly in `dtype`: a float32 build cast afterwards would first need float32's
    memory (Flux's 17 B parameters: 67 GB) and makes diffusers warn about every cast model."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def meta_denoiser(arch: str, config: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The family's denoiser built from `config` on the meta device in `dtype`: exact shapes, no memory."""
    with torch.device("meta"), default_dtype(dtype):
        return family(arch).denoiser_class.from_config(config)


def rows_per_call(arch: str, batch: int) -> int:
    """Images' rows in one denoiser call: doubled where CFG runs an unconditional pass."""
    return 2 * batch if runs_cfg(arch) else batch


def call_inputs(arch: str, denoiser: torch.nn.Module, batch: int, latent_side: int) -> dict:
    """Keyword arguments of one call of a meta `denoiser` for `batch` images at `latent_side`² latent
    pixels, in its dtype (empty tensors: the values do not matter to op counts or FLOPs)."""
    rows, cfg, dtype = rows_per_call(arch, batch), denoiser.config, denoiser.dtype

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="meta", dtype=dtype)

    if "cap_feat_dim" in cfg:  # Z-Image
        return {"x": [empty(cfg.in_channels, 1, latent_side, latent_side) for _ in range(rows)], "t": empty(rows),
                "cap_feats": [empty(_CAPTION_TOKENS, cfg.cap_feat_dim) for _ in range(rows)], "return_dict": False}
    if family(arch).denoiser == "transformer":
        tokens, text = (latent_side // 2) ** 2, family(arch).max_sequence_length
        guidance = {"guidance": empty(rows)} if cfg.guidance_embeds else {}
        # FLUX.1 reads a pooled text vector and 3 position axes; FLUX.2 none and 4 axes, with a batch dimension
        pooled = ({"pooled_projections": empty(rows, cfg.pooled_projection_dim)}
                  if "pooled_projection_dim" in cfg else {})
        axes = len(cfg.axes_dims_rope)
        ids = {"img_ids": empty(tokens, 3), "txt_ids": empty(text, 3)} if axes == 3 else \
            {"img_ids": empty(rows, tokens, axes), "txt_ids": empty(rows, text, axes)}
        return {"hidden_states": empty(rows, tokens, cfg.in_channels),
                "encoder_hidden_states": empty(rows, text, cfg.joint_attention_dim), "timestep": empty(rows),
                "return_dict": False, **pooled, **ids, **guidance}
    inputs = {"sample": empty(rows, cfg.in_channels, latent_side, latent_side),
              "timestep": torch.tensor(500.0, device="meta"),
              "encoder_hidden_states": empty(rows, _TEXT_TOKENS, cfg.cross_attention_dim), "return_dict": False}
    if cfg.addition_embed_type == "text_time":
        text_dim = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {"text_embeds": empty(rows, text_dim), "time_ids": empty(rows, 6)}
    return inputs


def tflop_per_step(arch: str, config: dict, batch: int, latent_side: int) -> float:
    """TFLOP of one denoising step (one denoiser call, on the CFG-doubled batch where the family
    uses CFG), counted by torch's FlopCounterMode on a meta-device copy: exact for the shapes, costs
    no memory and needs no GPU."""
    denoiser = meta_denoiser(arch, config)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        denoiser(**call_inputs(arch, denoiser, batch, latent_side))
    return counter.get_total_flops() / 1e12
