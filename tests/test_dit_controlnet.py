"""FLUX.1 and Z-Image ControlNets against diffusers' own pipelines, on tiny random weights (CPU, fp32).

What it protects: our control pipelines, run through each family's kit (the unit stack, `arm`), draw diffusers'
`FluxControlNetPipeline` / `ZImageControlNetPipeline` image bit for bit on the same weights, seed and settings;
weight 0 draws the plain txt2img image bit for bit (the ControlNet never moves the seed's noise); two units
sum as diffusers sums them; Z-Image's guidance window leaves the steps outside it uncontrolled; the ControlNet
files people have (XLabs' BFL names, Z-Image 2.0 beside 2.1) read to the right tensors and configs.

One difference from diffusers is by design and stated where the oracle is called: diffusers' FLUX.1 pipeline
draws the control image's VAE sample from the generators before the first noise, so a ControlNet would move
the noise; ours draws that noise as the seed draws it without one, so the oracle hands diffusers that noise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (
    FluxControlNetModel,
    FluxControlNetPipeline,
    FluxPipeline,
    ZImageControlNetModel,
    ZImageControlNetPipeline,
)
from PIL import Image

from app.controlnet.units import ControlUnit
from app.demo import build_tiny_controlnet, build_tiny_pipeline
from app.families import family, flux_controlnet, zimage_controlnet
from app.families.flux import (
    SteadyFluxControlNetImg2ImgPipeline,
    SteadyFluxControlNetPipeline,
    SteadyFluxImg2ImgPipeline,
    SteadyFluxPipeline,
)
from app.families.zimage import SteadyZImageControlNetPipeline, SteadyZImagePipeline

SEED, SIDE, STEPS = 7, 64, 2


def _map(seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(SIDE, SIDE, 3) * 255).astype(np.uint8))


def _gens() -> list[torch.Generator]:
    return [torch.Generator().manual_seed(SEED)]


def _quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def flux():
    return build_tiny_pipeline("flux-dev")


@pytest.fixture(scope="module")
def zimage():
    return build_tiny_pipeline("zimage-turbo")


def _flux_net(kind: str) -> FluxControlNetModel:
    transformer = family("flux-dev").test_kit.tiny_configs["transformer"]
    configs = {"union": flux_controlnet.tiny_config(transformer, union=True),
               "xlabs": flux_controlnet._configs(dict(transformer))[6]}
    assert configs["xlabs"]["conditioning_embedding_channels"]
    return build_tiny_controlnet("flux-dev", 1, configs[kind])


FLUX_CALL = dict(prompt="a red cube", num_inference_steps=STEPS, height=SIDE, width=SIDE, guidance_scale=3.5,
                 output_type="latent", max_sequence_length=32)


def _ours_flux(flux, nets, units, maps):
    stack = family("flux-dev").controlnet.stack_class(nets)
    pipe = _quiet(SteadyFluxControlNetPipeline(**flux.components, controlnet=stack))
    return pipe(generator=_gens(), **FLUX_CALL, **family("flux-dev").controlnet.arm(stack, "txt2img", maps, units,
                                                                                    3.5)).images


def _seed_noise() -> torch.Tensor:
    """The first noise the seed draws for a 64² FLUX.1 image, packed (what FluxPipeline draws)."""
    noise = torch.randn((1, 16, 8, 8), generator=torch.Generator().manual_seed(SEED))
    return FluxPipeline._pack_latents(noise, 1, 16, 8, 8)


@pytest.mark.parametrize("kind", ["union", "xlabs"])
def test_flux_controlnet_equals_diffusers_and_weight_zero_is_the_plain_image(flux, kind):
    """InstantX-style union (mode from the unit's preprocessor: depth = 2) and XLabs: our pipeline through the
    kit equals `FluxControlNetPipeline` bit for bit, given the seed's noise (see the module docstring); at weight
    0 (union) it equals `SteadyFluxPipeline`'s image bit for bit, and at 0.8 it differs from it."""
    net, unit = _flux_net(kind), ControlUnit(model="tiny", module="depth_midas", weight=0.8)
    ours = _ours_flux(flux, [net], [unit], [_map(0)])
    theirs = _quiet(FluxControlNetPipeline(**flux.components, controlnet=net))(
        generator=_gens(), latents=_seed_noise(), control_image=_map(0), controlnet_conditioning_scale=0.8,
        control_mode=2 if kind == "union" else None, **FLUX_CALL).images
    assert torch.equal(ours, theirs)
    if kind == "xlabs":  # the noise and the weight are the kit's and the pipeline's, whatever the net: once is enough
        return
    plain = _quiet(SteadyFluxPipeline(**flux.components))(generator=_gens(), **FLUX_CALL).images
    off = _ours_flux(flux, [net], [ControlUnit(model="tiny", module="depth_midas", weight=0.0)], [_map(0)])
    assert torch.equal(off, plain)
    assert (ours - plain).abs().max() > 1e-2


def test_two_flux_units_sum_as_diffusers_and_two_maps_give_two_images(flux):
    """Two union units (one net, canny and depth modes, different maps, weights and windows) equal diffusers'
    multi-ControlNet call bit for bit; swapping the maps changes the image."""
    net = _flux_net("union")
    units = [ControlUnit(model="tiny", module="canny", weight=0.7, guidance_end=0.5),
             ControlUnit(model="tiny", module="depth_anything", weight=0.5, guidance_start=0.5)]
    ours = _ours_flux(flux, [net, net], units, [_map(0), _map(1)])
    theirs = _quiet(FluxControlNetPipeline(**flux.components, controlnet=[net, net]))(
        generator=_gens(), latents=_seed_noise(), control_image=[_map(0), _map(1)], control_mode=[0, 2],
        controlnet_conditioning_scale=[0.7, 0.5], control_guidance_start=[0.0, 0.5], control_guidance_end=[0.5, 1.0],
        **FLUX_CALL).images
    assert torch.equal(ours, theirs)
    swapped = _ours_flux(flux, [net, net], units, [_map(1), _map(0)])
    assert (swapped - ours).abs().max() > 1e-3


def test_flux_img2img_control_at_weight_zero_is_the_img2img_stage(flux):
    """The img2img (and hires) control pipeline, handed latents as the engine's stages are: at weight 0 it draws
    the plain img2img stage's image bit for bit (same steps × strength, same noise), at 0.8 another one."""
    kit, net = family("flux-dev").controlnet, _flux_net("union")
    call = dict(FLUX_CALL, num_inference_steps=4, strength=0.6,
                image=torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3)))
    plain = _quiet(SteadyFluxImg2ImgPipeline(**flux.components))(generator=_gens(), **call).images
    parts = {k: v for k, v in flux.components.items() if k not in ("image_encoder", "feature_extractor")}
    out = {}
    for weight in (0.0, 0.8):
        stack = kit.stack_class([net])
        pipe = _quiet(SteadyFluxControlNetImg2ImgPipeline(**parts, controlnet=stack))
        unit = ControlUnit(model="tiny", module="tile_resample", weight=weight)
        out[weight] = pipe(generator=_gens(), **call, **kit.arm(stack, "img2img", [_map(0)], [unit], 3.5)).images
    assert torch.equal(out[0.0], plain)
    assert (out[0.8] - plain).abs().max() > 1e-2


def test_flux_units_the_kit_cannot_run_are_refused_by_name(flux):
    """A union unit whose preprocessor names no mode, a non-Balanced control mode, XLabs beside InstantX."""
    kit, union, xlabs = family("flux-dev").controlnet, _flux_net("union"), _flux_net("xlabs")
    with pytest.raises(ValueError, match="names none of its modes"):
        kit.arm(kit.stack_class([union]), "txt2img", [_map(0)], [ControlUnit(model="tiny", module="none")], 3.5)
    with pytest.raises(ValueError, match="control mode 'Balanced' only"):
        kit.arm(kit.stack_class([union]), "txt2img", [_map(0)],
                [ControlUnit(model="tiny", module="canny", control_mode="My prompt is more important")], 3.5)
    with pytest.raises(ValueError, match="XLabs and InstantX-style"):
        kit.arm(kit.stack_class([union, xlabs]), "txt2img", [_map(0)] * 2,
                [ControlUnit(model="tiny", module="canny")] * 2, 3.5)


def test_xlabs_file_reads_to_the_model_it_was_written_from(tmp_path):
    """An XLabs file (BFL names: fused qkv, `pos_embed_input`, the hint encoder's Sequential indices) loads,
    through the engine's ControlNet loader, to the tensors it was written from; its fused q/k/v rows are
    diffusers' to_q, to_k, to_v in that order and its convolutions keep x-flux's order (InvokeAI's port)."""
    net = _flux_net("xlabs")
    config, state = dict(net.config), net.state_dict()
    written = flux_controlnet.to_single_file(state, config)
    assert torch.equal(written["double_blocks.0.img_attn.qkv.weight"], torch.cat(
        [state[f"transformer_blocks.0.attn.to_{p}.weight"] for p in "qkv"]))
    assert torch.equal(written["input_hint_block.2.weight"], state["input_hint_block.blocks.0.weight"])
    assert torch.equal(written["input_hint_block.4.weight"], state["input_hint_block.blocks.1.weight"])
    assert torch.equal(written["input_hint_block.14.weight"], state["input_hint_block.conv_out.weight"])
    assert torch.equal(written["pos_embed_input.weight"], state["controlnet_x_embedder.weight"])
    read = _loaded(tmp_path, "xlabs", written, "flux-dev")
    assert read.config.conditioning_embedding_channels == 16 and read.state_dict().keys() == state.keys()
    assert all(torch.equal(read.state_dict()[k], state[k]) for k in state)


def _loaded(folder, name: str, tensors: dict, family_name: str) -> torch.nn.Module:
    """`tensors` saved as a single file and read by the engine's ControlNet loader for `family_name`."""
    from safetensors.torch import save_file

    from app.controlnet import loading
    from app.controlnet.files import ControlNetEntry

    path = folder / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return loading.load(ControlNetEntry(name, path, path), family(family_name), torch.float32)


# ------------------------------------------------------------------------------------------------ Z-Image
ZIMAGE_CALL = dict(prompt="a red cube", num_inference_steps=STEPS, height=SIDE, width=SIDE, output_type="latent",
                   max_sequence_length=32)


def _zimage_net() -> ZImageControlNetModel:
    return build_tiny_controlnet("zimage-turbo", 3)


def _ours_zimage(zimage, nets, units, maps, guidance=0.0):
    kit = family("zimage-turbo").controlnet
    stack = kit.stack_class(nets)
    pipe = _quiet(SteadyZImageControlNetPipeline(**zimage.components, controlnet=stack))
    return pipe(generator=_gens(), guidance_scale=guidance, **ZIMAGE_CALL,
                **kit.arm(stack, "txt2img", maps, units, guidance)).images, stack


@pytest.mark.parametrize("guidance", [0.0, 3.0])
def test_zimage_controlnet_equals_diffusers_and_weight_zero_is_the_plain_image(zimage, guidance):
    """Turbo's no-CFG call and a CFG call: ours equals `ZImageControlNetPipeline` bit for bit (diffusers' net
    owns the transformer's parts as submodules, ours borrows them); at weight 0 (no CFG) it equals
    `SteadyZImagePipeline`'s image bit for bit, and at 0.8 it differs from it."""
    net = _zimage_net()
    ours, stack = _ours_zimage(zimage, [net], [ControlUnit(model="tiny", weight=0.8)], [_map(0)], guidance)
    assert not set(map(id, stack.parameters())) & set(map(id, zimage.transformer.parameters()))
    theirs_net = ZImageControlNetModel(**net.config)
    theirs_net.load_state_dict(net.state_dict())
    theirs = _quiet(ZImageControlNetPipeline(**zimage.components, controlnet=theirs_net))(
        generator=_gens(), guidance_scale=guidance, control_image=_map(0), controlnet_conditioning_scale=0.8,
        **ZIMAGE_CALL).images
    assert torch.equal(ours, theirs)
    if guidance:  # the CFG batch's layout is what this case adds; weight 0 is checked without it
        return
    plain = _quiet(SteadyZImagePipeline(**zimage.components))(generator=_gens(), guidance_scale=guidance,
                                                                **ZIMAGE_CALL).images
    off, _ = _ours_zimage(zimage, [net], [ControlUnit(model="tiny", weight=0.0)], [_map(0)], guidance)
    assert torch.equal(off, plain)
    assert (ours - plain).abs().max() > 1e-2


def test_zimage_units_add_up_and_the_guidance_window_counts_steps(zimage):
    """A second unit at weight 0 leaves the image (to float rounding, see below); at 0.5 with another map it
    changes it; a unit whose window is the second half runs its ControlNet on the second of two steps only."""
    net = _zimage_net()
    one, _ = _ours_zimage(zimage, [net], [ControlUnit(model="tiny", weight=0.8)], [_map(0)])
    other = ControlUnit(model="tiny", weight=0.0)
    same, _ = _ours_zimage(zimage, [net, net], [ControlUnit(model="tiny", weight=0.8), other], [_map(0), _map(1)])
    # within 1e-5, not bit for bit: the units' maps are VAE-encoded as one batch, and CPU convolutions round by
    # batch size (measured 4.8e-7; the same unit alone, weight 0 or not, is bit-exact above)
    assert (same - one).abs().max() < 1e-5
    two, _ = _ours_zimage(zimage, [net, net], [ControlUnit(model="tiny", weight=0.8),
                                               ControlUnit(model="tiny", weight=0.5)], [_map(0), _map(1)])
    assert (two - one).abs().max() > 1e-3
    calls = []
    handle = net.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        _ours_zimage(zimage, [net], [ControlUnit(model="tiny", guidance_start=0.5)], [_map(0)])
    finally:
        handle.remove()
    assert len(calls) == 1


def test_zimage_files_read_as_their_version(tmp_path):
    """Through the engine's loader: 2.1 (trained refiner `before_proj`) reads as 2.1; the same shapes with that
    projection zero read as 2.0, its refiner tensors left out; both to the tensors diffusers' `from_single_file`
    reads from the same file (given the same config: it would fetch one from the hub)."""
    state = _zimage_net().state_dict()
    untrained = dict(state, **{zimage_controlnet._BEFORE: torch.zeros_like(state[zimage_controlnet._BEFORE])})
    for file_state, kind in ((state, "control_noise_refiner"), (untrained, "control_layers")):
        ours = _loaded(tmp_path, kind, file_state, "zimage-turbo")
        assert ours.config.add_control_noise_refiner == kind
        assert any(k.startswith("control_noise_refiner.") for k in ours.state_dict()) == (kind != "control_layers")
        ZImageControlNetModel(**ours.config).save_config(tmp_path / kind)
        theirs = ZImageControlNetModel.from_single_file(tmp_path / f"{kind}.safetensors",
                                                        config=str(tmp_path / kind)).state_dict()
        assert theirs.keys() == ours.state_dict().keys()
        assert all(torch.equal(theirs[k], ours.state_dict()[k]) for k in theirs)
