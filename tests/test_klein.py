"""FLUX.2 Klein's own behaviour, on the tiny 4B: our images equal diffusers' `Flux2KleinPipeline`'s on
the same weights, seed and settings, bit for bit on the CPU in fp32 (txt2img distilled and base with
CFG, reference editing with one and two pictures); the distilled flag (folder, file name); BFL's and
ComfyUI's separate files, fp8 with `weight_scale` included; the LoRA formats diffusers reads fuse to
diffusers' own result and to the float64 formula, Qwen3 LoRAs too, and come off bit for bit; a FLUX.1
LoRA is refused by name; an fp32 LoRA on a bf16 and on an fp8-stored model generates. What every
family must do (offload modes, fp8, stages, strict forwards) is the conformance suite's."""

from __future__ import annotations

import base64
import io
import json
import os

import gradio as gr
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from app.adapters.errors import LoraApplyError
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import adapter_state_digests
from app.demo import build_tiny_pipeline
from app.engine.generate import GenerateParams
from app.families import family
from app.ui.generate_tab import family_updates
from tests import family_files as kit

FAMILY = "flux2-klein-4b"
FILE, FOLDER = f"tiny-{FAMILY}.safetensors", f"tiny-{FAMILY}-diffusers"
W = 0.8  # LoRA strength
data, eng, oracle = kit.data, kit.eng, kit.oracle  # the module's fixtures (tests/family_files.py)
params = kit.params


def theirs(pipe, p: GenerateParams, distilled: bool, **inputs) -> np.ndarray:
    pipe.register_to_config(is_distilled=distilled)
    out = pipe(prompt=p.prompt, num_inference_steps=p.steps, height=p.height, width=p.width, guidance_scale=p.cfg,
               num_images_per_prompt=p.batch, output_type="pil", **inputs,
               generator=[torch.Generator().manual_seed(p.seed + i) for i in range(p.batch)]).images
    return np.stack([np.asarray(im) for im in out])


def test_txt2img_equals_flux2_klein_pipeline_distilled_and_base(eng, oracle, data):
    """The distilled file at CFG 1 and the base folder (model_index `is_distilled: false`, diffusers'
    default) at CFG 4 (its unconditional pass with the empty prompt) give diffusers' pixels exactly; a
    file named "…base…" is undistilled, so CFG 4 changes its image, while the distilled file ignores it."""
    eng.load_model(FILE)
    assert eng.pipeline.config.is_distilled
    assert np.array_equal(kit.ours(eng.generate(params())), theirs(oracle, params(), True))
    distilled_cfg4 = kit.ours(eng.generate(params(cfg=4.0)))
    assert np.array_equal(distilled_cfg4, kit.ours(eng.generate(params())))
    eng.load_model(FOLDER)
    assert not eng.pipeline.config.is_distilled
    assert np.array_equal(kit.ours(eng.generate(params(cfg=4.0))), theirs(oracle, params(cfg=4.0), False))
    base = data / "models/Stable-diffusion" / "tiny-flux-2-klein-base-4b.safetensors"
    os.link(data / "models/Stable-diffusion" / FILE, base)
    eng.load_model(base.name)
    assert not eng.pipeline.config.is_distilled
    assert not np.array_equal(kit.ours(eng.generate(params(cfg=4.0))), distilled_cfg4)


def test_the_page_fills_in_the_base_models_steps_and_guidance(eng, data):
    """The model cards: distilled 4 steps without guidance, base 50 steps at guidance 4. Loading a base
    checkpoint after a distilled one (one family) fills steps and guidance in; another distilled
    checkpoint keeps the user's."""
    distilled = eng.load_model(FILE)
    base = data / "models/Stable-diffusion" / "tiny-flux-2-klein-base-4b-defaults.safetensors"
    os.link(data / "models/Stable-diffusion" / FILE, base)
    undistilled = eng.load_model(base.name)
    assert (distilled.defaults, undistilled.defaults) == ((4, 1.0), (50, 4.0))
    *_samplers, steps, guidance = family_updates(distilled, undistilled)
    assert (steps.value, guidance.value) == (50, 4.0)
    *_samplers, steps, guidance = family_updates(undistilled, distilled)
    assert (steps.value, guidance.value) == (4, 1.0)
    assert family_updates(distilled, distilled)[2:] == [gr.update(), gr.update()]


def test_reference_editing_equals_flux2_klein_pipeline(eng, oracle):
    """One and two reference pictures (other sizes than the output, as users send them), batch 2: our
    `edit` gives diffusers' pixels exactly and the infotext says how many pictures it read."""
    eng.load_model(FILE)
    pictures = kit.references()
    for refs in (pictures[:1], pictures):
        made = eng.edit(params(batch=2), refs)
        expected = theirs(oracle, params(batch=2), True, image=refs)
        assert np.array_equal(kit.ours(made), expected), len(refs)
        assert f"Reference images: {len(refs)}" in made[0].infotext
    assert not np.array_equal(kit.ours(eng.edit(params(), pictures[:1])), kit.ours(eng.generate(params())))
    with pytest.raises(ValueError, match="FLUX.2 Klein 4B takes 1 to 4 reference images"):
        eng.edit(params(), pictures * 3)


def test_bfl_and_comfyui_separate_files_fp8_included(eng, data, oracle, tmp_path):
    """What a ComfyUI user has: the bare BFL transformer (here stored in fp8 e4m3 with ComfyUI's
    per-tensor `weight_scale`) in the checkpoint folder, `qwen_3_4b.safetensors` in models/text_encoder
    and `flux2-vae.safetensors` in models/VAE. Text encoder and VAE load bit for bit; each transformer
    weight is its fp8 bytes times its scale."""
    pieces = {"qwen_3_4b.safetensors": ("text_encoders.qwen3_4b.transformer.", "text_encoder"),
              "flux2-vae.safetensors": ("vae.", "vae")}
    fp8 = kit.load_separate_files(eng, oracle, data / "models/Stable-diffusion" / FILE, pieces,
                                  "klein-4b-fp8.safetensors")
    pipe = eng.pipeline
    loaded = pipe.transformer.state_dict()
    q = loaded["transformer_blocks.0.attn.to_q.weight"]
    qkv = fp8["double_blocks.0.img_attn.qkv.weight"].float() * fp8["double_blocks.0.img_attn.qkv.weight_scale"]
    assert torch.equal(q, qkv[: q.shape[0]])
    assert torch.equal(loaded["proj_out.weight"], fp8["final_layer.linear.weight"].float()
                       * fp8["final_layer.linear.weight_scale"])
    assert eng.generate(params())[0].image.size == (64, 64)


# ------------------------------------------------------------------------------------ LoRA formats
def _kohya_flux2(transformer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A kohya Flux.2 LoRA (BFL names, fused q/k/v, alpha 2 at rank 4) and the float64 ΔW per diffusers module."""
    block = transformer.transformer_blocks[0]
    inner = block.attn.to_q.out_features
    fused = {"double_blocks_0_img_attn_qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), 3 * inner, inner),
             "double_blocks_0_img_mlp_0": (("ff.linear_in",), block.ff.linear_in.out_features, inner),
             "single_blocks_1_linear1": (("single.attn.to_qkv_mlp_proj",),
                                         transformer.single_transformer_blocks[1].attn.to_qkv_mlp_proj.out_features,
                                         inner),
             "txt_in": (("context_embedder",), inner, transformer.context_embedder.in_features)}
    state, deltas = {}, {}
    for i, (bfl, (modules, out_f, in_f)) in enumerate(fused.items()):
        down, up = kit.lora_factors(out_f, in_f, 4, i)
        key = f"lora_unet_{bfl}"
        state |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(2.0)}
        delta = (2.0 / 4) * up.double() @ down.double()
        for j, module in enumerate(modules):
            path = ("single_transformer_blocks.1." + module.removeprefix("single.") if module.startswith("single.")
                    else module if module == "context_embedder" else f"transformer_blocks.0.{module}")
            deltas[path] = delta[j * (out_f // len(modules)):(j + 1) * (out_f // len(modules))]
    return state, deltas


def _comfyui(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same LoRA as ComfyUI/ai-toolkit write it: `diffusion_model.` + dotted BFL names, lora_A/lora_B,
    the alpha folded into the down factor."""
    out = {}
    for key, tensor in state.items():
        layer, _, suffix = key.partition(".")
        if suffix == "alpha":
            continue
        dotted = "diffusion_model." + {"double_blocks_0_img_attn_qkv": "double_blocks.0.img_attn.qkv",
                                       "double_blocks_0_img_mlp_0": "double_blocks.0.img_mlp.0",
                                       "single_blocks_1_linear1": "single_blocks.1.linear1",
                                       "txt_in": "txt_in"}[layer.removeprefix("lora_unet_")]
        scale = 0.5 if suffix == "lora_down.weight" else 1.0
        out[f"{dotted}.{'lora_A' if 'down' in suffix else 'lora_B'}.weight"] = tensor * scale
    return out


def _lokr(transformer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LyCORIS LoKr over diffusers names (full w1, w2: scale 1) on two attention projections."""
    state, deltas = {}, {}
    for i, path in enumerate(("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_add_out")):
        out_f, in_f = transformer.get_submodule(path).weight.shape
        g = torch.Generator().manual_seed(10 + i)
        w1, w2 = torch.randn(4, 4, generator=g) * 0.3, torch.randn(out_f // 4, in_f // 4, generator=g) * 0.3
        key = "lycoris_" + path.replace(".", "_")
        state |= {f"{key}.lokr_w1": w1, f"{key}.lokr_w2": w2}
        deltas[path] = torch.kron(w1.double(), w2.double())
    return state, deltas


def _diffusers_fused(state: dict[str, torch.Tensor], paths) -> dict[str, torch.Tensor]:
    pipe = build_tiny_pipeline(FAMILY)
    pipe.load_lora_weights(dict(state))
    pipe.fuse_lora(lora_scale=W)
    modules = dict(pipe.transformer.named_modules())
    return {p: (modules[p].base_layer if hasattr(modules[p], "base_layer") else modules[p]).weight.detach()
            for p in paths}


@pytest.mark.parametrize("layout", ["kohya Flux.2", "ComfyUI diffusion_model.", "LyCORIS LoKr"])
def test_lora_formats_diffusers_reads_fuse_to_its_result_and_the_formula(eng, data, layout):
    """Each layout diffusers' Flux.2 loader reads (its converters `_convert_kohya_flux2_lora_to_diffusers`,
    `_convert_non_diffusers_flux2_lora_to_diffusers`, `_convert_lycoris_flux2_lokr_to_diffusers`), fused at
    0.8: every touched weight equals diffusers' fused weight and W0 + 0.8·ΔW in float64 (fused q/k/v cut
    by rows exactly); removing it gives every tensor back bit for bit."""
    eng.load_model(FILE)
    transformer = eng.pipeline.transformer
    state, deltas = _lokr(transformer) if layout == "LyCORIS LoKr" else _kohya_flux2(transformer)
    state = _comfyui(state) if layout.startswith("ComfyUI") else state
    name = "klein-" + layout.split()[0].lower()
    save_file(state, str(data / "models/Lora" / f"{name}.safetensors"))
    before, digests = {p: transformer.get_submodule(p).weight.detach().clone() for p in deltas}, \
        adapter_state_digests(eng.pipeline)
    assert eng.inspect_lora(name).unmatched_keys == 0
    eng.set_loras([LoraSpec(name, W)])
    reference = _diffusers_fused(state, deltas)
    for path, delta in deltas.items():
        mine = transformer.get_submodule(path).weight.detach()
        expected = (before[path].double() + W * delta).float()
        torch.testing.assert_close(mine, expected, rtol=2e-6, atol=2e-7, msg=path)
        torch.testing.assert_close(mine, reference[path], rtol=2e-6, atol=2e-7, msg=path)
    eng.set_loras([])
    assert adapter_state_digests(eng.pipeline) == digests


def test_a_qwen3_lora_fuses_to_the_formula_and_a_flux1_lora_is_refused_by_name(eng, data):
    """A kohya LoRA on the Qwen3 text encoder (`lora_te_model_layers_9_self_attn_q_proj`, the layers the
    pipeline reads) fuses to W0 + 0.8·(α/r)·B·A and changes the image. A FLUX.1 LoRA whose attention layers
    fit by shape (the 4B is as wide as FLUX.1) is refused, naming FLUX.1 and its layer, nothing applied."""
    eng.load_model(FILE)
    encoder = eng.pipeline.text_encoder
    q = encoder.model.layers[9].self_attn.q_proj
    down, up = kit.lora_factors(q.out_features, q.in_features, 4, 3)
    save_file({"lora_te_model_layers_9_self_attn_q_proj.lora_down.weight": down * 10,
               "lora_te_model_layers_9_self_attn_q_proj.lora_up.weight": up * 10,
               "lora_te_model_layers_9_self_attn_q_proj.alpha": torch.tensor(4.0)},
              str(data / "models/Lora" / "klein-qwen3.safetensors"))
    w0, plain = q.weight.detach().clone(), kit.ours(eng.generate(params()))
    eng.set_loras([LoraSpec("klein-qwen3", W)])
    expected = (w0.double() + W * (up.double() * 10) @ (down.double() * 10)).float()
    torch.testing.assert_close(q.weight.detach(), expected, rtol=2e-6, atol=2e-7)
    assert not np.array_equal(kit.ours(eng.generate(params())), plain)
    eng.set_loras([])
    assert torch.equal(q.weight.detach(), w0)
    inner = eng.pipeline.transformer.transformer_blocks[0].attn.to_q
    flux1 = {}
    for layer in ("transformer.transformer_blocks.0.attn.to_q", "transformer.transformer_blocks.0.norm1.linear"):
        module = inner if layer.endswith("to_q") else torch.nn.Linear(inner.in_features, 6 * inner.in_features)
        a, b = kit.lora_factors(module.out_features, module.in_features, 4, 5)
        flux1 |= {f"{layer}.lora_A.weight": a, f"{layer}.lora_B.weight": b}
    save_file(flux1, str(data / "models/Lora" / "flux1-style.safetensors"))
    digests = adapter_state_digests(eng.pipeline)
    with pytest.raises(LoraApplyError, match=r"made for FLUX\.1.*norm1\.linear"):
        eng.set_loras([LoraSpec("flux1-style", 1.0)])
    assert adapter_state_digests(eng.pipeline) == digests


@pytest.mark.parametrize("weights", ["full", "fp8"])
def test_an_fp32_lora_on_a_bf16_and_an_fp8_stored_klein_generates(data, weights):
    """InvokeAI 6.13.5 fixed a crash applying a LoRA to FLUX.2 with fp8 storage: here an fp32 kohya Flux.2
    LoRA on Klein computing in bf16 (weights bf16, or fp8 with bypass forwards) generates with no dtype
    error, changes the image, zero violations, and comes off leaving the stored bytes as they were."""
    lora = _kohya_flux2(build_tiny_pipeline(FAMILY).transformer)[0]
    save_file(lora, str(data / "models/Lora" / "klein-fp32.safetensors"))
    kit.fp32_lora_generates(data, FILE, "klein-fp32", params(), weights)


def test_the_a1111_img2img_api_reads_init_images_as_references_when_asked(eng, data):
    """`/sdapi/v1/img2img` with `reference_images: true` on a Klein model is the engine's `edit` bit for bit
    (the pictures as base64 `init_images`, the answer's infotext naming them); without it, img2img."""
    from app.a1111 import img2img
    from app.a1111.schema import Img2ImgRequest
    from app.a1111.state import ApiState
    from app.ui.common import UiContext
    from app.ui.login_jobs import quota

    eng.load_model(FILE)
    picture = kit.references()[0]
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    state = ApiState(UiContext(engine=eng, settings=eng.settings), quota(eng.settings, logins=False))
    body = dict(prompt="a red cube", steps=2, width=64, height=64, seed=7, sampler_name="Euler", cfg_scale=1.0,
                init_images=[base64.b64encode(buffer.getvalue()).decode()])
    answer = img2img.run(state, Img2ImgRequest(**body, reference_images=True))
    made = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))))
    assert np.array_equal(made, kit.ours(eng.edit(params(), [picture]))[0])
    assert "Reference images: 1" in json.loads(answer["info"])["infotexts"][0]
    plain = img2img.run(state, Img2ImgRequest(**body, denoising_strength=0.5))
    assert "Reference images" not in json.loads(plain["info"])["infotexts"][0]


def test_the_img2img_tabs_reference_panel_shows_for_klein_and_runs_the_engines_edit(eng):
    """The img2img tab's "Reference images" panel is shown while a family that takes them is loaded, its
    gallery saying how many (hidden for SD1.5), and its job (the gallery's pictures, the shared settings)
    is the engine's `edit`, bit for bit."""
    from app.ui.common import UiContext
    from app.ui.img2img_tab import reference_panel_state
    from app.ui.workflow_api import edit_job

    eng.load_model(FILE)
    ctx = UiContext(engine=eng, settings=eng.settings)
    assert reference_panel_state(ctx) == (True, "Reference images (1-4)") and family("sd15").reference_images == 0
    picture = kit.references()[0]
    base = ["a red cube", "", "Euler", 2, 1.0, 7, 64, 64, 1]
    _params, call, _notes = edit_job(ctx, base, [(picture, None)])
    assert np.array_equal(kit.ours(call(None)), kit.ours(eng.edit(params(), [picture])))
    with pytest.raises(ValueError, match="add the reference images first"):
        edit_job(ctx, base, [])
