"""Every user-facing option in one frozen dataclass.

`launch.py` turns command-line flags into a `Settings`; the engine, the UI and the bug report
read from it. Keeping it in one place lets the bug report dump the whole configuration (minus
secrets) and lets tests build an engine with a two-line override.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

DTYPE_CHOICES = ("auto", "fp16", "bf16", "fp32")
# "inductor" is the real compiled path (CUDA); "eager"/"aot_eager" run the same dispatch and counting
# on the CPU in seconds (the benchmark's smoke mode and tests).
COMPILE_BACKENDS = ("inductor", "eager", "aot_eager")
OFFLOAD_CHOICES = ("none", "model", "sequential", "balanced", "group")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    """Paths, engine policy and serving options.

    `data_dir` follows the A1111 layout so an existing install can be pointed at directly:
    `models/Stable-diffusion` (checkpoints: `.safetensors` files and diffusers folders),
    `models/Lora`, `embeddings`, `outputs`.
    """

    data_dir: Path = Path(".")
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"
    offload: str = "none"
    vram_budget_gib: float | None = None
    balanced_watermark: float = 0.85
    history_size: int = 200
    lora_debug: bool = field(default_factory=lambda: _env_flag("SD_LORA_DEBUG"))
    move_debug: bool = field(default_factory=lambda: _env_flag("SD_MOVE_DEBUG"))
    strict: bool = False
    max_lora_errors: int = 3
    slider_min: float = -2.0
    slider_max: float = 2.0
    compile: bool = False
    compile_mode: str = "reduce-overhead"  # or "default" (no CUDA graphs)
    compile_backend: str = "inductor"
    # serving
    listen: bool = False
    port: int = 7860
    share: bool = False
    auth: tuple[tuple[str, str], ...] = ()
    no_auth: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.compile_mode not in ("reduce-overhead", "default"):
            raise ValueError(f"compile_mode must be reduce-overhead or default, got {self.compile_mode!r}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend must be one of {COMPILE_BACKENDS}, got {self.compile_backend!r}")
        if self.offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {self.offload!r}")
        if not 0 < self.balanced_watermark <= 1:
            raise ValueError(f"the VRAM watermark is a fraction of the GPU's memory in (0, 1], "
                             f"got {self.balanced_watermark}")
        if self.vram_budget_gib is not None and not self.vram_budget_gib > 0:
            raise ValueError(f"the VRAM budget must be a positive number of GiB, got {self.vram_budget_gib}")
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "models" / "Stable-diffusion"

    @property
    def lora_dir(self) -> Path:
        return self.data_dir / "models" / "Lora"

    @property
    def embeddings_dir(self) -> Path:
        return self.data_dir / "embeddings"

    @property
    def outputs_dir(self) -> Path:
        return self.data_dir / "outputs"

    @property
    def compile_cache_dir(self) -> Path:
        """torch.compile artifacts kept across restarts, so a warm start skips the minute-long compile."""
        return self.data_dir / "cache" / "torch-compile"

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)

    def public_dict(self) -> dict:
        """Settings safe to publish in a bug report: credentials are reduced to a count."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "auth"}
        out["data_dir"] = str(self.data_dir)
        out["auth_users"] = len(self.auth)
        return out
