"""Shared fixtures. No test downloads anything: the Hugging Face hub is switched off before any
library that could reach it is imported, and every model is a tiny random-weight one."""

from __future__ import annotations

import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"  # read once when huggingface_hub is imported
# The suite runs as two pytest-xdist workers on two cores (`-n 2` in pyproject.toml), each module
# whole on one worker (`--dist loadfile`: a module's served app starts once). One thread each, so
# the workers' kernels do not fight over the cores; apps the tests launch inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from browser_kit import chromium, open_page  # noqa: E402


@pytest.fixture(scope="session")
def demo_paths(tmp_path_factory) -> dict[str, Path]:
    """Paths written once per session by `app.demo.write_demo` (tiny single files and diffusers
    folders per family, the SD1.5 inpainting checkpoint, one embedding per family, the demo LoRAs).
    Shared: copy before modifying anything in it."""
    from app.adapters.synthetic import write_demo_loras
    from app.demo import write_demo

    return write_demo(tmp_path_factory.mktemp("demo"), lora_writer=write_demo_loras, inpainting=True)


@pytest.fixture(scope="session")
def demo_dir(demo_paths) -> Path:
    """The session's demo data folder (A1111 layout: models/Stable-diffusion, models/Lora, embeddings)."""
    return demo_paths["checkpoints_dir"].parent.parent


@pytest.fixture(scope="module")
def module_engine(demo_dir, tmp_path_factory):
    """A CPU engine shared by one test module, on hard links to the session's demo models and LoRAs
    (a module's tests then load each model once)."""
    from app.engine.worker import Engine
    from app.settings import Settings

    data = tmp_path_factory.mktemp("module-engine")
    for sub in ("models/Stable-diffusion", "models/Lora"):
        shutil.copytree(demo_dir / sub, data / sub, copy_function=os.link)
    eng = Engine(Settings(data_dir=data, device="cpu"))
    yield eng
    eng.close()


@pytest.fixture
def engine(data_dir):
    """A CPU engine on a private data folder, closed after the test."""
    from app.engine.worker import Engine
    from app.settings import Settings

    eng = Engine(Settings(data_dir=data_dir, device="cpu"))
    yield eng
    eng.close()


@pytest.fixture
def data_dir(demo_dir, tmp_path) -> Path:
    """A private data folder whose models, LoRAs, upscaler and embeddings are hard links to the session's demo
    files, so a test can add files (a corrupt checkpoint, a new LoRA) or write outputs without
    affecting other tests. Tests must not modify the linked files in place."""
    for sub in ("models/Stable-diffusion", "models/Lora", "models/RealESRGAN", "embeddings"):
        source = demo_dir / sub
        if source.is_dir():
            shutil.copytree(source, tmp_path / sub, copy_function=os.link)
        else:
            (tmp_path / sub).mkdir(parents=True)
    return tmp_path


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests skip (with the reason) where there is no CUDA device."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu_data_dir(data_dir) -> Path:
    """The same private data folder, for GPU tests (kept separate so intent is visible)."""
    return data_dir


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium per browser-test module, or a skip saying why there is none."""
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser, served):
    """A fresh page on the module's served app (`served` = url, engine) with no LoRA wanted (the
    tests of a module share one engine)."""
    page = open_page(browser, *served)
    yield page
    page.close()
