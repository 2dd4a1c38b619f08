"""Z-Image's native formats and its oracle, offline: the ComfyUI transformer (original names, fused
`attention.qkv`; bf16, fp8 and both fp8 "scaled" layouts) with `qwen_3_4b.safetensors` and
`ae.safetensors` beside it gives the diffusers folder's bits; the folder tells Turbo from Base; our
image equals diffusers' own `ZImagePipeline` on the same weights, seed and settings; the bundled
configs and tokenizer are what the published models and the InvokeAI wheel hold. What every family
must do (layouts, seeds, PEFT LoRA, offload, fp8 storage, stages) is the conformance suite's."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline
from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
from safetensors import safe_open
from safetensors.torch import save_file

from app.engine import checkpoint_files, generate, models
from app.engine.checkpoint_files import ModelLoadError
from app.engine.component_files import CONFIGS_METADATA_KEY
from app.engine.generate import GenerateParams
from app.engine.part_choices import PartFiles
from app.engine.stage_params import HiresParams
from app.families import family
from app.families.qwen3 import QWEN3_TOKENIZER_DIR
from app.preview import pictures, preview_pixels
from app.settings import Settings

TURBO, BASE = "zimage-turbo", "zimage-base"
FP8 = torch.float8_e4m3fn


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _load(path: Path, dtype=torch.float32, parts: PartFiles | None = None):
    kind = "folder" if path.is_dir() else "file"
    return models.load_pipeline(checkpoint_files.CheckpointInfo(path.name, path, kind, 0), dtype, parts).pipe


def _scaled(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as a scaled fp8 file stores it: q = w / s in fp8, s = amax / 448 (ComfyUI's rule)."""
    scale = weight.abs().max().float() / torch.finfo(FP8).max
    return (weight / scale).to(FP8), scale


def write_comfyui_files(all_in_one: Path, data: Path, storage: str = "bf16-as-is") -> Path:
    """What a ComfyUI user has: the bare transformer file (`storage`: as written, `fp8`, fp8 `scaled`
    with `scale_weight` + `scaled_fp8`, or `mixed` with `weight_scale` + `comfy_quant` on 2-D
    weights), `qwen_3_4b.safetensors` under `model.` with an LM head beside it, `ae.safetensors`,
    each carrying its tiny config. Returns the transformer file."""
    tensors, metadata = _read(all_in_one)
    configs = json.loads(metadata[CONFIGS_METADATA_KEY])
    settings = Settings(data_dir=data)
    transformer = {k.removeprefix("model.diffusion_model."): v for k, v in tensors.items()
                   if k.startswith("model.diffusion_model.")}
    quantised = [k for k, v in transformer.items() if k.endswith(".weight") and v.dim() == 2]
    for key in quantised if storage != "bf16-as-is" else ():
        if storage == "fp8":
            transformer[key] = transformer[key].to(FP8)
        else:
            transformer[key], scale = _scaled(transformer[key])
            stem = key.removesuffix("weight")
            if storage == "scaled":
                transformer[stem + "scale_weight"] = scale
            else:
                transformer[stem + "weight_scale"] = scale
                transformer[stem + "comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'),
                                                                 dtype=torch.uint8)
    if storage == "scaled":
        transformer["scaled_fp8"] = torch.empty(0, dtype=FP8)
    encoder = {"model." + k.removeprefix("text_encoders.qwen3_4b.transformer.model."): v for k, v in tensors.items()
               if k.startswith("text_encoders.qwen3_4b.transformer.model.")}
    encoder["lm_head.weight"] = encoder["model.embed_tokens.weight"].clone()
    pieces = {settings.checkpoints_dir / "z_image_turbo.safetensors": (transformer, "transformer"),
              settings.text_encoder_dir / "qwen_3_4b.safetensors": (encoder, "text_encoder"),
              settings.vae_dir / "ae.safetensors": ({k.removeprefix("vae."): v for k, v in tensors.items()
                                                     if k.startswith("vae.")}, "vae")}
    for path, (part, component) in pieces.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(part, str(path), metadata={CONFIGS_METADATA_KEY: json.dumps({component: configs[component]})})
    return settings.checkpoints_dir / "z_image_turbo.safetensors"


def _parts(data: Path) -> PartFiles:
    settings = Settings(data_dir=data)
    return PartFiles(folders={"text_encoder_dir": settings.text_encoder_dir, "vae_dir": settings.vae_dir})


@pytest.fixture(scope="module")
def folder_pipe(demo_paths):
    return _load(demo_paths[f"{TURBO}_folder"])


def test_the_comfyui_layout_is_diffusers_converter_row_for_row(folder_pipe, demo_paths):
    """The transformer tensors we write (and read) in ComfyUI's layout are what diffusers' own
    single-file converter turns back into the diffusers model, fused qkv split by rows."""
    tensors, _ = _read(demo_paths[f"{TURBO}_file"])
    original = {k.removeprefix("model.diffusion_model."): v for k, v in tensors.items()
                if k.startswith("model.diffusion_model.")}
    assert "layers.0.attention.qkv.weight" in original and "x_embedder.weight" in original
    converted = convert_z_image_transformer_checkpoint_to_diffusers(dict(original))
    state = folder_pipe.transformer.state_dict()
    assert converted.keys() == state.keys()
    assert all(torch.equal(converted[k], state[k]) for k in state)


@pytest.mark.parametrize("storage", ["bf16-as-is", "fp8", "scaled", "mixed"])
def test_comfyui_transformer_with_separate_parts_loads_its_values(demo_paths, folder_pipe, tmp_path, storage):
    """The bare transformer file plus models/text_encoder and models/VAE: as written, every tensor
    equals the folder's bit for bit; in fp8, each 2-D weight is its fp8 value, times its scale in
    either scaled layout (the extra `scaled_fp8`, `comfy_quant` and LM-head tensors are not read)."""
    path = write_comfyui_files(demo_paths[f"{TURBO}_file"], tmp_path, storage)
    pipe = _load(path, parts=_parts(tmp_path))
    assert type(pipe) is family(TURBO).pipeline_class
    for component in ("text_encoder", "vae"):
        mine, theirs = getattr(pipe, component).state_dict(), getattr(folder_pipe, component).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), component
    stored, _ = _read(path)
    scales = ("scale_weight", "weight_scale")
    widened = {k: v.float() * next((stored[k.removesuffix("weight") + s].float() for s in scales
                                    if k.removesuffix("weight") + s in stored), torch.tensor(1.0))
               for k, v in stored.items() if not k.endswith((*scales, "comfy_quant", "scaled_fp8"))}
    want = convert_z_image_transformer_checkpoint_to_diffusers(widened)  # ComfyUI's dequantisation, diffusers' names
    mine = pipe.transformer.state_dict()
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in mine)
    if storage == "bf16-as-is":
        assert all(torch.equal(mine[k], v) for k, v in folder_pipe.transformer.state_dict().items())


def test_a_block_scaled_fp8_file_is_refused_by_name(demo_paths, tmp_path):
    """NVFP4/MXFP8 files store a block of scales per weight: not one factor, so not read as one."""
    path = write_comfyui_files(demo_paths[f"{TURBO}_file"], tmp_path, "mixed")
    tensors, metadata = _read(path)
    tensors["layers.0.feed_forward.w1.weight_scale"] = torch.ones(4)
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ModelLoadError, match=r"w1\.weight_scale holds 4 scales .*block-quantised"):
        _load(path, parts=_parts(tmp_path))


def test_a_folder_says_turbo_or_base_by_its_scheduler_shift(demo_paths, tmp_path):
    """Turbo and Base share every tensor; their folders differ in the scheduler's static shift."""
    assert _load(demo_paths[f"{TURBO}_folder"]).family is family(TURBO)
    assert _load(demo_paths[f"{BASE}_folder"]).family is family(BASE)
    assert family(TURBO).files.matches(frozenset(_read(demo_paths[f"{TURBO}_file"])[0]) - {"x"})


def test_bundled_configs_describe_the_published_models():
    """Parameter counts of the full-size architecture on the meta device, against what the cards state:
    Z-Image (Turbo and Base) "6B parameters" (Tongyi-MAI/Z-Image-Turbo model card; 6.15 B in the
    technical report); Qwen3-4B "Number of Parameters: 4.0B, Non-Embedding: 3.6B, 36 layers, 32 Q and
    8 KV heads" (Qwen/Qwen3-4B model card); the FLUX autoencoder's 83.8 M (its config is FLUX.1's)."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    counts = {}
    with torch.device("meta"):
        for name in (TURBO, BASE):
            folder = family(name).files.config_dir
            config = ZImageTransformer2DModel.load_config(folder / "transformer")
            transformer = ZImageTransformer2DModel.from_config(config)
            counts[name] = sum(p.numel() for p in transformer.parameters())
        folder = family(TURBO).files.config_dir
        qwen = Qwen3Model(Qwen3Config.from_pretrained(folder / "text_encoder"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae"))
    assert counts[TURBO] == counts[BASE] == 6_154_908_736  # 6.15 B
    total = sum(p.numel() for p in qwen.parameters())
    assert (round(total / 1e9, 1), round((total - qwen.embed_tokens.weight.numel()) / 1e9, 1)) == (4.0, 3.6)
    config = qwen.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (36, 32, 8)
    assert round(sum(p.numel() for p in vae.parameters()) / 1e6, 1) == 83.8
    shifts = [json.loads((family(n).files.config_dir / "scheduler/scheduler_config.json").read_text())["shift"]
              for n in (TURBO, BASE)]
    assert shifts == [3.0, 6.0]


def test_qwen3_tokenizer_is_the_extracted_one():
    """assets/qwen3_tokenizer holds exactly what ORIGIN.txt records, tokenizes as Qwen3 does and
    carries the chat template Z-Image formats every prompt with."""
    recorded = dict(line.split() for line in (QWEN3_TOKENIZER_DIR / "ORIGIN.txt").read_text().splitlines()
                    if line.startswith("  "))
    assert set(recorded) == {"tokenizer.json.gz", "tokenizer_config.json", "special_tokens_map.json"}
    for name, digest in recorded.items():
        assert hashlib.sha256((QWEN3_TOKENIZER_DIR / name).read_bytes()).hexdigest() == digest, name
    tokenizer = family(TURBO).tokenizers()["tokenizer"]
    assert len(tokenizer) == 151669 and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer("a photo of a cat").input_ids == [64, 6548, 315, 264, 8251]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)
    assert chat == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(module_engine):
    return module_engine


@pytest.mark.parametrize(("family_name", "cfg", "negative", "guidance_scale"),
                         [(TURBO, 1.0, "", 0.0), (BASE, 4.0, "blurry, text", 3.0)])
def test_our_image_equals_diffusers_zimage_pipeline(engine, demo_paths, family_name, cfg, negative, guidance_scale):
    """The oracle: on the tiny model, the engine's image (fp32 on the CPU) is diffusers'
    `ZImagePipeline`'s on the same folder, seed and settings, bit for bit. Turbo runs without CFG
    (CFG scale 1 = diffusers' guidance 0: one pass); Base with CFG scale 4 = diffusers' 3.0 and a
    negative prompt (A1111's neg + s·(pos − neg) is Z-Image's pos + (s − 1)·(pos − neg))."""
    engine.load_model(f"tiny-{family_name}-diffusers")
    ours = engine.generate(GenerateParams("a red cube on a table", negative, steps=3, cfg=cfg, seed=7, width=64,
                                          height=64, sampler="Euler"))[0]
    pipe = ZImagePipeline.from_pretrained(demo_paths[f"{family_name}_folder"], dtype=torch.float32)
    theirs = pipe("a red cube on a table", negative_prompt=negative or None, height=64, width=64,
                  num_inference_steps=3, guidance_scale=guidance_scale, max_sequence_length=512,
                  generator=torch.Generator().manual_seed(7)).images[0]
    assert np.array_equal(np.asarray(ours.image), np.asarray(theirs))
    assert f"CFG scale: {cfg:g}" in ours.infotext and "Steps: 3" in ours.infotext


def test_defaults_samplers_and_sizes(engine):
    """Turbo: 8 steps, CFG 1; Base: 50 steps, CFG 5 with a negative prompt; flow-match Euler with each
    sigma schedule; sizes in multiples of 16; fp16 refused with the reason."""
    turbo, base = family(TURBO), family(BASE)
    assert (turbo.sampling.default_steps, turbo.sampling.default_guidance,
            base.sampling.default_steps, base.sampling.default_guidance) == (8, 1.0, 50, 5.0)
    assert turbo.call_arguments(1.0) == {"guidance_scale": 0.0, "max_sequence_length": 512}
    engine.load_model(f"tiny-{TURBO}.safetensors")
    for sampler in turbo.sampling.samplers:
        image = engine.generate(GenerateParams("a cat", steps=2, cfg=1.0, seed=1, width=64, height=64,
                                               sampler=sampler))[0]
        assert image.image.size == (64, 64) and f"Sampler: {sampler}" in image.infotext
    with pytest.raises(ValueError, match="multiples of 16"):
        engine.generate(GenerateParams("a cat", steps=1, cfg=1.0, seed=1, width=72, height=64, sampler="Euler"))
    info = checkpoint_files.resolve_checkpoint(f"tiny-{TURBO}.safetensors", engine.settings.checkpoints_dir)
    with pytest.raises(ModelLoadError, match="overflows in fp16"):
        models.load_pipeline(info, torch.float16)


def test_hires_fix_live_preview_and_interrupt(engine):
    """Hires fix runs its img2img pass on Z-Image (64² → 128²);
    the step callback sees (batch, 16, h/8, w/8) latents the preview projects with the FLUX factors,
    without changing the image; Interrupt lands within two steps of a long run and keeps the partial
    image."""
    engine.load_model(f"tiny-{TURBO}.safetensors")
    params = GenerateParams("a red cube", steps=4, cfg=1.0, seed=3, width=64, height=64, sampler="Euler")
    hires = engine.generate(params, hires=HiresParams(scale=2.0, upscaler="Latent", denoising_strength=0.5))
    assert hires[0].image.size == (128, 128) and "Hires upscale: 2" in hires[0].infotext
    plain, seen = generate.run(engine.pipeline, params, 3), []

    def collect(step, total, latents):
        seen.append((step, total, tuple(latents.shape), pictures(preview_pixels(latents, TURBO))[0].size))
        return False

    watched = generate.run(engine.pipeline, params, 3, on_step=collect)
    assert seen == [(step, 4, (1, 16, 8, 8), (8, 8)) for step in range(1, 5)]
    assert np.array_equal(np.asarray(plain[0]), np.asarray(watched[0]))
    result = {}
    thread = threading.Thread(target=lambda: result.update(images=engine.generate(
        GenerateParams("a cat", steps=150, cfg=1.0, seed=5, width=64, height=64, sampler="Euler"), owner="tab")))
    thread.start()
    while (progress := engine.snapshot().progress) is None or progress.step < 3:
        time.sleep(0.01)
    assert engine.interrupt(owner="tab")
    thread.join(timeout=120)
    stopped = result["images"][0].stopped_at
    assert stopped is not None and stopped <= progress.step + 2


def test_compiled_path_compiles_three_caption_lengths_and_runs_the_rest_eager():
    """Every prompt gives the transformer captions of another token count, and each count would be a
    new graph: the compiled path (dynamo's eager backend here, inductor on a GPU) compiles the first
    `MAX_TEXT_LENGTHS` and runs the others eager with a note, so new prompts never recompile past
    torch's limit; compiled or not, the latents are the eager ones bit for bit."""
    from app.demo import build_tiny_pipeline
    from app.engine import compiled

    fam = family("zimage-turbo")
    pipe = fam.pipeline_class(**build_tiny_pipeline("zimage-turbo").components)
    prompts = ["a", "a cat", "a red cat", "a red cat on", "a red cat on a mat"]

    def run(prompt: str) -> torch.Tensor:
        request = GenerateParams(prompt, steps=2, width=64, height=64, cfg=fam.sampling.default_guidance,
                                 sampler=fam.sampling.default_sampler, seed=3)
        return generate.denoise(pipe, request, 3, width=64, height=64)

    eager = [run(p) for p in prompts]
    state = compiled.enable(pipe, backend="eager", background=False, device="cpu")
    try:
        assert all(torch.equal(run(p), e) for p, e in zip(prompts, eager, strict=True))
        assert state.status().shapes_ready == compiled.MAX_TEXT_LENGTHS
        assert "more than 3 lengths" in state.note
    finally:
        compiled.disable(pipe)


def test_the_cut_note_counts_a_prompt_as_the_pipeline_templates_it(folder_pipe):
    """The "the last N tokens change nothing" note counts a prompt inside the chat template as
    `ZImagePipeline` applies it (with a thinking block): the count equals the caption length the
    pipeline hands its transformer (19 tokens here). Counted with Klein's template, whose empty thinking
    block adds 4 tokens, the note fired 4 tokens early."""
    from app.prompts.as_text import templated_length

    te = family("zimage-turbo").text_encoders[0]
    prompt = "a lighthouse on a cliff at dusk, oil painting"
    with torch.no_grad():
        caption = folder_pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False)[0][0]
    assert templated_length(folder_pipe.tokenizer, prompt, te.chat_template) == caption.shape[0]
