"""Serving the app for tests: synthetic kohya LoRAs on the tiny SD1.5 demo model, a free port, and
the app launched in-process. Shared by the API, browser, concurrency and bug-report tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file

from app.engine.worker import Engine
from app.settings import Settings
from app.ui.common import UiContext, checkpoint_names
from app.ui.serve import auth_policy, load_first_working, start_server, wait_until_ready

MODEL = "tiny-sd15.safetensors"
ATTN = "down_blocks.0.attentions.0.transformer_blocks.0.attn1."
MID = "mid_block.attentions.0.transformer_blocks.0."
# (module path, (out, in)) in the tiny SD1.5 demo model; kohya prefix per component.
LORAS = {
    "style": {"unet": {ATTN + "to_q": (32, 32), ATTN + "to_k": (32, 32)}},
    "detail": {"unet": {MID + "attn1.to_q": (64, 64), MID + "attn2.to_k": (64, 32)},
               "te": {"text_model.encoder.layers.0.self_attn.q_proj": (32, 32)}},
    "wrong": {"unet": {ATTN + "to_q": (48, 48)}},
    "nomatch": {"unet": {"no_such_block.proj": (8, 8)}},
    "partial": {"unet": {ATTN + "to_v": (32, 32), "no_such_block.proj": (8, 8)}},
}
STYLE_METADATA = {"ss_base_model_version": "sd_v1", "ss_network_dim": "4", "ss_network_alpha": "4",
                  "ss_tag_frequency": json.dumps({"set": {"watercolor": 5, "fox": 3}})}
STYLE_PREVIEW_RGB = (46, 110, 180)  # the colour of `style.preview.png`, the one LoRA with a thumbnail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_kohya_lora(path: Path, layers: dict[str, dict[str, tuple[int, int]]], seed: int, rank: int = 4,
                     metadata: dict[str, str] | None = None) -> None:
    """A kohya-format LoRA (`lora_down`, `lora_up`, `alpha`) with weights big enough to change an image."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for component, modules in layers.items():
        for module, (out_f, in_f) in modules.items():
            key = f"lora_{component}_" + module.replace(".", "_")
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, in_f, generator=generator) * 0.5
            tensors[f"{key}.lora_up.weight"] = torch.randn(out_f, rank, generator=generator) * 0.5
            tensors[f"{key}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path), metadata=metadata)


def make_ui_data(root: Path, demo_dir: Path) -> Path:
    """A private data folder: the demo models and upscaler (hard links) plus the synthetic LoRAs above."""
    for sub in ("models/Stable-diffusion", "models/RealESRGAN", "embeddings"):
        shutil.copytree(demo_dir / sub, root / sub, copy_function=os.link)
    lora_dir = root / "models" / "Lora"
    lora_dir.mkdir(parents=True, exist_ok=True)
    for seed, (name, layers) in enumerate(LORAS.items()):
        write_kohya_lora(lora_dir / f"{name}.safetensors", layers, seed, metadata=STYLE_METADATA if name == "style"
                         else None)
    Image.new("RGB", (320, 480), STYLE_PREVIEW_RGB).save(lora_dir / "style.preview.png")  # A1111's naming
    return root


@contextlib.contextmanager
def running_app(settings: Settings, engine: Engine | None = None):
    """Serve the app in this process (model loaded first); yields (server, engine)."""
    own = engine is None
    engine = engine or Engine(settings)
    try:
        if own:
            engine.load_model(MODEL)
        policy = auth_policy(settings)
        server = start_server(UiContext(engine, settings, secrets=tuple(p for _u, p in policy.credentials)), policy)
        try:
            wait_until_ready(server.local_url)
            yield server, engine
        finally:
            server.close()
    finally:
        if own:
            engine.close()


@contextlib.contextmanager
def served_demo(root: Path, demo_dir: Path):
    """The app on a private copy of the demo models and the LoRAs above, the tiny SD1.5 loaded; yields
    (server, engine)."""
    with running_app(Settings(data_dir=make_ui_data(root, demo_dir), device="cpu", port=free_port())) as started:
        yield started


@contextlib.contextmanager
def fresh_start(root: Path, demo_dir: Path):
    """The app as `python launch.py` starts it on the demo models (the first checkpoint that loads, by
    name: the tiny FLUX.1-dev); yields (url, engine)."""
    settings = Settings(data_dir=make_ui_data(root, demo_dir), device="cpu", port=free_port())
    engine = Engine(settings)
    try:
        assert load_first_working(engine, checkpoint_names(settings), []) is not None
        with running_app(settings, engine) as (server, _engine):
            yield server.local_url, engine
    finally:
        engine.close()
